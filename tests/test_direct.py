"""Direct streams (forged.http.direct): the pool's reader writes a stream's frames to
its socket as each step arrives, without waking the stream's task; the bytes are those
the general path (Quart, hypercorn, h11) sends, in order, also through a full socket."""

from __future__ import annotations

import re
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import h11
import msgspec
import pytest
import trio

from forged.engine.events import Delta, Done, Event, Failed
from forged.engine.pool import RequestStream
from forged.engine.request import Request
from forged.http import sse
from forged.http.direct import StepSink
from forged.http.generate import Outcome, Pace, _direct, _Frames, _stream
from forged.http.lifetime import Call
from forged.http.state import DrainDeadlines
from tests.conftest import DaemonFactory, RunningDaemon

TOKENS = 300


class _Served:
    def add(self, completion_id: str, key: str) -> None:
        pass


def _state(coalesce_ms: float = 0.0) -> Any:
    """What a stream reads of the daemon's state."""
    return SimpleNamespace(drain=DrainDeadlines(), holds=None, cfg=SimpleNamespace(
        limits=SimpleNamespace(retry_after=1),
        server=SimpleNamespace(stream_coalesce_ms=coalesce_ms)))


def _frames() -> _Frames:
    out = sse.ChatFormat(model="m", created=1)
    out.id = "chatcmpl-1"  # both paths' streams name the same completion
    outcome = Outcome(Call(), "/v1/chat/completions", cast(Any, None),
                      cast(Any, SimpleNamespace(served=_Served())))
    return _Frames(outcome, out, include_usage=True)


def _events() -> list[Event]:
    out: list[Event] = [Delta(rid=1, text=f"tok{i:03d} ") for i in range(TOKENS)]
    return [*out, Done(rid=1, text="end", stop_type="limit", prompt_tokens=3,
                       completion_tokens=TOKENS + 1, cached_tokens=0)]


def _stream_of() -> RequestStream:
    return RequestStream(1, Request(prompt=[1, 2, 3], max_tokens=TOKENS + 1),
                         clock=trio.current_time)


def _chunked(data: bytes) -> list[bytes]:
    """The chunks of a chunked body (without its last, empty one)."""
    out = []
    while data:
        size, _, rest = data.partition(b"\r\n")
        n = int(size, 16)
        assert rest[n:n + 2] == b"\r\n"
        out.append(rest[:n])
        data = rest[n + 2:]
    return out


async def _engine(rs: RequestStream, events: list[Event]) -> None:
    for ev in events:
        await trio.sleep(0.01)  # a step of 10 ms: slower than any coalescing budget
        rs.push(ev)


async def _general(events: list[Event]) -> bytes:
    """The general path's body: the frames ``_stream`` yields, framed by h11 as
    hypercorn sends them."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    assert isinstance(conn.next_event(), h11.Request)
    conn.send(h11.Response(status_code=200, headers=[]))
    rs, f, body = _stream_of(), _frames(), b""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_engine, rs, events)
        async for frames in _stream(_state(), rs, [], f.out, True, f.outcome, None):
            body += conn.send(h11.Data(data=frames)) or b""
    return body


async def _direct_body(events: list[Event], *, full: bool) -> tuple[bytes, int]:
    """The direct path's body for the same events, and how often the stream's task
    woke; ``full``: the client reads nothing until the engine has sent every event,
    through a socket that holds a few kilobytes."""
    a, b = trio.socket.socketpair()
    if full:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    rs, body, wakes = _stream_of(), b"", 0
    receive = rs.receive

    async def counted() -> list[Event]:
        nonlocal wakes
        wakes += 1
        return await receive()

    rs.receive = counted  # type: ignore[method-assign]

    async def engine() -> None:
        await _engine(rs, events)
        sent.set()

    async def stream() -> None:
        frames = _frames()
        await _direct(_state(), rs, [], frames, Pace(0.0), server)
        await server.send_eof()

    sent = trio.Event()
    async with trio.SocketStream(a) as server, trio.SocketStream(b) as client, \
            trio.open_nursery() as nursery:
        nursery.start_soon(engine)
        nursery.start_soon(stream)
        if full:
            await sent.wait()
        while data := await client.receive_some(65536):
            body += data
    return body, wakes


async def test_a_direct_stream_is_the_general_paths_bytes_and_wakes_its_task_once(
        autojump_clock: trio.testing.MockClock) -> None:
    events = _events()
    general = await _general(events)
    direct, wakes = await _direct_body(events, full=False)
    assert direct == general
    assert len(_chunked(direct)) == TOKENS + 2  # the role; a chunk a token; the end
    assert wakes == 1  # the reader wrote every token; the task woke for the end alone


async def test_through_a_full_socket_every_frame_arrives_in_order(
        autojump_clock: trio.testing.MockClock) -> None:
    events = _events()
    direct, wakes = await _direct_body(events, full=True)
    assert len(direct) > 10 * 4096  # far more than the socket held
    # Events that queued while the socket was full share a chunk: the same frames.
    assert b"".join(_chunked(direct)) == b"".join(_chunked(await _general(events)))
    assert wakes > 1  # the task finished the writes the socket did not take


async def test_the_tokens_of_one_frame_go_out_in_one_write(
        autojump_clock: trio.testing.MockClock) -> None:
    """A worker holding tokens sends several steps' in one frame: the pool pushes its
    events, then says it is delivered, and the stream writes them as one chunk; the
    bytes are the general path's."""
    events, rs, body = _events(), _stream_of(), b""

    async def engine() -> None:
        for delivery, (start, end) in enumerate([(0, 5), (5, 10)], 1):
            await trio.sleep(0.01)
            for ev in events[start:end]:
                rs.push(ev, delivery)
            rs.delivered()
        await _engine(rs, events[10:])  # then one event at a time

    async def stream() -> None:
        await _direct(_state(), rs, [], _frames(), Pace(0.0), server)
        await server.send_eof()

    a, b = trio.socket.socketpair()
    async with trio.SocketStream(a) as server, trio.SocketStream(b) as client, \
            trio.open_nursery() as nursery:
        nursery.start_soon(engine)
        nursery.start_soon(stream)
        while data := await client.receive_some(65536):
            body += data
    chunks = _chunked(body)
    assert [c.count(b"data: ") for c in chunks[:4]] == [1, 5, 5, 1]  # the role; 5; 5; 1
    assert b"".join(chunks) == b"".join(_chunked(await _general(events)))


async def _post_stream(d: RunningDaemon, body: bytes) -> tuple[bytes, list[bytes]]:
    """A streamed chat on a raw connection: the response's head and its chunks."""
    host, port = d.url.removeprefix("http://").rsplit(":", 1)
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: forged\r\nConnection: close\r\n"
               b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
               % (len(body), body))
    data = b""
    async with await trio.open_tcp_stream(host, int(port)) as stream:
        await stream.send_all(request)
        with trio.fail_after(30):
            while more := await stream.receive_some(65536):
                data += more
    head, _, rest = data.partition(b"\r\n\r\n")
    assert rest.endswith(b"0\r\n\r\n")  # the last chunk: the body ended cleanly
    return head, _chunked(rest.removesuffix(b"0\r\n\r\n"))


def _shapes(chunks: list[bytes]) -> list[Any]:
    """Each SSE frame's JSON with what differs between two answers blanked (ids, times,
    the text), consecutive repeats once: the stream's shape."""
    out: list[Any] = []
    for frame in b"".join(chunks).split(b"\n\n")[:-1]:
        assert frame.startswith(b"data: ")
        obj = frame.removeprefix(b"data: ")
        shape = obj if obj == b"[DONE]" else re.sub(
            rb'"(id|created|content|system_fingerprint)":("[^"]*"|\d+)', rb'"\1":X',
            re.sub(rb'\\.', b"", obj))
        if not out or out[-1] != shape:
            out.append(shape)
    return out


@pytest.fixture
def written(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Each event offered to a direct stream's sink: whether the reader wrote it."""
    out: list[bool] = []
    call = StepSink.__call__

    def counted(sink: StepSink, ev: Event) -> bool:
        took = call(sink, ev)
        out.append(took)
        return took

    monkeypatch.setattr(StepSink, "__call__", counted)
    return out


async def test_through_a_daemon_a_direct_stream_looks_like_the_general_one(
        tiny_model: Path, start_daemon: DaemonFactory, written: list[bool]) -> None:
    body = (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, '
            b'"ignore_eos": true, "cache_prompt": false, "stream": true, '
            b'"stream_options": {"include_usage": true}}')
    # Without coalescing: the tiny model's tokens come faster than its budget.
    async with start_daemon(tiny_model, server={"stream_coalesce_ms": 0}) as d:
        state = d.daemon.state
        assert state is not None
        direct_head, direct = await _post_stream(d, body)
        assert sum(written) > 10
        server = msgspec.structs.replace(state.cfg.server, hot_door=False)
        state.cfg = msgspec.structs.replace(state.cfg, server=server)
        written.clear()
        general_head, general = await _post_stream(d, body)
        assert not written
    blank = re.compile(rb"(x-request-id|date): [^\r]+")
    assert blank.sub(b"", direct_head) == blank.sub(b"", general_head)
    assert b"Transfer-Encoding: chunked" in direct_head  # h11 says it so
    assert _shapes(direct) == _shapes(general)
    assert _shapes(direct)[-1] == b"[DONE]" and b'"usage"' in _shapes(direct)[-2]


async def test_a_client_that_leaves_a_direct_stream_leaves_nothing_held(
        tiny_model: Path, start_daemon: DaemonFactory, written: list[bool]) -> None:
    """The reader was writing its frames; the client closes: the stream's writes stop,
    its sequence and its count in the drain come back, and the daemon serves on."""
    body = (b'{"prompt": "go on", "max_tokens": 2000, "ignore_eos": true, "stream": true}')
    async with start_daemon(tiny_model, server={"stream_coalesce_ms": 0}) as d:
        state = d.daemon.state
        assert state is not None
        host, port = d.url.removeprefix("http://").rsplit(":", 1)
        stream = await trio.open_tcp_stream(host, int(port))
        await stream.send_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        seen = b""
        with trio.fail_after(30):
            while seen.count(b"data: {") < 20:
                seen += await stream.receive_some(65536)
        assert sum(written) >= 10
        await stream.aclose()
        with trio.fail_after(20):
            while d.daemon.pool.in_flight() or len(state.drain):  # noqa: ASYNC110
                await trio.sleep(0.01)
        head, chunks = await _post_stream(d, b'{"messages": [{"role": "user", "content": '
                                             b'"x"}], "max_tokens": 3, "stream": true}')
        assert head.startswith(b"HTTP/1.1 200 ") and _shapes(chunks)[-1] == b"[DONE]"


async def test_an_error_in_a_frame_the_reader_made_is_raised_in_the_streams_task(
        autojump_clock: trio.testing.MockClock) -> None:
    """The pool's reader runs every stream of its worker: a frame that fails to be made
    there must end its own stream, never the reader."""
    frames = _frames()
    make = frames.delta

    def delta(ev: Delta) -> None:
        if ev.text == "tok005 ":
            raise ValueError("a frame that cannot be made")
        make(ev)

    frames.delta = delta  # type: ignore[method-assign]
    rs, events = _stream_of(), _events()
    a, b = trio.socket.socketpair()
    with pytest.raises(ExceptionGroup) as raised:
        async with trio.SocketStream(a) as server, trio.SocketStream(b), \
                trio.open_nursery() as nursery:
            nursery.start_soon(_engine, rs, events)  # the reader: never raises
            await _direct(_state(), rs, [], frames, Pace(0.0), server)
    assert raised.group_contains(ValueError, match="cannot be made", depth=1)
    assert len(raised.value.exceptions) == 1  # the stream's alone
    assert rs.sink is None


async def test_a_stream_that_fails_midway_ends_with_the_general_paths_error_frame(
        autojump_clock: trio.testing.MockClock) -> None:
    events: list[Event] = [*_events()[:50], Failed(rid=1, code="engine_error",
                                                   message="the worker's step failed")]
    general = await _general(events)
    direct, _ = await _direct_body(events, full=False)
    assert direct == general
    assert b"the worker's step failed" in _chunked(direct)[-1]


@pytest.mark.parametrize("fingerprint", [None, "fp_1"])
@pytest.mark.parametrize("make", [sse.ChatFormat, sse.CompletionFormat])
def test_a_pre_encoded_text_chunk_is_the_chunk_encoded_whole(
        make: type[sse.ChatFormat] | type[sse.CompletionFormat],
        fingerprint: str | None) -> None:
    """A token's chunk is made from its choice's bytes around the text (encoded once);
    it must be the envelope encoded whole, whatever the text."""
    out = make(model='m "x" \u00e9', created=7, n=2, fingerprint=fingerprint)
    for index in (1, 0, 1):
        for text in ["", "hi", ' a "quote" \\ and\nnewline', "\x00\x1f\u2028 caf\u00e9 \U0001f600",
                     "\ue000forged\ue000"]:
            key = "delta" if make is sse.ChatFormat else "text"
            value: object = {"content": text} if key == "delta" else text
            choice = {"index": index, key: value, "logprobs": None, "finish_reason": None}
            whole = {"id": out.id, "object": out.object_chunk, "created": 7, "model": out.model,
                     "choices": [choice],
                     **({"system_fingerprint": fingerprint} if fingerprint else {})}
            assert out.delta(text, index) == b"data: " + msgspec.json.encode(whole) + b"\n\n"


async def _general_until_drain(rs: RequestStream, engine: Any, deadline_s: float,
                               coalesce_ms: float, read_s: float) -> bytes:
    """The general path's body (its frames joined) with the drain's deadline at
    ``deadline_s`` from now, the events pushed by ``engine(rs)`` and a client that
    takes ``read_s`` to read each write."""
    state, f, body = _state(coalesce_ms), _frames(), b""
    state.drain.set(trio.current_time() + deadline_s)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine, rs)
        async for frames in _stream(state, rs, [], f.out, True, f.outcome, None):
            body += frames
            await trio.sleep(read_s)
        nursery.cancel_scope.cancel()
    return body


async def test_events_taken_before_the_drains_deadline_are_written(
        autojump_clock: trio.testing.MockClock) -> None:
    """Tokens a millisecond apart share a write for up to the 5 ms budget; the drain's
    deadline passing within that wait still writes what was taken, and a stream whose
    last event came meanwhile ends as finished. (They were dropped, and the stream
    reported cut short.)"""
    events = _events()[:3] + _events()[-1:]  # three tokens, then the end

    async def engine(rs: RequestStream) -> None:
        for ev in events:
            await trio.sleep(0.001)
            rs.push(ev)

    body = await _general_until_drain(_stream_of(), engine, 0.0035, 5.0, 0.0)
    assert b"tok001" in body and b"tok002" in body
    assert b'"finish_reason":"length"' in body and b"cut short" not in body


async def test_the_drains_deadline_cuts_a_stream_whose_events_are_always_waiting(
        autojump_clock: trio.testing.MockClock) -> None:
    """A client that reads slower than tokens come finds events waiting at every
    turn: the deadline still cuts the stream, with its 503 frame. (Waiting events
    returned without a checkpoint, so the deadline never fired: the stream ran on to
    its end, holding the drain open.)"""
    async def engine(rs: RequestStream) -> None:
        for ev in _events():
            await trio.sleep(0.005)
            rs.push(ev)

    body = await _general_until_drain(_stream_of(), engine, 0.1, 0.0, 0.01)
    assert b"cut short" in body and b'"finish_reason":"length"' not in body
    assert b"tok%03d" % (TOKENS - 1) not in body
