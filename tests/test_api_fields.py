"""The rest of the API that coding tools use (issue 18, points 5 and 6): the model's
context in /v1/models, /tokenize and /detokenize, vLLM's extra sampling fields,
stop_reason and system_fingerprint, and an honest 400 for what forged does not do."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from forged.engine.limits import scheduler_limits
from forged.engine.prompts import Prompter
from tests.conftest import make_config
from tests.daemonproc import DaemonProcess, free_port, write_config
from tests.tinymodel import write_tiny_llama

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
    # write_config's own argument is named `model`: the alias goes in by hand
    cfg.write_text(cfg.read_text().replace("[model]\n", '[model]\naliases = ["gpt-x"]\n'))
    d = DaemonProcess(cfg, port)
    try:
        d.wait_ready(180)
        yield d
    finally:
        assert d.stop() == 0


def _client(d: DaemonProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.url + "/v1", api_key="none", max_retries=0, timeout=60)


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
