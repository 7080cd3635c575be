"""Chat latency while an index is built with embeddings (issue 36): what `forged index
add` costs the callers of a running daemon. One command:

    .venv/bin/python -m bench.buildload [--seconds 150] [--rate 0.3] [--files 2000]

forged serves SmolLM2 (the chat model) with all-MiniLM-L6-v2 beside it (`make
embed-model`), as a node with an embedding model does. An open loop of short chats
(Poisson arrivals at ``--rate`` a second, the same arrivals and prompts each time) runs
once to warm the caches up (not reported: the later runs find the prompts' prefixes
cached, so a cold first run would be an unfair baseline), then three times: quiet,
while `forged index add` builds and embeds an index of a source tree (the first
``--files`` package sources, as bench.retrieval assembles them; the command lowers
itself to nice 19 before it loads the model, as it does for admins), and quiet again.
The build is stopped when its window ends: at 4-6 chunks a second it would take far
longer. Goal: chat TTFT p99 during the build within 1.5x of quiet.

Writes bench/results/buildload.json and the table for docs/benchmarks.md
(bench/results/buildload.md). Every loop is bounded in time.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import trio

from bench.daemonproc import DaemonProcess, free_port, write_config
from bench.retrieval import EMBED_MODEL, MODEL, assemble
from bench.run import MAX_TOKENS, ROOT, THREADS, write_results
from forged.observe.loadtest import make_prompts, run_load

PHASES = ("quiet", "building", "quiet again")
KEYS = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "itl_p99_9", "itl_max", "out_tok_per_s")


def _daemon(tmp: Path) -> DaemonProcess:
    port = free_port()
    config = write_config(tmp / "forged.toml", MODEL, port, engine={"threads": THREADS},
                          models=[{"path": str(EMBED_MODEL), "name": "minilm"}])
    d = DaemonProcess(config, port)
    d.wait_ready(300)
    return d


def _build(tmp: Path, tree: Path) -> subprocess.Popen[bytes]:
    """`forged index add` as an admin runs it, its output kept for the record."""
    log = open(tmp / "index.log", "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen([str(ROOT / ".venv" / "bin" / "forged"), "index", "add",
                             "bench", str(tree), "--config", str(tmp / "forged.toml")],
                            stdout=log, stderr=subprocess.STDOUT)


def _stop(build: subprocess.Popen[bytes]) -> bool:
    """Stop the build; whether it was still running (it should be: see the doc)."""
    running = build.poll() is None
    if running:
        build.send_signal(signal.SIGTERM)
        try:
            build.wait(30)
        except subprocess.TimeoutExpired:
            build.kill()
            build.wait(30)
    return running


async def _phase(url: str, args: argparse.Namespace, label: str) -> dict[str, Any]:
    n = int(args.rate * args.seconds * 2) + 8  # more than the window can send
    prompts = make_prompts("short", n, MAX_TOKENS, seed=args.seed)
    return await run_load(url, prompts, concurrency=None, rate=args.rate,
                          duration=args.seconds, model=None, label=label, seed=args.seed)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="forged-buildload-") as tmp_name:
        tmp = Path(tmp_name)
        files = assemble(tmp / "tree", args.files)
        daemon = _daemon(tmp)
        runs: dict[str, Any] = {}
        try:
            trio.run(_phase, daemon.url, args, "warm-up")
            runs["quiet"] = trio.run(_phase, daemon.url, args, "quiet")
            build = _build(tmp, tmp / "tree")
            try:
                runs["building"] = trio.run(_phase, daemon.url, args, "building")
            finally:
                ran_throughout = _stop(build)
            runs["quiet again"] = trio.run(_phase, daemon.url, args, "quiet again")
        finally:
            daemon.stop()
        log = (tmp / "index.log").read_text(errors="replace")[-2000:]
    return {"files": files, "rate": args.rate, "seconds": args.seconds,
            "build_ran_throughout": ran_throughout, "index_log_tail": log, "runs": runs}


def table(result: dict[str, Any]) -> str:
    runs = result["runs"]
    rows = ["| phase | " + " | ".join(KEYS) + " |", "|---" * (len(KEYS) + 1) + "|"]
    for phase in PHASES:
        rows.append(f"| {phase} | " + " | ".join(_fmt(runs[phase].get(k)) for k in KEYS)
                    + " |")
    quiet = max(runs["quiet"]["ttft_p99"], runs["quiet again"]["ttft_p99"])
    ratio = runs["building"]["ttft_p99"] / quiet if quiet else float("nan")
    rows.append(f"\nTTFT p99 during the build / the slower quiet run: {ratio:.2f} "
                f"(goal <= 1.5); {result['files']} files, {result['rate']} req/s, "
                f"{result['seconds']} s a phase; the build ran throughout: "
                f"{result['build_ran_throughout']}")
    return "\n".join(rows)


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.3g}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=150.0, help="each phase's window")
    ap.add_argument("--rate", type=float, default=0.3, help="chats a second (open loop)")
    ap.add_argument("--files", type=int, default=2000, help="files in the indexed tree")
    ap.add_argument("--seed", type=int, default=11)
    result = measure(ap.parse_args())
    write_results("buildload", result, table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
