"""Retrieval through the API: ``/v1/retrieve`` (paths, line ranges, errors, per-key
access), retrieval-augmented infill, completions and chat on the tiny FIM model, the
search kept off the event loop while streams decode, and an index across a restart."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio

from forged.auth import add_key
from forged.http import retrieve as rt
from forged.http.infill import InfillRequest, infill_context, infill_tokens
from forged.http.state import AppState
from forged.retrieval.store import Index, cursor_names
from tests.conftest import DaemonFactory

NURSERY = '''"""Nurseries."""


def open_nursery(strict: bool) -> int:
    """Open one."""
    return 1 if strict else 0


class TaskGroup:
    def start_soon(self, fn: object) -> None:
        pass
'''
CALLER = "def main() -> int:\n    return open_nursery(False)\n"


def make_repo(root: Path, n_filler: int = 0) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "nursery.py").write_text(NURSERY)
    (root / "caller.py").write_text(CALLER)
    for i in range(n_filler):  # more to search through: other names, same words
        (root / f"filler_{i}.py").write_text(
            "".join(f"def helper_{i}_{j}(task_group, nursery_size):\n"
                    f"    return task_group.spawn(nursery_size + {j})\n\n"
                    for j in range(20)))
    return root


def index(tmp_path: Path, name: str = "demo", n_filler: int = 0) -> None:
    src = make_repo(tmp_path / f"src-{name}", n_filler)
    with Index.create(tmp_path / "state" / "index", name, src) as idx:
        idx.update()


def state_of(d: Any) -> AppState:
    state = d.daemon.state
    assert state is not None
    return state  # type: ignore[no-any-return]


async def test_retrieve_returns_paths_and_line_ranges(
        tiny_model: Path, tmp_path: Path, start_daemon: DaemonFactory) -> None:
    index(tmp_path)
    with trio.fail_after(60):
        async with start_daemon(tiny_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            r = await c.post("/v1/retrieve", json={"repo": "demo", "query": "openNursery",
                                                   "k": 3})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["repo"] == "demo"
            first = body["data"][0]
            # The definition, ranked above its use in caller.py.
            assert (first["path"], first["start_line"], first["end_line"]) == \
                ("nursery.py", 4, 6)
            assert first["text"].startswith("def open_nursery(")
            assert [h["path"] for h in body["data"]][:2] == ["nursery.py", "caller.py"]
            assert body["data"][0]["score"] >= body["data"][1]["score"]


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"repo": "nope", "query": "x"}, 404, "repo"),
    ({"repo": "../etc", "query": "x"}, 400, "repo"),
    ({"query": "x"}, 400, "repo"),  # no repo, and no key with a default
    ({"repo": "demo", "query": ""}, 400, "query"),
    ({"repo": "demo", "query": "x", "k": 0}, 400, "k"),
    ({"repo": "demo", "query": "x", "k": 51}, 400, "k"),  # over retrieval.max_k
    ({"repo": "demo"}, 400, None),
    ({"repo": "demo", "query": "x", "top_k": 3}, 400, None),  # unknown: never ignored
])
async def test_retrieve_refuses_bad_input_with_an_openai_error(
        tiny_model: Path, tmp_path: Path, start_daemon: DaemonFactory,
        body: dict[str, Any], status: int, param: str | None) -> None:
    index(tmp_path)
    with trio.fail_after(60):
        async with start_daemon(tiny_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            r = await c.post("/v1/retrieve", json=body)
            assert r.status_code == status, r.text
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["message"]
            if param is not None:
                assert err["param"] == param


async def test_a_key_limited_to_some_repos_gets_403_for_others(
        tiny_model: Path, tmp_path: Path, start_daemon: DaemonFactory) -> None:
    index(tmp_path, "demo")
    index(tmp_path, "other")
    keys = tmp_path / "keys.toml"
    limited = add_key(keys, "team-a", max_streams=4, max_queued=4, priority="interactive",
                      repos=["demo"], default_repo="demo")
    open_key = add_key(keys, "admin", max_streams=4, max_queued=4, priority="interactive")
    with trio.fail_after(60):
        async with start_daemon(tiny_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            async def ask(key: str, **body: Any) -> httpx.Response:
                return await c.post("/v1/retrieve", json={"query": "open_nursery", **body},
                                    headers={"Authorization": f"Bearer {key}"})

            assert (await ask(limited, repo="demo")).status_code == 200
            r = await ask(limited, repo="other")
            assert r.status_code == 403, r.text
            assert r.json()["error"]["code"] == "permission_denied"
            r = await ask(limited)  # its default_repo
            assert r.status_code == 200 and r.json()["repo"] == "demo"
            assert (await ask(open_key, repo="other")).status_code == 200
            assert (await ask(open_key)).status_code == 400  # no default: name one


def infill_body(**kw: Any) -> dict[str, Any]:
    return {"input_prefix": "def run():\n    n = ", "input_suffix": "\n    return n\n",
            "prompt": "open_nursery(", "n_predict": 4, "temperature": 0,
            "input_extra": [{"filename": "notes.txt", "text": "editor's own chunk\n"}], **kw}


async def test_a_rag_infill_prompt_holds_the_chunk_within_budget(
        fim_model: Path, tmp_path: Path, start_daemon: DaemonFactory) -> None:
    index(tmp_path)
    budget = 150  # room for the definition, not for the caller too
    with trio.fail_after(60):
        async with start_daemon(fim_model, retrieval={"context_tokens": budget}) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            state = state_of(d)
            req = msgspec.convert(infill_body(repo="demo"), InfillRequest)
            found = await infill_context(state, state.models.default, req, None)
            assert found is not None
            # The query: the identifiers of the lines around the cursor.
            query = "def run():\n    n = open_nursery(\n\n    return n"
            assert rt.query_around(req.input_prefix + req.prompt,  # type: ignore[operator]
                                   req.input_suffix, 8) == query  # type: ignore[arg-type]
            # The name at the cursor, whose definition comes first.
            focus = ["open_nursery", "n"]
            assert cursor_names("def run():\n    n = open_nursery(") == focus
            ranked = await rt.search(state, "demo", query, 4, focus)
            assert [h.path for h in ranked][:2] == ["nursery.py", "caller.py"]
            sizes = [rt.chunk_tokens(state.models.default.prompter, h) for h in ranked]
            assert sizes[0] <= budget < sizes[0] + sizes[1], sizes  # the premise
            # The best chunk first; the caller's left out whole (smaller ones may fit).
            assert found.hits[0] == ranked[0] and ranked[1] not in found.hits
            used = sum(rt.chunk_tokens(state.models.default.prompter, h) for h in found.hits)
            assert used <= budget
            with_rag = await infill_tokens(state, state.models.default, req, found)
            plain = await infill_tokens(state, state.models.default, req)
            chunk = state.models.default.prompter.tokenize(found.hits[0].text, add_special=False,
                                            parse_special=False)
            assert _contains(with_rag, chunk) and not _contains(plain, chunk)
            # The extra files (FIM_SEP, path line, text each) are all that was added.
            assert len(with_rag) - len(plain) == used
            r = await c.post("/infill", json=infill_body(repo="demo"))
            assert r.status_code == 200, r.text
            served = r.json()
            assert served["tokens_evaluated"] == len(with_rag)
            assert served["retrieved"] == found.named()
            assert served["retrieved"][0]["start_line"] == 4
            r = await c.post("/infill", json=infill_body())
            assert r.json()["tokens_evaluated"] == len(plain)
            assert "retrieved" not in r.json()


def _contains(ids: list[int], part: list[int]) -> bool:
    return any(ids[i:i + len(part)] == part for i in range(len(ids) - len(part) + 1))


async def test_completions_and_chat_name_the_chunks_they_used(
        fim_model: Path, tmp_path: Path, start_daemon: DaemonFactory) -> None:
    index(tmp_path)
    with trio.fail_after(60):
        async with start_daemon(fim_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            common = {"max_tokens": 2, "temperature": 0, "repo": "demo"}
            r = await c.post("/v1/completions", json={"prompt": "x = open_nursery(",
                                                      **common})
            assert r.status_code == 200, r.text
            plain = await c.post("/v1/completions", json={
                "prompt": "x = open_nursery(", "max_tokens": 2, "temperature": 0})
            assert r.json()["usage"]["prompt_tokens"] > plain.json()["usage"]["prompt_tokens"]
            assert r.json()["retrieved"][0]["path"] == "nursery.py"
            assert "retrieved" not in plain.json()
            r = await c.post("/v1/completions", json={"prompt": "x = open_nursery(",
                                                      "suffix": "\n", **common})
            assert r.status_code == 200 and r.json()["retrieved"][0]["path"] == "nursery.py"
            r = await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "where is open_nursery?"}],
                "stream": True, **common})
            assert r.status_code == 200, r.text
            assert '"retrieved":[{"repo":"demo","path":"nursery.py"' in r.text
            r = await c.post("/v1/completions", json={"prompt": [1, 2, 3], **common})
            assert r.status_code == 400 and r.json()["error"]["param"] == "repo"


def test_chat_context_joins_a_leading_system_message() -> None:
    from forged.http.schemas import ChatMessage, ChatRequest
    from forged.retrieval.store import Hit

    found = rt.Retrieved("demo", [Hit("a.py", 1, 2, 1.0, "def f(): pass")])
    req = ChatRequest(messages=[ChatMessage(role="system", content="Be brief."),
                                ChatMessage(role="user", content="f?")])
    out = rt.chat_with_context(req, found)
    assert len(out.messages) == 2 and out.messages[0].content is not None
    assert out.messages[0].content.startswith("Be brief.\n\nCode from the repository demo")
    assert "a.py (lines 1-2):\n```\ndef f(): pass\n```" in str(out.messages[0].content)
    bare = ChatRequest(messages=[ChatMessage(role="user", content="f?")])
    assert rt.chat_with_context(bare, found).messages[0].role == "system"
    assert rt.chat_with_context(bare, rt.Retrieved("demo", [])) is bare


async def test_searches_run_in_threads_while_streams_decode(
        tiny_model: Path, tmp_path: Path, start_daemon: DaemonFactory) -> None:
    """100 concurrent /v1/retrieve calls beside 16 decoding streams: every search runs
    off the event loop's thread, and no stream's gap between tokens grows past a bound
    far above a tiny-model step (the ITL bound of test_api's streams)."""
    index(tmp_path, n_filler=200)
    loop_thread = threading.get_ident()
    threads: set[int] = set()
    with trio.fail_after(120):
        async with start_daemon(tiny_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=60,
                                  limits=httpx.Limits(max_connections=200)) as c:
            searcher = state_of(d).searcher
            search = searcher.search

            def recorded(*args: Any) -> Any:
                threads.add(threading.get_ident())
                return search(*args)

            searcher.search = recorded  # type: ignore[method-assign]
            gaps: list[float] = []
            statuses: list[int] = []

            async def stream() -> None:
                body = {"prompt": "once upon", "max_tokens": 48, "temperature": 0,
                        "ignore_eos": True, "stream": True}
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    last = None
                    async for line in r.aiter_lines():
                        now = time.monotonic()
                        if line.startswith("data: ") and last is not None:
                            gaps.append(now - last)
                        last = now

            async def ask() -> None:
                r = await c.post("/v1/retrieve", json={
                    "repo": "demo", "query": "task_group nursery_size spawn helper", "k": 20})
                statuses.append(r.status_code)

            async with trio.open_nursery() as n:
                for _ in range(16):
                    n.start_soon(stream)
                await trio.sleep(0.2)
                for _ in range(100):
                    n.start_soon(ask)
    assert statuses == [200] * 100
    assert threads and loop_thread not in threads
    assert len(gaps) > 16 * 10 and max(gaps) < 2.0


async def test_an_index_survives_a_daemon_restart(
        tiny_model: Path, tmp_path: Path, start_daemon: DaemonFactory) -> None:
    index(tmp_path)
    answers = []
    with trio.fail_after(90):
        for _ in range(2):
            async with start_daemon(tiny_model) as d, \
                    httpx.AsyncClient(base_url=d.url, timeout=30) as c:
                r = await c.post("/v1/retrieve", json={"repo": "demo", "query": "TaskGroup"})
                assert r.status_code == 200, r.text
                answers.append(r.json()["data"])
    assert answers[0] == answers[1] and answers[0][0]["path"] == "nursery.py"


async def test_searches_see_the_previous_version_while_a_large_update_writes(
        tiny_model: Path, tmp_path: Path, start_daemon: DaemonFactory,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An update larger than SQLite's page cache spills into the file: with a rollback
    journal it then held an exclusive lock to its commit, and every search waited
    BUSY_TIMEOUT and failed (503) for the rest of the build. The index's WAL lets
    searches read the last committed version meanwhile."""
    index(tmp_path)
    monkeypatch.setattr("forged.retrieval.query.BUSY_TIMEOUT", 0.05)
    writer = Index.open(tmp_path / "state" / "index", "demo").db
    with trio.fail_after(60):
        async with start_daemon(tiny_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            writer.execute("PRAGMA cache_size = 10")
            writer.execute("BEGIN")
            writer.executemany("INSERT INTO meta VALUES (?, ?)",
                               ((f"filler-{i}", "x" * 1000) for i in range(5000)))
            try:
                r = await c.post("/v1/retrieve", json={"repo": "demo", "query": "nursery"})
                assert r.status_code == 200, r.text
                assert r.json()["data"][0]["path"] == "nursery.py"
            finally:
                writer.rollback()
    writer.close()


async def test_a_damaged_index_is_a_503_naming_it_not_a_500(
        tiny_model: Path, tmp_path: Path, start_daemon: DaemonFactory) -> None:
    index(tmp_path)
    (tmp_path / "state" / "index" / "bad.sqlite3").write_bytes(b"not a database" * 100)
    with trio.fail_after(60):
        async with start_daemon(tiny_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            r = await c.post("/v1/retrieve", json={"repo": "bad", "query": "nursery"})
            assert r.status_code == 503 and "'bad'" in r.json()["error"]["message"], r.text
            r = await c.post("/v1/retrieve", json={"repo": "demo", "query": "nursery"})
            assert r.status_code == 200


async def test_an_index_locked_by_an_update_is_a_503_not_a_500(
        fim_model: Path, tmp_path: Path, start_daemon: DaemonFactory,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A large first build spills its cache into the file and locks readers out until
    it commits: a search then fails with a retry, and a completion goes on without
    context (it was an unhandled sqlite3 error: a 500)."""
    index(tmp_path)
    monkeypatch.setattr("forged.retrieval.query.BUSY_TIMEOUT", 0.05)
    writer = sqlite3.connect(tmp_path / "state" / "index" / "demo.sqlite3")
    with trio.fail_after(60):
        async with start_daemon(fim_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            # In WAL, only a writer in exclusive locking mode locks readers out.
            writer.execute("PRAGMA locking_mode = EXCLUSIVE")
            writer.execute("BEGIN EXCLUSIVE")
            try:
                r = await c.post("/v1/retrieve", json={"repo": "demo", "query": "nursery"})
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "unavailable"
                assert "Retry-After" in r.headers
                r = await c.post("/infill", json=infill_body(repo="demo"))
                assert r.status_code == 200 and r.json()["retrieved"] == []
            finally:
                writer.rollback()
                writer.close()  # an exclusive locking mode holds the lock until then
            r = await c.post("/v1/retrieve", json={"repo": "demo", "query": "open_nursery"})
            assert r.status_code == 200 and r.json()["data"]


class _WholeSplitRefused(str):
    """A prefix that refuses to be split whole: the query around a cursor needs its
    last lines only, and splitting a 4 MiB prefix held the event loop 30-60 ms."""

    def splitlines(self, keepends: bool = False) -> list[str]:
        raise AssertionError("the whole text was split")

    def split(self, sep: str | None = None, maxsplit: int = -1) -> list[str]:
        assert maxsplit >= 0, "the whole text was split"
        return str.split(self, sep, maxsplit)


async def test_the_query_around_a_cursor_reads_only_the_lines_it_needs() -> None:
    prefix = _WholeSplitRefused("import os\n" * 1000 + "def run():\r\n    n = open_nursery(")
    suffix = _WholeSplitRefused("\n    return n\n" + "x = 1\n" * 1000)
    assert rt.query_around(prefix, suffix, 2) == "def run():\n    n = open_nursery(\n\n    return n"
    assert cursor_names(prefix) == ["open_nursery", "n"]
