"""End-to-end tests start ``forged serve`` with the benchmark's helper (bench/ never
imports tests/, so the helper lives there), and talk to it with the ``openai`` client."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai

from bench.daemonproc import DaemonProcess, free_port, health_ok, write_config

__all__ = ["DaemonProcess", "client", "close_client", "free_port", "health_ok", "serve",
           "serve_model", "write_config"]

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


def serve(config: Path, port: int) -> Iterator[DaemonProcess]:
    """A module fixture's body: ``forged serve`` on ``config`` until the module ends,
    its client closed first."""
    d = DaemonProcess(config, port)
    try:
        d.wait_ready(180)
        yield d
    finally:
        close_client(d)
        assert d.stop() == 0


def serve_model(model: Path, tmp: Path, **engine: Any) -> Iterator[DaemonProcess]:
    """:func:`serve` with ``model`` and these engine settings, its files in ``tmp``."""
    port = free_port()
    yield from serve(write_config(tmp / "forged.toml", model, port, engine=engine), port)
