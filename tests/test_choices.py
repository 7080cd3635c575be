"""``n`` > 1 (issue 18, point 4): one prompt, computed once, and n choices, end to end.

The scheduler's and the worker core's share of it is tested without a model in
test_scheduler.py and test_core.py. Here: the in-process daemon for what the engine
counts (the prompt computed once, every sequence freed), and ``forged serve`` with the
official ``openai`` client for the shapes, on the tiny model (whose template renders
tools) and on SmolLM2.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import trio
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from forged.auth import add_key
from forged.engine import testhooks
from forged.engine.events import Delta, Done
from forged.engine.pool import RequestStream
from forged.engine.request import Request
from tests.conftest import DaemonFactory
from tests.daemonproc import DaemonProcess, client, serve_model
from tests.test_api import assert_a_dropped_stream_is_freed_within_a_step, open_raw_stream, until
from tests.tinymodel import write_tiny_llama

MAX_RUNNING = 8
CHAT = [{"role": "user", "content": "Say something."}]

# --- in process: what the engine counts -------------------------------------------------


@pytest.mark.trio
async def test_n_computes_the_prompt_once_and_frees_every_sequence(
        tiny_model: Path, start_daemon: DaemonFactory) -> None:
    with trio.fail_after(60):
        async with start_daemon(tiny_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            computed = []
            # token-id prompts of one length that share nothing, so nothing is cached
            for n, first in ((1, 10), (4, 60)):
                before = d.stats().prompt_tokens_computed
                r = await c.post("/v1/completions", json={
                    "prompt": list(range(first, first + 30)), "max_tokens": 5, "n": n,
                    "ignore_eos": True})
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["prompt_tokens"] == 30
                assert r.json()["usage"]["completion_tokens"] == 5 * n
                await until(lambda: d.stats().running == 0)
                computed.append(d.stats().prompt_tokens_computed - before)
            assert computed == [30, 30]
            assert d.stats().kv_cells_active == 0


def test_latency_is_timed_on_the_first_choice() -> None:
    """Before, every choice's pieces were timed: n choices in one step made n - 1 gaps
    of ~0 in the ITL histogram."""
    rs = RequestStream(1, Request(prompt=[1], max_tokens=3, n=3))
    for index in (0, 1, 2, 0, 1, 2):
        rs.push(Delta(rid=1, text="a", index=index))
    rs.push(Done(rid=1, text="b", stop_type="eos", prompt_tokens=1,
                    completion_tokens=3, cached_tokens=0, index=1))
    assert len(rs.delta_times) == 2


@pytest.mark.trio
async def test_a_keys_places_count_every_choice(
        tiny_model: Path, start_daemon: DaemonFactory, tmp_path: Path) -> None:
    """max_streams counts sequences: before, n = 16 took one of a key's places."""
    key = add_key(tmp_path / "keys.toml", "three", max_streams=3, max_queued=3,
                  priority="interactive")
    body: dict[str, Any] = {"prompt": "x", "max_tokens": 2}
    with trio.fail_after(60):
        async with start_daemon(tiny_model) as d, httpx.AsyncClient(
                base_url=d.url, timeout=30, headers={"Authorization": f"Bearer {key}"}) as c:
            never = await c.post("/v1/completions", json={**body, "n": 4})
            assert never.status_code == 400 and never.json()["error"]["param"] == "n"
            testhooks.slow_steps(d.daemon.pool, 0, 0.05)  # the stream below stays open
            held = await open_raw_stream(d, "/v1/completions", {
                **body, "max_tokens": 200, "ignore_eos": True, "n": 2, "stream": True},
                1, headers=f"Authorization: Bearer {key}\r\n")
            state = d.daemon.state
            assert state is not None and state.key_usage["three"].open == 2
            over = await c.post("/v1/completions", json={**body, "n": 2})
            assert over.status_code == 429, over.text
            assert (await c.post("/v1/completions", json=body)).status_code == 200
            await held.aclose()
            await until(lambda: d.daemon.state is not None
                        and d.daemon.state.key_usage["three"].open == 0)


@pytest.mark.trio
@pytest.mark.parametrize("layout", ["unified", "per_slot"])
async def test_a_dropped_stream_of_n_choices_frees_them_all_within_a_step(
        layout: str, tiny_model: Path, start_daemon: DaemonFactory) -> None:
    with trio.fail_after(30):
        async with start_daemon(tiny_model, engine={"kv_layout": layout}) as d:
            await assert_a_dropped_stream_is_freed_within_a_step(
                d, "/v1/chat/completions", {
                    "messages": CHAT, "max_tokens": 200, "ignore_eos": True, "n": 3,
                    "stream": True}, events=6)


# --- forged serve and the openai client ----------------------------------------------------


def _start(model: Path, tmp: Path) -> Iterator[DaemonProcess]:
    yield from serve_model(model, tmp, kv_cells=8192, kv_layout="unified", max_context=2048,
                           slots=16, max_running=MAX_RUNNING)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    tmp = tmp_path_factory.mktemp("choices")
    yield from _start(write_tiny_llama(tmp / "tiny-tools.gguf", tools=True), tmp)


@pytest.fixture(scope="module")
def smol(real_model: Path, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[DaemonProcess]:
    yield from _start(real_model, tmp_path_factory.mktemp("smol-choices"))


def _client(d: DaemonProcess) -> openai.OpenAI:
    return client(d, timeout=120)


def _chat(d: DaemonProcess, **kw: Any) -> ChatCompletion:
    """A chat completion, validated against openai's own type."""
    raw = _client(d).chat.completions.with_raw_response.create(model="tiny-tools", **kw)
    return ChatCompletion.model_validate(raw.http_response.json())


def _texts(answer: ChatCompletion) -> list[str]:
    assert [c.index for c in answer.choices] == list(range(len(answer.choices)))
    return [c.message.content or "" for c in answer.choices]


def test_n_choices_whole_with_usage_and_reproducible_seeds(tiny: DaemonProcess) -> None:
    one = _chat(tiny, messages=CHAT, max_tokens=12, extra_body={"ignore_eos": True})
    kw: dict[str, Any] = {"messages": CHAT, "max_tokens": 12, "n": 4, "temperature": 1.0,
                          "seed": 7, "extra_body": {"ignore_eos": True}}
    first, again = _chat(tiny, **kw), _chat(tiny, **kw)
    assert len(first.choices) == 4
    assert _texts(first) == _texts(again)  # the whole response, from one seed
    assert len(set(_texts(first))) > 1  # each choice its own seed: they differ
    assert first.usage is not None and one.usage is not None
    assert first.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt once
    assert first.usage.completion_tokens == 4 * 12
    assert all(c.finish_reason == "length" for c in first.choices)
    # choice i samples with seed + i: choice 1 of seed 7 is choice 0 of seed 8
    shifted = _chat(tiny, **{**kw, "n": 1, "seed": 8})
    assert _texts(shifted)[0] == _texts(first)[1]


def test_n_choices_at_temperature_0_are_equal(tiny: DaemonProcess) -> None:
    answer = _chat(tiny, messages=CHAT, max_tokens=16, n=3, temperature=0)
    assert len(set(_texts(answer))) == 1


def test_n_choices_stream_with_their_index(tiny: DaemonProcess) -> None:
    chunks = list(_client(tiny).chat.completions.create(
        model="tiny-tools", messages=CHAT, max_tokens=10, n=3, seed=1, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    for ch in chunks:
        ChatCompletionChunk.model_validate(ch.model_dump())
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 30
    roles = [c.index for ch in body for c in ch.choices if c.delta.role == "assistant"]
    assert roles == [0, 1, 2]
    reasons = {c.index: c.finish_reason for ch in body for c in ch.choices if c.finish_reason}
    assert reasons == {0: "length", 1: "length", 2: "length"}
    assert all(len(ch.choices) == 1 for ch in body)  # one choice per chunk, as OpenAI
    # streamed, each choice says what the same request says whole
    whole = _chat(tiny, messages=CHAT, max_tokens=10, n=3, seed=1,
                  extra_body={"ignore_eos": True})
    streamed = ["".join(c.delta.content or "" for ch in body for c in ch.choices
                        if c.index == i) for i in range(3)]
    assert streamed == _texts(whole)


def test_n_completions_with_stop(tiny: DaemonProcess) -> None:
    raw = _client(tiny).completions.with_raw_response.create(
        model="tiny-tools", prompt="Once upon a time", max_tokens=40, n=5, seed=3,
        stop=["e", "a"], temperature=1.0)
    answer = Completion.model_validate(raw.http_response.json())
    assert [c.index for c in answer.choices] == list(range(5))
    for c in answer.choices:
        assert "e" not in c.text and "a" not in c.text
        assert c.finish_reason in ("stop", "length")
    assert any(c.finish_reason == "stop" for c in answer.choices)
    assert answer.usage is not None
    assert answer.usage.completion_tokens < 5 * 40


# No free-text strings: on the random tiny model at temperature 1 a string can hold
# invalid UTF-8 that llama.cpp's grammar counts as one character, so maxLength may
# fail (a known bug of the structured-output work, not of n).
SMALL = {"type": "object", "properties": {
    "role": {"enum": ["dev", "ops", "qa"]}, "age": {"type": "integer"},
    "admin": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["role", "age", "admin", "tags"], "additionalProperties": False}


def test_n_choices_each_match_the_schema(tiny: DaemonProcess) -> None:
    answer = _chat(tiny, messages=CHAT, max_tokens=400, n=6, seed=11, temperature=1.0,
                   response_format={"type": "json_schema",
                                    "json_schema": {"name": "small", "schema": SMALL}})
    assert len(answer.choices) == 6
    texts = _texts(answer)
    for text in texts:
        jsonschema.validate(json.loads(text), SMALL)
    assert len(set(texts)) > 1  # each choice's grammar state is its own


# Tools with no free-text arguments, for the reason SMALL has none.
PICK = {"type": "function", "function": {"name": "pick", "parameters": SMALL}}
ROLL = {"type": "function", "function": {"name": "roll", "parameters": {
    "type": "object", "properties": {"sides": {"enum": [6, 20]}}, "required": ["sides"],
    "additionalProperties": False}}}


def test_n_choices_each_make_a_valid_tool_call(tiny: DaemonProcess) -> None:
    tools: Any = [PICK, ROLL]
    answer = _chat(tiny, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                   tools=tools, tool_choice="required", parallel_tool_calls=False,
                   max_tokens=400, n=3, seed=5, temperature=1.0)
    for choice in answer.choices:
        assert choice.finish_reason == "tool_calls"
        calls = choice.message.tool_calls or []
        assert len(calls) == 1
        fn = calls[0].function  # type: ignore[union-attr]
        schema = next(t["function"]["parameters"] for t in tools
                      if t["function"]["name"] == fn.name)
        jsonschema.validate(json.loads(fn.arguments), schema)
    # streamed: each choice's calls arrive under its own index
    with httpx.stream("POST", tiny.url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Weather?"}], "tools": tools,
            "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 400,
            "n": 2, "seed": 5, "stream": True}) as r:
        chunks = [ChatCompletionChunk.model_validate_json(line[6:])
                  for line in r.iter_lines() if line.startswith("data: {")]
    for i in range(2):
        calls = [tc for ch in chunks for c in ch.choices if c.index == i
                 for tc in c.delta.tool_calls or []]
        assert calls and all(json.loads(tc.function.arguments or "") for tc in calls
                             if tc.function is not None)
        assert [c.finish_reason for ch in chunks for c in ch.choices
                if c.index == i and c.finish_reason] == ["tool_calls"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"n": 17}, "n"),
    ("/v1/completions", {"n": "two"}, "n"),
    ("/v1/chat/completions", {"n": MAX_RUNNING + 1}, "n"),  # more than can ever run at once
    ("/v1/completions", {"n": 2, "best_of": 3, "stream": True}, "best_of"),
    ("/v1/completions", {"n": 3, "best_of": 2}, "best_of"),
    ("/v1/chat/completions", {"best_of": MAX_RUNNING + 1}, "best_of"),
    ("/v1/completions", {"best_of": 0}, "best_of"),
    ("/infill", {"n": 2}, "n"),
])
def test_bad_n_and_best_of_get_a_400_that_names_them(
        tiny: DaemonProcess, path: str, body: dict[str, Any], param: str) -> None:
    base: dict[str, Any] = {"/v1/completions": {"prompt": "x"},
                            "/v1/chat/completions": {"messages": CHAT},
                            "/infill": {"input_prefix": "a", "input_suffix": "b"}}[path]
    r = httpx.post(tiny.url + path, timeout=30, json={**base, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    ok = httpx.post(tiny.url + "/v1/completions", timeout=30,
                    json={"prompt": "x", "max_tokens": 2, "n": 2, "best_of": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


def test_best_of_returns_the_choices_with_the_highest_logprob_per_token(
        tiny: DaemonProcess) -> None:
    """OpenAI's best_of: best_of choices generated, the n with the highest mean logprob
    per token returned. With a seed, choice i draws with seed + i, so asking for all of
    them with their logprobs shows which were best."""
    body = {"prompt": "Once upon", "max_tokens": 12, "temperature": 1.0, "seed": 11}
    every = httpx.post(tiny.url + "/v1/completions", timeout=60,
                       json={**body, "n": 4, "logprobs": 0}).json()
    mean = {c["text"]: sum(c["logprobs"]["token_logprobs"]) / len(c["logprobs"]["tokens"])
            for c in every["choices"]}
    assert len(mean) == 4  # four different answers to rank
    r = httpx.post(tiny.url + "/v1/completions", timeout=60,
                   json={**body, "n": 2, "best_of": 4})
    assert r.status_code == 200, r.text
    best = Completion.model_validate(r.json())
    assert [c.index for c in best.choices] == [0, 1]
    assert [c.text for c in best.choices] == sorted(mean, key=lambda t: -mean[t])[:2]
    assert all(c.logprobs is None for c in best.choices)  # not asked for
    assert best.usage is not None  # every choice generated counts, as OpenAI bills it
    assert best.usage.completion_tokens == every["usage"]["completion_tokens"]
    assert best.usage.prompt_tokens == every["usage"]["prompt_tokens"]


@pytest.mark.trio
async def test_best_of_is_bounded_as_n_is_and_a_key_s_400_names_it(
        tiny_model: Path, start_daemon: DaemonFactory, tmp_path: Path) -> None:
    """best_of had no bound but what a worker runs at once (engine.max_running, up to
    255), where README said n to 16; and a key's limit named n when best_of asked."""
    keys = {name: add_key(tmp_path / "keys.toml", name, max_streams=most, max_queued=4,
                          priority="interactive") for name, most in (("two", 2), ("all", 32))}
    body = {"prompt": "x", "max_tokens": 1}
    with trio.fail_after(60):
        async with start_daemon(tiny_model, engine={"max_running": 32, "slots": 32}) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            for name, asked, param in (
                    ("all", {"best_of": 17}, "best_of"),  # README's bound, n's
                    ("two", {"n": 1, "best_of": 3}, "best_of"),  # the key's limit
                    ("two", {"n": 3}, "n"), ("two", {"n": 3, "best_of": 3}, "n")):
                r = await c.post("/v1/completions", json={**body, **asked},
                                 headers={"Authorization": f"Bearer {keys[name]}"})
                assert r.status_code == 400, (asked, r.text)
                assert r.json()["error"]["param"] == param, (asked, r.text)
            r = await c.post("/v1/completions", json={**body, "best_of": 16},
                             headers={"Authorization": f"Bearer {keys['all']}"})
            assert r.status_code == 200, r.text


@pytest.mark.model
def test_n_choices_smollm2(smol: DaemonProcess) -> None:
    c = _client(smol)
    model = c.models.list().data[0].id
    # Without the prefix cache both requests compute the same thing: a cached prompt's
    # last token alone takes another kernel than the whole prompt, and sampling at 0.9
    # follows the last bits of the logits.
    kw: dict[str, Any] = {"model": model, "max_tokens": 24, "n": 3, "seed": 42,
                          "temperature": 0.9, "extra_body": {"cache_prompt": False},
                          "messages": [{"role": "user", "content": "Name a fruit."}]}
    first = c.chat.completions.create(**kw)
    again = c.chat.completions.create(**kw)
    texts = [ch.message.content for ch in first.choices]
    assert texts == [ch.message.content for ch in again.choices]
    assert len(set(texts)) > 1
    greedy = c.chat.completions.create(**{**kw, "temperature": 0})
    assert len({ch.message.content for ch in greedy.choices}) == 1
