"""Hybrid retrieval (issue 36): chunks' vectors kept beside FTS5 in the index, embedded
only when missing, and a search that fuses BM25 with the nearest by meaning; then the
same through ``forged index add`` and ``/v1/retrieve`` with the tiny BERT."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import trio

from forged.engine import testhooks
from forged.engine.kvdisk import model_identity
from forged.indexembed import index_embedding
from forged.retrieval.errors import IndexError_
from forged.retrieval.query import Searcher
from forged.retrieval.store import Index, remove_index
from forged.retrieval.vectors import Embedding, fuse
from tests.conftest import DaemonFactory

# A stand-in model that knows two "meanings": texts about adding and texts about
# waiting, whatever words they use.
TOPICS = {"add": ("sum", "plus", "total", "add"), "wait": ("sleep", "pause", "wait")}


def concept(text: str) -> bytes:
    v = np.array([sum(text.count(w) for w in words) for words in TOPICS.values()]
                 + [0.01], dtype="<f4")
    return (v / np.linalg.norm(v)).astype("<f4").tobytes()


class Counting:
    def __init__(self, model: str = "concepts") -> None:
        self.texts: list[str] = []
        self.model = model

    def embedding(self) -> Embedding:
        return Embedding(self.model, self.embed, batch=2)

    def embed(self, texts: list[str]) -> list[bytes]:
        self.texts += texts
        return [concept(t) for t in texts]


def repo(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "maths.py").write_text("def combine(a, b):\n    # the sum of both\n"
                                   "    return a + b  # plus\n")
    (root / "timing.py").write_text("def hold(seconds):\n    # sleep a while\n"
                                    "    time.sleep(seconds)  # pause\n")
    (root / "other.py").write_text("def unrelated(x):\n    return x\n")
    return root


def vectors(idx: Index) -> int:
    return int(idx.db.execute("SELECT count(*) FROM vectors").fetchone()[0])


def test_chunks_are_embedded_once_and_again_only_when_they_change(tmp_path: Path) -> None:
    src = repo(tmp_path / "src")
    counting = Counting()
    with Index.create(tmp_path / "index", "demo", src) as idx:
        stats = idx.update(embedding=counting.embedding())
        assert stats.embedded == 3 == vectors(idx)
        assert all(t.split("\n")[0].endswith(".py") for t in counting.texts)  # path first
        assert idx.update(embedding=counting.embedding()).embedded == 0
        (src / "maths.py").write_text("def combine(a, b):\n    return a + b\n")
        (src / "other.py").unlink()
        stats = idx.update(embedding=counting.embedding())
        assert stats.embedded == 1 and vectors(idx) == 2
        assert counting.texts[-1].startswith("maths.py\n")
        # Another model's vectors are not comparable: all of them are made again.
        assert idx.update(embedding=Counting("other").embedding()).embedded == 2
        # Without an embedding model, an update leaves the vectors as they are.
        assert idx.update().embedded == 0 and vectors(idx) == 2


def test_a_search_by_meaning_finds_what_no_word_matches(tmp_path: Path) -> None:
    src = repo(tmp_path / "src")
    with Index.create(tmp_path / "index", "demo", src) as idx:
        idx.update(embedding=Counting().embedding())
    searcher = Searcher(tmp_path / "index")
    query = "total amount"  # no word of the code matches
    assert searcher.search("demo", query, 3) == []
    hits = searcher.search("demo", query, 3, vector=concept(query), model="concepts")
    assert hits[0].path == "maths.py"
    hits = searcher.search("demo", "wait a moment", 3, vector=concept("wait"),
                           model="concepts")
    assert hits[0].path == "timing.py"
    # A vector of another model than the index's is not used.
    assert searcher.search("demo", query, 3, vector=concept(query), model="x") == []


def test_an_index_embedded_in_part_is_searched_by_its_words_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A first embedding cut short (or under way, for hours on a large tree) left some
    chunks with vectors: searches fused BM25 with the nearest among those alone, and
    the files embedded first ranked above the rest."""
    src = repo(tmp_path / "src")
    monkeypatch.setattr("forged.retrieval.vectors.COMMIT_EVERY", 2)
    done: list[str] = []

    def cut_short(texts: list[str]) -> list[bytes]:
        if done:
            raise OSError("the model went away")
        done.extend(texts)
        return [concept(t) for t in texts]

    with Index.create(tmp_path / "index", "demo", src) as idx:
        with pytest.raises(OSError):
            idx.update(embedding=Embedding("concepts", cut_short, batch=2))
        assert 0 < vectors(idx) < 3
    query = "total amount"
    searcher = Searcher(tmp_path / "index")
    assert searcher.search("demo", query, 3, vector=concept(query), model="concepts") == []
    with Index.open(tmp_path / "index", "demo") as idx:
        idx.update(embedding=Counting().embedding())
    hits = searcher.search("demo", query, 3, vector=concept(query), model="concepts")
    assert hits[0].path == "maths.py"


def test_a_search_by_meaning_returns_as_many_hits_as_asked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each ranking was cut at FUSE_DEPTH (50): k = 150 gave at most 100 hits, fewer
    than BM25 alone gives."""
    src = repo(tmp_path / "src")
    with Index.create(tmp_path / "index", "demo", src) as idx:
        idx.update(embedding=Counting().embedding())
    monkeypatch.setattr("forged.retrieval.store.FUSE_DEPTH", 1)
    query = "combine hold unrelated"
    searcher = Searcher(tmp_path / "index")
    assert len(searcher.search("demo", query, 3)) == 3
    assert len(searcher.search("demo", query, 3, vector=concept(query), model="concepts")) == 3


def test_an_index_removed_during_a_search_by_meaning_is_no_index(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``forged index rm`` between the search's connection and its vectors' stat: a
    FileNotFoundError (a 500), where the search before it says "no index"."""
    src = repo(tmp_path / "src")
    with Index.create(tmp_path / "index", "demo", src) as idx:
        idx.update(embedding=Counting().embedding())
    searcher = Searcher(tmp_path / "index")
    stat, calls = os.stat, []

    def vanishing(path: Any, *args: Any, **kw: Any) -> os.stat_result:
        calls.append(path)  # the connection's stat sees the file; the vectors' does not
        if len(calls) > 1 and str(path).endswith("demo.sqlite3"):
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return stat(path, *args, **kw)

    monkeypatch.setattr(os, "stat", vanishing)
    with pytest.raises(IndexError_):
        searcher.search("demo", "sum", 3, vector=concept("sum"), model="concepts")


def test_a_removed_index_s_vectors_leave_the_daemons_memory(tmp_path: Path) -> None:
    """A 100,000-chunk index's matrix is about 150 MB: it stayed until a restart."""
    src = repo(tmp_path / "src")
    with Index.create(tmp_path / "index", "demo", src) as idx:
        idx.update(embedding=Counting().embedding())
    searcher = Searcher(tmp_path / "index")
    assert searcher.search("demo", "sum", 3, vector=concept("sum"), model="concepts")
    assert "demo" in searcher._matrices
    remove_index(tmp_path / "index" / "demo.sqlite3")
    with pytest.raises(IndexError_):
        searcher.search("demo", "sum", 3, vector=concept("sum"), model="concepts")
    assert "demo" not in searcher._matrices


def test_reciprocal_rank_fusion_puts_what_both_find_first() -> None:
    a, b, c = ("a.py", 1), ("b.py", 1), ("c.py", 1)
    fused = fuse([[a, b], [c, b]])
    assert [k for k, _ in fused] == [b, a, c]
    assert fused[0][1] > fused[1][1] == fused[2][1]


def test_the_searcher_reads_the_vectors_again_after_an_update(tmp_path: Path) -> None:
    src = repo(tmp_path / "src")
    with Index.create(tmp_path / "index", "demo", src) as idx:
        idx.update(embedding=Counting().embedding())
        searcher = Searcher(tmp_path / "index")
        q = concept("sleep")
        assert searcher.search("demo", "x", 1, vector=q, model="concepts")[0].path == \
            "timing.py"
        (src / "timing.py").unlink()
        idx.update(embedding=Counting().embedding())
        assert searcher.search("demo", "x", 1, vector=q, model="concepts")[0].path != \
            "timing.py"


def config_with_bert(tmp_path: Path, tiny_model: Path, tiny_bert: Path) -> Path:
    config = tmp_path / "forged.toml"
    config.write_text(f'[model]\npath = "{tiny_model}"\n[server]\nstate_dir = '
                      f'"{tmp_path / "state"}"\n[[models]]\npath = "{tiny_bert}"\n'
                      f'name = "bert"\n')
    return config


def test_index_add_embeds_with_the_configs_embedding_model(
        tmp_path: Path, tiny_model: Path, tiny_bert: Path) -> None:
    src = repo(tmp_path / "src")
    config = config_with_bert(tmp_path, tiny_model, tiny_bert)
    run = subprocess.run([sys.executable, "-m", "forged", "index", "add", "demo", str(src),
                          "--config", str(config)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert "3 chunks embedded" in run.stderr and "nice 19" in run.stderr
    with Index.open(tmp_path / "state" / "index", "demo") as idx:
        assert vectors(idx) == 3
        row = idx.db.execute("SELECT value FROM meta WHERE key = 'embed_model'").fetchone()
        assert row[0] == model_identity(str(tiny_bert))
    (src / "other.py").write_text("def changed(y):\n    return y\n")
    run = subprocess.run([sys.executable, "-m", "forged", "index", "update", "demo",
                          "--no-embed", "--config", str(config)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "embedded" not in run.stderr, run.stderr
    with Index.open(tmp_path / "state" / "index", "demo") as idx:
        assert vectors(idx) == 2  # the changed file's chunk waits for the next update


async def test_retrieve_fuses_meaning_when_the_daemon_serves_the_indexs_model(
        tmp_path: Path, tiny_model: Path, tiny_bert: Path,
        start_daemon: DaemonFactory) -> None:
    src = repo(tmp_path / "src")
    # Not at nice 19: that would stay with the test process.
    embedding = index_embedding(config_with_bert(tmp_path, tiny_model, tiny_bert), nice=0)
    assert embedding is not None
    with Index.create(tmp_path / "state" / "index", "demo", src) as idx:
        assert idx.update(embedding=embedding).embedded == 3
    query = "total amount"  # no word of the code: BM25 finds nothing
    with trio.fail_after(60):
        async with start_daemon(tiny_model, models=[{"path": str(tiny_bert),
                                                     "name": "bert"}]) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            r = await c.post("/v1/retrieve", json={"repo": "demo", "query": query, "k": 3})
            assert r.status_code == 200, r.text
            # The tiny BERT's weights are random: which chunk is nearest means nothing,
            # but that chunks are found by meaning at all shows the fusion ran.
            assert len(r.json()["data"]) == 3
            pool = d.daemon.models.resolve("bert", embed=True).pool
            assert pool.totals().embed_inputs == 1
            # A chat's question is searched by meaning too; the code around a cursor
            # (a completion with repo) by BM25 alone: no query embedded for it.
            r = await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": query}], "repo": "demo",
                "max_tokens": 1})
            assert r.status_code == 200 and r.json()["retrieved"], r.text
            assert pool.totals().embed_inputs == 2
            r = await c.post("/v1/completions", json={"prompt": "x = combine(",
                                                      "repo": "demo", "max_tokens": 1})
            assert r.status_code == 200, r.text
            assert pool.totals().embed_inputs == 2
        async with start_daemon(tiny_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            r = await c.post("/v1/retrieve", json={"repo": "demo", "query": query, "k": 3})
            assert r.status_code == 200 and r.json()["data"] == []  # BM25 alone


async def test_a_busy_embedding_model_leaves_bm25_alone_and_says_so(
        tmp_path: Path, tiny_model: Path, tiny_bert: Path,
        start_daemon: DaemonFactory) -> None:
    """The query's embedding waits at most server.door_timeout (the embedding worker may
    be busy with an index's calls), then the search goes on by BM25 alone: counted in
    forged_retrieval_bm25_alone_total, which nothing showed before (a log line at info
    level, and none at all on the timeout)."""
    src = repo(tmp_path / "src")
    embedding = index_embedding(config_with_bert(tmp_path, tiny_model, tiny_bert), nice=0)
    assert embedding is not None
    with Index.create(tmp_path / "state" / "index", "demo", src) as idx:
        idx.update(embedding=embedding)
    with trio.fail_after(60):
        async with start_daemon(tiny_model, server={"door_timeout": 0.5},
                                models=[{"path": str(tiny_bert), "name": "bert"}]) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            testhooks.hang_worker(d.daemon.models.resolve("bert", embed=True).pool, 0, 3.0)
            r = await c.post("/v1/retrieve", json={"repo": "demo", "query": "total amount",
                                                   "k": 3})
            assert r.status_code == 200 and r.json()["data"] == []  # BM25 finds nothing
            assert d.daemon.state is not None
            assert d.daemon.state.metrics.registry.get_sample_value(
                "forged_retrieval_bm25_alone_total", {"reason": "timeout"}) == 1
