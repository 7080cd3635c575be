"""End to end with the real default model (SmolLM2-135M) and the official openai client."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import llama_cpp
import openai
import pytest

from tests.daemonproc import DaemonProcess, free_port, write_config

pytestmark = pytest.mark.model

# The shipped defaults: 16 slots of 2,048 cells each (kv_layout = "per_slot"), no flash
# attention, steps of at most 256 tokens bounded by a 150 ms target.
ENGINE = {"kv_cells": 32768, "kv_layout": "per_slot", "max_context": 2048, "slots": 16,
          "max_running": 16, "step_tokens": 256, "prefill_step_tokens": 256, "threads": 2,
          "flash_attn": False, "target_step_ms": 150.0}


def _start(real_model: Path, tmp: Path, **engine: Any) -> Iterator[DaemonProcess]:
    port = free_port()
    d = DaemonProcess(write_config(tmp / "forged.toml", real_model, port,
                                   engine={**ENGINE, **engine}), port)
    try:
        d.wait_ready()
        yield d
    finally:
        assert d.stop() == 0


@pytest.fixture(scope="module")
def daemon(real_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    yield from _start(real_model, tmp_path_factory.mktemp("forged"))


@pytest.fixture
def fresh_daemon(real_model: Path, tmp_path: Path) -> Iterator[DaemonProcess]:
    yield from _start(real_model, tmp_path)


@pytest.fixture
def unsplit_daemon(real_model: Path, tmp_path: Path) -> Iterator[DaemonProcess]:
    """A short prompt is computed in one chunk however slow the machine is: the step's
    time target (which the learned cost model applies) is far above any such prompt's
    cost. So two requests of one prompt are the same computation, and give the same
    greedy text (under load, a 150 ms target split the prompt one time and not the
    other, and the two answers differed)."""
    yield from _start(real_model, tmp_path, target_step_ms=5000.0, heartbeat_timeout=120.0)


@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[openai.OpenAI]:
    # Closed, not left to the garbage collector (whose socket warnings are errors here).
    with openai.OpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0,
                       timeout=120) as c:
        yield c


def test_streaming_chat(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", stream=True, max_tokens=24, temperature=0,
        messages=[{"role": "user", "content": "Write a Python function that adds two numbers."}],
        stream_options={"include_usage": True},
    ))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason in ("stop", "length")
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens > 10
    assert 0 < usage.completion_tokens <= 24


def test_non_streaming_completion_and_usage(client: openai.OpenAI) -> None:
    r = client.completions.create(model="SmolLM2-135M-Instruct.Q4_1",
                                  prompt="The capital of France is", max_tokens=8,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_stop_strings(client: openai.OpenAI) -> None:
    prompt = "def fibonacci(n):\n    "
    full = client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=prompt,
                                     max_tokens=32, temperature=0).choices[0].text
    assert "fibonacci" in full
    # a stop string that spans several tokens and appears mid-text
    stop = "onacci"
    cut = client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=prompt,
                                    max_tokens=32, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full[: full.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", prompt=prompt, max_tokens=32, temperature=0,
        stop=[stop], stream=True))
    assert streamed == cut.choices[0].text


@pytest.mark.parametrize("prompt", ["def fibonacci(n):\n    ", "The quick brown fox",
                                    "# A Python function that reverses a string\n"])
def test_greedy_output_equals_llama_cpp_python(fresh_daemon: DaemonProcess, real_model: Path,
                                               prompt: str) -> None:
    # A fresh daemon: llama.cpp's attention sums over every cell in use, so cells that
    # other requests left in the shared cache can change the last bits of the logits
    # (llama-server behaves the same). One request on an empty cache must match exactly.
    client = openai.OpenAI(base_url=fresh_daemon.url + "/v1", api_key="none", max_retries=0)
    ours = client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=prompt,
                                     max_tokens=32, temperature=0).choices[0].text
    # forged's per-slot stream is kv_cells / slots cells: the same context for the oracle.
    n_ctx = int(ENGINE["kv_cells"]) // int(ENGINE["slots"])
    # A lone prompt runs in one prefill step of up to 256 tokens, as the oracle's batch.
    llm = llama_cpp.Llama(str(real_model), n_ctx=n_ctx, n_batch=256, n_ubatch=256,
                          n_threads=2, flash_attn=False, verbose=False)
    try:
        ref = llm.create_completion(prompt, temperature=0, max_tokens=32)
    finally:
        llm.close()
    assert ours == ref["choices"][0]["text"]  # type: ignore[index]
    assert len(ours) > 16  # a real continuation, not an empty match


def test_32_concurrent_openai_streams(client: openai.OpenAI) -> None:
    def one(i: int) -> tuple[int, int]:
        n = 0
        stream = client.chat.completions.create(
            model="SmolLM2-135M-Instruct.Q4_1", stream=True, max_tokens=16 + i % 8,
            messages=[{"role": "user", "content": f"Question {i}: what is a closure?"}],
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        usage = None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                n += 1
            usage = chunk.usage or usage
        assert usage is not None
        return i, usage.completion_tokens

    with ThreadPoolExecutor(32) as pool:
        results = dict(pool.map(one, range(32)))
    assert results == {i: 16 + i % 8 for i in range(32)}


def test_long_prompt_does_not_stall_running_streams(client: openai.OpenAI) -> None:
    """Eight streams decode; a ~1,500-token prompt arrives. Chunked prefill must keep
    their inter-token gaps near one step, far below the time the whole prefill takes."""
    gaps_before: list[float] = []
    gaps_during: list[float] = []
    phase = {"v": "before"}
    started = threading.Barrier(9)
    prefill: dict[str, float] = {}

    def decoder(i: int) -> None:
        stream = client.completions.create(
            model="SmolLM2-135M-Instruct.Q4_1", prompt=f"Story {i}:", max_tokens=220,
            stream=True, temperature=0, extra_body={"ignore_eos": True})
        last = None
        for k, _ in enumerate(stream):
            now = time.monotonic()
            if k == 3:
                started.wait()
            if last is not None and k > 3:
                (gaps_before if phase["v"] == "before" else gaps_during).append(now - last) \
                    if phase["v"] != "after" else None
            last = now

    def long_prompt() -> None:
        started.wait()
        time.sleep(0.5)
        phase["v"] = "during"
        t0 = time.monotonic()
        stream = client.completions.create(
            model="SmolLM2-135M-Instruct.Q4_1", prompt="x = 1\n" * 375, max_tokens=1,
            stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            prefill.setdefault("ttft", time.monotonic() - t0)
            if chunk.usage:
                prefill["tokens"] = chunk.usage.prompt_tokens
        phase["v"] = "after"

    with ThreadPoolExecutor(9) as pool:
        futures = [pool.submit(decoder, i) for i in range(8)] + [pool.submit(long_prompt)]
        for f in futures:
            f.result()
    decode_step = statistics.median(gaps_before)
    worst = max(gaps_during)
    # Steps are bounded by the target in the cost model's estimate; the model follows
    # the machine's speed, so a slow spell stretches steps only until it is refitted.
    target = float(ENGINE["target_step_ms"]) / 1000
    print(f"decode-only step {decode_step * 1000:.0f} ms, target {target * 1000:.0f} ms, "
          f"worst gap during prefill {worst * 1000:.0f} ms, prefill of {prefill['tokens']} "
          f"tokens took {prefill['ttft'] * 1000:.0f} ms")
    assert worst < 4 * target, "a stream waited for much more than one bounded step"
    assert worst < prefill["ttft"] / 5, "the prefill was not split across steps"


def test_text_held_for_a_stop_string_is_released_at_end_of_sequence(
        unsplit_daemon: DaemonProcess) -> None:
    client = openai.OpenAI(base_url=unsplit_daemon.url + "/v1", api_key="none",
                           max_retries=0)

    def answer(**kw: object) -> openai.types.chat.ChatCompletion:
        # No prompt cache: both answers come from the same computation.
        return client.chat.completions.create(
            model="SmolLM2-135M-Instruct.Q4_1", temperature=0, max_tokens=64,
            messages=[{"role": "user", "content": "Say hello."}],
            extra_body={"cache_prompt": False}, **kw)  # type: ignore[call-overload]

    full = answer()
    text = full.choices[0].message.content
    assert full.choices[0].finish_reason == "stop" and text  # it ended with EOS
    # A stop string that starts with the answer's last character and never completes:
    # that character is held back until EOS, and must come out then.
    held = answer(stop=[text[-1] + "\u2603never"])
    assert held.choices[0].finish_reason == "stop"
    assert held.choices[0].message.content == text
