"""llama.cpp's native API and its whole sampler chain.

* Each sampler acts, through llama.cpp's own samplers (forged.engine.backend), on
  SmolLM2: a checkable effect per sampler, computed from the model's own logits where
  it can be.
* ``samplers`` as names and as llama.cpp's letters (forged.http.sampling).
* ``forged serve`` with the real model: llama.vscode's chat-edit body, Continue's
  ``/completion`` body whole and streamed, ``n_probs``, ``/props``,
  ``/apply-template``, and the 400s.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import llama_cpp as ll
import msgspec
import numpy as np
import pytest
import trio

from forged import errors as e
from forged.auth import add_key
from forged.engine import testhooks
from forged.engine.backend import Context, ContextParams, Model, Sampler
from forged.engine.events import Done
from forged.engine.request import SAMPLER_ORDER, SamplerName, Sampling
from forged.http import sse
from forged.http.infill import InfillFormat
from forged.http.llamacpp import LlamaFormat
from forged.http.sampling import sampler_order
from tests.conftest import DaemonFactory
from tests.daemonproc import DaemonProcess, serve_model

CAPITAL = "The capital of France is"
COUNTING = "1 2 3 4 5 1 2 3 4 5 1 2 3 4 5 1 2 3 4"


# --- samplers: names and letters ---------------------------------------------------------


def test_the_letters_and_the_names_give_the_same_chain() -> None:
    names = ["penalties", "dry", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]
    assert sampler_order("edkypmxt") == sampler_order(names)
    assert sampler_order("edskypmxt") == SAMPLER_ORDER
    # llama.cpp's other spellings, in any case
    assert sampler_order(["Top-K", "typical_p", "TEMP", "nucleus", "minp", "infill"]) == (
        "top_k", "typical_p", "temperature", "top_p", "min_p", "infill")
    assert sampler_order("") == sampler_order([]) == ()


@pytest.mark.parametrize("bad", ["edkz", ["top_k", "adaptive_p"], ["mirostat"]])
def test_an_unknown_sampler_is_refused_naming_samplers(bad: str | list[str]) -> None:
    with pytest.raises(e.BadRequest) as info:
        sampler_order(bad)
    assert info.value.param == "samplers"


# llama.vscode's and llama.vim's /infill sampling (bench.editors sends the same).
EDITOR_INFILL = {"samplers": ["top_k", "top_p", "infill"], "top_k": 40, "top_p": 0.99}
HI = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("body", [
    {**HI, "samplers": ["top_k", "infill"]}, {**HI, "samplers": ["infill"]},
    {**HI, "samplers": ["infill", "top_k"], "top_k": 40},
    {**HI, "samplers": ["top_k", "infill"], "top_k": 0},
    {**HI, "samplers": ["top_k", "infill"], "top_k": -1},
    {**HI, "samplers": "ki", "top_k": 257}, {**HI, "samplers": "pi", "top_k": 40}])
@pytest.mark.trio
async def test_an_infill_sampler_without_a_small_top_k_before_it_is_a_400(
        fim_model: Path, start_daemon: DaemonFactory, body: dict[str, Any]) -> None:
    """llama.cpp's infill sampler compares every candidate with every other: over
    SmolLM2's 49k tokens its first token took 16.5 s, and the worker's heartbeat ran out
    with every stream on it (503 worker_lost)."""
    with trio.fail_after(60):
        async with start_daemon(fim_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            r = await c.post("/v1/chat/completions", json=body)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "samplers"
            for extra in ({}, {"temperature": 0}, {"mirostat": 2, "top_k": None}):
                r = await c.post("/v1/chat/completions", json={
                    **HI, **EDITOR_INFILL, **extra})
                assert r.status_code == 200, r.text
                r = await c.post("/infill", json={
                    "input_prefix": "def f(", "input_suffix": ")\n", "n_predict": 4,
                    **EDITOR_INFILL, **extra})
                assert r.status_code == 200, r.text


def test_at_temperature_0_what_comes_before_infill_still_runs(tiny_model: Path) -> None:
    """Greedy keeps only the samplers that can move the top token, but the infill
    sampler's answer depends on what it is handed: a top_k before it was left out, and
    it went over the whole vocabulary."""
    model = Model(str(tiny_model), vocab_only=True)
    try:
        order: tuple[SamplerName, ...] = ("top_k", "infill", "top_p")
        with Sampler(model, Sampling(temperature=0.0, top_k=40, top_p=0.5,
                                     order=order)) as s:
            chain = s._ptr
            names = [ll.llama_sampler_name(ll.llama_sampler_chain_get(chain, i))
                     for i in range(ll.llama_sampler_chain_n(chain))]
    finally:
        model.close()
    assert names == [b"top-k", b"infill", b"greedy"]


# --- each sampler acts, on the real model --------------------------------------------------


class Generator:
    """SmolLM2 in this process: a prompt, then tokens drawn by a Sampler of forged's."""

    def __init__(self, path: Path) -> None:
        self.model = Model(str(path))
        self.ctx = Context(self.model, ContextParams(n_ctx=256, n_seq_max=1, n_batch=128,
                                                     threads=2))

    def _prompt(self, text: str) -> tuple[list[int], int]:
        prompt = self.model.tokenize(text, add_special=True, parse_special=True)
        self.ctx.seq_rm(0, 0)
        return prompt, self.ctx.decode([(0, 0, prompt, 1)])[0]

    def tokens(self, text: str, sampling: Sampling, n: int = 6) -> list[int]:
        prompt, index = self._prompt(text)
        out: list[int] = []
        with Sampler(self.model, sampling, prompt) as sampler:
            for i in range(n):
                out.append(sampler.sample(self.ctx, index))
                index = self.ctx.decode([(0, len(prompt) + i, [out[-1]], 1)])[0]
        return out

    def first_probabilities(self, text: str) -> Any:
        """The model's distribution over the first token after ``text``."""
        _, index = self._prompt(text)
        row = np.ctypeslib.as_array(ll.llama_get_logits_ith(self.ctx.ptr, index),
                                    shape=(self.model.n_vocab,)).astype(np.float64)
        p = np.exp(row - row.max())
        return p / p.sum()

    def close(self) -> None:
        self.ctx.close()
        self.model.close()


@pytest.fixture(scope="module")
def smol(real_model: Path) -> Iterator[Generator]:
    g = Generator(real_model)
    yield g
    g.close()


GREEDY = Sampling(temperature=0.0)


@pytest.mark.model
def test_top_k_1_draws_what_temperature_0_picks(smol: Generator) -> None:
    greedy = smol.tokens(CAPITAL, GREEDY)
    for seed in (1, 2):
        assert smol.tokens(CAPITAL, Sampling(temperature=1.5, top_k=1, seed=seed)) == greedy


@pytest.mark.model
def test_typical_p_keeps_the_most_typical_token(smol: Generator) -> None:
    # typical_p 0 keeps one token: the one whose surprise is nearest the entropy. Every
    # seed then draws the same answer, which is not the greedy one.
    p = smol.first_probabilities(CAPITAL)
    entropy = -(p[p > 0] * np.log(p[p > 0])).sum()
    typical = int(np.argmin(np.abs(-np.log(np.maximum(p, 1e-300)) - entropy)))
    answers = {tuple(smol.tokens(CAPITAL, Sampling(temperature=1.5, typical_p=0.0,
                                                   seed=seed))) for seed in range(3)}
    assert len(answers) == 1
    answer = answers.pop()
    assert answer[0] == typical and list(answer) != smol.tokens(CAPITAL, GREEDY)
    # at 1 it is off: the seeds differ
    assert len({tuple(smol.tokens(CAPITAL, Sampling(temperature=1.5, typical_p=1.0,
                                                    seed=seed))) for seed in range(3)}) > 1


@pytest.mark.model
def test_xtc_removes_the_likeliest_tokens_above_its_threshold(smol: Generator) -> None:
    p = smol.first_probabilities(CAPITAL)
    ranked = np.argsort(-p)
    assert p[ranked[1]] > 0.02  # two tokens above the threshold below
    # With certainty, every token at or above the threshold but the least likely of them
    # goes: greedy then picks that one.
    threshold = 0.02
    survivor = int(ranked[np.sum(p >= threshold) - 1])
    first = smol.tokens(CAPITAL, Sampling(temperature=0.0, xtc_probability=1.0,
                                          xtc_threshold=threshold), n=1)
    assert first == [survivor] and survivor != ranked[0]
    # over 0.5 the threshold removes nothing
    assert smol.tokens(CAPITAL, Sampling(temperature=0.0, xtc_probability=1.0,
                                         xtc_threshold=0.6), n=1) == [int(ranked[0])]


@pytest.mark.model
def test_dry_breaks_a_repetition(smol: Generator) -> None:
    text = lambda toks: b"".join(smol.model.piece(t) for t in toks).decode()  # noqa: E731
    assert text(smol.tokens(COUNTING, GREEDY, n=4)) == " 5 1"
    dry = Sampling(temperature=0.0, dry_multiplier=5.0, dry_allowed_length=2)
    assert not text(smol.tokens(COUNTING, dry, n=4)).startswith(" 5")
    # a window of 0 turns it off, and so does a breaker the repetition holds
    off = Sampling(temperature=0.0, dry_multiplier=5.0, dry_penalty_last_n=0)
    assert text(smol.tokens(COUNTING, off, n=4)) == " 5 1"
    broken = Sampling(temperature=0.0, dry_multiplier=5.0, dry_sequence_breakers=(" ",))
    assert text(smol.tokens(COUNTING, broken, n=4)) == " 5 1"


@pytest.mark.model
def test_the_penalties_look_at_repeat_last_n_tokens(smol: Generator) -> None:
    greedy = smol.tokens(COUNTING, GREEDY, n=2)
    penalised = Sampling(temperature=0.0, repeat_penalty=3.0)
    assert smol.tokens(COUNTING, penalised, n=2) != greedy
    assert smol.tokens(COUNTING, Sampling(temperature=0.0, repeat_penalty=3.0,
                                          repeat_last_n=0), n=2) == greedy


@pytest.mark.model
def test_mirostat_runs_and_tau_0_is_greedy(smol: Generator) -> None:
    greedy = smol.tokens(CAPITAL, GREEDY)
    # Mirostat 2 keeps the tokens less surprising than mu (2 tau at first): none at tau
    # 0 but the likeliest, and mu only falls from there.
    assert smol.tokens(CAPITAL, Sampling(mirostat=2, mirostat_tau=0.0, seed=4)) == greedy
    for version in (1, 2):
        s = Sampling(temperature=1.0, mirostat=version, mirostat_tau=5.0, seed=7)
        first = smol.tokens(CAPITAL, s)
        assert len(first) == 6 and smol.tokens(CAPITAL, s) == first  # seeded


@pytest.mark.model
def test_dynamic_temperature_follows_the_entropy(smol: Generator) -> None:
    # Between 0 and 2, by the normalised entropy to the 10th power: near 0 on these
    # confident steps, so every seed gives the greedy answer; plain 1.5 does not.
    greedy = smol.tokens(CAPITAL, GREEDY)
    dyn = [smol.tokens(CAPITAL, Sampling(temperature=1.0, dynatemp_range=1.0,
                                         dynatemp_exponent=10.0, seed=s)) for s in range(3)]
    assert all(d == greedy for d in dyn)
    plain = [smol.tokens(CAPITAL, Sampling(temperature=1.5, seed=s)) for s in range(3)]
    assert any(d != greedy for d in plain)


@pytest.mark.model
def test_the_order_is_the_chain(smol: Generator) -> None:
    # top_k 1 before XTC leaves XTC one token to keep; after it, XTC's survivor.
    xtc = dict(temperature=1.0, top_k=1, xtc_probability=1.0, xtc_threshold=0.02, seed=1)
    greedy = smol.tokens(CAPITAL, GREEDY, n=1)
    assert smol.tokens(CAPITAL, Sampling(**xtc, order=("top_k", "xtc")), n=1) == greedy
    assert smol.tokens(CAPITAL, Sampling(**xtc, order=("xtc", "top_k")), n=1) != greedy


# --- forged serve: the native API --------------------------------------------------------

# llama.vscode's "edit with AI" request, as it sends it (src/llama-server.ts,
# createChatEditRequestPayload).
VSCODE_EDIT = {
    "messages": [{"role": "system", "content": "You are an expert coder."},
                 {"role": "user", "content": "Modify the following original code according "
                  "to the instructions. Output only the modified code. No explanations."
                  "\n\ninstructions:\nrename x to y\n\noriginal code:\nx = 1\n\n"
                  "modified code:"}],
    "stream": False, "cache_prompt": True, "samplers": "edkypmxt", "temperature": 0.8,
    "dynatemp_range": 0, "dynatemp_exponent": 1, "top_k": 40, "top_p": 0.95,
    "min_p": 0.05, "typical_p": 1, "xtc_probability": 0, "xtc_threshold": 0.1,
    "repeat_last_n": 64, "repeat_penalty": 1, "presence_penalty": 0,
    "frequency_penalty": 0, "dry_multiplier": 0, "dry_base": 1.75,
    "dry_allowed_length": 2, "dry_penalty_last_n": -1, "max_tokens": -1,
    "timings_per_token": False,
}
# Continue's llama.cpp provider.
CONTINUE = {"prompt": "def fibonacci(n):", "stream": True, "n_predict": 12,
            "temperature": 0.0, "stop": ["\n\n\n"], "cache_prompt": True}
TIMINGS = {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "prompt_per_second",
           "predicted_per_second", "cache_n"}


@pytest.fixture(scope="module")
def daemon(real_model: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[DaemonProcess]:
    # A short context: max_tokens -1 runs to its end.
    yield from serve_model(real_model, tmp_path_factory.mktemp("llamacpp"), kv_cells=2048,
                           kv_layout="unified", max_context=256, slots=8, max_running=4)


@pytest.fixture
def http(daemon: DaemonProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=daemon.url, timeout=120) as c:
        yield c


def events(r: httpx.Response) -> list[dict[str, Any]]:
    assert r.headers["content-type"].startswith("text/event-stream")
    lines = [line for line in r.text.splitlines() if line]
    assert all(line.startswith("data: {") for line in lines), lines  # no [DONE]
    return [json.loads(line.removeprefix("data: ")) for line in lines]


@pytest.mark.model
def test_llama_vscode_chat_edit_body_is_answered(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json=VSCODE_EDIT)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] >= 1  # -1: until the context is full
    # the same sampler fields with DRY and XTC and the rest turned on
    on = {**VSCODE_EDIT, "max_tokens": 8, "dry_multiplier": 0.8, "xtc_probability": 0.5,
          "typical_p": 0.9, "dynatemp_range": 0.5, "repeat_penalty": 1.1, "seed": 3}
    assert http.post("/v1/chat/completions", json=on).status_code == 200


@pytest.mark.model
def test_letters_and_names_give_the_same_answer(http: httpx.Client) -> None:
    # cache_prompt off: both prompts are computed the same way. The shared daemon's
    # slots hold this prompt from earlier tests, and a prompt restored from one of them
    # differs from a recomputed one in the last bits, which flips a draw at
    # temperature 1.2 (seen once in a full run).
    body = {"prompt": CAPITAL, "max_tokens": 8, "seed": 11, "temperature": 1.2,
            "top_k": 20, "typical_p": 0.9, "min_p": 0.02, "cache_prompt": False}
    by_letters = http.post("/v1/completions", json={**body, "samplers": "kypmt"})
    by_names = http.post("/v1/completions", json={**body, "samplers": [
        "top_k", "typ_p", "top_p", "min_p", "temperature"]})
    assert by_letters.status_code == by_names.status_code == 200, by_letters.text
    assert by_letters.json()["choices"][0]["text"] == by_names.json()["choices"][0]["text"]


@pytest.mark.model
def test_completion_whole(http: httpx.Client) -> None:
    r = http.post("/completion", json={**CONTINUE, "stream": False, "return_tokens": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["stop"] is True and body["id_slot"] == -1 and body["index"] == 0
    assert body["content"] and len(body["tokens"]) == body["tokens_predicted"] == 12
    assert body["stop_type"] == "limit" and body["stopping_word"] == ""
    assert body["truncated"] is False and body["tokens_evaluated"] > 0
    assert set(body["timings"]) >= TIMINGS
    settings = body["generation_settings"]
    assert settings["n_ctx"] == 256 and settings["n_predict"] == 12
    assert settings["temperature"] == 0.0 and settings["samplers"] == list(SAMPLER_ORDER)
    # the same through /v1/completions: temperature 0 is greedy on both
    v1 = http.post("/v1/completions", json={"prompt": CONTINUE["prompt"], "max_tokens": 12,
                                           "temperature": 0.0})
    assert v1.json()["choices"][0]["text"] == body["content"]


@pytest.mark.model
def test_the_whole_context_windows(http: httpx.Client) -> None:
    # -1, and any window longer than the context, look at the whole context
    body = http.post("/completion", json={"prompt": CAPITAL, "n_predict": 1,
                                          "dry_penalty_last_n": -1, "dry_multiplier": 0.5,
                                          "repeat_last_n": 10**9, "repeat_penalty": 1.1,
                                          "dry_base": 0.5}).json()
    settings = body["generation_settings"]
    assert settings["dry_penalty_last_n"] == settings["repeat_last_n"] == 256
    assert settings["dry_base"] == 1.75  # below 1: llama-server's default


@pytest.mark.model
def test_completion_streamed_as_continue_asks(http: httpx.Client) -> None:
    whole = http.post("/completion", json={**CONTINUE, "stream": False}).json()
    evs = events(http.post("/completion", json=CONTINUE))
    *parts, last = evs
    assert all(ev["stop"] is False and set(ev) >= {"content", "tokens", "id_slot", "index"}
               for ev in parts)
    assert "".join(ev["content"] for ev in parts) == whole["content"]
    assert sum(len(ev["tokens"]) for ev in parts) == 12  # a stream always has the ids
    assert last["stop"] is True and last["content"] == ""
    assert last["tokens_predicted"] == 12 and last["stop_type"] == "limit"
    assert set(last["timings"]) >= TIMINGS and last["model"]
    # the alias
    assert http.post("/completions", json={**CONTINUE, "stream": False}).json()[
        "content"] == whole["content"]


@pytest.mark.model
def test_completion_stops_on_a_word(http: httpx.Client) -> None:
    body = http.post("/completion", json={"prompt": COUNTING, "n_predict": 20,
                                          "temperature": 0, "stop": [" 2"]}).json()
    assert body["content"] == " 5 1" and body["stop_type"] == "word"
    assert body["stopping_word"] == " 2"


@pytest.mark.model
def test_n_probs(http: httpx.Client) -> None:
    body = http.post("/completion", json={"prompt": CAPITAL, "n_predict": 3,
                                          "temperature": 0, "n_probs": 5}).json()
    probs = body["completion_probabilities"]
    assert len(probs) == 3
    first = probs[0]
    assert first["token"] == " Paris" and first["bytes"] == list(b" Paris")
    assert len(first["top_logprobs"]) == 5 and first["top_logprobs"][0]["id"] == first["id"]
    logprobs = [t["logprob"] for t in first["top_logprobs"]]
    assert logprobs == sorted(logprobs, reverse=True) and -0.5 < logprobs[0] < 0
    # streamed: each event carries its tokens' entries
    evs = events(http.post("/completion", json={"prompt": CAPITAL, "n_predict": 3,
                                                "temperature": 0, "n_probs": 2,
                                                "stream": True}))
    streamed = [p for ev in evs[:-1] for p in ev["completion_probabilities"]]
    assert [p["id"] for p in streamed] == [p["id"] for p in probs]
    assert all(len(p["top_logprobs"]) == 2 for p in streamed)


@pytest.mark.model
def test_completion_prompts_and_budgets(http: httpx.Client) -> None:
    ids = http.post("/tokenize", json={"content": CAPITAL}).json()["tokens"]
    by_text = http.post("/completion", json={"prompt": CAPITAL, "n_predict": 4,
                                             "temperature": 0}).json()["content"]
    # token ids, and llama.cpp's mix of ids and text, give what the text gives
    for prompt in (ids, [*ids[:2], http.post("/detokenize", json={
            "tokens": ids[2:]}).json()["content"]]):
        r = http.post("/completion", json={"prompt": prompt, "n_predict": 4,
                                           "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["content"] == by_text
    # n_predict 0 warms the cache up; -1 runs to the context's end (256 here)
    warm = http.post("/completion", json={"prompt": CAPITAL, "n_predict": 0}).json()
    assert warm["content"] == "" and warm["tokens_predicted"] == 0
    long = (ids * 60)[:246]
    endless = http.post("/completion", json={"prompt": long, "n_predict": -1,
                                             "ignore_eos": True, "response_fields": [
                                                 "tokens_evaluated", "timings/predicted_n"]})
    assert endless.json() == {"tokens_evaluated": 246, "timings/predicted_n": 10}


@pytest.mark.model
def test_props_and_apply_template(http: httpx.Client, real_model: Path) -> None:
    props = http.get("/props").json()
    assert props["default_generation_settings"]["n_ctx"] == 256
    params = props["default_generation_settings"]["params"]
    assert params["samplers"] == list(SAMPLER_ORDER) and params["typical_p"] == 1.0
    assert props["total_slots"] == 4 and props["model_path"] == real_model.name
    assert "<|im_start|>" in props["chat_template"]
    assert props["modalities"] == {"vision": False, "audio": False}
    assert props["build_info"].startswith("forged ")
    r = http.post("/apply-template", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200, r.text
    prompt = r.json()["prompt"]
    assert "<|im_start|>user\nHi<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.model
def test_a_messages_text_parts_are_joined_by_newlines_as_the_peers_join_them(
        http: httpx.Client) -> None:
    """llama-server and vLLM join a message's text parts with a newline; forged ran
    them together ("First part.Second part.")."""
    parts = [{"type": "text", "text": "First part."}, {"type": "text", "text": "Second part."}]
    r = http.post("/apply-template", json={"messages": [{"role": "user", "content": parts}]})
    assert r.status_code == 200, r.text
    assert "<|im_start|>user\nFirst part.\nSecond part.<|im_end|>" in r.json()["prompt"]


@pytest.mark.model
@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {**VSCODE_EDIT, "typical_p": 2}, "typical_p"),
    ("/v1/chat/completions", {**VSCODE_EDIT, "samplers": "edkypmxz"}, "samplers"),
    ("/v1/completions", {"prompt": "x", "mirostat": 3}, "mirostat"),
    ("/v1/completions", {"prompt": "x", "xtc_threshold": -0.1}, "xtc_threshold"),
    ("/v1/completions", {"prompt": "x", "dry_sequence_breakers": []},
     "dry_sequence_breakers"),
    ("/v1/completions", {"prompt": "x", "repeat_last_n": -2}, "repeat_last_n"),
    ("/v1/chat/completions", {**VSCODE_EDIT, "max_tokens": 0}, "max_tokens"),
    ("/completion", {"prompt": "x", "id_slot": 0}, "id_slot"),
    ("/completion", {"prompt": "x", "n_probs": 21}, "n_probs"),
    ("/completion", {"prompt": "x", "lora": [{"id": 0, "scale": 1}]}, "lora"),
    ("/completion", {"prompt": "x", "n_cmpl": 2}, "n_cmpl"),
    ("/completion", {"prompt": "x", "n_cache_reuse": 256}, "n_cache_reuse"),
    ("/completion", {"prompt": ["a", "b"]}, "prompt"),
    # taken from /v1/completions' body and dropped: the answer held no prompt
    ("/completion", {"prompt": "x", "echo": True}, "echo"),
    # llama-server's images: the model answered about a picture it never saw
    ("/completion", {"prompt": "x", "image_data": [{"data": "AAAA", "id": 1}]},
     "image_data"),
    ("/completion", {"prompt": "x", "multimodal_data": ["AAAA"]}, "multimodal_data"),
    ("/infill", {"input_prefix": "x", "input_suffix": "", "dynatemp_range": -1},
     "dynatemp_range"),
])
def test_bad_values_are_400s_naming_the_field(http: httpx.Client, path: str,
                                              body: dict[str, Any], param: str) -> None:
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.trio
async def test_the_native_routes_need_an_api_key(
        tiny_model: Path, start_daemon: DaemonFactory, tmp_path: Path) -> None:
    key = add_key(tmp_path / "keys.toml", "editor", max_streams=2, max_queued=2,
                  priority="interactive")
    with trio.fail_after(60):
        async with start_daemon(tiny_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            for method, path, body in (
                    ("POST", "/completion", {"prompt": "x", "n_predict": 2}),
                    ("POST", "/completions", {"prompt": "x", "n_predict": 2}),
                    ("GET", "/props", None),
                    ("POST", "/apply-template", {"messages": [{"role": "user",
                                                               "content": "x"}]})):
                r = await c.request(method, path, json=body)
                assert r.status_code == 401, path
                r = await c.request(method, path, json=body, headers={"x-api-key": key})
                assert r.status_code == 200, (path, r.text)


NEWLINE = 3 + 0x0A  # the tiny vocabulary's byte token for "\n"


@pytest.mark.trio
async def test_completion_honours_the_editors_bounds(tiny_model: Path,
                                                     start_daemon: DaemonFactory) -> None:
    """n_indent and t_max_predict_ms were taken by /completion and ignored: only
    /infill's reached the engine. (The bounds token by token: tests/test_core.py.)"""
    with trio.fail_after(60):
        async with start_daemon(tiny_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            # the cursor's line goes out; the next, indented less than 2, is cut
            r = await c.post("/completion", json={
                "prompt": "def f():", "n_predict": 12, "n_indent": 2,
                "grammar": 'root ::= "x\\ny" "z"*'})
            assert r.status_code == 200, r.text
            assert (r.json()["content"], r.json()["stop_type"]) == ("x\n", "limit")
            testhooks.slow_steps(d.daemon.pool, 0, 0.01)  # 10 ms per token at least
            r = await c.post("/completion", json={
                "prompt": "a", "n_predict": 200, "ignore_eos": True,
                "logit_bias": {str(NEWLINE): 100}, "t_max_predict_ms": 50})
            # every token is a newline: the first one made after 50 ms ends it
            cut = r.json()
            assert cut["stop_type"] == "limit" and 2 <= cut["tokens_predicted"] < 200


SPLITS = [
    [(s, 1) for s in range(16)],
    [(s, 1) for s in (0, 1, 2, 5, 6, 7)],
    [*((s, 1) for s in range(16) if s != 5), (5, 30)],
    [(0, 1), (1, 1), (2, 1), (3, 30), (4, 10), (5, 1)],
    [(3, 30), (4, 1), (5, 30)],
    [(s, 10) for s in range(0, 16, 2)],
    [(s, 15) for s in range(16)],
]


def test_micro_batches_are_llama_cpps_own_split(tiny_model: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The cost model's count of passes (costmodel.micro_batches) is what llama.cpp does
    with a per-slot batch: its batch debugging (read when a context is made) logs each
    micro-batch it splits off."""
    from forged.engine import backend
    from forged.engine.costmodel import micro_batches

    model = Model(str(tiny_model))
    logged: list[bytes] = []

    @ll.llama_log_callback  # type: ignore[untyped-decorator]
    def keep(level: int, text: bytes, user_data: object) -> None:
        logged.append(text)

    monkeypatch.setenv("LLAMA_BATCH_DEBUG", "1")
    ll.llama_log_set(keep, None)
    try:
        ctx = Context(model, ContextParams(n_ctx=16 * 64, n_seq_max=16, n_batch=256,
                                           threads=1, kv_unified=False))
        for runs in SPLITS:
            logged.clear()
            ctx.decode([(seq, 0, [1] * n, 1) for seq, n in sorted(runs)])  # as forged sends
            split = sum(b"added ubatch to split" in line for line in logged)
            assert split == micro_batches(runs, 256), runs
            for seq, _ in runs:
                ctx.seq_rm(seq, 0)
        ctx.close()
    finally:
        ll.llama_log_set(backend._log_errors_only, None)
        model.close()


async def test_detokenize_checks_its_ids_off_the_event_loop(
        tiny_model: Path, start_daemon: DaemonFactory, monkeypatch: pytest.MonkeyPatch
        ) -> None:
    """The check grows with the list (80 ms for a million ids, every stream stalled):
    it runs in one of the door's threads, with the detokenizing."""
    import threading

    import forged.http.tokens as tokens

    loop_thread, threads = threading.get_ident(), []
    check = tokens.check_ids

    def recorded(*args: Any) -> None:
        threads.append(threading.get_ident())
        check(*args)

    monkeypatch.setattr(tokens, "check_ids", recorded)
    with trio.fail_after(60):
        async with start_daemon(tiny_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            r = await c.post("/detokenize", json={"tokens": [1, 2]})
            assert r.status_code == 200, r.text
            r = await c.post("/detokenize", json={"tokens": [1, 10**9]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert len(threads) == 2 and loop_thread not in threads


# --- has_new_line ------------------------------------------------------------------------


def _last_event(frames: bytes) -> dict[str, Any]:
    return json.loads(frames.strip().split(b"\n\n")[-1].removeprefix(b"data: "))


@pytest.mark.parametrize("make", [
    lambda: LlamaFormat("m", 0, settings={}, probs=0, tokens=False, fields=None),
    lambda: InfillFormat("m", 0),
], ids=["completion", "infill"])
def test_has_new_line_says_whether_the_text_generated_holds_a_newline(
        make: Callable[[], sse.Format]) -> None:
    """llama-server sets ``has_new_line`` on the last event once a text it sent held a
    newline (server_slot.has_new_line). A stream's last event has no text of its own,
    and forged looked for the newline there: always false in a stream."""
    done = Done(rid=1, text="", stop_type="limit", prompt_tokens=3, completion_tokens=4,
                cached_tokens=0)
    streamed = make()
    frames = streamed.delta("def f():\n") + streamed.delta("    return 1")
    assert _last_event(streamed.finish(done))["has_new_line"] is True
    assert _last_event(frames)["content"] == "    return 1"
    held_back = make()  # the newline in the text held back to the end
    held_back.delta("x = 1")
    assert _last_event(held_back.finish(msgspec.structs.replace(done, text="\n")))[
        "has_new_line"] is True
    one_line = make()
    one_line.delta("x = 1")
    assert _last_event(one_line.finish(done))["has_new_line"] is False
    assert make().whole(["a\nb"], [done])["has_new_line"] is True
    assert make().whole(["a b"], [done])["has_new_line"] is False
