"""One repository's index: an SQLite file with an FTS5 table of chunks.

Each index is ``<directory>/<NAME>.sqlite3`` (the daemon's directory is
``server.state_dir/index``). It remembers its source folder, and for every file a
version: the git blob id for a file that is clean in a git work tree, otherwise
``size:mtime_ns``. ``update`` lists the source, compares versions, and re-chunks only
the files whose version changed, so an unchanged repository costs one ``git
ls-files`` and one table read.

Ranking is FTS5's BM25 over four columns: the identifiers a chunk defines (heaviest),
its path's words, and the identifiers it uses. Identifiers are stored split into
lowercase words (``open_nursery`` and ``openNursery`` both become ``open nursery``),
and queries are split the same way, so either spelling finds the other.

Error handling: a name that is not a plain file name, or an index that does not
exist, raises ``IndexError_`` with a message meant for the admin.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from forged.retrieval.chunking import chunk_file, identifiers, search_words, split_words
from forged.retrieval.errors import IndexError_
from forged.retrieval.source import SourceTree, list_source, open_root
from forged.retrieval.vectors import (
    FUSE_DEPTH,
    VECTORS_SCHEMA,
    Embedding,
    Matrix,
    embed_missing,
    forget,
    fuse,
    nearest,
)

MAX_FILE_BYTES = 1 << 20
# bm25() weights, one per column of ``chunks`` in order; UNINDEXED columns get 0.
WEIGHTS = (0.0, 0.0, 0.0, 0.0, 10.0, 3.0, 1.0)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS files (
    path TEXT PRIMARY KEY, version TEXT NOT NULL, chunks INTEGER NOT NULL,
    skipped TEXT, indexed_at REAL NOT NULL, first_row INTEGER);
CREATE VIRTUAL TABLE IF NOT EXISTS chunks USING fts5(
    path UNINDEXED, start_line UNINDEXED, end_line UNINDEXED, text UNINDEXED,
    defines, path_words, uses, tokenize = 'unicode61');
CREATE VIRTUAL TABLE IF NOT EXISTS chunks_vocab USING fts5vocab(chunks, 'row');
-- How many chunks hold each word, refreshed by every update that changed something:
-- a search keeps its rarest words (fts5vocab counts by reading a word's whole list).
CREATE TABLE IF NOT EXISTS terms (term TEXT PRIMARY KEY, docs INTEGER NOT NULL)
    WITHOUT ROWID;
""" + VECTORS_SCHEMA
# A search scores every chunk that holds any of its words: only the rarest few are kept
# (the code around a cursor has dozens of identifiers, and the common ones weigh ~0 in
# BM25 while costing the most).
MAX_QUERY_TERMS = 12
# Chunks whose ``defines`` hold a focus name's words, read to find the one that
# defines the name itself (its tests and namesakes hold the words too).
DEFINITION_CANDIDATES = 50
MAX_POSTINGS = 20_000


@dataclass(frozen=True)
class Hit:
    path: str
    start_line: int
    end_line: int
    score: float
    text: str


@dataclass(frozen=True)
class UpdateStats:
    files: int  # files listed in the source, skipped ones included
    rechunked: int  # files read and chunked again
    removed: int  # files gone from the source
    seconds: float
    embedded: int = 0  # chunks given a vector
    embed_seconds: float = 0.0  # of ``seconds``


@dataclass(frozen=True)
class IndexInfo:
    name: str
    source: str
    files: int
    chunks: int
    size: int  # bytes of the database file
    updated_at: float | None


def index_path(directory: Path, name: str) -> Path:
    if not _NAME.fullmatch(name):
        raise IndexError_(f"index name {name!r}: use letters, digits, '.', '_' or '-'")
    return directory / f"{name}.sqlite3"


def list_indexes(directory: Path) -> list[str]:
    return sorted(p.stem for p in directory.glob("*.sqlite3")) if directory.is_dir() else []


class Index:
    """Resource handling: holds one SQLite connection; use as a context manager."""

    def __init__(self, db: sqlite3.Connection, name: str, source: Path) -> None:
        self.db, self.name, self.source = db, name, source
        db.executescript(SCHEMA)  # what an older index lacks (IF NOT EXISTS throughout)
        # FTS merges of a large build touch many pages: a cache of 64 MiB, not 2.
        db.execute("PRAGMA cache_size = -65536")
        columns = [row[1] for row in db.execute("PRAGMA table_info(files)")]
        if "first_row" not in columns:  # an index made before first_row existed
            with db:
                db.execute("ALTER TABLE files ADD COLUMN first_row INTEGER")

    @classmethod
    def create(cls, directory: Path, name: str, source: Path) -> Index:
        path = index_path(directory, name)
        if path.exists():
            raise IndexError_(f"index {name!r} exists already ({path})")
        if not source.is_dir():
            raise IndexError_(f"{source}: not a directory")
        remove_index(path)  # a log left by a database removed by hand
        # The folder as it is now, symlinks resolved: later updates read that folder
        # and refuse a path that has come to pass through a symlink since.
        source = source.resolve()
        os.close(open_root(source))  # reachable without a symlink, or the error says why
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # as the daemon's user: the state folder is not its own
            raise IndexError_(f"{directory}: cannot create: {exc.strerror}") from exc
        db = _connect(path)
        db.executescript(SCHEMA)
        with db:
            db.execute("INSERT INTO meta VALUES ('source', ?)", (str(source),))
        return cls(db, name, source)

    @classmethod
    def open(cls, directory: Path, name: str) -> Index:
        path = index_path(directory, name)
        if not path.exists():
            raise IndexError_(f"no index {name!r} in {directory}")
        db = _connect(path)
        row = db.execute("SELECT value FROM meta WHERE key = 'source'").fetchone()
        return cls(db, name, Path(row[0]))

    def __enter__(self) -> Index:
        return self

    def __exit__(self, *exc: object) -> None:
        self.db.close()

    def update(self, max_bytes: int = MAX_FILE_BYTES,
               progress: Callable[[int, int], None] | None = None,
               embedding: Embedding | None = None,
               embed_progress: Callable[[int, int], None] | None = None) -> UpdateStats:
        """Bring the index in line with its source; ``progress(done, total)`` after
        each file read and chunked again. With ``embedding``, every chunk without a
        vector gets one (``embed_progress`` after each batch), once the chunks are in."""
        t0 = time.monotonic()
        # Every file is read through the folder's descriptor, never by path
        # (forged.retrieval.source): nothing outside the folder is ever read.
        with SourceTree(self.source) as tree:
            listed = dict(list_source(tree))
            known = dict(self.db.execute("SELECT path, version FROM files"))
            gone = [p for p in known if p not in listed]
            changed = [p for p, v in listed.items() if known.get(p) != v]
            with self.db:  # one transaction: a crash leaves the previous index intact
                for path in gone:
                    self._forget(path)
                for done, path in enumerate(changed, 1):
                    self._forget(path)
                    self._add(tree, path, listed[path], max_bytes)
                    if progress is not None:
                        progress(done, len(changed))
                if gone or changed or not self._has_terms():
                    self.db.execute("DELETE FROM terms")
                    self.db.execute("INSERT INTO terms SELECT term, doc FROM chunks_vocab")
                self.db.execute("INSERT OR REPLACE INTO meta VALUES ('updated_at', ?)",
                                (repr(time.time()),))
        # After the chunks' commit, in transactions of its own (forged.retrieval.vectors).
        embedded = embed_missing(self.db, embedding, embed_progress) \
            if embedding is not None else None
        return UpdateStats(len(listed), len(changed), len(gone), time.monotonic() - t0,
                           embedded.chunks if embedded else 0,
                           embedded.seconds if embedded else 0.0)

    def _has_terms(self) -> bool:
        return self.db.execute("SELECT 1 FROM terms LIMIT 1").fetchone() is not None

    def _forget(self, path: str) -> None:
        # A file's chunks have consecutive rowids from its first_row: deleting that range
        # is a lookup. By path it would scan the whole table (path is UNINDEXED), once
        # per file: a 20,000-file build took more than 8 minutes that way.
        row = self.db.execute("SELECT first_row, chunks FROM files WHERE path = ?",
                              (path,)).fetchone()
        if row is None:
            return
        first, n = row
        if first is None:  # recorded before first_row existed (and before vectors)
            self.db.execute("DELETE FROM chunks WHERE path = ?", (path,))
        elif n:
            self.db.execute("DELETE FROM chunks WHERE rowid >= ? AND rowid < ?",
                            (first, first + n))
            forget(self.db, first, n)
        self.db.execute("DELETE FROM files WHERE path = ?", (path,))

    def _add(self, tree: SourceTree, path: str, version: str, max_bytes: int) -> None:
        data, skipped = tree.read(path, max_bytes)
        chunks = chunk_file(path, data.decode("utf-8", "replace")) if data is not None else []
        words = split_words(path.replace("/", " ").replace(".", " ").split())
        first = self.db.execute("SELECT coalesce(max(rowid), 0) + 1 FROM chunks_content"
                                ).fetchone()[0]
        self.db.executemany(
            "INSERT INTO chunks (rowid, path, start_line, end_line, text, defines, "
            "path_words, uses) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            [(first + i, c.path, c.start_line, c.end_line, c.text, split_words(c.defines),
              words, split_words(c.uses)) for i, c in enumerate(chunks)])
        self.db.execute("INSERT INTO files (path, version, chunks, skipped, indexed_at, "
                        "first_row) VALUES (?, ?, ?, ?, ?, ?)",
                        (path, version, len(chunks), skipped, time.time(), first))

    def search(self, query: str, limit: int = 10, focus: Sequence[str] = ()) -> list[Hit]:
        return search_db(self.db, query, limit, focus)

    def info(self) -> IndexInfo:
        return info_db(self.db, self.name)


def remove_index(path: Path) -> None:
    """The index's file and its WAL's: a log left behind would be replayed into a new
    index of the same name. The database goes first (a search then finds no index)."""
    for suffix in ("", "-wal", "-shm"):
        path.with_name(path.name + suffix).unlink(missing_ok=True)


def _connect(path: Path) -> sqlite3.Connection:
    """A writer's connection, the file in WAL mode (kept in the file): the daemon's
    searches read the last committed version while an update writes. With a rollback
    journal, an update past the page cache locked them out until its commit, and one
    killed meanwhile left a hot journal that only a writer can roll back."""
    db = sqlite3.connect(path)
    db.execute("PRAGMA journal_mode = WAL")
    return db


def info_db(db: sqlite3.Connection, name: str) -> IndexInfo:
    """What ``forged index list`` and the status page say of an index."""
    files, chunks = db.execute(
        "SELECT count(*), coalesce(sum(chunks), 0) FROM files WHERE skipped IS NULL"
    ).fetchone()
    meta = dict(db.execute("SELECT key, value FROM meta WHERE key IN ('source', "
                           "'updated_at')").fetchall())
    size = sum(Path(p).stat().st_size for _, _, p in db.execute("PRAGMA database_list")
               if p)
    updated = meta.get("updated_at")
    return IndexInfo(name, str(meta.get("source", "")), files, chunks, size,
                     float(updated) if updated else None)


# A query's vector and the index's vectors (of the same model) to search with.
Semantic = tuple[Matrix, npt.NDArray[np.float32]]


def search_db(db: sqlite3.Connection, query: str, limit: int,
              focus: Sequence[str] = (), semantic: Semantic | None = None) -> list[Hit]:
    """The ``limit`` best chunks of an index's database for ``query``, best first.

    ``focus``: names whose definitions come first (the name being called at a cursor:
    what a completion most needs to see), up to ``limit // 2 + 1`` of them, then the
    rest by BM25 over the whole query, fused with the nearest by meaning when
    ``semantic`` is given (forged.retrieval.vectors)."""
    first = _definitions(db, focus, limit // 2 + 1) if focus else []
    seen = {(h.path, h.start_line) for h in first}
    words = fts_query(rarest(db, query_words(query)))
    ranked = _ranked(db, words, limit) if semantic is None else \
        _hybrid(db, words, semantic, max(FUSE_DEPTH, limit))
    rest = [h for h in ranked if (h.path, h.start_line) not in seen]
    return (first + rest)[:limit]


def _hybrid(db: sqlite3.Connection, words: str, semantic: Semantic, depth: int
            ) -> list[Hit]:
    """Each ranking ``depth`` deep: FUSE_DEPTH, or as many as asked for if more."""
    lexical = _ranked(db, words, depth)
    rowids = nearest(semantic[0], semantic[1], depth)
    marks = ", ".join("?" * len(rowids))
    rows = {r: Hit(p, int(s), int(e), 0.0, t) for r, p, s, e, t in db.execute(
        f"SELECT rowid, path, start_line, end_line, text FROM chunks WHERE rowid IN "
        f"({marks})", rowids)} if rowids else {}
    near = [rows[r] for r in rowids if r in rows]
    hits = {(h.path, h.start_line): h for h in [*near, *lexical]}
    fused = fuse([[(h.path, h.start_line) for h in lexical],
                  [(h.path, h.start_line) for h in near]])
    return [dataclasses.replace(hits[k], score=score) for k, score in fused]


def _ranked(db: sqlite3.Connection, match: str, limit: int) -> list[Hit]:
    if not match:
        return []
    weights = ", ".join(str(w) for w in WEIGHTS)
    rows = db.execute(
        f"SELECT path, start_line, end_line, bm25(chunks, {weights}) AS r, text "
        "FROM chunks WHERE chunks MATCH ? ORDER BY r LIMIT ?", (match, limit))
    # bm25() is lower-is-better and negative; report higher-is-better.
    return [Hit(p, int(s), int(e), -r, t) for p, s, e, r, t in rows]


def _definitions(db: sqlite3.Connection, focus: Sequence[str], limit: int) -> list[Hit]:
    """Up to ``limit`` chunks for the focus names: first those that define a name
    itself (its ``def``, ``class`` or assignment in the text), the nearest name's
    first; then the rest that define its words. By the words alone, tests named after
    a class (``test_cancel_scope_repr``, short ``defines``) outranked the class itself
    (a long ``defines``: its members), and a qualifier (``_core`` in
    ``_core.CancelScope(``) weighed as much as the name: on trio's call sites 119 of
    400 definitions were missed."""
    found: dict[tuple[str, int], Hit] = {}
    for name in focus:
        defines = _definition_line(name)
        for h in _ranked(db, _defining([name]), DEFINITION_CANDIDATES):
            if defines.search(h.text):
                found.setdefault((h.path, h.start_line), h)
    for h in _ranked(db, _defining(focus), limit):
        found.setdefault((h.path, h.start_line), h)
    return list(found.values())[:limit]


def _definition_line(name: str) -> re.Pattern[str]:
    """A line that defines ``name`` in Python: ``def``, ``async def``, ``class``, or an
    assignment (annotated or not); indented too (methods, class attributes)."""
    n = re.escape(name)
    return re.compile(rf"^[ \t]*(?:(?:async[ \t]+)?def|class)[ \t]+{n}\b"
                      rf"|^[ \t]*{n}[ \t]*(?::[^=\n]*)?=(?!=)", re.M)


def _defining(names: Sequence[str]) -> str:
    """An FTS5 query for chunks defining any of ``names``: each name's words as a
    phrase in the ``defines`` column."""
    phrases = dict.fromkeys(" ".join(search_words(n)) for n in names)
    return " OR ".join(f'defines : "{p}"' for p in phrases if p)


def cursor_names(prefix: str, n: int = 2) -> list[str]:
    """The last ``n`` identifiers on the cursor's line, the nearest first: after
    ``x = open_nursery(``, the name whose definition the completion wants."""
    # The last line alone is split off, however long the prefix (a final newline starts
    # no line: a cursor at a line's start looks at the line above).
    last = prefix.removesuffix("\n").rsplit("\n", 1)[-1]
    return identifiers(last)[-n:][::-1]


def query_words(query: str) -> list[str]:
    """The query's identifiers' words, once each, in order, stop words left out."""
    return list(dict.fromkeys(w for name in identifiers(query) for w in search_words(name)))


def rarest(db: sqlite3.Connection, words: list[str]) -> list[str]:
    """The words in fewest chunks, at most ``MAX_QUERY_TERMS``, while the chunks they
    are in stay under ``MAX_POSTINGS`` together (the rarest one always); words in no
    chunk are dropped. A search's cost is the chunks it scores: this bounds it."""
    if not words:
        return []
    marks = ", ".join("?" * len(words))
    try:
        docs = dict(db.execute(f"SELECT term, docs FROM terms WHERE term IN ({marks})",
                               words))
    except sqlite3.OperationalError:  # an index from before `terms`: until its update
        return words[:MAX_QUERY_TERMS]
    kept: list[str] = []
    total = 0
    for w in sorted((w for w in words if w in docs), key=lambda w: docs[w]):
        if kept and (len(kept) == MAX_QUERY_TERMS or total + docs[w] > MAX_POSTINGS):
            break
        kept.append(w)
        total += docs[w]
    return kept


def fts_query(words: list[str]) -> str:
    """Any of ``words``, each quoted so FTS5 syntax cannot leak in."""
    return " OR ".join(f'"{w}"' for w in words)
