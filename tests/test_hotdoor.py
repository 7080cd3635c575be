"""The door's cheap paths. The hot door (forged.http.hotdoor): GET /health and
GET /v1/models answered off the socket give the general path's bytes, headers, metrics
and log lines; everything else is handed to hypercorn with the bytes already read, on
the same connection. A stream's tokens share a write only within their budget
(forged.http.generate.Pace)."""

from __future__ import annotations

import errno
import logging
import os
import re
import socket
import struct
from contextlib import suppress
from functools import partial
from pathlib import Path
from typing import Any, cast

import httpx
import msgspec
import pytest
import trio
import trio.testing
from hypercorn.config import Config as HyperConfig

from forged.auth import add_key
from forged.daemon import listener
from forged.daemon.accept import ResponseTail, accept_bursts
from forged.daemon.doorproc import DoorView
from forged.daemon.doorwire import View
from forged.engine.events import Delta, Event
from forged.engine.pool import RequestStream
from forged.engine.request import Request
from forged.http import hotdoor, hotpost
from forged.http.generate import Pace
from forged.http.hotdoor import HotDoor, IdleConnections, parse_head
from tests.conftest import DaemonFactory, RunningDaemon
from tests.test_api import until

# A header that hands the request to the general path and changes nothing in the answer
# (an empty body on a GET).
GENERAL = b"Content-Length: 0\r\n"
# What httpx (the openai and anthropic SDKs), requests and Node's fetch send on every
# request: hot, answered as without it.
KEEP_ALIVE = b"Connection: keep-alive\r\n"
CLOSE = b"Connection: close\r\n"


def _get(path: str, extra: bytes = b"") -> bytes:
    return b"GET %s HTTP/1.1\r\nHost: forged\r\n%s\r\n" % (path.encode(), extra)


def test_only_the_plainest_get_is_hot() -> None:
    head = parse_head(b"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization:  Bearer k \t"
                      b"\r\nX-Empty:\r\nUser-Agent: caf\xc3\xa9/1 (x; y)")
    assert head is not None and head.path == "/health"
    assert head.headers == {b"host": b"x", b"authorization": b"Bearer k", b"x-empty": b"",
                            b"user-agent": b"caf\xc3\xa9/1 (x; y)"}
    for value, close in [(b"keep-alive", False), (b"Keep-Alive", False),
                         (b"keep-alive , KEEP-ALIVE", False), (b"close", True),
                         (b"Close", True), (b"keep-alive, close", True)]:
        head = parse_head(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: " + value)
        assert head is not None and head.headers[b"connection"] == value
        assert head.close is close
    for raw in [b"POST /health HTTP/1.1\r\nHost: x",  # another method
                b"GET /health HTTP/1.0\r\nHost: x",  # another version
                b"GET /health HTTP/1.1",  # no Host (h11 answers 400)
                b"GET  /health HTTP/1.1\r\nHost: x",  # a malformed request line
                b"GET /health HTTP/1.1\r\nHost: x\r\nHost: y",  # a repeated header
                b"GET /health HTTP/1.1\r\nHost : x",  # space before the colon
                b"GET /health HTTP/1.1\r\nHost: x\r\n folded",  # obsolete line folding
                b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 0",  # a body
                b"GET /health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked",
                b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: keep-alive, Upgrade",
                b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: keep-alive,",
                b"GET /health HTTP/1.1\r\nHost: x\r\nUpgrade: h2c",
                b"GET /health HTTP/1.1\r\nHost: x\r\nBad Name: y",  # not a token
                b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: y\x00z",  # a control byte
                b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: y\rz",
                b"GET /h\xc3\xa9 HTTP/1.1\r\nHost: x"]:  # not ASCII
        assert parse_head(raw) is None, raw


def _hot_door() -> HotDoor:
    """A hot door answering from a door process's view: no daemon behind it."""
    view = DoorView(View(on=True, health_status=200, health=b'{"status":"ok"}',
                         models=b"{}", keys=[], keep_alive_s=30.0, max_requests=100))
    return HotDoor(view, ResponseTail(HyperConfig()))


async def _handed_over(*sends: bytes, eof: bool = False) -> bytes | None:
    """The bytes the hot door hands to the general path when a client sends each of
    ``sends`` (and then, with ``eof``, its end of the connection); None if the door
    closes the connection instead. Within a second: a door still waiting for more
    fails it (hypercorn would have answered)."""
    idle, handed = IdleConnections(lambda: 30.0), []

    async def general(stream: trio.abc.Stream) -> None:
        assert isinstance(stream, hotdoor.Prefixed)
        handed.append(stream.first)
        await stream.aclose()

    ours, theirs = trio.socket.socketpair()
    async with trio.SocketStream(ours) as server, trio.SocketStream(theirs) as peer:
        with trio.fail_after(1):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_hot_door().serve, server,
                                   hotdoor.Handoff(general, lambda: 100, idle))
                for data in sends:
                    if handed:  # hypercorn's already: it would read the rest
                        break
                    await peer.send_all(data)
                    await trio.testing.wait_all_tasks_blocked()
                if eof and not handed:
                    await peer.send_eof()
    return handed[0] if handed else None


@pytest.mark.parametrize("head", [
    b"GET /health HTTP/1.1\nHost: x\n\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\n\n",
    b"POST /tokenize HTTP/1.1\nHost: x\nContent-Length: 2\n\n{}",
])
async def test_a_head_whose_lines_end_in_a_bare_lf_is_handed_over_at_once(
        head: bytes, autojump_clock: trio.testing.MockClock) -> None:
    """h11 ends a line at a bare LF and a head at a blank line of them: hypercorn
    answers such a head, so the hot door hands it over as soon as it sees one. (It
    waited for a CRLF blank line that never came: the client got nothing, and the
    connection closed at the keep-alive timeout.)"""
    assert await _handed_over(head) == head
    # The LF in a later read (a POST is hypercorn's from its first read already).
    assert await _handed_over(head[:20], head[20:]) == (
        head if head.startswith(b"GET ") else head[:20])


async def test_a_bare_lf_health_probe_is_answered(
        tiny_model: Path, start_daemon: DaemonFactory) -> None:
    """As plain hypercorn answers it: 200."""
    async with start_daemon(tiny_model) as d, await _connect(d) as stream:
        answer, = await _exchange(stream, b"GET /health HTTP/1.1\nHost: x\n\n", 1)
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b'{"status":"ok"}')


@pytest.mark.parametrize(("sends", "eof"), [
    ((b"\x16\x03\x01\x00\xa5",), False),  # a TLS ClientHello on the plain port
    ((b"\r\nGET /health HTTP/1.1\r\nHost: x\r\n",), False),  # a leading CRLF
    ((b"POST",), False),  # no route the hot door answers: hypercorn's, from here
    ((b"GET /health?x=1 ",), False),
    ((b"GET /he",), True),  # part of a head, then the client's end
    ((b"GET /health HTTP/1.1\r\n", b"Host: x\r\n"), True),
])
async def test_what_cannot_be_a_hot_head_is_handed_over_at_once_and_so_is_an_end(
        sends: tuple[bytes, ...], eof: bool, autojump_clock: trio.testing.MockClock) -> None:
    """hypercorn answers some input at once: h11 refuses a first byte below "!" (a TLS
    ClientHello, a leading CRLF) and part of a head that its client ends, with a 400.
    The hot door hands a head over as soon as it cannot be a hot route's, and one the
    client ended, with the bytes read. (It kept reading until a blank line or 16 KiB:
    the client waited for the keep-alive timeout, then got nothing; a head cut short
    by the client's end got nothing at once.)"""
    assert await _handed_over(*sends, eof=eof) == b"".join(sends)


async def test_a_client_that_ends_between_requests_is_closed() -> None:
    assert await _handed_over(eof=True) is None
    assert await _handed_over(_get("/health"), eof=True) is None


async def test_what_h11_refuses_at_once_gets_its_400_at_once(
        tiny_model: Path, start_daemon: DaemonFactory) -> None:
    async with start_daemon(tiny_model) as d:
        for data, eof in ((b"\x16\x03\x01\x00\xa5", False), (b"GET /he", True)):
            async with await _connect(d) as stream:
                await stream.send_all(data)
                if eof:
                    await stream.send_eof()
                answer = b""
                with trio.fail_after(1):
                    while chunk := await stream.receive_some(65536):
                        answer += chunk
            assert answer.startswith(b"HTTP/1.1 400 ") and b"connection: close" in answer


async def _exchange(stream: trio.SocketStream, request: bytes, answers: int) -> list[bytes]:
    """Send ``request`` (one or more pipelined requests) and read ``answers`` responses,
    each with its Content-Length body."""
    await stream.send_all(request)
    buf, out = b"", []
    with trio.fail_after(10):
        while len(out) < answers:
            end = buf.find(b"\r\n\r\n")
            length = re.search(rb"content-length: (\d+)", buf[:end]) if end >= 0 else None
            if length is not None and len(buf) >= end + 4 + int(length[1]):
                cut = end + 4 + int(length[1])
                out.append(buf[:cut])
                buf = buf[cut:]
                continue
            data = await stream.receive_some(65536)
            assert data, f"closed after {len(out)} answers: {buf!r}"
            buf += data
    return out


def _shape(answer: bytes) -> bytes:
    """An answer with the values that differ between any two answers blanked."""
    answer = re.sub(rb"x-request-id: [0-9a-f]{32}", b"x-request-id: ID", answer)
    return re.sub(rb"date: [^\r]+", b"date: DATE", answer)


async def _connect(d: RunningDaemon) -> trio.SocketStream:
    host, port = d.url.removeprefix("http://").rsplit(":", 1)
    return await trio.open_tcp_stream(host, int(port))


@pytest.fixture
def answered(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths the hot door answered (not those it handed to the general path)."""
    paths: list[str] = []
    answer = HotDoor.answer

    def counted(door: HotDoor, head: hotdoor.Head) -> bytes | None:
        out = answer(door, head)
        if out is not None:
            paths.append(head.path)
        return out

    monkeypatch.setattr(HotDoor, "answer", counted)
    return paths


def _requests(d: RunningDaemon, rule: str) -> float:
    assert d.daemon.state is not None
    total = 0.0
    for metric in d.daemon.state.metrics.requests.collect():
        total += sum(s.value for s in metric.samples
                     if s.name.endswith("_total") and s.labels["endpoint"] == rule)
    return total


async def test_a_hot_answer_is_the_general_paths_bytes_headers_count_and_log(
        tiny_model: Path, start_daemon: DaemonFactory, caplog: pytest.LogCaptureFixture,
        answered: list[str]) -> None:
    caplog.set_level(logging.INFO, logger="forged.access")
    async with start_daemon(tiny_model) as d:
        for path in ("/health", "/v1/models"):
            before = _requests(d, path)
            async with await _connect(d) as stream:  # once handed over, it stays so
                hot, kept = await _exchange(stream, _get(path) + _get(path, KEEP_ALIVE), 2)
                general, = await _exchange(stream, _get(path, GENERAL), 1)
            assert hot.startswith(b"HTTP/1.1 200 \r\n")
            assert _shape(hot) == _shape(kept) == _shape(general)
            assert _requests(d, path) == before + 3
            lines = [r for r in caplog.records if r.name == "forged.access"
                     and r.getMessage() == f"{path} 200"][-3:]
            ids = [re.search(rb"x-request-id: (\w+)", a)[1].decode()  # type: ignore[index]
                   for a in (hot, kept, general)]
            assert [r.fields["request_id"] for r in lines] == ids  # type: ignore[attr-defined]
            assert {r.fields["key"] for r in lines} == {"-"}  # type: ignore[attr-defined]
            async with await _connect(d) as a, await _connect(d) as b:  # each its last
                hot, = await _exchange(a, _get(path, CLOSE), 1)
                general, = await _exchange(b, _get(path, CLOSE + GENERAL), 1)
            assert hot.split(b"\r\n\r\n")[0].endswith(b"\r\nConnection: close")
            assert _shape(hot) == _shape(general)
        assert answered == ["/health"] * 3 + ["/v1/models"] * 3
        # The hot door's answers follow the state, as the general path's do.
        assert d.daemon.state is not None
        d.daemon.state.leaving = True
        async with await _connect(d) as stream:
            hot, = await _exchange(stream, _get("/health"), 1)
        assert hot.startswith(b"HTTP/1.1 503 ") and hot.endswith(b'{"status":"draining"}')
        d.daemon.state.leaving = False


async def test_pipelined_requests_are_answered_in_order_across_the_handoff(
        tiny_model: Path, start_daemon: DaemonFactory, answered: list[str]) -> None:
    """Two hot requests, then one for the general path, in one write: hypercorn gets
    the bytes the hot door read but did not answer, and the connection stays usable."""
    body = b'{"content": "hello"}'
    tokenize = (b"POST /tokenize HTTP/1.1\r\nHost: forged\r\nContent-Type: application/json"
                b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    async with start_daemon(tiny_model) as d, await _connect(d) as stream:
        # About 90 KiB, more than one read, each answered from an offset in it; fewer
        # than hypercorn's keep_alive_max_requests (1000), after which it closes.
        many, agent = 900, b"User-Agent: %s\r\n" % (b"x" * 60)
        answers = await _exchange(stream, _get("/health", agent) * many
                                  + _get("/v1/models") + tokenize, many + 2)
        assert all(a.endswith(b'{"status":"ok"}') for a in answers[:many])
        assert b'"object":"list"' in answers[many]
        assert b'"tokens":[' in answers[many + 1]
        assert answered == ["/health"] * many + ["/v1/models"]
        answers = answers[many - 1:]
        again, = await _exchange(stream, _get("/health"), 1)  # now hypercorn's connection
        assert _shape(again) == _shape(answers[0])


def _post(path: str, body: bytes, extra: bytes = b"", chunked: bool = False) -> bytes:
    """A POST of ``body``; ``chunked``: in one chunk, which hands it to the general path
    and changes nothing in the answer."""
    framing = b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) \
        if chunked else b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    return b"POST %s HTTP/1.1\r\nHost: forged\r\nContent-Type: application/json\r\n%s%s" % (
        path.encode(), extra, framing)


async def _answer(stream: trio.SocketStream) -> tuple[bytes, bytes]:
    """One answer's head and its body (de-chunked), whichever its framing."""
    async def more() -> bytes:
        data = await stream.receive_some(65536)
        assert data, f"closed after {buf + rest!r}"
        return bytes(data)

    buf = rest = b""
    with trio.fail_after(30):
        while b"\r\n\r\n" not in buf:
            buf += await more()
        head, _, rest = buf.partition(b"\r\n\r\n")
        if head.startswith(b"HTTP/1.1 1"):  # an interim answer (100 Continue): no body
            return head, b""
        if (length := re.search(rb"content-length: (\d+)", head)) is not None:
            while len(rest) < int(length[1]):
                rest += await more()
            assert len(rest) == int(length[1]), "one answer at a time"
            return head, rest
        body = b""
        while True:
            while b"\r\n" not in rest:
                rest += await more()
            size, _, rest = rest.partition(b"\r\n")
            while len(rest) < int(size, 16) + 2:
                rest += await more()
            body, rest = body + rest[:int(size, 16)], rest[int(size, 16) + 2:]
            if int(size, 16) == 0:
                assert rest == b"", "one answer at a time"
                return head, body


# What differs between two generations' answers: ids, times, the text and its length (a
# second request meets the first's cache, which may change a near tie), the usage.
_VARIES = [(rb"x-request-id: [0-9a-f]{32}", b"x-request-id: ID"), (rb"date: [^\r]+", b"date: D"),
           (rb"content-length: \d+", b"content-length: N"), (rb'"id":"[^"]*"', b'"id":"ID"'),
           (rb'"created":\d+', b'"created":0'),
           (rb'"(content|text)":"(?:[^"\\]|\\.)*"', rb'"\1":""'),
           (rb'"usage":\{.*?\}\}?', b'"usage":{}'), (rb'"system_fingerprint":"[^"]*"', b"")]


def _blanked(data: bytes) -> bytes:
    """``data`` with what varies blanked; of a stream, each kind of event once, in order
    (how many text events a text makes depends on the text)."""
    for pattern, blank in _VARIES:
        data = re.sub(pattern, blank, data)
    return b"".join(dict.fromkeys(data.split(b"\n\n")))


def _logged(caplog: pytest.LogCaptureFixture, ids: list[str]) -> bool:
    return set(ids) <= {getattr(r, "fields", {}).get("request_id") for r in caplog.records}


async def test_a_hot_generation_is_the_general_paths_head_body_count_and_log(
        tiny_model: Path, start_daemon: DaemonFactory, caplog: pytest.LogCaptureFixture,
        posted: list[str]) -> None:
    """Chat and completion, whole and streamed, and errors (a 400 and a 404): the
    same status line, headers in the same order, body (but for what differs between any
    two generations), forged_requests count and access-log line."""
    caplog.set_level(logging.INFO, logger="forged.access")
    # ignore_eos: the second request meets the first's cache, whose numerics may move a
    # near tie, and so the end of generation, but never the answer's shape.
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True}
    bodies = [("/v1/chat/completions", chat),
              ("/v1/chat/completions", {**chat, "stream": True,
                                        "stream_options": {"include_usage": True}}),
              ("/v1/completions", {"prompt": "def f(", "max_tokens": 3, "ignore_eos": True,
                                   "stream": True}),
              ("/v1/completions", {"prompt": "def f(", "max_tokens": 3, "ignore_eos": True}),
              ("/v1/chat/completions", {**chat, "max_tokens": 0}),
              ("/v1/completions", {"prompt": "x", "model": "nobody"})]
    async with start_daemon(tiny_model) as d:
        for (path, body), close in zip(bodies * 2, [False] * 6 + [True] * 6, strict=True):
            before = _requests(d, path)
            raw, extra = msgspec.json.encode(body), CLOSE if close else b""
            async with await _connect(d) as stream, await _connect(d) as other:
                await stream.send_all(_post(path, raw, extra))
                hot = await _answer(stream)
                # hypercorn's from here: on another connection if this one has closed
                general_on = other if close else stream
                await general_on.send_all(_post(path, raw, extra, chunked=True))
                general = await _answer(general_on)
            assert hot[0].startswith(b"HTTP/1.1 "), hot
            assert [_blanked(part) for part in hot] == [_blanked(part) for part in general]
            assert _requests(d, path) == before + 2
            ids = [re.search(rb"x-request-id: (\w+)", h)[1].decode()  # type: ignore[index]
                   for h, _ in (hot, general)]
            # A generation's line comes when its request ends, after its last byte.
            await until(partial(_logged, caplog, ids))
            lines = [r for r in caplog.records if r.name == "forged.access"
                     and r.fields["request_id"] in ids]  # type: ignore[attr-defined]
            assert [r.fields["request_id"] for r in lines] == ids  # type: ignore[attr-defined]
            assert lines[0].getMessage() == lines[1].getMessage()
        assert posted == [path for path, _ in bodies] * 2


async def test_what_the_hot_door_does_not_take_of_a_post_is_the_general_paths(
        tiny_model: Path, start_daemon: DaemonFactory, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, posted: list[str]) -> None:
    """A body that comes late (the general path then waits for it, and its
    read_timeout ends a body that never comes), one over max_body_bytes (its 413), an
    unknown key (its 401), an expected body (its 100 Continue), another route: each
    answered by the general path on the same connection, which lives on."""
    monkeypatch.setattr(hotdoor, "BODY_WAIT_S", 0.05)
    key = add_key(tmp_path / "keys.toml", "editor", max_streams=2, max_queued=2,
                  priority="interactive")
    auth = b"Authorization: Bearer %s\r\n" % key.encode()
    body = b'{"prompt": "x", "max_tokens": 2}'
    async with start_daemon(tiny_model, server={"max_body_bytes": 4096}) as d:
        async with await _connect(d) as stream:
            late = _post("/v1/completions", body, auth)
            await stream.send_all(late[:-5])
            await trio.sleep(0.3)
            await stream.send_all(late[-5:])
            head, _ = await _answer(stream)
            assert head.startswith(b"HTTP/1.1 200 ")
            await stream.send_all(_post("/v1/completions", body, auth))  # hypercorn's now
            assert (await _answer(stream))[0].startswith(b"HTTP/1.1 200 ")
        for request, status in [
                (_post("/v1/completions", b" " * 5000 + body, auth), b"413"),
                (_post("/v1/completions", body, b"Authorization: Bearer no\r\n"), b"401"),
                (_post("/v1/completions", body, auth + b"Expect: 100-continue\r\n"), b"100"),
                (_post("/v1/embeddings", b'{"input": "x"}', auth), b"400")]:
            async with await _connect(d) as stream:
                await stream.send_all(request)
                head, _ = await _answer(stream)
                assert head.startswith(b"HTTP/1.1 " + status + b" "), (request, head)
        assert posted == []


async def test_a_bug_in_a_hot_answer_ends_its_connection_not_the_daemon(
        tiny_model: Path, start_daemon: DaemonFactory, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, posted: list[str]) -> None:
    """An exception where forged's code has no handler of its own (here, recording a
    response) ends that connection, logged, as hypercorn's task group ends one; it
    does not reach the listener's nursery, which would stop the daemon."""
    async def broken(*args: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(hotpost, "responded", broken)
    body = b'{"prompt": "x", "max_tokens": 2}'
    async with start_daemon(tiny_model) as d:
        async with await _connect(d) as stream:
            await stream.send_all(_post("/v1/completions", body))
            with trio.fail_after(10):
                assert await stream.receive_some(100) == b""  # cut, no answer
        async with await _connect(d) as stream:
            health, = await _exchange(stream, _get("/health"), 1)
        assert health.endswith(b'{"status":"ok"}')
    assert posted == ["/v1/completions"]
    assert "Error in the hot door's answer to POST /v1/completions" in caplog.text
    assert "RuntimeError: a bug" in caplog.text  # its traceback


async def _all_of(stream: trio.SocketStream, data: bytes) -> bytes:
    """What the daemon answers to ``data`` until it closes the connection."""
    await stream.send_all(data)
    out = b""
    with trio.fail_after(10):
        while chunk := await stream.receive_some(65536):
            out += chunk
    return out


async def test_a_close_request_with_a_next_one_after_it_gets_the_general_paths_400(
        tiny_model: Path, start_daemon: DaemonFactory, answered: list[str],
        posted: list[str]) -> None:
    """Bytes after a request that asks ``Connection: close``, in the same read: h11
    expects the connection's end there, and hypercorn answers its 400 instead of the
    request. (The hot door answered the request, as if nothing followed.)"""
    body = b'{"prompt": "x", "max_tokens": 2}'
    async with start_daemon(tiny_model) as d:
        for hot, general in [
                (_get("/health", CLOSE), _get("/health", CLOSE + GENERAL)),
                (_post("/v1/completions", body, CLOSE),
                 _post("/v1/completions", body, CLOSE, chunked=True))]:
            answers = []
            for request in (hot, general):
                async with await _connect(d) as stream:
                    answers.append(await _all_of(stream, request + _get("/health")))
            assert answers[0].startswith(b"HTTP/1.1 400 ")
            assert _shape(answers[0]) == _shape(answers[1])
    assert answered == posted == []


async def test_a_request_handed_over_once_the_listener_is_stopping_is_answered(
        tiny_model: Path, start_daemon: DaemonFactory, monkeypatch: pytest.MonkeyPatch,
        posted: list[str]) -> None:
    """A POST whose body is late is handed to hypercorn after the hot door's wait. A
    drain that began meanwhile (a stream still generating, so the drain goes on) stops
    the listener's accepting at once; hypercorn's idle timer then closed the handed
    connection at once too, racing its read of the request handed with it, and the
    client got nothing. It gets the drain's 503, as before the hot door waited."""
    monkeypatch.setattr(hotdoor, "BODY_WAIT_S", 1.0)
    body = b'{"prompt": "late", "max_tokens": 2}'
    long = b'{"prompt": "go", "max_tokens": 2000, "ignore_eos": true, "stream": true}'
    async with start_daemon(tiny_model, server={"drain_timeout": 5.0}) as d, \
            httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=d.admin_sock),
                              base_url="http://admin") as admin:
        await admin.post("/debug/slow-steps", params={"seconds": 0.02})
        async with await _connect(d) as streaming, await _connect(d) as stream:
            await streaming.send_all(_post("/v1/completions", long))
            with trio.fail_after(10):
                assert (await streaming.receive_some(65536)).startswith(b"HTTP/1.1 200 ")
            await stream.send_all(_post("/v1/completions", body)[:-len(body)])
            d.daemon.begin_drain()  # the listener stops accepting within the hot door's wait
            await trio.sleep(1.3)  # the wait is over: the request is hypercorn's
            await stream.send_all(body)
            head, error = await _answer(stream)
    assert head.startswith(b"HTTP/1.1 503 "), head
    assert msgspec.json.decode(error)["error"]["code"] == "unavailable"
    assert posted == ["/v1/completions"]  # the stream, not the late one


async def test_a_hot_post_between_hot_gets_in_one_write_keeps_their_order(
        tiny_model: Path, start_daemon: DaemonFactory, answered: list[str],
        posted: list[str]) -> None:
    body = b'{"prompt": "x", "max_tokens": 2, "stream": true}'
    async with start_daemon(tiny_model) as d, await _connect(d) as stream:
        await stream.send_all(_get("/health") + _post("/v1/completions", body)
                              + _get("/v1/models") + _post("/v1/completions", body))
        answers = [await _answer(stream) for _ in range(4)]
    assert [b"text/event-stream" in h for h, _ in answers] == [False, True, False, True]
    assert answers[1][1].endswith(b"data: [DONE]\n\n") and b'"object":"list"' in answers[2][1]
    assert answered == ["/health", "/v1/models"]
    assert posted == ["/v1/completions"] * 2


async def test_a_hot_generations_time_starts_at_its_head_as_the_general_paths_does(
        tiny_model: Path, start_daemon: DaemonFactory, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch, posted: list[str]) -> None:
    """The general path's request starts when hypercorn has its head, before its body
    is read: a body that comes late counts in its duration and its TTFT (the access
    log's, the metrics'). So it does on the hot path, which reads the body itself."""
    caplog.set_level(logging.INFO, logger="forged.access")
    monkeypatch.setattr(hotdoor, "BODY_WAIT_S", 5.0)
    body = b'{"prompt": "x", "max_tokens": 2}'
    request = _post("/v1/completions", body)
    async with start_daemon(tiny_model) as d, await _connect(d) as stream:
        await stream.send_all(request[:-len(body)])
        await trio.sleep(1.0)  # within hotdoor.BODY_WAIT_S: still hot
        await stream.send_all(body)
        head, _ = await _answer(stream)
        rid = re.search(rb"x-request-id: (\w+)", head)[1].decode()  # type: ignore[index]
        await until(partial(_logged, caplog, [rid]))
    line, = [r for r in caplog.records if getattr(r, "fields", {}).get("request_id") == rid]
    # (the generation itself takes a tenth of that)
    assert float(line.fields["duration"]) >= 1.0  # type: ignore[attr-defined]
    assert float(line.fields["ttft"]) >= 1.0  # type: ignore[attr-defined]
    assert posted == ["/v1/completions"]


async def test_with_keys_a_known_key_is_hot_and_a_wrong_one_gets_the_general_401(
        tiny_model: Path, start_daemon: DaemonFactory, tmp_path: Path,
        answered: list[str]) -> None:
    key = add_key(tmp_path / "keys.toml", "editor", max_streams=2, max_queued=2,
                  priority="interactive")
    async with start_daemon(tiny_model) as d, await _connect(d) as stream:
        auth = b"Authorization: Bearer %s\r\n" % key.encode()
        hot, = await _exchange(stream, _get("/v1/models", auth), 1)
        x_api_key, = await _exchange(stream, _get("/v1/models", b"x-api-key: %s\r\n"
                                                  % key.encode()), 1)
        general, = await _exchange(stream, _get("/v1/models", auth + GENERAL), 1)
        assert hot.startswith(b"HTTP/1.1 200 ") and _shape(hot) == _shape(general)
        assert _shape(x_api_key) == _shape(hot)
        async with await _connect(d) as other:
            wrong, = await _exchange(other, _get("/v1/models", b"Authorization: Bearer no\r\n"),
                                     1)
            assert wrong.startswith(b"HTTP/1.1 401 ")
            error = msgspec.json.decode(wrong.split(b"\r\n\r\n", 1)[1])
            assert error["error"]["type"] == "invalid_request_error"
            health, = await _exchange(other, _get("/health"), 1)  # the connection lives on
            assert health.endswith(b'{"status":"ok"}')
        assert answered == ["/v1/models", "/v1/models"]  # the Bearer and the x-api-key


async def test_idle_connections_close_after_keep_alive_and_all_at_shutdown(
        autojump_clock: trio.testing.MockClock) -> None:
    idle = IdleConnections(lambda: 30.0)
    a, b = trio.socket.socketpair()
    c, d = trio.socket.socketpair()
    first, second = trio.SocketStream(a), trio.SocketStream(c)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(idle.sweep)
        assert idle.waiting(first, True)
        await trio.sleep(20)
        assert idle.waiting(second, True)
        assert idle.waiting(first, True)  # still waiting: its time is not renewed
        await trio.sleep(11)  # past the first's 30 s, and within the second's
        with pytest.raises(trio.ClosedResourceError):
            await first.send_all(b"x")
        await second.send_all(b"x")  # open
        idle.busy(second)  # a request arrived: no longer idle
        await trio.sleep(60)
        await second.send_all(b"x")
        assert idle.waiting(second, True)
        await idle.close_all()
        with pytest.raises(trio.ClosedResourceError):
            await second.send_all(b"x")
        assert not idle.waiting(second, True)  # shutting down: no more waiting
        nursery.cancel_scope.cancel()
    b.close()
    d.close()


async def test_the_sweep_leaves_a_connection_that_got_its_request_meanwhile(
        autojump_clock: trio.testing.MockClock) -> None:
    """The sweep closes the connections past their time one after another, and each
    close is a checkpoint: one whose request arrived meanwhile is busy and stays open.
    (It was closed mid-request; in a door, its handoff could then send a descriptor
    number that the next accept had reused.)"""
    idle = IdleConnections(lambda: 30.0)

    class Conn:  # a connection as the sweep sees it: nothing waits on its socket
        def __init__(self) -> None:
            self.closed = False
            self.on_close = lambda: None
            self.socket, self._peer = socket.socketpair()

        async def aclose(self) -> None:
            self.on_close()
            self.closed = True
            await trio.lowlevel.checkpoint()

    first, second = Conn(), Conn()
    first.on_close = lambda: idle.busy(cast(trio.SocketStream, second))  # a head arrives
    streams = [cast(trio.SocketStream, c) for c in (first, second)]
    assert all(idle.waiting(s, True) for s in streams)
    await trio.sleep(31)
    await idle._close(streams, trio.current_time())
    assert first.closed and not second.closed  # the second is being served
    for conn in (first, second):
        conn.socket.close()
        conn._peer.close()


async def test_at_shutdown_a_connection_whose_request_has_arrived_is_answered_not_closed(
        ) -> None:
    """close_all closes the connections waiting for a request; one whose request bytes
    already wait in its socket (accepted just before a drain, not yet read) is left to
    its reader, which answers it. (It was closed: the client got an empty reply, seen
    as curl's exit 52 in the package's upgrade test.)"""
    idle = IdleConnections(lambda: 30.0)
    (a, b), (c, d) = trio.socket.socketpair(), trio.socket.socketpair()
    idle_one, arrived = trio.SocketStream(a), trio.SocketStream(c)
    assert idle.waiting(idle_one, True) and idle.waiting(arrived, True)
    await d.send(b"GET /health HTTP/1.1\r\n\r\n")
    await idle.close_all()
    with pytest.raises(trio.ClosedResourceError):
        await idle_one.send_all(b"x")
    assert await arrived.receive_some(100) == b"GET /health HTTP/1.1\r\n\r\n"
    assert not idle.waiting(arrived, True)  # after its answer, the reader closes it
    await arrived.aclose()
    b.close()
    d.close()


async def test_at_shutdown_a_connection_with_no_request_yet_is_read_and_answered(
        autojump_clock: trio.testing.MockClock) -> None:
    """close_all closes the connections between requests (one answered, nothing of the
    next read) at once; one just accepted, whose client has not written yet, or that
    has sent part of a head (its first, or its next after an answer), is read and
    answered, with ``connection: close``, if its request comes within the grace time,
    and closed after it if not. (Each was closed at once: a request sent just after a
    drain's start got an empty reply or a reset.)"""
    view = DoorView(View(on=True, health_status=200, health=b'{"status":"ok"}',
                         models=b"{}", keys=[], keep_alive_s=30.0, max_requests=100))
    door = HotDoor(view, ResponseTail(HyperConfig()))
    idle = IdleConnections(lambda: 30.0)

    async def general(stream: trio.abc.Stream) -> None:
        raise AssertionError("a hot request was handed over")

    handoff = hotdoor.Handoff(general, lambda: 100, idle)
    peers = []
    async with trio.open_nursery() as nursery:
        for _ in range(5):
            ours, theirs = trio.socket.socketpair()
            nursery.start_soon(door.serve, trio.SocketStream(ours), handoff)
            peers.append(trio.SocketStream(theirs))
        fresh, partial, between, silent, again = peers
        await partial.send_all(b"GET /health HTTP/1.1\r\n")
        for peer in (between, again):
            answer, = await _exchange(peer, _get("/health"), 1)
            assert b"connection: close" not in answer
        await trio.testing.wait_all_tasks_blocked()  # both wait between requests
        await again.send_all(b"GET /health HTTP/1.1\r\n")  # and then one does not
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(idle.close_all)
        await trio.testing.wait_all_tasks_blocked()
        assert await between.receive_some(100) == b""  # closed at once
        started = trio.current_time()
        await trio.sleep(0.5)
        await fresh.send_all(_get("/health"))
        for peer in (partial, again):
            await peer.send_all(b"Host: forged\r\n\r\n")
        for peer in (fresh, partial, again):
            data = b""
            while chunk := await peer.receive_some(65536):
                data += chunk
            assert data.startswith(b"HTTP/1.1 200 ")
            assert b"\r\nconnection: close\r\n" in data and data.endswith(b'{"status":"ok"}')
        assert await silent.receive_some(100) == b""  # closed after the grace time
        assert trio.current_time() - started == pytest.approx(hotdoor.CLOSING_GRACE_S)
    for peer in peers:
        await peer.aclose()


async def test_an_accept_that_fails_for_one_connection_leaves_the_listener_accepting(
        ) -> None:
    """A connection reset, or refused by a firewall, before it was accepted fails its
    own accept (ECONNABORTED, EPERM): the listener goes on, as trio's does. (It ended
    the listener, and with it the API.)"""
    class Flaky(socket.socket):
        failed = False

        def accept(self) -> tuple[socket.socket, object]:
            if not Flaky.failed:
                Flaky.failed = True
                raise OSError(errno.ECONNABORTED, "aborted")
            return super().accept()

    listener = Flaky(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    served = trio.Event()

    async def handler(stream: trio.SocketStream) -> None:
        served.set()

    client = socket.create_connection(listener.getsockname())
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(accept_bursts, listener, handler, nursery)
            await served.wait()
            nursery.cancel_scope.cancel()
    client.close()
    assert Flaky.failed


async def _paced(intervals: list[float], budget_s: float) -> list[list[tuple[float, float]]]:
    """Deltas pushed after each of ``intervals`` (seconds), read as the SSE body reads
    them; each write's (pushed, written) times."""
    rs = RequestStream(1, Request(prompt=[1], max_tokens=len(intervals)),
                       clock=trio.current_time)
    pace, pushed, writes = Pace(budget_s), [], []

    async def engine() -> None:
        for i, wait in enumerate(intervals):
            await trio.sleep(wait)
            pushed.append(trio.current_time())
            rs.push(Delta(rid=1, text=str(i)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine)
        while sum(len(w) for w in writes) < len(intervals):
            events = await rs.receive()
            events += await pace.gather(rs)
            now = trio.current_time()
            writes.append([(pushed[int(ev.text)], now) for ev in events
                           if isinstance(ev, Delta)])
    return writes


async def test_fast_tokens_share_writes_within_the_budget_and_slow_ones_go_at_once(
        autojump_clock: trio.testing.MockClock) -> None:
    fast = await _paced([0.001] * 200, budget_s=0.005)
    delays = [written - pushed for write in fast for pushed, written in write]
    assert max(delays) <= 0.005 + 1e-9  # never past the budget
    assert len(fast) <= 200 / 4  # about 5 tokens a write at 1 ms a token
    for gap in (0.020, 0.004):  # slower than half the budget: each token at once
        slow = await _paced([gap] * 50, budget_s=0.005)
        assert [len(w) for w in slow] == [1] * 50
        assert all(written == pushed for write in slow for pushed, written in write)
    off = await _paced([0.001] * 50, budget_s=0.0)  # stream_coalesce_ms = 0
    assert all(written == pushed for write in off for pushed, written in write)


async def test_a_frame_of_several_steps_tokens_is_paced_by_the_gap_before_it(
        autojump_clock: trio.testing.MockClock) -> None:
    """A worker holding tokens (forged.engine.hold) sends several steps' in one frame,
    5 ms apart: they arrive together. A direct stream's sink asks the pace at each of
    them; reading the nothing between them as the stream's gap, it would decline them
    and the stream's task would wait another budget (a double delay)."""
    rs = RequestStream(1, Request(prompt=[1], max_tokens=20), clock=trio.current_time)
    pace, asked = Pace(0.005), []

    class Asking:
        def __call__(self, ev: Event) -> bool:
            asked.append(pace.waits(rs))
            return True

        def delivered(self) -> None:
            pass

    rs.sink = Asking()
    for delivery in (1, 2, 3):
        await trio.sleep(0.005)
        for _ in range(4):
            rs.push(Delta(rid=1, text="x"), delivery)
    assert asked == [False] * 12
    asked.clear()
    await trio.sleep(0.005)
    for _ in range(4):  # events that each came on their own, at once: a fast stream
        rs.push(Delta(rid=1, text="x"))
    assert asked == [False, True, True, True]
    # n > 1: every 20 ms step's frame brings a token of each choice, back to back.
    # Before, choice 1's token read as a stream 0 ms after choice 0's: held, and the
    # stream's task woke to write it 5 ms later, every step.
    asked.clear()
    for delivery in (4, 5, 6):
        await trio.sleep(0.020)
        for index in (0, 1, 2):
            rs.push(Delta(rid=1, text="x", index=index), delivery)
    assert asked == [False] * 9


async def test_a_request_that_asks_connection_close_gets_its_answer_then_the_close(
        tiny_model: Path, start_daemon: DaemonFactory) -> None:
    """Before, quart-trio cancelled hypercorn's close of the connection halfway (the
    handler is cancelled once the request is over), and the connection stayed open
    until the client closed it: a client that reads to the end waited forever."""
    body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, ' \
           b'"stream": true}'
    chat = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: forged\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (len(body), body))
    async with start_daemon(tiny_model) as d:
        for request in (_get("/v1/models", b"Connection: close\r\n"), chat):
            async with await _connect(d) as stream:
                await stream.send_all(request)
                answer = b""
                with trio.fail_after(10):
                    while data := await stream.receive_some(65536):
                        answer += data
                assert answer.startswith(b"HTTP/1.1 200 ")
                assert answer.endswith((b"]}", b"data: [DONE]\n\n\r\n0\r\n\r\n"))


async def test_the_last_request_a_connection_may_make_is_answered_then_closed(
        tiny_model: Path, start_daemon: DaemonFactory, answered: list[str]) -> None:
    """hypercorn's keep_alive_max_requests (1000), kept by the hot door as hypercorn
    keeps it: the last answer says ``connection: close``, then the connection ends."""
    async with start_daemon(tiny_model) as d, await _connect(d) as stream:
        answers = await _exchange(stream, _get("/health") * 1000, 1000)
        assert b"connection: close" not in answers[-2]
        assert b"server: hypercorn-h11\r\nconnection: close\r\n\r\n" in answers[-1]
        with trio.fail_after(10):
            assert await stream.receive_some(100) == b""
        assert len(answered) == 1000


def _sockets() -> int:
    """This process's open sockets (the daemon under test runs in it)."""
    return sum(os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
               for fd in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{fd}"))


async def test_a_general_connection_its_client_ends_between_requests_closes_at_once(
        tiny_model: Path, start_daemon: DaemonFactory) -> None:
    """As the hot door closes one. hypercorn's trio server stopped reading at the
    client's end (its FIN or a reset) but left its keep-alive timer running: the
    connection, its task and its descriptor stayed for keep_alive_timeout (30 s), in
    CLOSE-WAIT, and a client that half-closes after its request (``nc -N``) read its
    answer, then waited that long for the end."""
    async with start_daemon(tiny_model) as d:
        async with await _connect(d) as stream:
            answer, = await _exchange(stream, _get("/health", GENERAL), 1)
            await trio.testing.wait_all_tasks_blocked(0.01)  # between requests
            await stream.send_eof()
            with trio.fail_after(2):
                assert await stream.receive_some(100) == b""
        assert answer.startswith(b"HTTP/1.1 200 ")
        before = _sockets()
        for _ in range(20):  # clients that reset their connection after the answer
            async with await _connect(d) as stream:
                await _exchange(stream, _get("/health", GENERAL), 1)
                await trio.testing.wait_all_tasks_blocked(0.01)
                stream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await until(lambda: _sockets() <= before, limit=2)


async def test_a_client_that_reads_nothing_does_not_hold_the_daemons_stop(
        tiny_model: Path, start_daemon: DaemonFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that sends requests and reads no answer (one stopped, or gone without a
    word: a stream to it fills the socket) no longer holds the listener past its grace
    (drain_timeout + 5 s). hypercorn shields each write, and forged the last one of a
    response: the shutdown's cancellation could not end one, and the daemon's stop
    waited forever (under systemd, until its SIGKILL at TimeoutStopSec, with no
    session's KV state saved)."""
    ended = listener_ends(monkeypatch)

    async def send(stream: trio.SocketStream) -> None:
        with suppress(trio.BrokenResourceError):  # the daemon's end, closed unread
            await stream.send_all(_get("/v1/models", GENERAL) * 50_000)

    async with start_daemon(tiny_model, server={"drain_timeout": 1.0}) as d, \
            await _connect(d) as stream, trio.open_nursery() as client:
        client.start_soon(send, stream)
        await trio.testing.wait_all_tasks_blocked(0.1)  # both ends' buffers full
        d.daemon.begin_drain()
        started = trio.current_time()
        await until(lambda: len(ended) == 2, limit=15)  # the API's listener and the admin's
        assert max(ended) - started < 1.0 + 5.0 + 1.0
        client.cancel_scope.cancel()


def listener_ends(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The (trio) times at which the daemon's listeners end (forged.daemon.listener's
    serve returns), appended as they do."""
    serve, ended = listener.serve, []

    async def timed(*args: Any, **kwargs: Any) -> None:
        try:
            await serve(*args, **kwargs)
        finally:
            ended.append(trio.current_time())

    monkeypatch.setattr(listener, "serve", timed)
    return ended
