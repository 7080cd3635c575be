"""The HTTP API against an in-process daemon and a tiny random-weight model."""

from __future__ import annotations

import gzip
import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from forged.auth import add_key
from forged.engine import testhooks
from tests.conftest import DaemonFactory, RunningDaemon

pytestmark = pytest.mark.trio


def sse_events(lines: list[str]) -> list[Any]:
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def stream(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[Any]:
    async with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        return sse_events([line async for line in r.aiter_lines()])


async def until(pred: Any, limit: float = 20.0) -> None:
    """Poll ``pred``: the state lives in another process, so there is no event to wait on.
    ``limit`` only bounds a failure; it is generous for a slow, shared machine."""
    with trio.fail_after(limit):
        while not pred():  # noqa: ASYNC110
            await trio.sleep(0.01)


async def test_models_health_and_completion(tiny_model: Path, start_daemon: DaemonFactory) -> None:
    with trio.fail_after(30):
        async with start_daemon(tiny_model) as d, httpx.AsyncClient(base_url=d.url) as c:
            assert (await c.get("/health")).json() == {"status": "ok"}
            models = (await c.get("/v1/models")).json()
            assert models["data"][0]["id"] == "tiny"
            r = await c.post("/v1/completions", json={
                "model": "tiny", "prompt": "Hello", "max_tokens": 12, "ignore_eos": True,
                "temperature": 0})
            assert r.status_code == 200
            body = r.json()
            assert body["object"] == "text_completion"
            assert body["usage"]["completion_tokens"] == 12
            assert body["choices"][0]["finish_reason"] == "length"
            assert r.headers["x-request-id"]
            # greedy is deterministic
            again = await c.post("/v1/completions", json={
                "prompt": "Hello", "max_tokens": 12, "ignore_eos": True, "temperature": 0})
            assert again.json()["choices"][0]["text"] == body["choices"][0]["text"]
            # and the second run reused the cached prompt
            assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_streaming_chat_with_usage(tiny_model: Path, start_daemon: DaemonFactory) -> None:
    with trio.fail_after(30):
        async with start_daemon(tiny_model) as d, httpx.AsyncClient(base_url=d.url) as c:
            events = await stream(c, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9,
                "ignore_eos": True, "stream_options": {"include_usage": True}})
            assert events[-1] == "[DONE]"
            assert events[0]["choices"][0]["delta"]["role"] == "assistant"
            assert events[-3]["choices"][0]["finish_reason"] == "length"
            assert events[-2]["usage"]["completion_tokens"] == 9
            assert events[-2]["choices"] == []


BAD_REQUESTS = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[]", 400, None),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": 3}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 17}, 400, "n"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {}, 400, None),
    ("/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "model"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": ["a"] * 17}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 500}}, 400, None),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, 400, "prompt"),
    ("/v1/completions", {"prompt": "word " * 3000}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "x", "priority": "urgent"}, 400, "priority"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}, 400, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url"}]}]}, 400, None),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 3000}]},
     400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 5000}, 400, "messages"),
    ("/v1/chat/completions", b"\xff\xfe", 400, None),
]


async def test_bad_input_gets_openai_4xx_and_loses_nothing(
    tiny_model: Path, start_daemon: DaemonFactory
) -> None:
    with trio.fail_after(60):
        async with start_daemon(tiny_model, server={"max_body_bytes": 100_000}) as d, \
                httpx.AsyncClient(base_url=d.url) as c:
            for path, body, status, param in BAD_REQUESTS:
                if isinstance(body, bytes):
                    r = await c.post(path, content=body)
                else:
                    r = await c.post(path, json=body)
                assert r.status_code == status, (body, r.text)
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"}, err
                assert err["message"]
                if param is not None:
                    assert err["param"] == param, (body, err)
            for method, path, status in [("GET", "/nope", 404), ("GET", "/v1/completions", 405),
                                         ("POST", "/stats", 404), ("GET", "/metrics", 404)]:
                r = await c.request(method, path)
                assert r.status_code == status
                assert r.json()["error"]["type"] == "invalid_request_error"
            r = await c.post("/v1/completions", content=b"x" * 200_000)
            assert r.status_code == 413 and "error" in r.json()
            # unknown fields are ignored, as OpenAI-compatible servers do
            r = await c.post("/v1/completions", json={
                "prompt": "x", "max_tokens": 2, "frobnicate": {"a": 1}, "logprobs": None})
            assert r.status_code == 200
            assert (await c.get("/health")).status_code == 200
            await until(lambda: d.stats().running == 0)
            assert d.stats().kv_cells_active == 0


async def test_a_compressed_body_is_a_415_naming_content_encoding(
        tiny_model: Path, start_daemon: DaemonFactory) -> None:
    """A body sent gzipped was parsed as JSON as it came: a 400 "could not parse"
    that hid the cause. It is a 415 naming Content-Encoding (llama-server's answer),
    in each dialect's error shape, and the keep-alive connection serves on."""
    body = json.dumps({"prompt": "x", "max_tokens": 1, "model": "tiny",
                       "messages": [{"role": "user", "content": "x"}]}).encode()
    with trio.fail_after(60):
        async with start_daemon(tiny_model) as d, httpx.AsyncClient(base_url=d.url) as c:
            for path in ("/v1/chat/completions", "/completion", "/api/chat",
                         "/v1/messages", "/v1/responses"):
                for coding in ("gzip", "deflate", "br"):
                    r = await c.post(path, content=gzip.compress(body), headers={
                        "Content-Encoding": coding, "Content-Type": "application/json"})
                    assert r.status_code == 415, (path, r.text)
                    assert r.headers["Accept-Encoding"] == "identity"
                    assert f"Content-Encoding: {coding}" in json.dumps(r.json()), r.text
            r = await c.post("/v1/chat/completions", content=gzip.compress(body),
                             headers={"Content-Encoding": "gzip"})
            assert r.json()["error"] == {
                "message": "Content-Encoding: gzip is not supported: send the request body "
                           "uncompressed (Content-Encoding: identity, or none)",
                "type": "invalid_request_error", "param": None,
                "code": "unsupported_content_encoding"}
            r = await c.post("/v1/completions", content=body,
                             headers={"Content-Encoding": "identity"})
            assert r.status_code == 200, r.text


async def open_raw_stream(d: RunningDaemon, path: str, body: dict[str, Any], events: int,
                          headers: str = "") -> trio.SocketStream:
    """POST ``body`` to ``path`` on a raw connection and read until ``events`` SSE events
    arrived; the caller holds the stream open, or drops it, by the socket (an httpx
    stream left unread warns when it is collected)."""
    raw = json.dumps(body).encode()
    host, port = d.url.removeprefix("http://").rsplit(":", 1)
    sock = await trio.open_tcp_stream(host, int(port))
    await sock.send_all(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}"
        f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
    received = b""
    while received.count(b"data: {") < events:
        received += await sock.receive_some(65536)
    return sock


async def assert_a_dropped_stream_is_freed_within_a_step(
        d: RunningDaemon, path: str, body: dict[str, Any], events: int) -> None:
    """Stream ``body`` to ``path`` over a raw connection, drop it after ``events`` SSE
    events, and check that the engine let go of it, all its ``n`` sequences, within the
    step in flight."""
    # Slow steps (500 ms) make "within one step" countable on a tiny model, with
    # room for a slow machine to notice the drop within the step in flight.
    step = 0.5
    testhooks.slow_steps(d.daemon.pool, 0, step)
    sock = await open_raw_stream(d, path, body, events)
    assert d.stats().running == body.get("n", 1)
    await trio.sleep(2 * step)  # statistics arrive with each (slow) step
    steps_at_drop = d.stats().steps
    await sock.aclose()
    await until(lambda: d.stats().running == 0)
    st = d.stats()
    assert st.kv_cells_active == 0
    # At most the step in flight when the cancel arrived (and one whose statistics
    # were still on the wire) ran after the drop.
    assert st.steps - steps_at_drop <= 2
    assert d.daemon.pool.in_flight() == 0


async def test_disconnect_frees_the_sequence_within_a_step(
    tiny_model: Path, start_daemon: DaemonFactory
) -> None:
    with trio.fail_after(30):
        async with start_daemon(tiny_model) as d:
            await assert_a_dropped_stream_is_freed_within_a_step(
                d, "/v1/completions", {"prompt": "Tell me a long story", "max_tokens": 2000,
                                       "ignore_eos": True, "stream": True}, events=2)


async def test_worker_crash_gives_clean_errors_and_restarts(
    tiny_model: Path, start_daemon: DaemonFactory, caplog: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(60):
        async with start_daemon(tiny_model) as d, httpx.AsyncClient(base_url=d.url) as c:
            results: list[list[Any]] = []

            async def one() -> None:
                results.append(await stream(c, "/v1/completions", {
                    "prompt": "go", "max_tokens": 2000, "ignore_eos": True}))

            testhooks.slow_steps(d.daemon.pool, 0, 0.01)  # streams outlast the three waits
            w = d.daemon.pool.workers[0]
            old_pid = w.pid
            async with trio.open_nursery() as n:
                for _ in range(3):
                    n.start_soon(one)
                await until(lambda: d.stats().running == 3)
                assert old_pid is not None
                os.kill(old_pid, signal.SIGKILL)
            for events in results:
                assert events[-1] == "[DONE]"
                assert events[-2]["error"]["code"] == "worker_lost"
            await until(lambda: w.ready and w.pid != old_pid)
            assert w.restarts == 1
            # A crash in llama.cpp leaves no traceback: the log says how the process ended.
            assert "(killed by SIGKILL)" in caplog.text
            r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
            assert r.status_code == 200


async def test_32_concurrent_streams_all_finish(tiny_model: Path,
                                                start_daemon: DaemonFactory) -> None:
    with trio.fail_after(60):
        async with start_daemon(tiny_model, engine={"max_running": 16, "slots": 32}) as d:
            limits = httpx.Limits(max_connections=64)
            async with httpx.AsyncClient(base_url=d.url, limits=limits, timeout=30) as c:
                counts: dict[int, int] = {}

                async def one(i: int) -> None:
                    events = await stream(c, "/v1/completions", {
                        "prompt": f"request {i}", "max_tokens": 20 + i, "ignore_eos": True,
                        "stream_options": {"include_usage": True}})
                    counts[i] = events[-2]["usage"]["completion_tokens"]

                async with trio.open_nursery() as n:
                    for i in range(32):
                        n.start_soon(one, i)
            assert counts == {i: 20 + i for i in range(32)}
            await until(lambda: d.stats().running == 0)


@pytest.mark.parametrize(("overtake_window", "short_first"), [(30.0, True), (0.0, False)])
async def test_a_short_prompt_overtakes_queued_long_prompts(
    overtake_window: float, short_first: bool, tiny_model: Path, start_daemon: DaemonFactory
) -> None:
    """Both running places are taken; three long prompts queue, then a short one. When
    the places free up, shortest first with aging admits the short one before them.
    With overtake_window = 0 (arrival order) it waits behind them: the control that
    proves the requests really queued."""
    engine = {"kv_cells": 16384, "max_running": 2}
    # No refusal for the wait: this is about order (the estimate is rough under load).
    limits = {"overtake_window": overtake_window, "queue_timeout": 86400.0}
    with trio.fail_after(120):
        async with start_daemon(tiny_model, engine=engine, limits=limits) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=120) as c:
            testhooks.slow_steps(d.daemon.pool, 0, 0.01)  # the two hogs last 20 s at least
            finished: list[str] = []

            async def hog() -> None:
                async with c.stream("POST", "/v1/completions", json={
                        "prompt": "go", "max_tokens": 2000, "ignore_eos": True,
                        "stream": True}) as r:
                    async for _ in r.aiter_lines():
                        pass
                raise AssertionError("a hog finished before the queue was built")

            async def gen(name: str, prompt: str, max_tokens: int) -> None:
                r = await c.post("/v1/completions", json={
                    "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
                assert r.status_code == 200, r.text
                finished.append(name)

            def queued() -> int:
                return int(d.stats().queued_interactive)

            async with trio.open_nursery() as n, trio.open_nursery() as hogs:
                hogs.start_soon(hog)
                hogs.start_soon(hog)
                await until(lambda: d.stats().running == 2)
                # ~800 tokens each, one after another; each its own (the scheduler holds
                # a request whose prompt another is computing, and lets others pass).
                for i in range(3):
                    n.start_soon(gen, f"long{i}", f"{i} " + "word " * 160, 8)
                    await until(lambda i=i: queued() == i + 1)
                n.start_soon(gen, "short", "short", 4)
                await until(lambda: queued() == 4)
                assert d.stats().running == 2
                hogs.cancel_scope.cancel()  # both places free up
    assert len(finished) == 4
    if short_first:
        assert finished[0] == "short", finished
    else:
        assert finished.index("short") >= 2, finished


async def test_admin_is_not_on_the_api_port(tiny_model: Path,
                                            start_daemon: DaemonFactory) -> None:
    with trio.fail_after(30):
        async with start_daemon(tiny_model) as d:
            async with httpx.AsyncClient(base_url=d.url) as c:
                assert (await c.get("/stats")).status_code == 404
            transport = httpx.AsyncHTTPTransport(uds=d.admin_sock)
            async with httpx.AsyncClient(transport=transport, base_url="http://admin") as a:
                st = (await a.get("/stats")).json()
                assert st["ready"] and st["engine"]["workers"][0]["ready"]




async def test_per_slot_prefix_copy_gives_the_same_text(
    tiny_model: Path, start_daemon: DaemonFactory
) -> None:
    """kv_layout = per_slot: a running request's prefix is reused by copying its stream;
    the text must equal what the same request gives on an empty cache."""
    engine = {"kv_layout": "per_slot", "kv_cells": 8 * 512, "slots": 8, "max_running": 8,
              "max_context": 512}
    shared = "The shared repository context: " + "def f(x): return x * 2\n" * 6
    body = {"prompt": shared + "Question B", "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}
    with trio.fail_after(60):
        async with start_daemon(tiny_model, engine=engine) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            alone = (await c.post("/v1/completions", json=body)).json()
        async with start_daemon(tiny_model, engine=engine) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            testhooks.slow_steps(d.daemon.pool, 0, 0.03)  # request A runs 9 s: still running for B

            async def request_a() -> None:
                await c.post("/v1/completions", json={
                    "prompt": shared + "Question A", "max_tokens": 300, "ignore_eos": True})

            async with trio.open_nursery() as n:
                n.start_soon(request_a)
                await until(lambda: d.stats().running == 1
                            and d.stats().prefilling == 0)
                copied = (await c.post("/v1/completions", json=body)).json()
                n.cancel_scope.cancel()
    assert copied["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    assert alone["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert copied["choices"][0]["text"] == alone["choices"][0]["text"]


async def test_a_session_resumes_its_conversation_under_cache_pressure(
    tiny_model: Path, start_daemon: DaemonFactory
) -> None:
    """Two slots. Between a conversation's turns, other callers' prompts need both slots:
    without a session the first turn's KV is the LRU victim; with one it is pinned, and
    the second turn computes only its new tokens. (Without the RAM tier, which would
    keep the victim too: test_kvtiers_daemon.py.)"""
    engine = {"kv_layout": "per_slot", "kv_cells": 2 * 512, "slots": 2, "max_running": 2,
              "max_context": 512, "cache_ram_mib": 0, "cache_disk_mib": 0}
    first = [{"role": "system", "content": "You review Python code."},
             {"role": "user", "content": "What does def f(x): return x * 2 do?"}]

    async def conversation(c: httpx.AsyncClient, session: str | None) -> tuple[int, int]:
        extra = {} if session is None else {"session": session}
        body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, **extra}
        one = (await c.post("/v1/chat/completions", json={"messages": first, **body})).json()
        for i in range(3):  # other callers, other prompts, one after another
            await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": f"Unrelated question {i} " * 8}],
                "max_tokens": 4})
        reply = one["choices"][0]["message"]["content"]
        second = [*first, {"role": "assistant", "content": reply},
                  {"role": "user", "content": "And for strings?"}]
        two = (await c.post("/v1/chat/completions", json={"messages": second, **body})).json()
        return one["usage"]["prompt_tokens"], two["usage"]["prompt_tokens_details"][
            "cached_tokens"]

    with trio.fail_after(60):
        async with start_daemon(tiny_model, engine=engine) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            _, cached_anonymous = await conversation(c, None)
            first_prompt, cached_session = await conversation(c, "review-42")
            st = d.stats()
    assert cached_anonymous < 16  # at most the chat template's opening tokens
    assert cached_session >= first_prompt
    assert st.session_resumes == 1 and st.sessions_pinned == 1


@pytest.mark.parametrize("point", ["submitted", "admitted", "responding", "streaming"])
async def test_a_client_gone_before_its_first_byte_leaves_nothing_held(
    point: str, tiny_model: Path, start_daemon: DaemonFactory, tmp_path: Path
) -> None:
    """The handler is parked (a test hook) at one point between the request's arrival and
    its first byte on the wire; the client then drops the connection. The key's place,
    the engine's sequence and the drain's count must all come back."""
    key = add_key(tmp_path / "keys.toml", "solo", max_streams=1, max_queued=1,
                  priority="interactive")
    auth = {"Authorization": f"Bearer {key}"}
    body = json.dumps({"prompt": "go on", "max_tokens": 2000, "ignore_eos": True,
                       "stream": True}).encode()
    with trio.fail_after(60):
        async with start_daemon(tiny_model) as d, \
                httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=d.admin_sock),
                                  base_url="http://admin", timeout=30) as admin:
            state = d.daemon.state
            assert state is not None
            assert (await admin.post("/debug/hold", params={"point": point})).status_code == 200
            host, port = d.url.removeprefix("http://").rsplit(":", 1)
            sock = await trio.open_tcp_stream(host, int(port))
            await sock.send_all(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: " +
                auth["Authorization"].encode() + b"\r\nContent-Length: " +
                str(len(body)).encode() + b"\r\n\r\n" + body)
            assert (await admin.get("/debug/held", params={"point": point})).status_code == 200
            await sock.aclose()  # gone before reading a byte

            def released() -> bool:
                usage = state.key_usage["solo"]
                return (usage.open, usage.queued, len(state.drain),
                        d.daemon.pool.in_flight()) == (0, 0, 0, 0)

            async def engine_idle() -> bool:
                totals = (await admin.get("/stats")).json()["engine"]["totals"]
                return bool(totals["running"] == 0 and totals["queued_interactive"] == 0)

            await until(released)
            with trio.fail_after(20):
                while not await engine_idle():  # noqa: ASYNC110 (another process's state)
                    await trio.sleep(0.05)
            async with httpx.AsyncClient(base_url=d.url, headers=auth, timeout=30) as c:
                r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 200, r.text


async def test_drain_lets_whole_completions_finish_then_answers_503(
    tiny_model: Path, start_daemon: DaemonFactory
) -> None:
    """Non-streamed completions are open generations too: a drain counts them, lets
    them finish until its deadline, and answers the rest with a 503 to retry (not a
    dropped connection)."""
    with trio.fail_after(60):
        async with start_daemon(tiny_model, server={"drain_timeout": 10.0}) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=60) as c:
            state = d.daemon.state
            assert state is not None
            # The long one needs 75 s at the least; the short one 4 steps, which take
            # 0.4 s each on a machine this busy: both far from the 10 s drain.
            testhooks.slow_steps(d.daemon.pool, 0, 0.05)
            replies: dict[str, httpx.Response] = {}

            async def one(name: str, max_tokens: int) -> None:
                replies[name] = await c.post("/v1/completions", json={
                    "prompt": name, "max_tokens": max_tokens, "ignore_eos": True})

            async with trio.open_nursery() as n:
                n.start_soon(one, "short", 4)
                n.start_soon(one, "long", 1500)
                await until(lambda: d.stats().running == 2)
                assert len(state.drain) == 2
                d.daemon.begin_drain()
    short, long = replies["short"], replies["long"]
    assert short.status_code == 200, short.text
    assert short.json()["usage"]["completion_tokens"] == 4
    assert long.status_code == 503, long.text
    assert long.headers["retry-after"] == "2"
    assert set(long.json()["error"]) == {"message", "type", "param", "code"}
    assert "shutting down" in long.json()["error"]["message"]
