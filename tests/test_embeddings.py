"""Embeddings through the API (issue 36): an embedding model group beside a chat model,
OpenAI's /v1/embeddings, llama.cpp's /embedding and Ollama's /api/embed and
/api/embeddings, with the official clients; and the converter, on a tiny BERT."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import gguf
import httpx
import numpy as np
import ollama
import openai
import pytest
import trio

from forged import cli
from forged import config as fc
from forged.convert import ConvertError, convert_bert, write_bert
from forged.daemon.startup import open_prompter
from forged.engine.backend import ContextParams, Embedder
from tests.conftest import DaemonFactory
from tests.tinymodel import tiny_bert_parts

EMBED = {"name": "minilm", "engine": {"slots": 8, "max_running": 8}}
TEXTS = ["def add(a, b): return a", "class test_error:", "import the function"]


def _rows(body: dict[str, Any]) -> np.ndarray:
    return np.array([d["embedding"] for d in body["data"]], dtype=np.float32)


async def test_embeddings_in_openai_shape_batched_as_if_alone(
        tiny_model: Path, tiny_bert: Path, start_daemon: DaemonFactory) -> None:
    with trio.fail_after(60):
        async with start_daemon(tiny_model, models=[{"path": str(tiny_bert), **EMBED}]) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            listed = (await c.get("/v1/models")).json()["data"]
            assert [(m["id"], m["role"]) for m in listed] == [("tiny", "chat"),
                                                            ("minilm", "embed")]
            r = await c.post("/v1/embeddings", json={"input": TEXTS})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["object"] == "list" and body["model"] == "minilm"
            assert [d["index"] for d in body["data"]] == [0, 1, 2]
            rows = _rows(body)
            assert rows.shape == (3, 32)
            assert np.allclose(np.linalg.norm(rows, axis=1), 1.0, atol=1e-5)
            counted = [len((await c.post("/tokenize", json={
                "content": t, "model": "minilm", "add_special": True})).json()["tokens"])
                for t in TEXTS]
            assert body["usage"] == {"prompt_tokens": sum(counted),
                                     "total_tokens": sum(counted)}
            # Each input is its own sequence: batched with others, as alone.
            for text, row in zip(TEXTS, rows, strict=True):
                alone = _rows((await c.post("/v1/embeddings", json={"input": text})).json())
                assert np.allclose(alone[0], row, atol=1e-4)
            assert not np.allclose(rows[0], rows[1], atol=1e-2)  # texts differ


async def test_every_input_shape_and_encoding(
        tiny_model: Path, tiny_bert: Path, start_daemon: DaemonFactory) -> None:
    with trio.fail_after(60):
        async with start_daemon(tiny_model, models=[{"path": str(tiny_bert), **EMBED}]) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            text = _rows((await c.post("/v1/embeddings", json={"input": TEXTS[0]})).json())
            ids = (await c.post("/tokenize", json={"content": TEXTS[0], "model": "minilm",
                                                   "add_special": True})).json()["tokens"]
            for given in (ids, [ids, ids]):
                r = await c.post("/v1/embeddings", json={"input": given})
                assert r.status_code == 200, r.text
                assert np.allclose(_rows(r.json()), text[0], atol=1e-4)
            r = await c.post("/v1/embeddings", json={"input": TEXTS[0],
                                                      "encoding_format": "base64",
                                                      "dimensions": 32})
            packed = r.json()["data"][0]["embedding"]
            assert np.allclose(np.frombuffer(base64.b64decode(packed), dtype="<f4"), text[0])


REFUSED: list[tuple[dict[str, Any], int, str]] = [
    ({"input": []}, 400, "input"),
    ({"input": [[]]}, 400, "input"),
    ({"input": ""}, 400, "input"),  # a BERT's [CLS] [SEP] is no text: OpenAI's 400
    ({"input": ["a", ""]}, 400, "input"),
    ({"input": "x", "dimensions": 16}, 400, "dimensions"),
    ({"input": [99999]}, 400, "input"),
    ({"input": [1, "x"]}, 400, "input"),
    ({"input": "x", "model": "tiny"}, 400, "model"),  # a chat model makes no embeddings
    ({"input": "x", "model": "nope"}, 404, "model"),
    ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": ["x"] * 2049}, 400, "input"),
]


async def test_what_it_cannot_embed_is_a_400_naming_the_field(
        tiny_model: Path, tiny_bert: Path, start_daemon: DaemonFactory) -> None:
    with trio.fail_after(60):
        async with start_daemon(tiny_model, models=[{"path": str(tiny_bert), **EMBED}]) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            for body, status, param in REFUSED:
                r = await c.post("/v1/embeddings", json=body)
                assert r.status_code == status, (body, r.text)
                assert r.json()["error"]["param"] == param, (body, r.text)
            r = await c.post("/api/embed", json={"model": "minilm", "input": "x",
                                                 "options": {"num_ctx": 9}})
            assert r.status_code == 400 and "options" in r.json()["error"]
            assert d.daemon.models.resolve("minilm", embed=True).pool.restarts() == 0


async def test_a_long_input_is_refused_unless_truncated_and_models_keep_their_roles(
        tiny_model: Path, tiny_bert: Path, start_daemon: DaemonFactory) -> None:
    long = "def " * 200  # the tiny BERT's positions end at 128
    with trio.fail_after(60):
        async with start_daemon(tiny_model, models=[{"path": str(tiny_bert), **EMBED}]) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            r = await c.post("/v1/embeddings", json={"input": long})
            assert r.status_code == 400
            assert r.json()["error"]["code"] == "context_length_exceeded"
            r = await c.post("/v1/embeddings", json={"input": long, "truncate": True})
            assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 128
            # The embedding model generates nothing; requests naming none go elsewhere.
            r = await c.post("/v1/chat/completions", json={
                "model": "minilm", "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_supported"
            r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
            assert r.status_code == 200 and r.json()["model"] == "tiny"
            assert d.daemon.models.resolve("minilm", embed=True).pool.restarts() == 0


async def test_no_embedding_model_is_an_honest_400(
        tiny_model: Path, start_daemon: DaemonFactory) -> None:
    with trio.fail_after(60):
        async with start_daemon(tiny_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            r = await c.post("/v1/embeddings", json={"input": "x"})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "model_not_supported"


async def test_llamacpp_and_ollama_routes_and_the_official_clients(
        tiny_model: Path, tiny_bert: Path, start_daemon: DaemonFactory) -> None:
    with trio.fail_after(90):
        async with start_daemon(tiny_model, models=[{"path": str(tiny_bert), **EMBED}]) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            want = _rows((await c.post("/v1/embeddings", json={"input": TEXTS})).json())
            r = await c.post("/embedding", json={"content": TEXTS})
            assert r.status_code == 200, r.text
            assert [x["index"] for x in r.json()] == [0, 1, 2]
            assert np.allclose([x["embedding"][0] for x in r.json()], want, atol=1e-4)
            async with ollama.AsyncClient(host=d.url, timeout=30) as o:
                got = await o.embed("minilm:latest", TEXTS)
                assert got.prompt_eval_count and got.model == "minilm:latest"
                assert np.allclose(np.array(got.embeddings), want, atol=1e-4)
                old = await o.embeddings("minilm", TEXTS[1])
                assert np.allclose(old.embedding, want[1], atol=1e-4)
            sdk = openai.OpenAI(base_url=f"{d.url}/v1", api_key="none", max_retries=0)
            # The SDK asks for base64 and decodes it itself.
            made = await trio.to_thread.run_sync(
                lambda: sdk.embeddings.create(model="minilm", input=TEXTS))
            assert np.allclose([e.embedding for e in made.data], want, atol=1e-4)
            assert made.usage.prompt_tokens > 0
            async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(
                    uds=d.admin_sock), base_url="http://admin", timeout=30) as a:
                metrics = (await a.get("/metrics")).text
            # Four calls of three texts, and one of one.
            inputs = [float(line.split()[-1]) for line in metrics.splitlines()
                      if line.startswith('forged_embedding_inputs_total{model="minilm"')]
            assert inputs == [13.0]
            assert any(line.startswith("forged_requests_total{") and all(
                label in line for label in ('endpoint="/api/embed"', 'model="minilm"',
                                            'priority="interactive"', 'status="200"'))
                for line in metrics.splitlines())


async def test_ollama_s_empty_embed_loads_the_model_and_answers_no_vectors(
        tiny_model: Path, tiny_bert: Path, start_daemon: DaemonFactory) -> None:
    """Ollama answers an /api/embed with no input, "" or [] with no vectors (200): its
    clients warm a model up so. forged answered a 400 (OpenAI's way, kept there)."""
    with trio.fail_after(60):
        async with start_daemon(tiny_model, models=[{"path": str(tiny_bert), **EMBED}]) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            for extra in ({}, {"input": ""}, {"input": []}):
                r = await c.post("/api/embed", json={"model": "minilm", **extra})
                assert r.status_code == 200, (extra, r.text)
                assert r.json() == {"model": "minilm", "embeddings": []}
            r = await c.post("/api/embeddings", json={"model": "minilm", "prompt": ""})
            assert r.status_code == 200 and r.json() == {"embedding": []}, r.text
            async with ollama.AsyncClient(host=d.url, timeout=30) as o:
                assert (await o.embed("minilm", [])).embeddings == []
            # The model is still looked up; OpenAI's route still refuses an empty input.
            assert (await c.post("/api/embed", json={"model": "nope"})).status_code == 404
            assert (await c.post("/api/embed", json={"model": "tiny"})).status_code == 400
            assert (await c.post("/v1/embeddings", json={"input": ""})).status_code == 400


def test_roles_must_fit_the_model(tiny_model: Path, tiny_bert: Path, tmp_path: Path) -> None:
    with pytest.raises(fc.ConfigError, match="not an embedding model"):
        open_prompter(tmp_path / "f.toml", fc.ModelConfig(path=str(tiny_model), role="embed"))
    with pytest.raises(fc.ConfigError, match="is an embedding model"):
        open_prompter(tmp_path / "f.toml", fc.ModelConfig(path=str(tiny_bert), role="chat"))
    with open_prompter(tmp_path / "f.toml", fc.ModelConfig(path=str(tiny_bert))) as prompter:
        assert prompter.embedding


def test_the_converter_refuses_what_llama_cpp_would_abort_on(tmp_path: Path) -> None:
    config = {"max_position_embeddings": 8, "hidden_size": 4, "intermediate_size": 8,
              "num_hidden_layers": 1, "num_attention_heads": 1}
    specials = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"}
    with pytest.raises(ConvertError, match="twice"):
        write_bert(tmp_path / "x.gguf", config, [*sorted(specials), "a", "##b", "##b"],
                   specials, {}, pooling=gguf.PoolingType.MEAN, name="x")
    with pytest.raises(ConvertError, match="no \\[UNK\\]"):
        write_bert(tmp_path / "y.gguf", config, ["[PAD]", "a"], {"[PAD]"}, {},
                   pooling=gguf.PoolingType.MEAN, name="y")


def test_the_converter_says_what_is_missing_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A folder without model.safetensors, or with a damaged one, was a traceback."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text('{"model_type": "bert"}')
    (src / "tokenizer.json").write_text('{"model": {"type": "WordPiece", "vocab": {}}}')
    out = str(tmp_path / "out.gguf")
    (src / "pytorch_model.bin").write_bytes(b"torch")
    assert cli.main(["model", "convert", str(src), out]) == 1
    assert "no model.safetensors (pytorch_model.bin" in capsys.readouterr().err
    (src / "model.safetensors").write_bytes(b"garbage" * 10)
    assert cli.main(["model", "convert", str(src), out]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_a_converted_model_is_named_after_its_folder(tmp_path: Path) -> None:
    """config.json's _name_or_path names the model it was fine-tuned from (MiniLM's
    base, for all-MiniLM-L6-v2): the GGUF, and Ollama's /api/show, said that name."""
    src = _bert_folder(tmp_path / "all-MiniLM-L6-v2")
    out = convert_bert(src, tmp_path / "out.gguf")
    name = gguf.GGUFReader(out).fields["general.name"].contents()
    assert name == "all-MiniLM-L6-v2"


def test_a_sentence_transformers_max_seq_length_is_the_models_context(
        tmp_path: Path) -> None:
    """sentence_bert_config.json was not read: all-MiniLM-L6-v2's GGUF took inputs up
    to its 512 positions, where sentence-transformers (and vLLM, and TEI) cut every
    input at its max_seq_length, 256; an input between was embedded as the model never
    embeds it. Its context is max_seq_length now, and what fits is embedded as before."""
    from safetensors.numpy import save_file

    config, vocab, tensors = tiny_bert_parts()
    src = tmp_path / "st"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "bert", **config}))
    (src / "tokenizer.json").write_text(json.dumps({"model": {
        "type": "WordPiece", "vocab": {t: i for i, t in enumerate(vocab)}}}))
    save_file(tensors, str(src / "model.safetensors"))
    whole = convert_bert(src, tmp_path / "whole.gguf")
    (src / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 16}))
    cut = convert_bert(src, tmp_path / "cut.gguf")
    reader = gguf.GGUFReader(cut)
    assert reader.fields["bert.context_length"].contents() == 16
    assert [t.shape.tolist() for t in reader.tensors if t.name == "position_embd.weight"] \
        == [[config["hidden_size"], 16]]
    with open_prompter(tmp_path / "f.toml", fc.ModelConfig(path=str(cut))) as prompter:
        assert prompter.n_ctx_train == 16
        ids = prompter.tokenize("def the function", add_special=True, parse_special=False)
    vectors = []
    for gguf_path in (whole, cut):
        embedder = Embedder(str(gguf_path), ContextParams(n_ctx=16, n_seq_max=1, n_batch=16,
                                                          threads=1))
        try:
            vectors.append(np.frombuffer(embedder.embed([ids]), dtype="<f4"))
        finally:
            embedder.close()
    assert np.array_equal(vectors[0], vectors[1])
    (src / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 4096}))
    assert gguf.GGUFReader(convert_bert(src, tmp_path / "long.gguf")).fields[
        "bert.context_length"].contents() == config["max_position_embeddings"]


def _bert_folder(src: Path) -> Path:
    """A Hugging Face BERT's files, without weights (enough for what is refused first)."""
    from safetensors.numpy import save_file

    src.mkdir()
    (src / "config.json").write_text(json.dumps({
        "model_type": "bert", "_name_or_path": "nreimers/MiniLM-L6-H384-uncased",
        "max_position_embeddings": 8, "hidden_size": 4, "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 1}))
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a"]
    (src / "tokenizer.json").write_text(json.dumps({
        "model": {"type": "WordPiece", "vocab": {t: i for i, t in enumerate(vocab)}}}))
    save_file({}, str(src / "model.safetensors"))
    return src


def _module(kind: str, path: str) -> dict[str, str]:
    return {"path": path, "type": f"sentence_transformers.models.{kind}"}


def test_the_converter_lists_a_token_for_every_row_of_the_embeddings(tmp_path: Path) -> None:
    """Ids past the WordPiece vocabulary (added tokens, or rows padded to vocab_size)
    were left out: the token list was shorter than the embedding matrix, and llama.cpp
    refused the GGUF ("wrong shape")."""
    src = _bert_folder(tmp_path / "padded")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "vocab_size": 9}))
    tokenizer = json.loads((src / "tokenizer.json").read_text())
    tokenizer["added_tokens"] = [{"id": i, "content": t, "special": True} for i, t in
                                 enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])]
    tokenizer["added_tokens"].append({"id": 6, "content": "<code>", "special": True})
    (src / "tokenizer.json").write_text(json.dumps(tokenizer))
    out = convert_bert(src, tmp_path / "padded.gguf")
    field = gguf.GGUFReader(out).fields["tokenizer.ggml.tokens"]
    assert field.contents() == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "\u2581a",
                                "<code>", "[PAD7]", "[PAD8]"]


def test_the_converter_leaves_out_the_pre_training_heads(tmp_path: Path) -> None:
    """A BertForMaskedLM checkpoint's cls.predictions.* were 'no llama.cpp name'."""
    config = {"max_position_embeddings": 8, "hidden_size": 4, "intermediate_size": 8,
              "num_hidden_layers": 1, "num_attention_heads": 1}
    specials = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"}
    heads = {name: np.zeros(4, dtype=np.float32) for name in (
        "cls.predictions.bias", "cls.predictions.transform.dense.bias",
        "cls.seq_relationship.bias", "bert.pooler.dense.bias")}
    write_bert(tmp_path / "x.gguf", config, [*sorted(specials), "a"], specials, heads,
               pooling=gguf.PoolingType.MEAN, name="x")
    assert not gguf.GGUFReader(tmp_path / "x.gguf").tensors


def test_the_converter_refuses_what_llama_cpp_would_compute_otherwise(tmp_path: Path) -> None:
    """A Dense module after the pooling (LaBSE's), or two poolings at once, were
    dropped: the GGUF's vectors were silently not the model's."""
    src = _bert_folder(tmp_path / "labse")
    (src / "1_Pooling").mkdir()
    (src / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    modules = [_module("Transformer", ""), _module("Pooling", "1_Pooling"),
               _module("Dense", "2_Dense"), _module("Normalize", "3_Normalize")]
    (src / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ConvertError, match="a Dense module \\(2_Dense\\)"):
        convert_bert(src, tmp_path / "labse.gguf")
    del modules[2]
    (src / "modules.json").write_text(json.dumps(modules))
    convert_bert(src, tmp_path / "labse.gguf")  # CLS pooling alone: as it is
    (src / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}))
    with pytest.raises(ConvertError, match="pooling pooling_mode_cls_token, pooling_mode_m"):
        convert_bert(src, tmp_path / "both.gguf")
    # A cased vocabulary: llama.cpp would read "Paris" as "paris".
    cased = _bert_folder(tmp_path / "cased")
    tokenizer = json.loads((cased / "tokenizer.json").read_text())
    tokenizer["normalizer"] = {"type": "BertNormalizer", "lowercase": False}
    (cased / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ConvertError, match="cased tokenizer"):
        convert_bert(cased, tmp_path / "cased.gguf")
