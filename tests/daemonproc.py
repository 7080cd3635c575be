"""End-to-end tests start ``forged serve`` with the benchmark's helper (bench/ never
imports tests/, so the helper lives there)."""

from bench.daemonproc import DaemonProcess, free_port, health_ok, write_config

__all__ = ["DaemonProcess", "free_port", "health_ok", "write_config"]
