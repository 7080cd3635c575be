"""End-to-end tests start ``forged serve`` with the benchmark's helper (bench/ never
imports tests/, so the helper lives there), and talk to it with the ``openai`` client."""

import openai

from bench.daemonproc import DaemonProcess, free_port, health_ok, write_config

__all__ = ["DaemonProcess", "client", "close_client", "free_port", "health_ok",
           "write_config"]

_CLIENTS: dict[str, openai.OpenAI] = {}


def client(d: DaemonProcess, timeout: float = 120.0) -> openai.OpenAI:
    """One client per daemon. A client holds a connection pool; one left to the garbage
    collector warns about its sockets in whichever test runs then (an error here)."""
    if d.url not in _CLIENTS:
        _CLIENTS[d.url] = openai.OpenAI(base_url=d.url + "/v1", api_key="none",
                                        max_retries=0, timeout=timeout)
    return _CLIENTS[d.url]


def close_client(d: DaemonProcess) -> None:
    """Before the daemon stops."""
    c = _CLIENTS.pop(d.url, None)
    if c is not None:
        c.close()
