"""One owner per request: what a request holds is released when its ASGI call ends.

quart-trio runs each request in a nursery beside a task that watches for the client
going away, and cancels the handler when it does. That cancel lands at whatever
checkpoint the handler is at: waiting for a slot, in an ``after_request`` function, or
in hypercorn's send of the response start. Quart closes an SSE body generator only
once it has entered the body (``_send_response``: start first, then ``async with
response.response``), and a generator that never started runs no ``finally``, not even
on ``aclose()``. So neither the handler nor the body can own what the request holds.

:class:`RequestResources` wraps the whole ASGI call instead, and makes the request's
one :class:`Call`: its id and start, its caller, its labels, and the stack ``held``
into which a handler enters each thing it takes (the key's place, the engine request,
the drain's count, the access-log record) the moment it takes it. The stack is closed
exactly once, when the call returns, raises or is cancelled, shielded: its callbacks
are synchronous bookkeeping and must run even while the request is being cancelled.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import trio
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, Scope
from quart import request

from forged.auth import KeyEntry
from forged.http.access import request_id
from forged.http.direct import CONNECTION

if TYPE_CHECKING:
    from forged.http.generate import Outcome
    from forged.http.keylimits import KeyHold

ASGIApp = Callable[[Scope, ASGIReceiveCallable, ASGISendCallable], Awaitable[None]]
_KEY = "forged.resources"


@dataclass
class Call:
    """One HTTP request's own state, from its arrival to its access-log line."""

    request_id: str = field(default_factory=request_id)  # its X-Request-Id
    started: float = field(default_factory=time.monotonic)
    # What it holds, released when its ASGI call ends.
    held: AsyncExitStack = field(default_factory=AsyncExitStack)
    key: KeyEntry | None = None  # its caller, with API keys
    # The metrics' labels: the model as configured (never as asked), the priority.
    model: str = "-"
    priority: str = "none"
    hold: KeyHold | None = None  # its places in its key's limits
    # A generation's (or an embedding's) record, which logs its own access-log line.
    outcome: Outcome | None = None
    # The socket of its plain HTTP/1.1 connection through the hot door, which a stream
    # may write to directly (forged.http.direct); None otherwise.
    connection: trio.SocketStream | None = None

    @property
    def key_name(self) -> str:
        return self.key.name if self.key is not None else "-"


class RequestResources:
    """ASGI middleware: one :class:`Call` per HTTP request, its stack closed when it ends."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: ASGIReceiveCallable,
                       send: ASGISendCallable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        this = Call()
        if scope["http_version"] == "1.1":  # h2 has its own framing; 1.0 no chunks
            this.connection = CONNECTION.get()
        cast(dict[str, Any], scope)[_KEY] = this  # Quart's request keeps this scope
        try:
            await self.app(scope, receive, send)
        finally:
            with trio.CancelScope(shield=True):
                await this.held.aclose()


def call() -> Call:
    """The current request's :class:`Call`."""
    return cast(Call, cast(dict[str, Any], request.scope)[_KEY])

