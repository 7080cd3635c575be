"""Keys, limits on input, slow clients, disconnect storms, overload, bad state dirs,
and a fuzzer posting thousands of generated bodies to every endpoint."""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.daemonproc import DaemonProcess, free_port, write_config
from tests.test_rag import index as rag_index

ENGINE = {"kv_layout": "unified", "kv_cells": 4096, "max_context": 2048, "slots": 16,
          "max_running": 8,
          "step_tokens": 64}


def start(tmp: Path, model: Path, **sections: Any) -> DaemonProcess:
    port = free_port()
    sections.setdefault("engine", ENGINE)
    d = DaemonProcess(write_config(tmp / "forged.toml", model, port, **sections), port,
                      extra=["--test-hooks"])
    d.wait_ready()
    return d


def admin_stats(d: DaemonProcess) -> dict[str, Any]:
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(d.config.parent / "admin.sock")),
                      base_url="http://admin", timeout=30) as a:
        data: dict[str, Any] = a.get("/stats").json()
        return data


def add_key(tmp: Path, name: str, *extra: str) -> str:
    r = subprocess.run([sys.executable, "-m", "forged", "keys", "add", name, "--keys-file",
                        str(tmp / "keys.toml"), *extra], capture_output=True, text=True,
                       timeout=30, check=True)
    return r.stdout.strip()


# --- API keys ----------------------------------------------------------------------------


def test_keys_are_required_limited_per_key_and_revoked_on_reload(
    tmp_path: Path, tiny_model: Path
) -> None:
    alice = add_key(tmp_path, "alice", "--max-streams", "2")
    bob = add_key(tmp_path, "bob")
    stored = (tmp_path / "keys.toml").read_text()
    assert alice not in stored and bob not in stored  # hashes only
    assert oct((tmp_path / "keys.toml").stat().st_mode & 0o777) == "0o640"
    d = start(tmp_path, tiny_model)
    try:
        with httpx.Client(base_url=d.url, timeout=30) as c:
            body = {"prompt": "x", "max_tokens": 3}
            for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": alice}):
                r = c.post("/v1/completions", json=body, headers=headers)
                assert r.status_code == 401
                assert r.json()["error"]["code"] == "invalid_api_key"
            assert c.get("/v1/models").status_code == 401
            assert c.get("/v1/models/tiny").status_code == 401
            for path in ("/tokenize", "/detokenize"):  # llama.cpp's, outside /v1/
                assert c.post(path, json={}).status_code == 401
            assert c.get("/health").status_code == 200  # health stays open
            ok = c.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {bob}"})
            assert ok.status_code == 200

            # alice may hold 2 streams; the third gets 429, bob is unaffected. Slow steps
            # keep her two generating (30 s) while the others are tried.
            d_admin = admin_stats(d)
            assert d_admin["ready"]
            with httpx.Client(transport=httpx.HTTPTransport(
                    uds=str(d.config.parent / "admin.sock")), base_url="http://admin") as a:
                a.post("/debug/slow-steps", params={"seconds": 0.02})
            with httpx.Client(base_url=d.url, timeout=60) as c2:
                long = {"prompt": "go", "max_tokens": 1500, "ignore_eos": True, "stream": True}
                auth = {"Authorization": f"Bearer {alice}"}
                streams = [c2.stream("POST", "/v1/completions", json=long, headers=auth)
                           for _ in range(2)]
                opened = [s.__enter__() for s in streams]
                try:
                    assert all(r.status_code == 200 for r in opened)
                    r = c.post("/v1/completions", json=body, headers=auth)
                    assert r.status_code == 429
                    assert r.headers["retry-after"] == "2"
                    assert r.json()["error"]["code"] == "rate_limit_exceeded"
                    r = c.post("/v1/completions", json=body,
                               headers={"Authorization": f"Bearer {bob}"})
                    assert r.status_code == 200
                finally:
                    for s in streams:
                        s.__exit__(None, None, None)
            with httpx.Client(transport=httpx.HTTPTransport(
                    uds=str(d.config.parent / "admin.sock")), base_url="http://admin") as a:
                a.post("/debug/slow-steps", params={"seconds": 0})
            new_alice = revoke_bob_and_rotate_alice_under_carols_stream(tmp_path, d, c)
            for key, status in ((bob, 401), (alice, 401), (new_alice, 200)):
                r = c.post("/v1/completions", json=body,
                           headers={"Authorization": f"Bearer {key}"})
                assert r.status_code == status
            assert alice != new_alice
    finally:
        d.stop()
    log = d.log.read_text()
    assert alice not in log and bob not in log
    assert "key=alice" in log


def revoke_bob_and_rotate_alice_under_carols_stream(tmp: Path, d: DaemonProcess,
                                                    c: httpx.Client) -> str:
    """`forged keys revoke` and `rotate`, applied by a reload while another key streams:
    the stream ends whole; the new secret of alice is returned."""
    keys = ["--keys-file", str(tmp / "keys.toml")]
    carol = add_key(tmp, "carol")
    reload_and_wait(d, c, carol, 200)
    subprocess.run([sys.executable, "-m", "forged", "keys", "revoke", "bob", *keys],
                   check=True, timeout=30, capture_output=True)
    new_alice = subprocess.run(
        [sys.executable, "-m", "forged", "keys", "rotate", "alice", *keys], check=True,
        timeout=30, capture_output=True, text=True).stdout.strip()
    listed = subprocess.run([sys.executable, "-m", "forged", "keys", "list", "--json", *keys],
                            check=True, timeout=30, capture_output=True).stdout
    assert [k["name"] for k in json.loads(listed)] == ["alice", "carol"]
    assert new_alice.encode() not in listed
    admin_slow_steps(d, 0.01)  # 400 tokens: at least 4 s, the reload takes milliseconds
    body = {"prompt": "go", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with c.stream("POST", "/v1/completions", json=body,
                  headers={"Authorization": f"Bearer {carol}"}) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")  # carol is streaming
        reload_and_wait(d, c, new_alice, 200)
        rest = [line for line in lines if line]
    admin_slow_steps(d, 0)
    assert rest[-1] == "data: [DONE]"
    assert any('"finish_reason":"length"' in line for line in rest)  # all 400 made
    assert not any('"error"' in line for line in rest)
    return new_alice


def reload_and_wait(d: DaemonProcess, c: httpx.Client, key: str, status: int) -> None:
    """SIGHUP, then wait until ``key`` gets ``status``: the reload is applied."""
    d.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1},
                 headers={"Authorization": f"Bearer {key}"}).status_code != status:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def admin_slow_steps(d: DaemonProcess, seconds: float) -> None:
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(d.config.parent / "admin.sock")),
                      base_url="http://admin", timeout=30) as a:
        a.post("/debug/slow-steps", params={"seconds": seconds})


# --- slow clients --------------------------------------------------------------------------


def test_slow_headers_and_slow_bodies_are_cut_off(tmp_path: Path, tiny_model: Path) -> None:
    d = start(tmp_path, tiny_model, server={"read_timeout": 1.0, "keep_alive_timeout": 1.0})
    try:
        # headers that never finish
        s = socket.create_connection(("127.0.0.1", d.port), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        t0 = time.monotonic()
        assert s.recv(65536) == b""  # closed by the server
        assert time.monotonic() - t0 < 8  # 1 s, with room for a busy machine
        s.close()
        # a body that never arrives
        s = socket.create_connection(("127.0.0.1", d.port), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        t0 = time.monotonic()
        reply = b""
        while b'"error"' not in reply and (chunk := s.recv(65536)):
            reply += chunk
        assert time.monotonic() - t0 < 8
        assert reply.startswith(b"HTTP/1.1 408"), reply
        assert b'"error"' in reply
        s.close()
        # a stream that lasts longer than both timeouts is not cut: the client is idle
        # while it reads, by design
        with httpx.Client(transport=httpx.HTTPTransport(
                uds=str(d.config.parent / "admin.sock")), base_url="http://admin") as a:
            a.post("/debug/slow-steps", params={"seconds": 0.02})
        with httpx.Client(base_url=d.url, timeout=60) as c, c.stream(
                "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 150,
                                                 "ignore_eos": True, "stream": True}) as r:
            t0 = time.monotonic()
            frames = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert time.monotonic() - t0 > 2.5
        assert frames[-1] == "data: [DONE]"
        assert httpx.get(d.url + "/health").status_code == 200
    finally:
        d.stop()


# --- storms and overload ---------------------------------------------------------------------


def test_a_thousand_dropped_streams_leave_nothing_held(tmp_path: Path, tiny_model: Path) -> None:
    d = start(tmp_path, tiny_model)
    rng = random.Random(3)
    body = json.dumps({"prompt": "storm", "max_tokens": 500, "ignore_eos": True,
                       "stream": True}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
               + str(len(body)).encode() + b"\r\n\r\n" + body)

    async def client(delay: float) -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", d.port)
        try:
            await stream.send_all(request)
            with trio.move_on_after(delay):
                while await stream.receive_some(65536):
                    pass
        finally:
            await stream.aclose()

    async def storm() -> None:
        with trio.fail_after(120):
            for _wave in range(10):  # 10 waves of 100: bounded in count and time
                async with trio.open_nursery() as n:
                    for _ in range(100):
                        n.start_soon(client, rng.uniform(0.0, 0.3))

    try:
        trio.run(storm)
        deadline = time.monotonic() + 20
        while True:
            st = admin_stats(d)
            t = st["engine"]["totals"]
            if t.get("running") == 0 and t.get("queued_interactive") == 0 \
                    and st["engine"]["in_flight"] == 0:
                break
            assert time.monotonic() < deadline, st
            time.sleep(0.1)
        assert t["kv_cells_active"] == 0
        assert st["open_streams"] == 0
        assert httpx.get(d.url + "/health").status_code == 200
    finally:
        d.stop()


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _worker_pid(pid: int) -> int:
    """The daemon's child process (its model worker)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            return int(stat.parent.name)
    raise AssertionError(f"no worker process under {pid}")


def test_open_loop_overload_answers_200_or_503_and_memory_stays_flat(
    tmp_path: Path, tiny_model: Path
) -> None:
    from forged.observe.loadtest import make_prompts, run_load

    d = start(tmp_path, tiny_model, limits={"max_queued": 16, "queue_timeout": 2.0},
              engine={**ENGINE, "max_running": 4})
    try:
        d_pid = d.proc.pid
        admin_stats(d)
        # slow the worker so that 4x its capacity is a modest request rate
        with httpx.Client(transport=httpx.HTTPTransport(
                uds=str(d.config.parent / "admin.sock")), base_url="http://admin") as a:
            a.post("/debug/slow-steps", params={"seconds": 0.01})
        prompts = make_prompts("short", 60, 16, seed=1)
        base = trio.run(lambda: run_load(d.url, prompts, concurrency=4, rate=None,
                                         duration=60, model=None))
        rss_1x, worker_1x = _rss(d_pid), _rss(_worker_pid(d_pid))
        capacity = base["req_per_s"]
        prompts = make_prompts("short", int(capacity * 4 * 8), 16, seed=2)
        over = trio.run(lambda: run_load(d.url, prompts, concurrency=None, rate=capacity * 4,
                                         duration=40, model=None))
        rss_4x, worker_4x = _rss(d_pid), _rss(_worker_pid(d_pid))
        assert set(over["errors"]) <= {"503"}, over["errors"]
        assert over["errors"].get("503", 0) > 0  # it was overloaded, and said so
        assert over["ok"] > 0
        # The daemon (connections, queues, buffers) must stay flat. The worker's memory
        # is llama.cpp's, allocated per context and touched as slots are first used, so
        # it is bounded by the configuration rather than by the load.
        assert rss_4x < rss_1x * 1.10 + 20 * 1024, (rss_1x, rss_4x)
        assert worker_4x < worker_1x + 256 * 1024, (worker_1x, worker_4x)
        assert httpx.get(d.url + "/health").status_code == 200
    finally:
        d.stop()


# --- startup faults --------------------------------------------------------------------------


def test_unwritable_state_dir_is_a_clear_error(tmp_path: Path, tiny_model: Path) -> None:
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("x")
    cfg = write_config(tmp_path / "forged.toml", tiny_model, free_port(),
                       server={"state_dir": str(blocked / "state")})
    r = subprocess.run([sys.executable, "-m", "forged", "serve", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 73
    assert "state directory" in r.stderr and "Traceback" not in r.stderr + r.stdout
    # a full disk: /dev/full accepts no byte
    if os.path.exists("/dev/full"):
        full = tmp_path / "full"
        full.mkdir()
        os.symlink("/dev/full", full / ".forged-write-test")
        cfg = write_config(tmp_path / "forged.toml", tiny_model, free_port(),
                           server={"state_dir": str(full)})
        r = subprocess.run([sys.executable, "-m", "forged", "serve", "--config", str(cfg)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 73 and "No space left" in r.stderr, r.stderr


# --- fuzzing -------------------------------------------------------------------------------

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                    st.floats(allow_nan=False), st.text(max_size=20))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)
FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k",
          "min_p", "stop", "stream", "stream_options", "logit_bias", "n", "seed",
          "ignore_eos", "priority", "presence_penalty", "max_completion_tokens", "suffix",
          "samplers", "input_prefix", "input_suffix", "input_extra", "n_predict",
          "t_max_predict_ms", "n_indent", "id_slot", "response_fields", "min_tokens",
          "repetition_penalty", "repeat_penalty", "include_stop_str_in_output",
          "stop_token_ids", "chat_template_kwargs", "content", "add_special",
          "with_pieces", "parse_special", "tokens", "audio", "modalities", "prediction",
          "store", "functions", "reasoning_effort", "moderation", "guided_regex",
          "typical_p", "best_of",
          "logprobs", "top_logprobs", "echo", "response_format", "json_schema", "grammar",
          "guided_json", "guided_choice", "tools", "tool_choice", "parallel_tool_calls",
          "repo", "query", "k", "type", "completion_id",
          # llama.cpp's sampler chain and its native API
          "dynatemp_range", "dynatemp_exponent", "top_n_sigma", "xtc_probability",
          "xtc_threshold", "repeat_last_n", "dry_multiplier", "dry_base",
          "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers", "mirostat",
          "mirostat_tau", "mirostat_eta", "min_keep", "n_probs", "return_tokens", "n_keep",
          "adaptive_target", "post_sampling_probs", "lora", "timings_per_token",
          "return_progress", "n_cmpl", "n_cache_reuse",
          # the dialects': Anthropic's, OpenAI's Responses, Ollama's
          "system", "stop_sequences", "metadata", "thinking", "output_config", "input",
          "instructions", "max_output_tokens", "previous_response_id", "text",
          "options", "raw", "format", "keep_alive", "think", "client_metadata",
          "image_data", "multimodal_data",
          # issue 36: the embedding routes'
          "encoding_format", "dimensions", "truncate", "embd_normalize", "user"]
code = st.one_of(st.text(max_size=40), st.lists(st.one_of(st.text(max_size=8),
                                                         st.integers(-5, 600)), max_size=4))
good_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "bogus"]),
                                      "content": st.one_of(st.text(max_size=30), values)})
# Issue 30: what took the daemon down or gave a 500. Every repetition keyword at 10^5 to
# 10^9, deep nesting, huge enums; llama.cpp's grammar nested deeper than its parser
# recurses; digits that are not ASCII; JSON nested deep inside a string that is parsed.
_huge = st.sampled_from([10**5, 10**6, 10**7, 10**9])
schema_bombs = st.one_of(
    st.builds(lambda k, n: {"type": "string", k: n},
              st.sampled_from(["minLength", "maxLength"]), _huge),
    st.builds(lambda k, n: {"type": "array", "items": {"type": "integer"}, k: n},
              st.sampled_from(["minItems", "maxItems"]), _huge),
    st.builds(lambda n: {"type": "string", "pattern": f"^a{{{n}}}$"}, _huge),
    st.builds(lambda n: {"enum": list(range(n))}, st.sampled_from([10**4, 10**5])),
    st.builds(lambda k, n: {"type": k, "minimum": -n, "exclusiveMaximum": n},
              st.sampled_from(["integer", "number"]), st.sampled_from([1e17, 1e300])),
    st.integers(33, 200).map(lambda n: functools.reduce(
        lambda inner, _: {"type": "array", "items": inner}, range(n), {"type": "null"})),
)
gbnf_bombs = st.integers(2000, 60000).map(lambda n: "root ::= " + "(" * n + '"a"' + ")" * n)
# Superscript two, Arabic-Indic three, Devanagari one two, mathematical bold nine.
unicode_digits = st.sampled_from(["\u00b2", "\u0663", "\u0967\u0968", "\U0001d7d7", "4\u00b2"])
_deep_json = st.integers(65, 3000).map(lambda n: "[" * n + "]" * n)
deep_call = st.builds(lambda args: {"role": "assistant", "content": None, "tool_calls": [
    {"id": "c", "type": "function", "function": {"name": "f", "arguments": args}}]},
    _deep_json)
structured = st.fixed_dictionaries({}, optional={
    "prompt": st.one_of(st.text(max_size=40), st.lists(st.integers(-5, 60000), max_size=5),
                        values),
    "messages": st.one_of(st.lists(st.one_of(good_message, deep_call), max_size=3), values),
    "max_tokens": st.one_of(st.integers(-3, 5000), values),
    "temperature": st.one_of(st.floats(-1, 3), values),
    "stream": st.one_of(st.booleans(), values),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=10), values),
    "logit_bias": st.one_of(st.dictionaries(st.one_of(st.text(max_size=6), unicode_digits),
                                            st.floats(-200, 200), max_size=3), values),
    "top_p": values, "seed": values,
    # n choices and best_of: within the cap, past it, past what a worker runs at once.
    "n": st.one_of(st.integers(-1, 20), values),
    "best_of": st.one_of(st.integers(0, 20), values), "priority": values, "model": values,
    "stream_options": values, "ignore_eos": values,
    "suffix": st.one_of(st.text(max_size=20), values),
    "samplers": st.one_of(st.lists(st.sampled_from(
        ["top_k", "top_p", "min_p", "temp", "temperature", "penalties", "infill", "dry",
         "typ_p", "xtc", "top_n_sigma", "adaptive_p", "Top-K"]), max_size=4),
        st.text(alphabet="edskypmxtiaz", max_size=10), values),
    "input_prefix": st.one_of(code, values), "input_suffix": st.one_of(code, values),
    "input_extra": st.one_of(st.lists(st.fixed_dictionaries(
        {"text": st.text(max_size=20)}, optional={"filename": values, "time": values}),
        max_size=2), values),
    "n_predict": st.one_of(st.integers(-3, 5000), values),
    "t_max_predict_ms": values, "n_indent": st.one_of(st.integers(-2, 8), values),
    "id_slot": values, "response_fields": st.one_of(st.lists(st.text(max_size=12),
                                                             max_size=3), values),
    # issue 18, points 5 and 6: vLLM's fields, /tokenize's, and the refused ones
    "min_tokens": st.one_of(st.integers(-2, 8), values),
    "repetition_penalty": st.one_of(st.floats(-1, 11), values),
    "repeat_penalty": st.one_of(st.floats(-1, 11), values),
    "include_stop_str_in_output": values,
    "stop_token_ids": st.one_of(st.lists(st.integers(-5, 60000), max_size=3), values),
    "chat_template_kwargs": st.one_of(st.dictionaries(
        st.sampled_from(["enable_thinking", "messages", "tools", "x", ""]), values,
        max_size=2), values),
    # /tokenize: now and then a content of half a megabyte, with pieces
    "content": st.one_of(st.text(max_size=20), values,
                         st.just("def f(x):\n    return x\n" * 20000)),
    "with_pieces": values, "add_special": values, "parse_special": values,
    "tokens": st.one_of(st.lists(st.integers(-5, 60000), max_size=5), values),
    "modalities": values, "store": values,
    # llama.cpp's samplers, in and out of range, on and off
    "typical_p": st.one_of(st.floats(-0.5, 2), values),
    "top_n_sigma": st.one_of(st.floats(-2, 5), values),
    "dynatemp_range": st.one_of(st.floats(-1, 3), values),
    "dynatemp_exponent": st.one_of(st.floats(-1, 20), values),
    "xtc_probability": st.one_of(st.floats(-0.5, 1.5), values),
    "xtc_threshold": st.one_of(st.floats(-0.5, 1.5), values),
    "repeat_last_n": st.one_of(st.integers(-3, 5000), values),
    "dry_multiplier": st.one_of(st.floats(-1, 10), values),
    "dry_base": st.one_of(st.floats(-1, 5), values),
    "dry_allowed_length": st.one_of(st.integers(-2, 10), values),
    "dry_penalty_last_n": st.one_of(st.integers(-3, 10**9), values),
    "dry_sequence_breakers": st.one_of(st.lists(st.text(max_size=42), max_size=10), values),
    "mirostat": st.one_of(st.integers(-1, 3), values),
    "mirostat_tau": st.one_of(st.floats(-1, 20), values),
    "mirostat_eta": st.one_of(st.floats(-1, 2), values),
    "min_keep": st.one_of(st.integers(-1, 100), values),
    "n_probs": st.one_of(st.integers(-1, 25), values),
    "return_tokens": values, "n_keep": st.one_of(st.integers(-2, 10), values),
    "adaptive_target": values, "post_sampling_probs": values, "lora": values,
    "timings_per_token": values, "return_progress": values,
    # logprobs is an int on completions and a bool on chat: both, everywhere
    "logprobs": st.one_of(st.booleans(), st.integers(-2, 25), values),
    "top_logprobs": st.one_of(st.integers(-2, 25), values),
    "echo": st.one_of(st.booleans(), values),
    # issue 18, points 1 and 2: constraints and tools, well-formed and not
    "response_format": st.one_of(st.sampled_from([
        {"type": "json_object"}, {"type": "text"}, {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"schema": {"type": "integer"}}},
        {"type": "json_schema", "json_schema": {"schema": {"oneOf": [{"type": "null"}]}}},
        {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}},
        {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/nowhere"}}},
        {"type": "json_object", "schema": {"enum": [1, "a", None]}}]),
        schema_bombs.map(lambda b: {"type": "json_schema", "json_schema": {"schema": b}}),
        values),
    "json_schema": st.one_of(st.just({"type": "string", "maxLength": 3}), schema_bombs,
                             values),
    "grammar": st.one_of(st.sampled_from(['root ::= "a"', "root ::= ", 'x ::= "y"',
                                          'root ::= [^\\x00]*']), st.text(max_size=12),
                         gbnf_bombs, values),
    "guided_json": st.one_of(st.just({"type": "boolean"}), values),
    "guided_choice": st.one_of(st.lists(st.text(max_size=6), max_size=3), values),
    "tools": st.one_of(st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["function", "code"]),
         "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g", "", "a b"])},
                                           optional={"parameters": values})}),
        max_size=2), values),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required", "x", {
        "type": "function", "function": {"name": "f"}}]), values),
    "parallel_tool_calls": values,
    # issue 15: `repo` on generations and /v1/retrieve (an index "demo" exists), and
    # /v1/events
    "repo": st.one_of(st.sampled_from(["demo", "nope", "", "../demo"]), values),
    "query": st.one_of(st.text(max_size=30), values),
    "k": st.one_of(st.integers(-2, 80), values),
    "type": st.one_of(st.sampled_from(["view", "select", "dismiss", "x"]), values),
    "completion_id": st.one_of(st.sampled_from(["cmpl-1", "", "a b", "x" * 200]),
                               st.text(max_size=12), values),
    # issue 32: the dialects' own fields
    "system": st.one_of(st.text(max_size=20), st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image"]), "text": st.text(max_size=10)}),
        max_size=2), values),
    "stop_sequences": st.one_of(st.lists(st.text(max_size=5), max_size=3), values),
    "input": st.one_of(st.text(max_size=30), st.lists(good_message, max_size=2),
                       st.lists(st.integers(-5, 200), max_size=6),
                       st.lists(st.text(max_size=300), max_size=40),
                       st.just(["def f(x):\n    return x\n" * 60] * 3), values),
    "instructions": st.one_of(st.text(max_size=20), values),
    "max_output_tokens": st.one_of(st.integers(-1, 20), values),
    "previous_response_id": st.one_of(st.text(max_size=12), values),
    "options": st.one_of(st.dictionaries(st.sampled_from(
        ["temperature", "num_predict", "top_k", "mirostat", "tfs_z", "typical_p",
         "num_ctx", "stop", "seed", "repeat_last_n"]), values, max_size=3), values),
    "raw": values, "format": st.one_of(st.just("json"), values), "think": values,
    # issue 36: embeddings (input as text and token ids is above, and content)
    "encoding_format": st.one_of(st.sampled_from(["float", "base64", "int8"]), values),
    "dimensions": st.one_of(st.integers(-1, 64), values),
    "truncate": values, "embd_normalize": st.one_of(st.integers(-1, 3), values),
})
def _short(d: dict[str, Any]) -> dict[str, Any]:
    """Generations of at most 4 tokens (-1 would run to the context's end): this is
    about the input."""
    short = {**d, **{k: 4 for k in ("max_tokens", "n_predict", "min_tokens",
                                    "max_output_tokens")
                     if isinstance(d.get(k), int) and (d[k] > 4 or d[k] == -1)}}
    if isinstance(d.get("options"), dict):  # Ollama's num_predict (-1, -2: the context)
        short["options"] = {**d["options"], "num_predict": 4}
    return short


bodies = st.one_of(
    structured.map(_short),
    st.dictionaries(st.sampled_from(FIELDS), values, max_size=6),
    values,
)
raw = st.one_of(st.binary(max_size=200),
                bodies.map(lambda v: json.dumps(v).encode()),
                st.tuples(bodies, st.integers(0, 60)).map(
                    lambda t: json.dumps(t[0]).encode()[: t[1]]))
ENDPOINTS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
             ("GET", "/v1/models"), ("GET", "/health"), ("POST", "/v1/models"),
             ("GET", "/v1/completions"), ("POST", "/infill"), ("POST", "/tokenize"),
             ("POST", "/detokenize"), ("GET", "/v1/models/tiny-fim"),
             ("GET", "/v1/models/nope"), ("POST", "/v1/retrieve"), ("POST", "/v1/events"),
             ("POST", "/completion"), ("POST", "/completions"), ("GET", "/props"),
             ("POST", "/apply-template"), ("POST", "/v1/messages"),
             ("POST", "/v1/messages/count_tokens"), ("POST", "/v1/responses"),
             ("GET", "/v1/responses/resp_nope"), ("POST", "/api/chat"),
             ("POST", "/api/generate"), ("POST", "/api/show"), ("GET", "/api/tags"),
             ("POST", "/v1/embeddings"), ("POST", "/embedding"), ("POST", "/api/embed"),
             ("POST", "/api/embeddings")]
# llama.cpp's routes whose events end with the last one, without [DONE].
NO_DONE = ("/infill", "/completion", "/completions")


def test_fuzz_every_endpoint_never_5xx(tmp_path: Path, fim_model: Path,
                                       tiny_bert: Path) -> None:
    """Over 5,000 generated bodies: never a 5xx, always a well-formed answer; then the
    daemon is healthy and holds nothing. One test, with its own daemon, so that what it
    counts and checks does not depend on which tests ran before it."""
    # Bodies without max_tokens get 16, not 1024: this is about the input, and a long
    # generation on a busy machine would only test the client's patience.
    # The tiny model with FIM tokens: /infill and `suffix` run, not only refuse.
    rag_index(tmp_path)  # under the daemon's state_dir: searches run, not only refuse
    # And an embedding model: the embedding routes compute, not only refuse.
    d = start(tmp_path, fim_model, engine={**ENGINE, "max_running": 16},
              limits={"max_queued": 1024, "default_max_tokens": 16},
              models=[{"path": str(tiny_bert), "name": "bert"}])
    posted: list[tuple[str, str, bytes]] = []
    restarts = worker_restarts(d)
    try:
        with httpx.Client(base_url=d.url, timeout=60) as client, _HealthWatch(d.url) as health:

            @settings(max_examples=5200, deadline=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(body=raw, endpoint=st.sampled_from(ENDPOINTS))
            def post(body: bytes, endpoint: tuple[str, str]) -> None:
                method, path = endpoint
                try:
                    r = client.request(method, path, content=body,
                                       headers={"Content-Type": "application/json"})
                except httpx.HTTPError as exc:
                    last = posted[-1] if posted else None
                    raise AssertionError(f"{exc!r} after {last!r}") from exc
                posted.append((method, path, body))
                _check_answer(r, path, body)

            post()
        assert len(posted) >= 5000
        assert health.slowest < 1.0, f"/health took {health.slowest:.2f} s"
        assert worker_restarts(d) == restarts  # no input cost a worker
        assert httpx.get(d.url + "/health").status_code == 200
        t = admin_stats(d)["engine"]["totals"]
        assert t["running"] == 0 and t["kv_cells_active"] == 0
    finally:
        d.stop()


def worker_restarts(d: DaemonProcess) -> int:
    return sum(int(w["restarts"]) for w in admin_stats(d)["engine"]["workers"])


class _HealthWatch:
    """Asks /health every 0.2 s in a thread while the block runs; ``slowest`` is the
    longest answer (bounded: each ask times out at 30 s)."""

    def __init__(self, url: str) -> None:
        self.url, self.slowest = url + "/health", 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        with httpx.Client(timeout=30) as c:
            while not self._stop.wait(0.2):
                t0 = time.monotonic()
                c.get(self.url)
                self.slowest = max(self.slowest, time.monotonic() - t0)

    def __enter__(self) -> _HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)


# Dialects whose streams are named events (``event:`` lines) and end without [DONE].
EVENTS = ("/v1/messages", "/v1/responses")


def _check_answer(r: httpx.Response, path: str, body: bytes) -> None:
    assert r.status_code < 500, (path, body, r.status_code, r.text)
    kind = r.headers.get("content-type", "")
    if kind.startswith("text/event-stream"):
        _check_events(r.text, path)
    elif kind.startswith("application/x-ndjson"):  # Ollama's stream: a JSON object a line
        lines = [json.loads(line) for line in r.text.splitlines() if line]
        assert lines and (lines[-1].get("done") or set(lines[-1]) == {"error"}), lines[-1:]
    elif r.status_code >= 400:
        _check_error(r.json(), path)
    else:
        r.json()


def _check_events(text: str, path: str) -> None:
    frames = [line for line in text.splitlines() if line]
    if path.startswith(EVENTS):
        assert all(f.startswith(("event: ", "data: {")) for f in frames), frames
        frames.append("data: [DONE]")
    elif path in NO_DONE and frames[-1] != "data: [DONE]":
        frames.append("data: [DONE]")  # llama.cpp's events end without one
    assert frames[-1] == "data: [DONE]"
    for f in frames[:-1]:
        if not f.startswith("event: "):
            json.loads(f.removeprefix("data: "))


def _check_error(data: dict[str, Any], path: str) -> None:
    """Each dialect's error body: Anthropic's, Ollama's, or OpenAI's."""
    if path.startswith("/v1/messages"):
        assert data["type"] == "error" and set(data["error"]) == {"type", "message"}
    elif path.startswith("/api/"):
        assert set(data) == {"error"} and isinstance(data["error"], str)
    else:
        assert set(data["error"]) == {"message", "type", "param", "code"}


def test_forged_bench_sends_an_api_key(tmp_path: Path, tiny_model: Path) -> None:
    """`forged bench` could not test a production appliance: it sent no key."""
    key = add_key(tmp_path, "bench")
    d = start(tmp_path, tiny_model)
    try:
        out = tmp_path / "bench.json"
        argv = [sys.executable, "-m", "forged", "bench", "--url", d.url, "--concurrency",
                "2", "--requests", "2", "--max-tokens", "4", "--duration", "60",
                "--out", str(out)]
        for extra, ok, errors in (([], 0, {"401": 2}), (["--api-key", key], 2, {})):
            r = subprocess.run(argv + extra, capture_output=True, text=True, timeout=120,
                               env={k: v for k, v in os.environ.items()
                                    if k != "FORGED_API_KEY"})
            assert r.returncode == 0, r.stderr
            summary = json.loads(out.read_text())["runs"][0]["summary"]
            assert (summary["ok"], summary["errors"]) == (ok, errors)
    finally:
        d.stop()
