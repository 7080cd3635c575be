"""Serve HAProxy's agent check: each TCP connection gets one line, then is closed.

Resource handling: :func:`serve_agent` runs until cancelled in the caller's nursery.
Each connection is answered within ``SEND_TIMEOUT`` and closed; at most ``MAX_OPEN``
are answered at once, and one beyond that is closed unanswered (HAProxy counts a
failed agent check as nothing, and its health check decides). The balancer asks
every ``agent-inter`` per backend, so a handful of connections is the normal load.

Error handling: a peer that leaves before its line is sent is no error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import trio

log = logging.getLogger("forged.agent")

SEND_TIMEOUT = 2.0
MAX_OPEN = 32


def split_host_port(bind: str) -> tuple[str, int]:
    host, _, port = bind.rpartition(":")
    return host.strip("[]"), int(port)


async def serve_agent(bind: str, reply: Callable[[], str], *,
                      task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """Answer agent checks on ``bind`` (HOST:PORT) with ``reply()``; ``started()`` with
    the address bound (its port is known even when 0 was asked for)."""
    host, port = split_host_port(bind)
    limiter = trio.CapacityLimiter(MAX_OPEN)

    async def answer(stream: trio.SocketStream) -> None:
        try:
            limiter.acquire_nowait()
        except trio.WouldBlock:
            await stream.aclose()
            return
        try:
            with trio.move_on_after(SEND_TIMEOUT):
                await stream.send_all(reply().encode())
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the balancer went away first: nothing to answer
        finally:
            limiter.release()
            await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, answer, port, host=host))
        sockname = listeners[0].socket.getsockname()
        host = f"[{sockname[0]}]" if ":" in sockname[0] else sockname[0]
        bound = f"{host}:{sockname[1]}"
        log.info("agent check listener on %s", bound)
        task_status.started(bound)
