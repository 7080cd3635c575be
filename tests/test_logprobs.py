"""logprobs, top_logprobs and echo (issue 18, point 3).

The worker's core around a fake backend (entries go out with their text, a stop
string's cut drops them, a scored prompt asks for every position's logits); the real
backend on the tiny model (a log-softmax that sums to one); and the official openai
client end to end against the tiny model, with its shapes validated by the openai
package's own types. The prompt's logprobs are checked against llama-cpp-python's own
evaluation of the same tokens (its ``Llama.eval`` with ``logits_all`` and its
``logits_to_logprobs``): the same model through another decode path.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import llama_cpp
import numpy as np
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from forged.engine import frames as fr
from forged.engine.backend import ContextParams, Llama, Model
from forged.engine.decoding import DecodeItem, TokenLogprob
from forged.engine.events import Admitted, Delta, Done, Event, Scored
from forged.engine.request import Request
from tests.daemonproc import DaemonProcess, free_port, write_config
from tests.test_core import EOS, FakeBackend, core_with, of, run
from tests.tinymodel import write_tiny_llama

# --- the core, with a fake backend ---------------------------------------------------

EURO = "\u20ac".encode()  # three bytes, split over two tokens below


class ScoringBackend(FakeBackend):
    """Token t has logprob -t; tokens 30 and 31 are the two halves of a euro sign."""

    def __init__(self, scripts: dict[int, list[int]]) -> None:
        super().__init__(scripts)
        self.logits_asked: list[int] = []

    def piece(self, token: int, special: bool = False) -> bytes:
        return {30: EURO[:2], 31: EURO[2:]}.get(token) or super().piece(token, special)

    def decode(self, items: Sequence[DecodeItem]) -> list[int]:
        self.logits_asked += [int(n) for _, _, _, n in items]
        return super().decode(items)

    def logprobs(self, index: int, token: int, top: int) -> TokenLogprob:
        return TokenLogprob(token, -float(token), [(7, -0.5)] * top)


def scoring_core(script: list[int]) -> tuple[Any, ScoringBackend]:
    core, _ = core_with({})
    backend = ScoringBackend({5: script})
    core.backend = backend
    return core, backend


def entries(events: list[Event]) -> list[int]:
    return [e.token for ev in events if isinstance(ev, Delta | Done)
            for e in ev.logprobs or []]


def text(events: list[Event]) -> str:
    return "".join(ev.text for ev in events if isinstance(ev, Delta | Done))


def submit(core: Any, rid: int, **kw: Any) -> None:
    core.handle(fr.Submit(rid=rid, request=Request(**{"max_tokens": 10, **kw})), 0.0)


def test_entries_go_out_with_their_text_and_a_split_character_waits() -> None:
    core, _ = scoring_core([1, 30, 31, 2, EOS])  # a, half a euro, the rest, b
    submit(core, 1, prompt=[5, 6], logprobs=1)
    events = run(core)
    assert text(events) == "a\u20acb" and entries(events) == [1, 30, 31, 2]
    for ev in events:  # each delta carries exactly the tokens its text completes
        if isinstance(ev, Delta):
            assert ev.text != "\u20ac" or [e.token for e in ev.logprobs or []] == [30, 31]
    first = next(e for e in events if isinstance(e, Delta))
    assert first.logprobs == [TokenLogprob(1, -1.0, [(7, -0.5)])]


def test_tokens_cut_by_a_stop_string_lose_their_entries() -> None:
    core, _ = scoring_core([1, 2, 3, 4, 5])  # a b c d e
    submit(core, 1, prompt=[5], logprobs=0, stop=["cd"])
    events = run(core)
    assert text(events) == "ab" and entries(events) == [1, 2]


def test_without_logprobs_nothing_is_scored_or_sent() -> None:
    core, backend = scoring_core([1, 2, EOS])
    submit(core, 1, prompt=[5, 6, 7])
    events = run(core)
    assert all(ev.logprobs is None for ev in events if isinstance(ev, Delta | Done))
    assert set(backend.logits_asked) <= {0, 1}
    assert b"logprobs" not in fr.encode(fr.Step(events=events, stats={}))


def test_a_scored_prompt_asks_for_every_position_and_is_sent_once() -> None:
    core, backend = scoring_core([1, EOS])
    prompt = [5, *range(1, 27), *range(1, 27)]  # 53 tokens
    submit(core, 1, prompt=prompt, logprobs=2, prompt_logprobs=True, max_tokens=0)
    events = of(run(core), 1)
    scored = [ev for ev in events if isinstance(ev, Scored)]
    assert len(scored) == 1 and [e.token for e in scored[0].logprobs] == prompt[1:]
    assert sum(backend.logits_asked) == len(prompt)  # every position, once
    done = events[-1]
    assert isinstance(done, Done) and done.text == "" and done.completion_tokens == 0


def test_a_scored_prompt_is_not_taken_from_the_cache() -> None:
    core, _ = scoring_core([1, EOS])
    submit(core, 1, prompt=[5, 6, 7, 8, 9])
    run(core)
    submit(core, 2, prompt=[5, 6, 7, 8, 9, 10], logprobs=0, prompt_logprobs=True)
    events = of(run(core), 2)
    admitted = next(ev for ev in events if isinstance(ev, Admitted))
    assert admitted.cached == 0
    assert [e.token for ev in events if isinstance(ev, Scored) for e in ev.logprobs] \
        == [6, 7, 8, 9, 10]


# --- the real backend ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("lp") / "tiny-tools.gguf", tools=True)


def test_the_log_softmax_covers_the_vocabulary(tiny: Path) -> None:
    with Llama(str(tiny), ContextParams(n_ctx=256, n_seq_max=1, n_batch=64, threads=2)
               ) as llm:
        prompt = llm.model.tokenize("Hello, world", add_special=True, parse_special=False)
        last = llm.decode([(0, 0, prompt, len(prompt))])[0]
        n_vocab = llm.model.n_vocab
        for j in range(len(prompt)):
            index = last - len(prompt) + 1 + j
            whole = llm.logprobs(index, 42, n_vocab)
            lps = [lp for _, lp in whole.top]
            assert len(whole.top) == n_vocab and lps == sorted(lps, reverse=True)
            assert math.isclose(sum(math.exp(lp) for lp in lps), 1.0, rel_tol=1e-6)
            assert dict(whole.top)[42] == whole.logprob <= 0.0
            few = llm.logprobs(index, 42, 3)
            assert few.top == whole.top[:3] and few.logprob == whole.logprob


# --- end to end ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    tmp, port = tmp_path_factory.mktemp("lpd"), free_port()
    # Per-slot streams: a request's logits depend on its own cells only.
    d = DaemonProcess(write_config(tmp / "forged.toml", tiny, port, engine={
        "kv_layout": "per_slot", "kv_cells": 8192, "slots": 4, "max_running": 4,
        "max_context": 2048}), port)
    try:
        d.wait_ready(120)
        yield d
    finally:
        assert d.stop() == 0


@pytest.fixture
def oai(daemon: DaemonProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0,
                       timeout=120) as c:
        yield c


MODEL = "tiny-tools"
MESSAGES: list[Any] = [{"role": "user", "content": "Write something."}]
# Fresh computations: a prefix from the cache is computed in other batch shapes, which
# may change the last bits of the logits.
FRESH = {"cache_prompt": False}


def chat(d: DaemonProcess, stream: bool = False, **kw: Any) -> Any:
    body = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 24,
            "stream": stream, **FRESH, **kw}
    r = httpx.post(d.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    if not stream:
        return ChatCompletion.model_validate(r.json())
    return [ChatCompletionChunk.model_validate_json(line[6:])
            for line in r.text.splitlines() if line.startswith("data: {")]


def _check_content_entry(e: Any, top: int) -> None:
    assert e.logprob <= 0.0 and len(e.top_logprobs) == top
    lps = [t.logprob for t in e.top_logprobs]
    assert lps == sorted(lps, reverse=True)
    if top:  # greedy: the chosen token is the most likely one, with its logprob
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
    for t in [e, *e.top_logprobs]:
        if not t.token.startswith("bytes:"):
            assert bytes(t.bytes or []) == t.token.encode()


def test_chat_logprobs_streamed_equal_whole(daemon: DaemonProcess) -> None:
    whole = chat(daemon, logprobs=True, top_logprobs=5)
    choice = whole.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    content = choice.logprobs.content
    for e in content:
        _check_content_entry(e, 5)
    # the tokens' bytes are the answer's text
    raw = b"".join(bytes(e.bytes or []) for e in content)
    assert raw.decode("utf-8", "replace") == choice.message.content
    chunks = chat(daemon, stream=True, logprobs=True, top_logprobs=5)
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content or []]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) \
        == choice.message.content
    plain = chat(daemon)  # without logprobs: none, and the same answer
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == choice.message.content


def test_chat_logprobs_without_alternatives_and_with_a_stop_string(
        daemon: DaemonProcess) -> None:
    full = chat(daemon, logprobs=True).choices[0]
    assert full.logprobs is not None and full.logprobs.content
    text = full.message.content or ""
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert len(stop) == 2
    cut = chat(daemon, logprobs=True, stop=[stop]).choices[0]
    assert cut.logprobs is not None and cut.logprobs.content is not None
    raw = b"".join(bytes(e.bytes or []) for e in cut.logprobs.content)
    # the entries are those of the text returned: a character split over the last
    # token kept may be returned whole, never a token of the cut text
    assert raw.decode("utf-8", "replace").startswith(cut.message.content or "")
    assert len(cut.logprobs.content) < len(full.logprobs.content)
    for e in cut.logprobs.content:
        _check_content_entry(e, 0)


def test_completion_logprobs_shapes(oai: openai.OpenAI) -> None:
    c = oai
    raw = c.completions.with_raw_response.create(
        model=MODEL, prompt="Once upon", max_tokens=20, temperature=0, logprobs=3,
        extra_body=FRESH)
    done = Completion.model_validate(raw.http_response.json())
    lp = done.choices[0].logprobs
    assert lp is not None and lp.tokens and done.usage is not None
    n = len(lp.tokens)
    assert n == done.usage.completion_tokens or done.choices[0].finish_reason == "stop"
    assert lp.token_logprobs and lp.top_logprobs and lp.text_offset
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    text = done.choices[0].text
    for tok, logprob, top, offset in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs,
                                         lp.text_offset, strict=True):
        assert logprob is not None and logprob <= 0.0
        assert 3 <= len(top) <= 4 and top[tok] == logprob == max(top.values())  # greedy
        if not tok.startswith("bytes:") and not tok.startswith("<"):
            assert text[offset:].startswith(tok)
    streamed = [ch for ch in c.completions.create(
        model=MODEL, prompt="Once upon", max_tokens=20, temperature=0, logprobs=3,
        stream=True, extra_body=FRESH)]
    got = [(t, p) for ch in streamed if ch.choices and ch.choices[0].logprobs
           for t, p in zip(ch.choices[0].logprobs.tokens or [],
                           ch.choices[0].logprobs.token_logprobs or [], strict=True)]
    assert got == list(zip(lp.tokens, lp.token_logprobs, strict=True))
    offsets = [o for ch in streamed if ch.choices and ch.choices[0].logprobs
               for o in ch.choices[0].logprobs.text_offset or []]
    assert offsets == lp.text_offset


def _reference(model: Path, tokens: list[int]) -> np.ndarray[Any, Any]:
    """llama-cpp-python's own logprobs of every position of ``tokens``: row i is the
    log-softmax of the logits after token i."""
    llm = llama_cpp.Llama(str(model), n_ctx=2048, n_batch=64, n_ubatch=64, logits_all=True,
                          n_threads=2, flash_attn=False, verbose=False)
    try:
        llm.eval(tokens)
        return np.asarray(llama_cpp.Llama.logits_to_logprobs(llm.scores[: len(tokens)]))
    finally:
        llm.close()


def test_echo_with_max_tokens_0_scores_the_prompt(daemon: DaemonProcess, tiny: Path) -> None:
    """As lm-eval-harness asks: token ids in a list of one, echo, logprobs, and no
    generation (or one token, greedy)."""
    with Model(str(tiny), vocab_only=True) as m:
        ids = m.tokenize("The quick brown fox jumps over the lazy dog. " * 4,
                         add_special=True, parse_special=False)
    assert len(ids) > 64  # more than one scored chunk
    ref = _reference(tiny, ids)
    for max_tokens in (0, 1):
        r = httpx.post(daemon.url + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": [ids], "max_tokens": max_tokens, "echo": True,
            "logprobs": 1, "temperature": 0})
        assert r.status_code == 200, r.text
        # The first token's null is OpenAI's own answer, but not in the openai
        # package's type: the rest is checked against it.
        body = r.json()
        done, lp = body["choices"][0], body["choices"][0]["logprobs"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        lp["token_logprobs"][0], lp["top_logprobs"][0] = 0.0, {}
        Completion.model_validate(body)
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(ids) + max_tokens
        ours = np.array(lp["token_logprobs"][1: len(ids)], dtype=float)
        theirs = ref[np.arange(len(ids) - 1), ids[1:]]
        np.testing.assert_allclose(ours, theirs, atol=2e-3)
        assert body["usage"]["completion_tokens"] == max_tokens
    # the one generated token is the argmax of the last row, with its logprob
    assert lp["token_logprobs"][-1] == pytest.approx(float(ref[-1].max()), abs=2e-3)
    # token ids echo as their text, as llama.cpp writes it out
    assert done["text"].startswith("<s>") and "The quick brown fox" in done["text"]


def test_echo_returns_the_prompt_as_given(oai: openai.OpenAI) -> None:
    c = oai
    prompt = "Echo \u20ac this"
    r = httpx.post(str(c.base_url) + "completions", timeout=120, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 3, "echo": True, "temperature": 0,
        "logprobs": 0})
    body = r.json()
    body["choices"][0]["logprobs"]["token_logprobs"][0] = 0.0  # null, as OpenAI's
    body["choices"][0]["logprobs"]["top_logprobs"][0] = {}
    choice = Completion.model_validate(body).choices[0]
    assert choice.text.startswith(prompt) and choice.logprobs is not None
    lp = choice.logprobs
    assert lp.tokens and lp.tokens[0] == "<s>" and lp.text_offset
    assert lp.text_offset[1] == 0 and lp.text_offset[-3] >= len(prompt) - 1
    assert lp.text_offset[-3:] == sorted(lp.text_offset[-3:])
    with httpx.stream("POST", str(c.base_url) + "completions", timeout=120, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 3, "echo": True,
            "temperature": 0, "logprobs": 0, "stream": True}) as s:
        streamed = [json.loads(line[6:]) for line in s.iter_lines()
                    if line.startswith("data: {")]
    assert "".join(ch["choices"][0]["text"] for ch in streamed) == choice.text
    first = streamed[0]["choices"][0]
    assert first["text"] == prompt and first["logprobs"]["token_logprobs"][0] is None
    assert first["logprobs"]["tokens"] == lp.tokens[: len(first["logprobs"]["tokens"])]
    plain = c.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True)
    assert plain.choices[0].text == prompt and plain.choices[0].logprobs is None


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False}}}


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_with_tools_cover_the_calls_text(daemon: DaemonProcess,
                                                  stream: bool) -> None:
    out = chat(daemon, stream, logprobs=True, top_logprobs=2, tools=[WEATHER],
               tool_choice="required", parallel_tool_calls=False, max_tokens=200)
    if not stream:
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        assert choice.logprobs is not None and choice.logprobs.content
        assert "<tool_call>" in "".join(e.token for e in choice.logprobs.content)
        return
    entries_ = [e for c in out if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content or []]
    assert out[-1].choices[0].finish_reason == "tool_calls"
    assert "<tool_call>" in "".join(e.token for e in entries_)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"echo": True, "suffix": "x"}, "echo"),
    ("/v1/completions", {"echo": "yes"}, "echo"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": [[1, 2], [3]]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 99999]]}, "prompt"),
])
def test_bad_logprob_fields_get_a_400_naming_them(daemon: DaemonProcess, path: str,
                                                  body: dict[str, Any], param: str) -> None:
    base = {"messages": MESSAGES} if "chat" in path else {"prompt": "hi"}
    r = httpx.post(daemon.url + path, json={**base, "max_tokens": 2, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert json.loads(r.text)["error"]["param"] == param


@pytest.mark.model
def test_smollm2_logprobs_through_the_openai_client(real_model: Path, tmp_path: Path) -> None:
    """The real model: chat logprobs with alternatives, each of n choices with its own
    legacy logprobs, and a prompt scored without generating (echo, max_tokens 0)."""
    port = free_port()
    d = DaemonProcess(write_config(tmp_path / "forged.toml", real_model, port), port)
    try:
        d.wait_ready(180)
        with openai.OpenAI(base_url=d.url + "/v1", api_key="none", max_retries=0,
                           timeout=120) as c:
            model = c.models.list().data[0].id
            r = c.chat.completions.create(model=model, messages=MESSAGES, temperature=0,
                                          max_tokens=16, logprobs=True, top_logprobs=3)
            content = r.choices[0].logprobs.content  # type: ignore[union-attr]
            assert content and len(content) == r.usage.completion_tokens  # type: ignore[union-attr]
            for e in content:
                _check_content_entry(e, 3)
            assert b"".join(bytes(e.bytes or []) for e in content).decode() \
                == r.choices[0].message.content
            two = c.completions.create(model=model, prompt="def add(a, b):", max_tokens=8,
                                       temperature=0, logprobs=2, n=2)
            lps = [ch.logprobs for ch in sorted(two.choices, key=lambda ch: ch.index)]
            assert lps[0] is not None and lps[1] is not None
            assert lps[0].tokens == lps[1].tokens and len(lps[0].tokens or []) == 8
            assert lps[0].text_offset == sorted(lps[0].text_offset or [])
        prompt = "The capital of France is Paris."
        scored = httpx.post(d.url + "/v1/completions", timeout=120, json={
            "prompt": prompt, "echo": True, "max_tokens": 0, "logprobs": 1}).json()
        choice = scored["choices"][0]
        assert choice["text"] == prompt and scored["usage"]["completion_tokens"] == 0
        tl = choice["logprobs"]["token_logprobs"]
        assert tl[0] is None and len(tl) == scored["usage"]["prompt_tokens"]
        assert all(lp <= 0.0 for lp in tl[1:])
    finally:
        assert d.stop() == 0
