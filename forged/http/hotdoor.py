"""The hot door: ``GET /health`` and ``GET /v1/models`` answered straight off the socket.

A health probe or a model listing through hypercorn, h11 and Quart costs about a
millisecond of CPU: a task per request, a request context, routing, hooks. Balancers
probe often and clients list models before every session, and that CPU comes from the
cores the model decodes on. So each plain-TCP connection of the API listener starts
here. A request head that is a hot route in its plainest form (HTTP/1.1, ``GET``, no
body, no ``Connection`` but keep-alive or close, no ``Upgrade`` or ``Expect``, no CORS in
the config) is answered
by this module with the bytes the general path would send: the same status, body and
headers (``x-request-id``, hypercorn's ``date`` and ``server``), the same metrics and
access-log line.

In the daemon, the generation routes' plainest requests are hot too (``POST
/v1/chat/completions`` and ``POST /v1/completions`` with a Content-Length, the whole
body within ``BODY_WAIT_S``): :class:`HotPosts` (forged.http.hotpost) runs the route's
own function and writes its response as hypercorn would, the route's errors included.

Anything else (another route, a missing or unknown key, a header this module does not
read, a head it cannot parse, a body too large or too slow) hands the connection, with
the bytes already read, to hypercorn for the rest of its life (:class:`Handoff`): as
soon as those bytes cannot begin a hot request line, and when the client ends the
connection partway through a head, since h11 answers some such input before a whole
head (a 400). So every edge of HTTP is the general path's, by construction: this
module answers no error of HTTP's own (a 400 of h11's, a 401, 408, 413 or 417).
"""

from __future__ import annotations

import logging
import math
import re
import select
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, NamedTuple, Protocol

import trio

from forged.auth import KeyEntry, KeyStore
from forged.http.access import log_access, request_id
from forged.http.direct import CONNECTION

if TYPE_CHECKING:
    from forged.http.lifetime import Call

log = logging.getLogger("forged.http")

MAX_HEAD = 16 * 1024  # h11's limit on an incomplete head; past it, hypercorn answers
READ_SIZE = 65536  # a read of a connection
# How long the hot door waits for the rest of a POST's body after its head, before it
# hands the request to the general path: clients write a head and its body apart, and
# on a busy door the body's read often comes a turn later.
BODY_WAIT_S = 1.0
# At shutdown, how long a connection accepted without its request yet has to send it.
CLOSING_GRACE_S = 1.0
# Headers whose presence means the general path must answer: a body, a protocol
# switch, a CORS origin's or a dialect's shape (Anthropic's anthropic-version on
# /v1/models). ``Connection`` too, unless it only says keep-alive or close (_CONNECTION).
_HANDED = frozenset((b"transfer-encoding", b"upgrade", b"expect", b"te", b"trailer",
                     b"anthropic-version"))
# ``Connection: keep-alive``, which HTTP/1.1 means anyway: httpx (the openai and
# anthropic SDKs), requests and Node's fetch send it on every request, and handing
# those to the general path cost each ``models.list()`` or health check about 1.4 ms of
# the door's CPU instead of 0.1 (docs/benchmarks.md). h11 answers it as it answers no
# header at all. ``close``: a request that is its connection's last (load generators,
# scripts), answered with h11's ``Connection: close`` (:func:`closing`). Any other
# option (one naming a header) is the general path's.
_CONNECTION = re.compile(rb"(?i)(?:keep-alive|close)(?:[ \t]*,[ \t]*(?:keep-alive|close))*")


# A header line as h11 accepts it: a token, a colon, and a value of visible characters,
# spaces and tabs (leading and trailing ones not part of it). Anything else is the
# general path's, whose h11 answers it with its 400.
_FIELD = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):[ \t]*((?:[\x21-\x7e\x80-\xff]"
                    rb"(?:[ \t\x21-\x7e\x80-\xff]*[\x21-\x7e\x80-\xff])?)?)[ \t]*")


class IdleConnections:
    """The hot door's connections waiting for a request, and until when each may.

    One sweeper task closes those past their time, once a second, rather than a timeout
    scope around every read: on a loaded door, a deadline per read cost a third of the
    request rate and pushed p99 from 13 ms to about 500 ms (docs/benchmarks.md). A
    connection's time starts when it waits for a request (hypercorn's keep-alive
    timeout, which also bounds slow headers) and ends when a whole head has arrived.

    At shutdown only the connections *between* requests (one answered, nothing of the
    next read) are closed, as hypercorn closes its idle ones: a client knows that a
    kept-alive connection may close. A connection that has sent nothing yet, or part of
    a head, was accepted for a request the client has sent or is sending: it is read
    and answered (and then closed) if it comes within ``CLOSING_GRACE_S``."""

    def __init__(self, keep_alive_s: Callable[[], float]) -> None:
        self._keep_alive_s = keep_alive_s  # read when needed: a reload changes it
        self._until: dict[trio.SocketStream, float] = {}
        self._between: set[trio.SocketStream] = set()  # waiting after an answer
        self.closing = False  # the listener is shutting down: no more waiting
        self._emptied = trio.Event()  # closing, and no connection waits any more

    def waiting(self, stream: trio.SocketStream, between: bool) -> bool:
        """Note that ``stream`` waits (from now, unless it already was), ``between``
        requests or for its first (or the rest of a head); False once the listener is
        shutting down and it is between requests, when it is closed instead."""
        if stream not in self._until:
            self._until[stream] = trio.current_time() + self._keep_alive_s()
            if between:
                self._between.add(stream)
        elif not between:  # part of its next head has come since: no longer idle
            self._between.discard(stream)
        return not (self.closing and between)

    def busy(self, stream: trio.SocketStream) -> float:
        """``stream`` waits no more; until when it might have (inf: it was not)."""
        until = self._until.pop(stream, math.inf)
        self._between.discard(stream)
        if self.closing and not self._until:
            self._emptied.set()
        return until

    async def sweep(self, every_s: float = 1.0) -> None:
        while True:
            await trio.sleep(every_s)
            now = trio.current_time()
            await self._close([s for s, until in self._until.items() if until <= now], now)

    async def close_all(self, grace_s: float = CLOSING_GRACE_S) -> None:
        """At shutdown: those between requests at once, as hypercorn does with its idle
        ones; those waiting for a first request (or the rest of a head) get ``grace_s``
        to send it, then go too, so that a connection that sends nothing never holds a
        shutdown for the listener's whole grace time."""
        self.closing = True
        await self._close([s for s in self._until if s in self._between], math.inf)
        with trio.move_on_after(grace_s):
            if self._until:  # each leaves once its head has arrived (busy)
                await self._emptied.wait()
        await self._close(list(self._until), math.inf)

    async def _close(self, streams: list[trio.SocketStream], now: float) -> None:
        for stream in streams:  # its reader then gets ClosedResourceError: it leaves
            # Each close is a checkpoint: a later stream may have got its request
            # meanwhile (busy), or be waiting for its next one (a new time).
            until = self._until.get(stream)
            if until is None or until > now or _readable(stream):
                continue  # readable: a request (or the client's close) its reader takes
            self.busy(stream)
            await stream.aclose()


def _readable(stream: trio.SocketStream) -> bool:
    """Bytes wait on ``stream`` (or its end): a request that has arrived, which closing
    the connection would answer with nothing (curl: "empty reply"). Seen at a drain's
    start, on a connection accepted just before it and not yet read."""
    fd = stream.socket.fileno()
    if fd < 0:  # closed already (its reader left): closing it again does nothing
        return False
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    return bool(poll.poll(0))


class Handoff(NamedTuple):
    """What the general path needs to take a connection over: ``serve(stream)`` runs
    hypercorn's connection on it. ``max_requests`` is hypercorn's setting, read when
    needed."""

    serve: Callable[[trio.abc.Stream], Awaitable[None]]
    max_requests: Callable[[], int]
    idle: IdleConnections


class Head(NamedTuple):
    path: str
    headers: dict[bytes, bytes]
    method: bytes = b"GET"
    length: int = 0  # a POST's body, by its Content-Length

    @property
    def close(self) -> bool:
        """The client asks that the connection end after this answer."""
        return b"close" in self.headers.get(b"connection", b"").lower()

    @property
    def authorization(self) -> str | None:
        """The key the client sent, as the general path reads it: Anthropic's clients
        send it as ``x-api-key``, every other as a Bearer token."""
        given = self.headers.get(b"authorization")
        if given is None and (x_api_key := self.headers.get(b"x-api-key")) is not None:
            given = b"Bearer " + x_api_key
        return given.decode("latin-1") if given is not None else None


def parse_head(raw: bytes) -> Head | None:
    """The path and headers of a plain ``GET`` head (without its blank line), or of a
    ``POST`` with a Content-Length, or None for anything else: another method or
    version, a malformed or repeated header line, a header that belongs to the general
    path."""
    lines = raw.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or parts[0] not in (b"GET", b"POST") or parts[2] != b"HTTP/1.1":
        return None
    headers = _headers(lines[1:])
    if headers is None or b"host" not in headers:
        return None  # h11 refuses an HTTP/1.1 request without Host: so must we
    length = headers.get(b"content-length")
    if (length is None) == (parts[0] == b"POST") or (
            length is not None and not (length.isdigit() and len(length) <= 12)):
        return None  # a GET with a body, a POST without a length (chunked), or a bad one
    try:
        return Head(parts[1].decode("ascii"), headers, parts[0], int(length or 0))
    except UnicodeDecodeError:
        return None


def _headers(lines: list[bytes]) -> dict[bytes, bytes] | None:
    """A head's header lines by lowercase name, or None if one is the general path's."""
    headers: dict[bytes, bytes] = {}
    for line in lines:
        field = _FIELD.fullmatch(line)
        if field is None:
            return None
        name = field[1].lower()
        if name in headers or name in _HANDED or (
                name == b"connection" and not _CONNECTION.fullmatch(field[2])):
            return None
        headers[name] = field[2]
    return headers


class HotView(Protocol):
    """What the hot door answers from: the daemon's own state
    (forged.http.hubview.HubView), or in a door process the copy of it that the daemon
    sends (forged.daemon.doors). This module imports neither, so that a door process
    loads only what it runs."""

    @property
    def on(self) -> bool:
        """The hot routes are answered here (``server.hot_door``, and no CORS)."""

    @property
    def keys(self) -> KeyStore: ...

    def health(self) -> tuple[int, bytes]: ...

    def models(self) -> bytes: ...

    def count(self, rule: str, status: int, key: KeyEntry | None) -> None: ...


class HotPosts(Protocol):
    """The generation routes the hot door answers too (forged.http.hotpost), in the
    daemon only: a door process hands them over."""

    @property
    def paths(self) -> frozenset[str]: ...

    def max_body(self) -> int:
        """Past this Content-Length, the general path answers (its 413)."""

    def caller(self, head: Head) -> Call | None:
        """The request's call, or None when the general path must answer it (its 401)."""

    async def __call__(self, call: Call, head: Head, body: bytes, stream: trio.SocketStream,
                       last: bool) -> bool:
        """Answer the request; False once the connection is broken. ``last``: the
        connection's last request (:func:`closing`; the hot door closes it then)."""


class HotDoor:
    """The hot routes of one API listener, and the loop that serves a connection."""

    def __init__(self, view: HotView, response_headers: Callable[[], bytes],
                 posts: HotPosts | None = None) -> None:
        """``response_headers``: the header lines hypercorn adds to every response
        (``date``, ``server``), each ending in CRLF."""
        self.view = view
        self._tail = response_headers
        self._routes: dict[str, tuple[str, Callable[[], tuple[int, bytes]]]] = {
            "/health": ("/health", view.health),
            "/v1/models": ("/v1/models", lambda: (200, view.models())),
        }
        self.posts = posts
        # The request lines this module may answer: a head that starts otherwise is the
        # general path's as soon as it shows it.
        self._lines = tuple(b"GET %s HTTP/1.1\r\n" % path.encode() for path in self._routes) \
            + tuple(b"POST %s HTTP/1.1\r\n" % path.encode()
                    for path in (posts.paths if posts is not None else ()))
        self._longest = max(map(len, self._lines))

    def answer(self, head: Head) -> bytes | None:
        """The whole response to ``head``, or None when the general path must answer."""
        route = self._routes.get(head.path)
        if route is None or not self.view.on:
            return None
        started = time.monotonic()
        key = None
        keys = self.view.keys
        if keys.enabled and head.path.startswith("/v1/"):
            key = keys.lookup(head.authorization)
            if key is None:
                return None  # the general path's 401, with its body drained
        rule, handler = route
        status, body = handler()
        rid = request_id()
        self.view.count(rule, status, key)
        log_access(rule, status, rid, key, started)
        return (b"HTTP/1.1 %d \r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"x-request-id: %s\r\n%s\r\n%s" % (status, len(body), rid.encode(),
                                                  self._tail(), body))

    async def _answer(self, stream: trio.SocketStream, head: Head, buf: bytes, at: int,
                      last: bool) -> tuple[bool | None, bytes]:
        """Answer ``head``, whose body (if any) starts at ``at`` of ``buf``: True, or
        False once the connection is closed; None: the general path's. With ``buf`` as
        read since (the rest of a body, the start of a next request)."""
        if head.close and len(buf) > at + head.length:
            return None, buf  # bytes after a close: h11's 400 (it expects the end)
        if head.method == b"GET":
            answer = self.answer(head)
            if answer is None:
                return None, buf
            return await _send(stream, answer, head, last), buf
        return await self._post(stream, head, buf, at, last)

    async def _post(self, stream: trio.SocketStream, head: Head, buf: bytes, at: int,
                    last: bool) -> tuple[bool | None, bytes]:
        """:meth:`_answer` of a POST: its body read, then answered by :class:`HotPosts`."""
        posts, end = self.posts, at + head.length
        if (posts is None or head.path not in posts.paths or not self.view.on
                or head.length > posts.max_body()):
            return None, buf
        # The general path's request starts with its head, before its body is read: a
        # late body counts in its duration and TTFT there, so it does here.
        started = time.monotonic()
        if len(buf) < end:
            buf = await _read_body(stream, buf, end)
        if head.close and len(buf) > end:
            return None, buf  # a next request came with the body: as in _answer
        call = posts.caller(head) if len(buf) >= end else None
        if call is None:
            return None, buf
        call.started = started
        try:
            answered, more = await _watched(stream, posts(call, head, buf[at:end], stream,
                                                          last))
        except Exception:  # forged's bug, not the client's: hypercorn's way (its task
            # group logs it and ends the connection), never the listener's end
            log.exception("Error in the hot door's answer to POST %s", head.path)
            return False, buf
        if answered and (last or head.close):
            await stream.aclose()
            answered = False
        return answered, buf + more

    def _may_be_hot(self, buf: bytes, start: int) -> bool:
        """Whether the head begun at ``start`` of ``buf``, not yet ended by a blank line
        of CRLFs, may still be one this module answers: the start of a hot route's
        request line, or one whole, and no bare LF. Anything else goes to hypercorn as
        soon as it shows, as h11 refuses some at once (a TLS ClientHello on the plain
        port, a leading CRLF: its 400) rather than after a whole head that may never
        come. h11 also ends a line at a bare LF, and a head at a blank line of them
        (``\\n\\n``, ``\\n\\r\\n``): such a head may be whole for hypercorn already."""
        pending = buf[start:start + self._longest]
        return (any(line.startswith(pending) or pending.startswith(line)
                    for line in self._lines)
                and buf.count(b"\n", start) == buf.count(b"\r\n", start))

    async def serve(self, stream: trio.SocketStream, handoff: Handoff, first: bytes = b"",
                    served: int = 0) -> None:
        """Answer the hot requests of ``stream`` until one is not, then hand it over;
        ``first``: bytes read from it already, ``served`` requests answered on it (a
        door process's handoff). Pipelined heads are read from an offset, not sliced off
        one by one: a read of 64 KiB of them would otherwise copy the rest of it once
        per request."""
        buf, start, head_by = first, 0, math.inf
        try:
            while True:
                end = buf.find(b"\r\n\r\n", start)
                if end < 0 and len(buf) - start <= MAX_HEAD and self._may_be_hot(buf, start):
                    between = served > 0 and start == len(buf)
                    waits = handoff.idle.waiting(stream, between)
                    data = await _receive(stream) if waits else None
                    if data is None or not (data or start < len(buf)):
                        await stream.aclose()  # closed (by the sweeper), or the client left
                        return
                    if not data:
                        break  # the client's end after part of a head: hypercorn's 400
                    buf, start = buf[start:] + data, 0
                    continue
                until = handoff.idle.busy(stream)
                head_by = until if end < 0 else math.inf  # part of a head: its time holds
                head = parse_head(buf[start:end]) if end >= 0 else None
                if head is None:
                    break
                last = served + 1 >= handoff.max_requests() or handoff.idle.closing
                answered, buf = await self._answer(stream, head, buf, end + 4, last)
                if answered is None:
                    break
                start, served = end + 4 + head.length, served + 1
                if not answered:
                    return
        finally:
            handoff.idle.busy(stream)
        CONNECTION.set(stream)  # for its requests' direct streams (forged.http.direct)
        await handoff.serve(Prefixed(stream, buf[start:], served, head_by))


async def _read_body(stream: trio.SocketStream, buf: bytes, end: int) -> bytes:
    """``buf`` read on to ``end`` (a body's end), or as far as it came within
    ``BODY_WAIT_S``, or until the client's end: a slow body is the general path's,
    whose ``server.read_timeout`` it then gets, as a body it reads from the start."""
    read = bytearray(buf)  # grown in place: a body of many reads is copied once
    with trio.move_on_after(BODY_WAIT_S):
        while len(read) < end:
            data = await _receive(stream)
            if not data:
                break
            read += data
    return bytes(read)


async def _watched(stream: trio.SocketStream, answer: Awaitable[bool]) -> tuple[bool, bytes]:
    """``answer``'s result, cancelled if the client ends the connection meanwhile (as
    quart-trio cancels a request's handler when hypercorn hears it go); and the bytes
    read meanwhile (a next request, pipelined)."""
    more: list[bytes] = []
    answered = False
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_watch, stream, nursery.cancel_scope, more)
        answered = await answer
        nursery.cancel_scope.cancel()
    return answered, b"".join(more)


async def _watch(stream: trio.SocketStream, answering: trio.CancelScope,
                 more: list[bytes]) -> None:
    """One read: the client's end (or a broken connection) cancels ``answering``; bytes
    are a next request, kept for after this answer (no more are read until then: the
    client's end is heard at the answer's next write)."""
    data = await _receive(stream)
    if data:
        more.append(data)
    else:
        answering.cancel()


async def _receive(stream: trio.SocketStream) -> bytes | None:
    """The next bytes; b"" at the client's end, None once the connection is broken or
    closed (by the sweeper)."""
    try:
        return bytes(await stream.receive_some(READ_SIZE))
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return None


def closing(head: Head, last: bool) -> tuple[bytes, bytes]:
    """The header lines that end a connection, as hypercorn and h11 write them: on its
    ``last`` request (``keep_alive_max_requests``, or a shutdown), hypercorn's
    ``connection: close`` after its ``date`` and ``server``; when the client asked,
    h11's ``Connection: close``, which replaces it and comes after every other line
    (h11's framing too). Each ends in CRLF, or is empty."""
    if head.close:
        return b"", b"Connection: close\r\n"
    return (b"connection: close\r\n" if last else b""), b""


async def _send(stream: trio.SocketStream, answer: bytes, head: Head, last: bool) -> bool:
    """Send one answer; False once the connection is closed (the client left, or it
    made its last request: hypercorn's ``keep_alive_max_requests``, or asked to)."""
    ours, h11s = closing(head, last)
    if ours or h11s:  # the last answer says so, then the connection closes
        cut = answer.index(b"\r\n\r\n") + 2
        answer = answer[:cut] + ours + h11s + answer[cut:]
    try:  # unshielded (a shield per send cost a tenth of the rate): only a shutdown
        await stream.send_all(answer)  # past its grace time cancels, and then cuts all
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return False
    if ours or h11s:
        await stream.aclose()
        return False
    return True


class Prefixed(trio.abc.Stream):
    """A socket stream whose first reads return bytes already read from it: the hot
    door's unanswered requests, which hypercorn then parses as if fresh. ``served``:
    the requests the hot door answered on it, which count towards hypercorn's
    ``keep_alive_max_requests``. ``head_by``: when ``first`` ends in part of a head,
    the (trio) time by which the rest must come, the hot door's keep-alive for it,
    which hypercorn's then keeps (inf: hypercorn's own, from the handoff)."""

    def __init__(self, stream: trio.SocketStream, first: bytes, served: int = 0,
                 head_by: float = math.inf) -> None:
        self.transport = stream
        self.socket = stream.socket  # hypercorn reads the peer's address from it
        self.first = first  # not yet returned by receive_some
        self.served = served
        self.head_by = head_by

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self.first:
            out, self.first = self.first, b""
            await trio.lowlevel.checkpoint()
            return out
        return bytes(await self.transport.receive_some(max_bytes))

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.transport.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.transport.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self.transport.send_eof()

    async def aclose(self) -> None:
        await self.transport.aclose()

