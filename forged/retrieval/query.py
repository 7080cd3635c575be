"""Searching the indexes from the daemon: read-only, one SQLite connection per thread.

The daemon searches in worker threads (``trio.to_thread.run_sync`` under a bounded
limiter, in :mod:`forged.http.retrieve`), never on the event loop: a search over a large
index takes milliseconds of CPU, and a stream's next token must not wait behind it. An
SQLite connection may not cross threads, so each thread keeps its own per index, opened
read-only (``mode=ro``): the daemon never writes an index; ``forged index update`` does,
in one transaction, and readers keep seeing the previous version until it commits (the
index is in WAL mode: forged.retrieval.store).

Resource handling: a thread's connections live as long as the thread (trio's thread
cache keeps idle threads for a while, then they exit and the connections are closed
by the garbage collector). An index deleted or re-created under an open connection is
noticed by its file's inode, and the connection replaced.

Error handling: an unknown or invalid name raises ``IndexError_``.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from forged.retrieval import vectors
from forged.retrieval.errors import IndexError_
from forged.retrieval.store import Hit, IndexInfo, index_path, info_db, list_indexes, search_db
from forged.retrieval.vectors import Matrix

# Seconds a search waits for ``forged index update`` to commit before it fails.
BUSY_TIMEOUT = 5.0


class Searcher:
    """Searches the indexes in ``directory``; safe to call from many threads at once.

    Each index's vectors are read once per version of the index (its last update) and
    kept, shared by every thread: a version replaces the one before."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._local = threading.local()
        self._lock = threading.Lock()
        self._matrices: dict[str, tuple[tuple[int, str], Matrix | None]] = {}

    def search(self, name: str, query: str, k: int, focus: Sequence[str] = (),
               vector: bytes = b"", model: str = "") -> list[Hit]:
        """With ``vector`` (the query's, by the embedding model ``model``), BM25 is
        fused with the nearest chunks, if the index's vectors are that model's."""
        db = self._connection(name)
        matrix = self._matrix(name, db) if vector else None
        query_vector = np.frombuffer(vector, dtype="<f4")
        semantic = (matrix, query_vector) if matrix is not None and matrix.model == model \
            and matrix.vectors.shape[1] == len(query_vector) else None
        return search_db(db, query, k, focus, semantic)

    def _matrix(self, name: str, db: sqlite3.Connection) -> Matrix | None:
        version = (self._inode(name), _updated_at(db))
        with self._lock:
            held = self._matrices.get(name)
        if held is not None and held[0] == version:
            return held[1]
        matrix = vectors.load(db)  # outside the lock: another index's search goes on
        with self._lock:
            self._matrices[name] = (version, matrix)
        return matrix

    def _inode(self, name: str) -> int:
        try:
            return os.stat(index_path(self.directory, name)).st_ino
        except FileNotFoundError:  # removed since the search's connection was taken
            raise IndexError_(f"no index {name!r}") from None

    def infos(self) -> list[IndexInfo]:
        """Every index's name, source, size and last update, read-only; an index removed
        or replaced meanwhile is left out."""
        out = []
        for name in list_indexes(self.directory):
            try:
                out.append(info_db(self._connection(name), name))
            except (IndexError_, sqlite3.Error, OSError):  # OSError: removed meanwhile
                continue
        return out

    def exists(self, name: str) -> bool:
        return index_path(self.directory, name).is_file()

    def _connection(self, name: str) -> sqlite3.Connection:
        path = index_path(self.directory, name)
        try:
            inode = os.stat(path).st_ino
        except FileNotFoundError:
            with self._lock:  # its vectors go too (a large index's are 100s of MB)
                self._matrices.pop(name, None)
            raise IndexError_(f"no index {name!r}") from None
        held: dict[str, tuple[int, sqlite3.Connection]] = self._local.__dict__.setdefault(
            "connections", {})
        if name in held and held[name][0] == inode:
            return held[name][1]
        if name in held:
            held.pop(name)[1].close()
        db = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True,
                             timeout=BUSY_TIMEOUT, check_same_thread=True)
        held[name] = (inode, db)
        return db


def _updated_at(db: sqlite3.Connection) -> str:
    """What changes when chunks or vectors do: their commits' times."""
    rows = db.execute("SELECT value FROM meta WHERE key IN ('updated_at', 'vectors_at') "
                      "ORDER BY key").fetchall()
    return " ".join(str(r[0]) for r in rows)
