"""What ``forged index add|update`` embeds chunks with (issue 36): the config's
embedding model (the served model whose role is "embed"), loaded in the command's own
process, never the daemon's workers.

The command runs at nice 19 before it loads the model: its llama.cpp threads take the
cores only where the daemon's workers leave them, so an index build never slows a
stream (it goes as fast as the idle CPU lets it, and says what it took). Texts are
packed into batches of at most the model's batch of tokens and its slots of inputs,
each its own sequence, as the daemon's embedding worker packs them; a text longer than
the model's positions is cut, its last token ([SEP]) kept.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from forged import config as fc
from forged.engine.backend import BackendError, ContextParams, Embedder, Model
from forged.engine.kvdisk import model_identity
from forged.engine.limits import scheduler_limits
from forged.retrieval.vectors import Embedding

INDEX_NICE = 19


def index_embedding(config_path: Path, nice: int = INDEX_NICE) -> Embedding | None:
    """The config's embedding model, loaded with this process at ``nice``; None if
    it serves none, or if it cannot be loaded (said on stderr: the index is then
    updated for BM25 alone, as the daemon would search it)."""
    cfg = fc.load(config_path)
    for model in cfg.served:
        if model.role in ("chat", "fim") or not (model.role == "embed" or _pools(model.path)):
            continue
        os.nice(max(0, nice - os.nice(0)))  # before llama.cpp starts its threads
        try:
            return _Packer(model.path, cfg.for_model(model)).embedding()
        except BackendError as exc:
            print(f"forged: chunks get no vectors: {exc}", file=sys.stderr)
            return None
    return None


def _pools(path: str) -> bool:
    """Whether the GGUF at ``path`` is an embedding model; a file llama.cpp cannot
    read is not one (the daemon says what is wrong with it)."""
    try:
        vocab = Model(path, vocab_only=True)
    except BackendError:
        return False
    try:
        return vocab.pools
    finally:
        vocab.close()


class _Packer:
    """An Embedder and the batches it takes."""

    def __init__(self, path: str, cfg: fc.Config) -> None:
        vocab = Model(path, vocab_only=True)
        n_ctx_train = vocab.n_ctx_train
        vocab.close()
        lim = scheduler_limits(cfg, n_ctx_train, encoder=True)
        self.batch, self.slots = lim.embed_batch, lim.slots
        self.longest = min(lim.max_context, self.batch)
        self.embedder = Embedder(path, ContextParams(
            n_ctx=self.batch, n_seq_max=self.slots, n_batch=self.batch,
            threads=cfg.engine.threads))
        self.model = model_identity(path)
        print(f"forged: embedding chunks with {Path(path).name} at nice {os.nice(0)}",
              file=sys.stderr)

    def embedding(self) -> Embedding:
        return Embedding(self.model, self.embed)

    def embed(self, texts: list[str]) -> list[bytes]:
        tokens = [self._fitted(t) for t in texts]
        size = 4 * self.embedder.n_embd
        out: list[bytes] = []
        start = 0
        while start < len(tokens):
            end, used = start, 0
            while end < len(tokens) and end - start < self.slots and \
                    used + len(tokens[end]) <= self.batch:
                used += len(tokens[end])
                end += 1
            packed = self.embedder.embed(tokens[start:end])
            out += [packed[i * size:(i + 1) * size] for i in range(end - start)]
            start = end
        return out

    def _fitted(self, text: str) -> list[int]:
        toks = self.embedder.model.tokenize(text, add_special=True, parse_special=False)
        return toks if len(toks) <= self.longest else toks[:self.longest - 1] + toks[-1:]
