"""The rest of the API that coding tools use (issue 18, points 5 and 6): the model's
context in /v1/models, /tokenize and /detokenize, vLLM's extra sampling fields,
stop_reason and system_fingerprint, and an honest 400 for what forged does not do."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from forged.engine.limits import scheduler_limits
from forged.engine.prompts import CHATML, Prompter
from forged.http import refused
from tests.conftest import make_config
from tests.daemonproc import DaemonProcess, client, free_port, serve, write_config
from tests.tinymodel import write_tiny_llama

# ChatML, and Qwen3's switch: with enable_thinking false, an empty thought is written
# into the prompt for the model.
THINKING = CHATML + ("{% if enable_thinking is defined and not enable_thinking %}"
                     "<think>\n\n</think>\n\n{% endif %}")
EOS = 2
A = 3 + 256 + ord("a") - 0x20  # the tiny vocabulary's "a"
# Greedy, with "a" (or the end) far ahead of every other token.
ALWAYS_A: dict[str, Any] = {"temperature": 0, "logit_bias": {str(A): 100}}
ALWAYS_END: dict[str, Any] = {"temperature": 0, "logit_bias": {str(EOS): 100}}


# --- the model's context ------------------------------------------------------------


def test_the_training_context_of_a_vocabulary_only_model_is_read_from_its_gguf(
        tiny_model: Path, tmp_path: Path) -> None:
    """llama.cpp loads no hyperparameters with vocab_only, so the daemon's model says
    n_ctx_train 0; max_context 0 (the model's context) then refused every request."""
    p = Prompter(str(tiny_model))
    try:
        assert p.n_ctx_train == 4096  # the tiny GGUF's llama.context_length
    finally:
        p.close()
    cfg = make_config(tiny_model, tmp_path, engine={"max_context": 0})
    assert scheduler_limits(cfg, 4096).max_context == min(cfg.engine.room, 4096)




# --- end to end, on the tiny model --------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """max_context 0: the model's own (4,096), which the daemon could not read before."""
    tmp = tmp_path_factory.mktemp("fields")
    model = write_tiny_llama(tmp / "tiny.gguf")
    port = free_port()
    cfg = write_config(tmp / "forged.toml", model, port, engine={
        "kv_cells": 8192, "kv_layout": "unified", "max_context": 0, "slots": 8,
        "max_running": 8})
    # write_config's own argument is named `model`: the model's keys go in by hand
    cfg.write_text(cfg.read_text().replace("[model]\n", '[model]\naliases = ["gpt-x"]\n'
                                           f"chat_template = {json.dumps(THINKING)}\n"))
    yield from serve(cfg, port)


def _client(d: DaemonProcess) -> openai.OpenAI:
    return client(d, timeout=60)


def test_models_tell_the_context_served(tiny: DaemonProcess) -> None:
    c = _client(tiny)
    listed = c.models.list().data
    assert [m.id for m in listed] == ["tiny", "gpt-x"]
    for m in listed:
        extra = m.model_dump()
        assert extra["max_model_len"] == 4096 and extra["root"] == "tiny"
        assert extra["meta"]["n_ctx_train"] == 4096
        assert extra["meta"]["n_vocab"] == 3 + 256 + 95 + 2
        assert extra["meta"]["n_embd"] == 64 and extra["meta"]["n_params"] > 0
    alias = c.models.retrieve("gpt-x")
    assert alias.id == "gpt-x" and alias.model_dump()["max_model_len"] == 4096
    with pytest.raises(openai.NotFoundError) as info:
        c.models.retrieve("nope")
    err = info.value.response.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"
    # a request served at the whole context: nothing refuses it as over "0 tokens"
    done = c.completions.create(model="gpt-x", prompt="x", max_tokens=4000 - 3)
    assert done.usage is not None and done.usage.prompt_tokens + 4000 - 3 <= 4096


def test_tokenize_and_detokenize_have_llama_cpp_shapes(tiny: DaemonProcess) -> None:
    with httpx.Client(base_url=tiny.url, timeout=30) as h:
        plain = h.post("/tokenize", json={"content": "hi <|im_end|>"}).json()["tokens"]
        assert all(isinstance(t, int) for t in plain) and plain[0] != 1  # no BOS asked
        assert h.post("/tokenize", json={"content": "hi", "add_special": True}
                      ).json()["tokens"][0] == 1
        # special tokens written in the text are parsed as such, unless asked not to
        assert len(plain) < len(h.post("/tokenize", json={
            "content": "hi <|im_end|>", "parse_special": False}).json()["tokens"])
        pieces = h.post("/tokenize", json={"content": "hé", "with_pieces": True}).json()
        assert [p["id"] for p in pieces["tokens"]] == h.post(
            "/tokenize", json={"content": "hé"}).json()["tokens"]
        # é has no token of its own: its two byte tokens are not UTF-8 alone
        assert [p["piece"] for p in pieces["tokens"]][-2:] == [[0xC3], [0xA9]]
        assert h.post("/detokenize", json={"tokens": plain}).json() == {
            "content": "hi <|im_end|>"}
        assert h.post("/tokenize", json={}).json() == {"tokens": []}
        assert h.post("/detokenize", json={}).json() == {"content": ""}
        bad = h.post("/detokenize", json={"tokens": [1, 10**6]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
        bad = h.post("/tokenize", json={"content": 5})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "content"


def test_the_piece_of_a_is_a(tiny: DaemonProcess) -> None:
    pieces = httpx.post(tiny.url + "/tokenize", json={"content": "a", "with_pieces": True})
    assert {"id": A, "piece": "a"} in pieces.json()["tokens"]


# --- vLLM's sampling fields ---------------------------------------------------------


def _complete(d: DaemonProcess, **body: Any) -> Completion:
    raw = _client(d).completions.with_raw_response.create(
        model="tiny", prompt="x", max_tokens=body.pop("max_tokens", 12), extra_body=body)
    return Completion.model_validate(raw.http_response.json())


def test_min_tokens_holds_the_end_back(tiny: DaemonProcess) -> None:
    assert _complete(tiny, **ALWAYS_END).usage.completion_tokens == 0  # type: ignore[union-attr]
    held = _complete(tiny, min_tokens=5, **ALWAYS_END)
    assert held.usage is not None and held.usage.completion_tokens == 5
    assert held.choices[0].finish_reason == "stop"
    # ... and a stop token of the caller's
    held = _complete(tiny, min_tokens=3, stop_token_ids=[A], **ALWAYS_A)
    assert held.usage is not None and held.usage.completion_tokens == 3
    assert "a" not in held.choices[0].text  # three others first, then "a" ends it
    assert held.choices[0].model_extra == {"stop_reason": A}


@pytest.mark.parametrize(("body", "text", "reason"), [
    ({"stop_token_ids": [A]}, "", A),
    ({"stop_token_ids": [A], "include_stop_str_in_output": True}, "a", A),
    ({"stop": ["q", "aa"]}, "", "aa"),
    ({"stop": ["aa"], "include_stop_str_in_output": True}, "aa", "aa"),
    ({}, "a" * 12, None),
])
def test_stop_reason_says_which_stop_ended_it(tiny: DaemonProcess, body: dict[str, Any],
                                              text: str, reason: str | int | None) -> None:
    whole = _complete(tiny, **body, **ALWAYS_A)
    assert whole.choices[0].text == text
    assert (whole.choices[0].model_extra or {}).get("stop_reason") == reason
    with httpx.stream("POST", tiny.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12,
            "stream": True, **body, **ALWAYS_A}) as r:
        chunks = [ChatCompletionChunk.model_validate_json(line[6:])
                  for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert (chunks[-1].choices[0].model_extra or {}).get("stop_reason") == reason


def test_system_fingerprint_and_usage_details(tiny: DaemonProcess) -> None:
    c = _client(tiny)
    raw = c.chat.completions.with_raw_response.create(
        model="gpt-x", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    chat = ChatCompletion.model_validate(raw.http_response.json())
    fp = chat.system_fingerprint
    assert fp is not None and fp.startswith("fp_") and len(fp) == 13
    assert chat.usage is not None and chat.usage.completion_tokens_details is not None
    assert chat.usage.completion_tokens_details.reasoning_tokens == 0
    assert chat.usage.prompt_tokens_details is not None
    assert _complete(tiny).system_fingerprint == fp  # the same model and build
    stream = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert {ch.system_fingerprint for ch in chunks} == {fp}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens_details


def test_chat_template_kwargs_reach_the_template(tiny: DaemonProcess) -> None:
    def prompt_tokens(**extra: Any) -> int:
        done = _client(tiny).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
            extra_body=extra)
        assert done.usage is not None
        return done.usage.prompt_tokens
    plain = prompt_tokens()
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": True}) == plain
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) > plain


@pytest.mark.parametrize(("body", "param"), [
    ({"repeat_penalty": 1.1, "repetition_penalty": 1.2}, "repetition_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 2, "grammar": 'root ::= "a"'}, "min_tokens"),
    ({"min_tokens": 2, "response_format": {"type": "json_object"}}, "min_tokens"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids[0]"),
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
])
def test_bad_vllm_fields_are_named(tiny: DaemonProcess, body: dict[str, Any],
                                   param: str) -> None:
    r = httpx.post(tiny.url + "/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"max_tokens": 2}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"text": "x"}]}]},
     "messages[0].content[0].type"),
    ("/v1/completions", {"max_tokens": 2}, "prompt"),
    ("/infill", {"input_prefix": "x"}, "input_suffix"),
    ("/v1/events", {"type": "view"}, "completion_id"),
    ("/embedding", {"content": "x", "frob": 1}, "frob"),  # a strict body's unknown field
])
def test_a_missing_or_unknown_field_is_named(tiny: DaemonProcess, path: str,
                                             body: dict[str, Any], param: str) -> None:
    """The message named the field and `param` was null."""
    r = httpx.post(tiny.url + path, timeout=30, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize(("body", "param"), [
    ({"logit_bias": {"5": 101}}, "logit_bias"), ({"logit_bias": {"5": None}}, "logit_bias"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {
        "minimum": 1e400}}}}, "response_format"),
])
def test_a_bad_value_inside_a_map_names_the_map(tiny: DaemonProcess, body: dict[str, Any],
                                                param: str) -> None:
    """`param` was msgspec's placeholder for a map's entries: `logit_bias[...]`."""
    r = httpx.post(tiny.url + "/v1/chat/completions", timeout=30,
                   content=json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                       **body}).replace("Infinity", "1e400"))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_equal_penalties_under_both_names_are_one(tiny: DaemonProcess) -> None:
    assert _complete(tiny, max_tokens=2, repeat_penalty=1.1, repetition_penalty=1.1).choices


# --- the honest 400 ------------------------------------------------------------------

REALISTIC: dict[str, Any] = {
    "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "def f(): pass"},
    "web_search_options": {}, "store": True, "reasoning_effort": "low",
    "functions": [{"name": "f", "parameters": {}}], "function_call": "auto",
    "guided_regex": "[a-z]+", "use_beam_search": True, "skip_special_tokens": False,
    "penalty_last_n": 128, "adaptive_target": 0.5, "post_sampling_probs": True,
    "return_progress": True, "timings_per_token": True, "lora": [{"id": 0, "scale": 0.5}],
    "n_cmpl": 2, "n_cache_reuse": 256, "service_tier": "flex",
    "moderation": {"model": "omni-moderation-latest", "policy": {"output": {"mode": "block"}}},
    "image_data": [{"data": "AAAA", "id": 1}], "multimodal_data": ["AAAA"],
}


@pytest.mark.parametrize("field", sorted(refused.FIELDS))
def test_a_field_forged_does_not_do_is_a_400_naming_it(tiny: DaemonProcess,
                                                      field: str) -> None:
    # llama.cpp's own routes too: /infill took every one of them and ignored it
    for path, body in (("/v1/chat/completions", {"messages": [
            {"role": "user", "content": "hi"}]}), ("/v1/completions", {"prompt": "hi"}),
            ("/completion", {"prompt": "hi"}),
            ("/infill", {"input_prefix": "def f(", "input_suffix": ")"})):
        r = httpx.post(tiny.url + path, timeout=30, json={
            **body, "max_tokens": 2, field: REALISTIC.get(field, {"on": True})})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == field and err["code"] == "unsupported_field"
        assert err["type"] == "invalid_request_error" and field in err["message"]
    for harmless in refused.FIELDS[field].harmless:  # its default asks for nothing
        ok = httpx.post(tiny.url + "/v1/completions", timeout=30,
                        json={"prompt": "hi", "max_tokens": 1, field: harmless})
        assert ok.status_code == 200, (harmless, ok.text)


def test_the_sdks_moderation_is_a_400_naming_it(tiny: DaemonProcess) -> None:
    """openai 3.x's chat.completions.create(moderation=...) asks for the input and the
    answer to be scored or blocked: it was ignored, and the answer came back as if
    moderated."""
    with pytest.raises(openai.BadRequestError) as err:
        _client(tiny).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            moderation=REALISTIC["moderation"])
    assert err.value.body["param"] == "moderation"  # type: ignore[index]


@pytest.mark.parametrize(("part", "code"), [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
     "unsupported_field"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
     "unsupported_field"),
    ({"type": "file", "file": {"file_id": "f"}}, "unsupported_field"),
    ({"type": "hologram"}, None),
])
def test_a_content_part_that_is_not_text_is_named(tiny: DaemonProcess, part: dict[str, Any],
                                                  code: str | None) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _client(tiny).chat.completions.create(model="tiny", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}])
    err = info.value.response.json()["error"]
    assert err["param"] == "messages[0].content[1].type" and err["code"] == code


def test_fields_forged_never_heard_of_are_ignored(tiny: DaemonProcess) -> None:
    done = _complete(tiny, max_tokens=2, frobnicate={"x": 1}, metadata={"team": "a"},
                     service_tier="auto", user="u1")
    assert done.choices[0].finish_reason == "length"


@pytest.mark.model
def test_smollm2_tells_its_context_and_honours_the_fields(real_model: Path,
                                                          tmp_path: Path) -> None:
    port = free_port()
    d = DaemonProcess(write_config(tmp_path / "forged.toml", real_model, port, engine={
        "kv_cells": 16384, "kv_layout": "unified", "max_context": 0, "slots": 4,
        "max_running": 4}), port)
    try:
        d.wait_ready(180)
        with openai.OpenAI(base_url=d.url + "/v1", api_key="none", max_retries=0,
                           timeout=120) as c:
            m = c.models.retrieve(c.models.list().data[0].id).model_dump()
            assert m["meta"]["n_ctx_train"] == 8192 and m["max_model_len"] == 8192
            raw = c.chat.completions.with_raw_response.create(
                model=m["id"], messages=[{"role": "user", "content": "Say hi."}],
                max_tokens=40, temperature=0, stop=["\n"], extra_body={"min_tokens": 8})
            chat = ChatCompletion.model_validate(raw.http_response.json())
            assert chat.usage is not None and chat.usage.completion_tokens >= 8
            assert chat.system_fingerprint and chat.system_fingerprint.startswith("fp_")
            assert (chat.choices[0].model_extra or {}).get("stop_reason") in ("\n", None)
    finally:
        assert d.stop() == 0
