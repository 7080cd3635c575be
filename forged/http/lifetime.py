"""One owner per request: what a request holds is released when its ASGI call ends.

quart-trio runs each request in a nursery beside a task that watches for the client
going away, and cancels the handler when it does. That cancel lands at whatever
checkpoint the handler is at: waiting for a slot, in an ``after_request`` function, or
in hypercorn's send of the response start. Quart closes an SSE body generator only
once it has entered the body (``_send_response``: start first, then ``async with
response.response``), and a generator that never started runs no ``finally``, not even
on ``aclose()``. So neither the handler nor the body can own what the request holds.

:class:`RequestResources` wraps the whole ASGI call instead. A handler enters each
thing it takes (the key's place, the engine request, the drain's count, the access-log
record) into :func:`resources` the moment it takes it. The stack is closed exactly
once, when the call returns, raises or is cancelled, shielded: its callbacks are
synchronous bookkeeping and must run even while the request is being cancelled.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any, cast

import trio
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, Scope
from quart import request

ASGIApp = Callable[[Scope, ASGIReceiveCallable, ASGISendCallable], Awaitable[None]]
_KEY = "forged.resources"


class RequestResources:
    """ASGI middleware: one ``AsyncExitStack`` per HTTP request, closed when it ends."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: ASGIReceiveCallable,
                       send: ASGISendCallable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        stack = AsyncExitStack()
        cast(dict[str, Any], scope)[_KEY] = stack  # Quart's request keeps this scope
        try:
            await self.app(scope, receive, send)
        finally:
            with trio.CancelScope(shield=True):
                await stack.aclose()


def resources() -> AsyncExitStack:
    """The current request's stack: enter what it holds, and it will be released."""
    return cast(AsyncExitStack, cast(dict[str, Any], request.scope)[_KEY])
