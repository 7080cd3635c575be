"""The accepting side of a plain-TCP listener, shared by the daemon's listener
(forged.daemon.listener) and its door processes (forged.daemon.doorproc), which import
this module and not the listener: a door loads only what it runs."""

from __future__ import annotations

import errno
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from hypercorn.config import Config as HyperConfig

log = logging.getLogger("forged.http")


class ResponseTail:
    """The header lines hypercorn adds to each response (``date``, ``server``), made
    once a second rather than once a request: the date has seconds only."""

    def __init__(self, hc: HyperConfig) -> None:
        self.hc = hc
        self._second = -1
        self._lines = b""

    def __call__(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._lines = b"".join(b"%s: %s\r\n" % kv for kv in self.hc.response_headers("h11"))
        return self._lines


Handler = Callable[[Any], Awaitable[None]]
# Out of descriptors or memory: wait and retry, as trio.serve_listeners does.
_ACCEPT_LATER = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS))
# What one connection's accept may fail with, the listener fine (trio's own list): a
# firewall's refusal (EPERM), a connection reset or aborted before it was accepted.
_ACCEPT_SKIP = frozenset(getattr(errno, name) for name in (
    "EPERM", "ECONNABORTED", "EPROTO", "ENETDOWN", "ENOPROTOOPT", "EHOSTDOWN", "ENONET",
    "EHOSTUNREACH", "EOPNOTSUPP", "ENETUNREACH", "ENOSR", "ESOCKTNOSUPPORT",
    "EPROTONOSUPPORT", "ETIMEDOUT", "ECONNRESET") if hasattr(errno, name))
_BURST = 256  # connections accepted at one wake, before the others get the loop again


async def accept_bursts(sock: socket.socket, handler: Handler, nursery: trio.Nursery) -> None:
    """Accept every connection waiting at each wake, not one per turn of the event loop
    as ``trio.serve_listeners`` does: with the loop busy, 256 connections opened at once
    waited up to a second for their turn to be accepted, which was the door's p99."""
    sock.setblocking(False)
    try:
        while True:
            await trio.lowlevel.wait_readable(sock)
            for _ in range(_BURST):
                try:
                    conn, _ = sock.accept()
                except BlockingIOError:
                    break
                except OSError as exc:
                    if exc.errno in _ACCEPT_SKIP:
                        continue
                    if exc.errno not in _ACCEPT_LATER:
                        raise
                    log.error("accept: %s; retrying in 0.1 s", os.strerror(exc.errno or 0))
                    await trio.sleep(0.1)
                    break
                stream = trio.SocketStream(trio.socket.from_stdlib_socket(conn))
                nursery.start_soon(connection, stream, handler)
    finally:
        sock.close()


async def connection(stream: trio.SocketStream, handler: Handler) -> None:
    try:
        await handler(stream)
    finally:
        await trio.aclose_forcefully(stream)
