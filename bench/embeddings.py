"""Embeddings per second (issue 36): forged's embedding worker against llama-server
``--embeddings --pooling mean`` on the same GGUF (all-MiniLM-L6-v2, `make embed-model`),
threads and batch, at 1 and 32 callers. One command:

    .venv/bin/python -m bench.embeddings [--seconds 20] [--rounds 2]

Each caller sends one chunk of forged's own source a request (an editor's or an
indexer's shape: llama.vscode sends one text a request), in a closed loop, through
``POST /v1/embeddings`` on both. The servers run in turn, the order alternating by
round, so that a slow spell of the machine reaches both. Goal: forged at 32 callers
>= 1.0x llama-server's inputs per second.

Writes bench/results/embeddings.json and the table for docs/benchmarks.md
(bench/results/embeddings.md). Every loop is bounded in time.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from bench.daemonproc import DaemonProcess, free_port, write_config
from bench.run import ROOT, THREADS, LlamaServer, write_results
from forged.observe.stats import percentile

MODEL = ROOT / "models" / "all-MiniLM-L6-v2.f16.gguf"
CALLERS = (1, 32)
SLOTS = 16
BATCH = 2048  # tokens a batch computes, on both servers
CHUNK_LINES = 12  # about 100-250 tokens of Python: an index chunk


def chunks() -> list[str]:
    """Pieces of forged's own source, CHUNK_LINES lines each."""
    out = []
    for path in sorted((ROOT / "forged").rglob("*.py")):
        lines = path.read_text().splitlines()
        for i in range(0, len(lines) - CHUNK_LINES, CHUNK_LINES):
            text = "\n".join(lines[i:i + CHUNK_LINES]).strip()
            if len(text) > 200:
                out.append(text)
    return out


async def load(url: str, texts: list[str], callers: int, seconds: float) -> dict[str, Any]:
    """A closed loop of ``callers``, each one text a request, for ``seconds``."""
    latencies: list[float] = []
    tokens, errors = [0], [0]
    start = time.monotonic()
    deadline = start + seconds

    async def caller(c: httpx.AsyncClient, k: int) -> None:
        i = k
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            r = await c.post("/v1/embeddings", json={"input": texts[i % len(texts)],
                                                     "model": "minilm"})
            if r.status_code != 200:
                errors[0] += 1
                continue
            latencies.append(time.monotonic() - t0)
            tokens[0] += r.json()["usage"]["prompt_tokens"]
            i += callers

    async with httpx.AsyncClient(base_url=url, timeout=60,
                                 limits=httpx.Limits(max_connections=callers)) as c, \
            trio.open_nursery() as n:
        for k in range(callers):
            n.start_soon(caller, c, k)
    elapsed = time.monotonic() - start
    latencies.sort()
    return {"callers": callers, "inputs_per_s": len(latencies) / elapsed,
            "tokens_per_s": tokens[0] / elapsed, "errors": errors[0],
            "p50_ms": 1000 * (percentile(latencies, 50) or 0.0),
            "p99_ms": 1000 * (percentile(latencies, 99) or 0.0)}


def _forged(tmp: Path) -> DaemonProcess:
    port = free_port()
    config = write_config(tmp / "forged.toml", MODEL, port, model={"name": "minilm"},
                          engine={"threads": THREADS, "slots": SLOTS, "max_running": SLOTS,
                                  "step_tokens": BATCH, "prefill_step_tokens": BATCH})
    d = DaemonProcess(config, port)
    d.wait_ready(300)
    return d


def _llama_server(tmp: Path) -> LlamaServer:
    binary = subprocess.run([str(ROOT / "bench" / "build-llama-server.sh")], check=True,
                            capture_output=True, text=True).stdout.strip()
    ls = LlamaServer(binary, ["--embeddings", "--pooling", "mean", "-np", str(SLOTS),
                              "-b", str(BATCH), "-ub", str(BATCH)],
                     tmp / "llama-server.log", model=MODEL, context=SLOTS * 512)
    ls.wait_ready()
    return ls


async def one_server(name: str, tmp: Path, texts: list[str], seconds: float
                     ) -> list[dict[str, Any]]:
    server: DaemonProcess | LlamaServer = _forged(tmp) if name == "forged" else \
        _llama_server(tmp)
    try:
        await load(server.url, texts, 4, 3.0)  # warm-up, not counted
        return [{"server": name, **await load(server.url, texts, c, seconds)}
                for c in CALLERS]
    finally:
        server.stop()


def table(result: dict[str, Any]) -> str:
    lines = ["| server | callers | inputs/s | tokens/s | p50 ms | p99 ms | errors |",
             "|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        lines.append(f"| {r['server']} | {r['callers']} | {r['inputs_per_s']:.1f} | "
                     f"{r['tokens_per_s']:.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
                     f"{r['errors']} |")
    for c, ratio in result["ratios"].items():
        lines.append(f"\nforged ÷ llama-server, inputs/s at {c} callers: {ratio:.2f}")
    return "\n".join(lines)


def _ratios(runs: list[dict[str, Any]]) -> dict[str, float]:
    out = {}
    for c in CALLERS:
        rate = {s: sum(r["inputs_per_s"] for r in runs
                       if r["server"] == s and r["callers"] == c) for s in ("forged",
                                                                          "llama-server")}
        out[str(c)] = rate["forged"] / max(rate["llama-server"], 1e-9)
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    if not MODEL.is_file():
        raise SystemExit(f"{MODEL} is missing: run `make embed-model`")
    texts = chunks()
    runs: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        order = ("forged", "llama-server") if rnd % 2 == 0 else ("llama-server", "forged")
        for name in order:
            tmp = Path(tempfile.mkdtemp(prefix=f"forged-embed-{name}-"))
            runs += await one_server(name, tmp, texts, args.seconds)
    return {"model": MODEL.name, "threads": THREADS, "slots": SLOTS, "batch": BATCH,
            "seconds": args.seconds, "rounds": args.rounds, "runs": runs,
            "ratios": _ratios(runs)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=20.0, help="per load, per server")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    result = trio.run(main_async, args)
    write_results("embeddings", result, table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
