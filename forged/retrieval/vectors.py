"""The index's second ranking: each chunk's embedding, and a search that fuses it with
BM25 (issue 36).

Vectors live in the index's own SQLite file (``vectors``: a chunk's rowid and its
unit-length float32 vector). An update commits its chunks first (searches see them at
once, by BM25), then embeds the chunks that have no vector, committing every
``COMMIT_EVERY`` of them: a first embedding of a large tree takes a while, and one
stopped midway (a timeout, a reboot) keeps what it made, so the next update goes on
from there instead of starting again. A chunk's vector goes in the transaction that
removes the chunk. ``meta.embed_model`` names the model that made them: a search embeds
its query with the daemon's embedding model and compares only vectors of the same one;
an update with another model embeds every chunk again.

Search: the nearest chunks by cosine (a matrix product over the whole index: 100,000
chunks of 384 dimensions are 150 MB and a few milliseconds), and BM25's best, fused by
reciprocal rank (each list's rank r adds 1 / (RRF_K + r)): a chunk both find comes
first, one only either finds still places. The matrix is read once per index version
and kept (:class:`Matrix`).

This module computes nothing with a model: the caller passes ``Embedding.embed``
(forged.indexembed in ``forged index``, the embedding worker in the daemon).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

# Reciprocal rank fusion's constant (Cormack et al.: 60 is the usual choice).
RRF_K = 60
# How deep each ranking goes before fusion.
FUSE_DEPTH = 50
# Chunks embedded per transaction.
COMMIT_EVERY = 1024
VECTORS_SCHEMA = "CREATE TABLE IF NOT EXISTS vectors (rowid INTEGER PRIMARY KEY, " \
                 "vec BLOB NOT NULL);"


@dataclass(frozen=True)
class Embedding:
    """How an update embeds chunks: ``embed`` maps texts to unit-length float32
    vectors (little-endian bytes), ``model`` names the model (its content's hash)."""

    model: str
    embed: Callable[[list[str]], list[bytes]]
    batch: int = 64


@dataclass(frozen=True)
class EmbedStats:
    chunks: int  # embedded by this update
    seconds: float


def chunk_text(path: str, text: str) -> str:
    """What a chunk's vector is made of: its path, then its text."""
    return f"{path}\n{text}"


def embed_missing(db: sqlite3.Connection, e: Embedding,
                  progress: Callable[[int, int], None] | None = None) -> EmbedStats:
    """Embed every chunk without a vector (all of them when the model changed), in
    transactions of COMMIT_EVERY chunks (``db`` must be outside one)."""
    t0 = time.monotonic()
    with db:
        row = db.execute("SELECT value FROM meta WHERE key = 'embed_model'").fetchone()
        if row is None or row[0] != e.model:
            db.execute("DELETE FROM vectors")
            db.execute("INSERT OR REPLACE INTO meta VALUES ('embed_model', ?)", (e.model,))
    todo = db.execute("SELECT rowid, path, text FROM chunks WHERE rowid NOT IN "
                      "(SELECT rowid FROM vectors)").fetchall()
    for start in range(0, len(todo), COMMIT_EVERY):
        with db:
            for i in range(start, min(start + COMMIT_EVERY, len(todo)), e.batch):
                part = todo[i:min(i + e.batch, start + COMMIT_EVERY)]
                vecs = e.embed([chunk_text(p, t) for _, p, t in part])
                db.executemany("INSERT INTO vectors VALUES (?, ?)",
                               [(r, v) for (r, _, _), v in zip(part, vecs, strict=True)])
                if progress is not None:
                    progress(i + len(part), len(todo))
            # What tells a searcher's kept matrix that it is out of date.
            db.execute("INSERT OR REPLACE INTO meta VALUES ('vectors_at', ?)",
                       (repr(time.time()),))
    return EmbedStats(len(todo), time.monotonic() - t0)


def forget(db: sqlite3.Connection, first: int, n: int) -> None:
    db.execute("DELETE FROM vectors WHERE rowid >= ? AND rowid < ?", (first, first + n))


@dataclass(frozen=True)
class Matrix:
    """An index's vectors, read once: rowids and a (chunks, dims) float32 matrix."""

    model: str
    rowids: npt.NDArray[np.int64]
    vectors: npt.NDArray[np.float32]


def load(db: sqlite3.Connection) -> Matrix | None:
    """The index's vectors; None unless every chunk has one. An embedding under way (a
    first one takes hours on a large tree) or cut short would otherwise fuse BM25 with
    the nearest of the chunks embedded so far: those files would rank above the rest."""
    row = db.execute("SELECT value FROM meta WHERE key = 'embed_model'").fetchone()
    rows = db.execute("SELECT rowid, vec FROM vectors ORDER BY rowid").fetchall()
    chunks = db.execute("SELECT coalesce(sum(chunks), 0) FROM files").fetchone()[0]
    if row is None or not rows or len(rows) != chunks:
        return None
    rowids = np.fromiter((r for r, _ in rows), dtype=np.int64, count=len(rows))
    vectors = np.frombuffer(b"".join(v for _, v in rows), dtype="<f4").reshape(len(rows), -1)
    return Matrix(row[0], rowids, vectors)


def nearest(m: Matrix, query: npt.NDArray[np.float32], n: int) -> list[int]:
    """The rowids of the ``n`` chunks nearest ``query`` (unit length), nearest first."""
    sims = m.vectors @ query
    n = min(n, len(sims))
    best = np.argpartition(-sims, n - 1)[:n]
    best = best[np.argsort(-sims[best], kind="stable")]
    return [int(m.rowids[i]) for i in best]


Key = tuple[str, int]  # a chunk: its path and first line


def fuse(rankings: Sequence[Sequence[Key]]) -> list[tuple[Key, float]]:
    """Reciprocal rank fusion of best-first rankings: each key and its score, best first."""
    scores: dict[Key, float] = {}
    for ranking in rankings:
        for rank, key in enumerate(ranking):
            scores[key] = scores.get(key, 0.0) + 1.0 / (RRF_K + rank + 1)
    return sorted(scores.items(), key=lambda kv: -kv[1])
