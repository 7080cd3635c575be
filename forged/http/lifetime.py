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
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

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


@dataclass
class Call:
    """One HTTP request's own state, from its arrival to its access-log line."""

    request_id: str = field(default_factory=request_id)  # its X-Request-Id
    started: float = field(default_factory=time.monotonic)
    # What it holds, released when its ASGI call ends.
    held: AsyncExitStack = field(default_factory=AsyncExitStack)
    key: KeyEntry | None = None  # its caller, with API keys
    # The metrics' labels: the route's rule (None: not looked up yet; :func:`rule`),
    # the model as configured (never as asked), the priority.
    rule: str | None = None
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
        async with calling(this):  # quart-trio's request tasks, spawned within, see it
            await self.app(scope, receive, send)


@asynccontextmanager
async def calling(this: Call) -> AsyncIterator[Call]:
    """``this`` as the current :func:`call` within; its stack closed when it ends,
    shielded. Also the hot door's generations' (forged.http.hotpost), which Quart
    never sees."""
    token = _CALL.set(this)
    try:
        yield this
    finally:
        try:
            with trio.CancelScope(shield=True):
                await this.held.aclose()
        finally:
            _CALL.reset(token)


_CALL: ContextVar[Call] = ContextVar("forged.call")


def call() -> Call:
    """The current request's :class:`Call`."""
    return _CALL.get()


def rule() -> str:
    """The current request's route as the metrics and the access log name it ("other":
    none matched): Quart's rule, or what the hot door set."""
    c = call()
    if c.rule is None:
        c.rule = request.url_rule.rule if request.url_rule is not None else "other"
    return c.rule

