"""The repository index (issue 15): build speed, re-index, query latency, recall@5.

``python -m bench.retrieval`` (about 10 minutes on 2 cores; ``--no-latency`` skips the
daemon part). Nothing is downloaded; every input is code already on this machine that
nobody here wrote:

* **Build.** A git work tree of ``--files`` (20,000) files, assembled from the package
  sources installed here: the virtualenv's site-packages, Debian's Python 3.11
  standard library (``/usr/lib/python3.11``) and pyenv's (in that order, sorted, caches
  left out, the first ``--files`` taken). ``Index.create`` + ``update``, as ``forged
  index add`` runs them, timed from start to commit. Target: at most 3 minutes.
* **Re-index.** ``update`` of the unchanged tree (``forged index update``). Target:
  at most 10 s.
* **Recall@5.** Queries from real call sites of a pinned package (``PACKAGE``): for each
  call of a name the package defines exactly once, the query is what an infill would
  send with the cursor just after ``name(`` (the ``retrieval.query_lines`` lines before
  and after, through ``forged.http.retrieve.query_around``), and the answer is the chunk
  holding the definition's first line. Calls inside their own definition are left
  out. Measured on an index of the package alone, and on the 20,000-file index (the
  package is in it, among everything else).
* **Hybrid** (``--embed``): the package's index embedded with all-MiniLM-L6-v2 (`make
  embed-model`) as ``forged index update`` embeds it (its cost: chunks per second), and
  recall@5 again with BM25 fused with the nearest chunks by meaning (issue 36).
* **The door** (``--door``, alone): a search in-process, one caller's ``/health`` and
  ``/v1/retrieve``, and the 100 callers, on the pinned package's small index.
* **Query latency.** ``forged serve`` (the default model, SmolLM2-135M) on that index;
  ``--streams`` (4) chat streams decode all along while ``--callers`` (100) callers each
  send ``--queries`` (10) ``/v1/retrieve`` calls (k = 5) at once: once with the recall
  queries (the code around a cursor), once with the called names alone (an engineer's
  "where is X handled?"), a fresh daemon each. Latency is the client's, request to full
  response; target p99 at most 50 ms.

Results: printed, and written to ``bench/results/retrieval-<time>.json``.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import trio

from bench.daemonproc import DaemonProcess, free_port, write_config
from forged.config import RetrievalConfig
from forged.http.retrieve import query_around
from forged.indexembed import index_embedding
from forged.observe.stats import percentile
from forged.retrieval.query import Searcher
from forged.retrieval.source import SKIP_DIRS
from forged.retrieval.store import Index, cursor_names
from forged.retrieval.vectors import Embedding

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBED_MODEL = ROOT / "models" / "all-MiniLM-L6-v2.f16.gguf"
PACKAGE = ("trio", "0.35.0")  # pinned: recall is comparable across runs only on it
SOURCES = [Path(sysconfig.get_paths()["purelib"]), Path("/usr/lib/python3.11"),
           Path(sysconfig.get_paths()["stdlib"])]
QUERY_LINES = RetrievalConfig().query_lines


@dataclass(frozen=True)
class Case:
    """One call site: the query, and where the called name is defined."""

    query: str
    focus: list[str]  # the names at the cursor, as the daemon takes them
    path: str  # relative to the package's folder
    line: int


def assemble(tree: Path, n_files: int) -> int:
    """Copy the first ``n_files`` source files into ``tree`` and commit them."""
    count = 0
    for i, source in enumerate(dict.fromkeys(s.resolve() for s in SOURCES)):
        for dirpath, dirnames, filenames in os.walk(source):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
            for name in sorted(filenames):
                if count == n_files:
                    break
                src = Path(dirpath, name)
                if src.is_symlink() or not src.is_file():
                    continue
                dst = tree / f"src{i}" / src.relative_to(source)
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dst)
                count += 1
    git = ["git", "-C", str(tree), "-c", "user.name=bench", "-c", "user.email=bench@localhost"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A", "-f"], check=True)
    subprocess.run([*git, "commit", "-qm", "tree"], check=True)
    return count


def timed_update(directory: Path, name: str, source: Path | None) -> dict[str, Any]:
    t0, cpu0 = time.monotonic(), time.process_time()
    with (Index.create(directory, name, source) if source else Index.open(directory, name)
          ) as idx:
        stats = idx.update()
        info = idx.info()
    # CPU time beside wall time: the machine is shared, and git's is not in it.
    return {"seconds": round(time.monotonic() - t0, 2),
            "cpu_seconds": round(time.process_time() - cpu0, 2), "listed": stats.files,
            "rechunked": stats.rechunked, "indexed_files": info.files,
            "chunks": info.chunks, "bytes": info.size}


def definitions(pkg: Path) -> dict[str, tuple[str, int, int, int]]:
    """Names defined exactly once (functions, classes, methods): where, and the span."""
    seen: dict[str, list[tuple[str, int, int, int]]] = {}
    for file in sorted(pkg.rglob("*.py")):
        rel = file.relative_to(pkg).as_posix()
        try:
            tree = ast.parse(file.read_text("utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                seen.setdefault(node.name, []).append(
                    (rel, node.lineno, first, node.end_lineno or node.lineno))
    return {name: places[0] for name, places in seen.items()
            if len(places) == 1 and len(name) >= 4 and not name.startswith("__")}


def call_sites(pkg: Path, limit: int) -> list[Case]:
    """Up to ``limit`` call sites (a fixed sample) of the names defined once."""
    defs = definitions(pkg)
    cases = []
    for file in sorted(pkg.rglob("*.py")):
        rel = file.relative_to(pkg).as_posix()
        text = file.read_text("utf-8")
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else \
                func.attr if isinstance(func, ast.Attribute) else None
            if name not in defs or func.end_lineno is None or func.end_col_offset is None:
                continue
            path, line, first, last = defs[name]
            if path == rel and first <= node.lineno <= last:
                continue  # a call inside its own definition
            row = func.end_lineno - 1
            prefix = "\n".join([*lines[max(0, row - QUERY_LINES):row],
                                lines[row][:func.end_col_offset] + "("])
            suffix = "\n".join(lines[row + 1:row + 1 + QUERY_LINES])
            cases.append(Case(query_around(prefix, suffix, QUERY_LINES),
                              cursor_names(prefix), path, line))
    random.Random(0).shuffle(cases)
    return cases[:limit]


def recall(directory: Path, name: str, cases: list[Case], under: str = "",
           focus: bool = True, embedding: Embedding | None = None) -> dict[str, Any]:
    """Recall@1 and @5: the share of cases whose definition's line is in a top chunk;
    with ``embedding``, by the hybrid search (each query embedded, as the daemon does)."""
    ranks = []
    t0 = time.monotonic()
    searcher = Searcher(directory)
    for case in cases:
        vector = embedding.embed([case.query])[0] if embedding else b""
        hits = searcher.search(name, case.query, 5, case.focus if focus else (),
                               vector, embedding.model if embedding else "")
        found = [i for i, h in enumerate(hits) if h.path == under + case.path
                 and h.start_line <= case.line <= h.end_line]
        ranks.append(found[0] if found else None)
    seconds = time.monotonic() - t0
    return {"cases": len(cases),
            "recall_at_1": round(sum(r == 0 for r in ranks) / len(cases), 3),
            "recall_at_5": round(sum(r is not None for r in ranks) / len(cases), 3),
            "mean_search_ms": round(1000 * seconds / len(cases), 2)}


async def _decode_loop(c: httpx.AsyncClient, stop: trio.Event) -> None:
    body = {"messages": [{"role": "user", "content": "Write a long story about a ship."}],
            "max_tokens": 256, "temperature": 0.7, "stream": True, "ignore_eos": True}
    while not stop.is_set():
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            async for _ in r.aiter_lines():
                if stop.is_set():
                    break


async def _callers(url: str, repo: str, queries: list[str], args: argparse.Namespace
                   ) -> dict[str, Any]:
    latencies: list[float] = []
    failures = 0
    limits = httpx.Limits(max_connections=args.callers + args.streams + 4)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as c:
        stop = trio.Event()

        async def caller(i: int) -> None:
            nonlocal failures
            for j in range(args.queries):
                q = queries[(i * args.queries + j) % len(queries)]
                t0 = time.perf_counter()
                r = await c.post("/v1/retrieve", json={"repo": repo, "query": q, "k": 5})
                latencies.append(time.perf_counter() - t0)
                failures += r.status_code != 200

        async with trio.open_nursery() as outer:
            for _ in range(args.streams):
                outer.start_soon(_decode_loop, c, stop)
            await trio.sleep(5)  # the streams are decoding
            async with trio.open_nursery() as n:
                for i in range(args.callers):
                    n.start_soon(caller, i)
            stop.set()
            outer.cancel_scope.cancel()
    ms = [1000 * x for x in latencies]
    return {"callers": args.callers, "calls": len(ms), "failures": failures,
            "streams_decoding": args.streams,
            "p50_ms": round(percentile(ms, 50) or 0, 1),
            "p99_ms": round(percentile(ms, 99) or 0, 1),
            "max_ms": round(max(ms), 1)}


def latency(work: Path, queries: list[str], args: argparse.Namespace,
            repo: str = "tree") -> dict[str, Any]:
    port = free_port()
    config = write_config(work / "forged.toml", MODEL, port,
                          server={"state_dir": str(work / "state")})
    d = DaemonProcess(config, port)
    try:
        d.wait_ready(180)
        return trio.run(_callers, d.url, repo, queries, args)
    finally:
        d.stop()


async def _sequential(url: str, repo: str, query: str, n: int = 100) -> dict[str, float]:
    """One caller: p50 ms of ``GET /health`` and of one ``/v1/retrieve``, in turn."""
    out = {}
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        sends: list[tuple[str, Callable[[], Awaitable[httpx.Response]]]] = [
                ("health_p50_ms", lambda: c.get("/health")),
                ("retrieve_p50_ms", lambda: c.post("/v1/retrieve", json={
                    "repo": repo, "query": query, "k": 5}))]
        for name, send in sends:
            ms = []
            for _ in range(n):
                t0 = time.perf_counter()
                await send()
                ms.append(1000 * (time.perf_counter() - t0))
            out[name] = round(percentile(ms, 50) or 0, 2)
    return out


def door(work: Path, args: argparse.Namespace) -> None:
    """``--door``: what the HTTP path costs beside the search, on a small index (the
    pinned package alone, a plain folder): a search in-process, one caller's
    ``/health`` and ``/v1/retrieve``, then the 100 callers with nothing decoding."""
    spec = importlib.util.find_spec(PACKAGE[0])
    assert spec is not None and spec.origin is not None
    src = work / "pkg-src"
    shutil.copytree(Path(spec.origin).resolve().parent, src)
    directory = work / "state" / "index"
    timed_update(directory, "pkg", src)
    with Index.open(directory, "pkg") as idx:
        t0 = time.perf_counter()
        for _ in range(200):
            idx.search("checkpoint", 5)
        step({}, "search_in_process_ms", round((time.perf_counter() - t0) / 0.2, 3))
    port = free_port()
    d = DaemonProcess(write_config(work / "forged.toml", MODEL, port,
                                   server={"state_dir": str(work / "state")}), port)
    try:
        d.wait_ready(180)
        step({}, "one_caller", trio.run(_sequential, d.url, "pkg", "checkpoint"))
    finally:
        d.stop()
    args.streams = 0
    step({}, "callers_nothing_decoding", latency(work, ["checkpoint"], args, "pkg"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--files", type=int, default=20_000)
    p.add_argument("--cases", type=int, default=500, help="recall call sites at most")
    p.add_argument("--callers", type=int, default=100)
    p.add_argument("--queries", type=int, default=10, help="per caller")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--no-latency", action="store_true")
    p.add_argument("--embed", action="store_true", help="also embed the package's index "
                   "and measure the hybrid search's recall (needs `make embed-model`)")
    p.add_argument("--keep", help="work in this (new) folder and keep it")
    p.add_argument("--door", action="store_true", help="only what the HTTP path costs "
                   "beside the search, on the pinned package's index (2 minutes)")
    args = p.parse_args()
    version = importlib.metadata.version(PACKAGE[0])
    if version != PACKAGE[1]:
        print(f"bench.retrieval: {PACKAGE[0]} {version} is installed; the pinned recall "
              f"set is {PACKAGE[1]}", file=sys.stderr)
        return 1
    out: dict[str, Any] = {"commit": _commit(), "package": f"{PACKAGE[0]}=={version}"}
    with tempfile.TemporaryDirectory(prefix="forged-bench-rag-") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        if args.door:
            door(work, args)
            return 0
        step(out, "tree_files", assemble(work / "tree", args.files))
        index_dir = work / "state" / "index"
        step(out, "build", timed_update(index_dir, "tree", work / "tree"))
        step(out, "reindex", timed_update(index_dir, "tree", None))
        spec = importlib.util.find_spec(PACKAGE[0])
        assert spec is not None and spec.origin is not None
        # The package's copy in the tree: the installed one sits in a virtualenv that
        # a git work tree ignores (an index of it would be empty).
        under = "src0/" + Path(spec.origin).resolve().parent.relative_to(
            SOURCES[0].resolve()).as_posix() + "/"
        pkg = work / "tree" / under
        cases = call_sites(pkg, args.cases)
        timed_update(index_dir, "pkg", pkg)
        step(out, "recall_package_index", recall(index_dir, "pkg", cases))
        step(out, "recall_package_index_without_focus",
             recall(index_dir, "pkg", cases, focus=False))
        step(out, "recall_tree_index", recall(index_dir, "tree", cases, under))
        if args.embed:
            hybrid(out, work, index_dir, cases)
        if not args.no_latency:
            # Two shapes: the code around a cursor (what a completion sends), and a
            # name alone (an engineer's "where is X handled?").
            step(out, "latency_code_queries",
                 latency(work, [c.query for c in cases], args))
            step(out, "latency_name_queries",
                 latency(work, [c.focus[0] for c in cases if c.focus], args))
    results = ROOT / "bench" / "results"
    results.mkdir(exist_ok=True)
    (results / f"retrieval-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(
        json.dumps(out, indent=2) + "\n")
    return 0


def hybrid(out: dict[str, Any], work: Path, index_dir: Path, cases: list[Case]) -> None:
    """The package's index embedded (all-MiniLM-L6-v2, `make embed-model`) and searched
    by BM25 fused with meaning; what embedding it cost, to reckon a larger tree's."""
    config = work / "embed.toml"
    config.write_text(f'[model]\npath = "{EMBED_MODEL}"\n'
                      f'[engine]\nthreads = 2\nstep_tokens = 2048\n'
                      f'prefill_step_tokens = 2048\n')
    embedding = index_embedding(config, nice=0)
    assert embedding is not None, "no embedding model"
    with Index.open(index_dir, "pkg") as idx:
        stats = idx.update(embedding=embedding)
    step(out, "embed_package_index", {"chunks": stats.embedded,
                                      "seconds": round(stats.embed_seconds, 1),
                                      "chunks_per_s": round(stats.embedded
                                                            / stats.embed_seconds, 1)})
    step(out, "recall_package_index_hybrid",
         recall(index_dir, "pkg", cases, embedding=embedding))
    step(out, "recall_package_index_hybrid_without_focus",
         recall(index_dir, "pkg", cases, focus=False, embedding=embedding))


def step(out: dict[str, Any], name: str, value: Any) -> None:
    out[name] = value
    print(f"{name}: {json.dumps(value)}", flush=True)


def _commit() -> str:
    r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                       capture_output=True, text=True, check=False)
    return r.stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
