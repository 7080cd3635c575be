"""The hot door's generations: ``POST /v1/chat/completions`` and ``POST /v1/completions``
answered without hypercorn, h11 and Quart (issue 33).

A generation's request cost the door about 4 ms of CPU, and the trivial routes showed
that most of it was the stack around the work: hypercorn's connection and its tasks, h11,
quart-trio's per-request tasks, Quart's request context, the ASGI messages and a locked
write per message (docs/benchmarks.md, "A generation request's door CPU"). So when the
hot door (forged.http.hotdoor) reads a plain head of one of these routes (HTTP/1.1, a
Content-Length, no ``Expect``, no CORS) with a known key (or no keys), it reads the
body itself and calls the route's own function
(:func:`forged.http.api.chat_route`, :func:`~forged.http.api.completion_route`) in a
:class:`~forged.http.lifetime.Call` of its own, then writes the response's bytes as
hypercorn would: the same status line, the same headers in the same order (the
response's, then hypercorn's ``date`` and ``server``, then h11's framing), the same
chunks, the same count and access-log line, the same error bodies. A stream's body is
written directly (forged.http.direct), as on the general path.

What stays the general path's: any other head, a body that does not come within
``hotdoor.BODY_WAIT_S`` (its ``server.read_timeout`` and 408), a body over
``server.max_body_bytes`` (its 413), a missing or unknown key (its 401).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio
from quart import Response
from quart.wrappers.response import DataBody
from werkzeug.exceptions import InternalServerError

from forged import errors as e
from forged.http.api import (
    chat_route,
    check_encoding,
    completion_route,
    responded,
    werkzeug_error,
)
from forged.http.hotdoor import Head, closing
from forged.http.lifetime import Call, calling
from forged.http.responses import error_response, from_exception
from forged.http.state import AppState

log = logging.getLogger("forged.http")
# Quart logs an exception in a route on its app's logger, named after the app.
app_log = logging.getLogger("forged")

Route = Callable[[AppState, bytes], Awaitable[Response]]
ROUTES: dict[str, Route] = {"/v1/chat/completions": chat_route,
                            "/v1/completions": completion_route}


class HotPosts:
    """The generation routes of the daemon's hot door (forged.http.hotdoor.HotPosts)."""

    def __init__(self, state: AppState, response_headers: Callable[[], bytes]) -> None:
        self.state = state
        self._tail = response_headers  # hypercorn's date and server lines
        self.paths = frozenset(ROUTES)

    def max_body(self) -> int:
        return self.state.cfg.server.max_body_bytes

    def caller(self, head: Head) -> Call | None:
        keys = self.state.keys
        if not keys.enabled:
            return Call(rule=head.path)
        key = keys.lookup(head.authorization)
        return None if key is None else Call(rule=head.path, key=key)

    async def __call__(self, call: Call, head: Head, body: bytes, stream: trio.SocketStream,
                       last: bool) -> bool:
        call.connection = stream  # a stream's body goes straight to it (forged.http.direct)
        async with calling(call):
            resp = await self._response(head, body)
            await responded(self.state, call, resp)
            try:
                return await _write(stream, resp, self._tail(), closing(head, last))
            except Exception:  # in a body, after the head: hypercorn's way, a cut
                log.exception("Exception in the response to POST %s", head.path)
                return False

    async def _response(self, head: Head, body: bytes) -> Response:
        """The route's response, or its error's as the general path's handlers make it."""
        try:
            check_encoding(head.headers.get(b"content-encoding", b"").decode("latin-1"))
            return await ROUTES[head.path](self.state, body)
        except e.ForgedError as exc:
            return error_response(from_exception(exc))
        except Exception:  # Quart's way: logged, and a 500 in the API's error body
            app_log.exception("Exception on request POST %s", head.path)
            return error_response(werkzeug_error(InternalServerError()))


async def _write(stream: trio.SocketStream, resp: Response, tail: bytes,
                 ends: tuple[bytes, bytes]) -> bool:
    """``resp`` as hypercorn and h11 write it; False if the client has gone. Their
    order: Quart's headers (lowercased), hypercorn's date and server (``tail``) and its
    ``connection: close``, then h11's lines, each title-cased at the end: its framing
    of a body of unknown length, then its ``Connection: close`` (``ends``:
    hotdoor.closing)."""
    whole = isinstance(resp.response, DataBody)
    head = b"HTTP/1.1 %d \r\n%s%s%s%s%s\r\n" % (
        resp.status_code,
        b"".join(b"%s: %s\r\n" % (k.lower().encode(), v.encode().strip())
                 for k, v in resp.headers.items()),
        tail, ends[0], b"" if whole else b"Transfer-Encoding: chunked\r\n", ends[1])
    try:
        if whole:
            await stream.send_all(head + await resp.get_data(as_text=False))
            return True
        await stream.send_all(head)
        async with resp.response as chunks:
            async for data in chunks:
                if data:
                    await stream.send_all(b"%x\r\n%s\r\n" % (len(data), data))
        await stream.send_all(b"0\r\n\r\n")
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return False
    return True
