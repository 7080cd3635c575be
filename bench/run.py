"""The comparison benchmark: forged against llama.cpp's llama-server, one command.

    make bench            # or: .venv/bin/python -m bench.run [--quick]

Builds llama-server from the llama-cpp-python sdist forged pins (cached outside the
repo), starts forged and two llama-server configurations on loopback with the same
model, threads and total context, runs the same load against them alternately with
`forged bench`, and writes bench/results/latest.json plus the tables for
docs/benchmarks.md (bench/results/benchmarks.md). Every run is bounded in requests and
time; the whole benchmark takes about 30 minutes on 2 cores (``--quick``: about 8).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import trio

from bench.daemonproc import DaemonProcess, free_port, health_ok, write_config
from forged.observe.loadtest import make_prompts, ratios, run_alternating, run_load
from forged.observe.stats import percentile
from forged.observe.status import fetch_stats

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
RESULTS = ROOT / "bench" / "results"
THREADS = 2
CONTEXT = 32768  # total KV cells for every server; llama-server -np 16 gets 2048 per slot
MAX_TOKENS = 64
BEST = ["-np", "16", "-b", "256", "-ub", "256"]  # llama-server's best-consistency setting


class LlamaServer:
    def __init__(self, binary: str, extra: list[str], log: Path, *, model: Path = MODEL,
                 context: int = CONTEXT, threads: int = THREADS) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = log.open("wb")
        self.proc = subprocess.Popen(
            [binary, "-m", str(model), "-t", str(threads), "-tb", str(threads), "-c", str(context),
             "--host", "127.0.0.1", "--port", str(self.port), *extra],
            stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if health_ok(self.url, timeout=2):
                return
            time.sleep(0.3)
        raise TimeoutError("llama-server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:  # seen once after the short generations: a
            self.proc.kill()  # benchmark's end must not hang on its peer's
            self.proc.wait()
        self._log.close()


def write_results(name: str, result: dict[str, Any], table: str) -> None:
    """``bench/results/NAME.json`` and the table for docs/benchmarks.md (``NAME.md``),
    and the table on stdout."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1))
    (RESULTS / f"{name}.md").write_text(table + "\n")
    print(table)


def rss_kb(pid: int) -> int:
    """Resident memory of one process, in KiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def worker_pid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/task/{pid}/children").read_text().split()[0])
    except (OSError, IndexError):
        return 0


class RssSampler:
    """The daemon's RSS (the front door: connections, queues) and, separately, its
    worker's (llama.cpp: the model and a KV cache allocated once, touched as used)."""

    def __init__(self, pid: int) -> None:
        self.pid, self._stop = pid, threading.Event()
        self.samples: list[int] = []
        self.worker_samples: list[int] = []
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.samples.append(rss_kb(self.pid))
            self.worker_samples.append(rss_kb(worker_pid(self.pid)))

    def __enter__(self) -> RssSampler:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()


def level_requests(c: int, quick: bool) -> int:
    return max(16 if quick else 32, min(256, (2 if quick else 3) * c))


async def compare(a: str, b: str, mix: str, c: int, quick: bool) -> dict[str, Any]:
    prompts = make_prompts(mix, level_requests(c, quick), MAX_TOKENS, seed=c)
    duration = 120.0 if quick else 180.0
    if c == 1:  # one caller: the servers take turns request by request
        sa, sb = await run_alternating((a, b), prompts, duration=2 * duration)
        return {"mix": mix, "concurrency": c, "forged": sa, "llama_server": sb,
                "ratio": ratios(sa, sb)}
    sa = await run_load(a, prompts, concurrency=c, rate=None, duration=duration, model=None,
                        label=f"forged {mix} c={c}")
    sb = await run_load(b, prompts, concurrency=c, rate=None, duration=duration, model=None,
                        label=f"llama-server {mix} c={c}")
    return {"mix": mix, "concurrency": c, "forged": sa, "llama_server": sb,
            "ratio": ratios(sa, sb)}


async def compare_warmup(url: str) -> None:
    prompts = make_prompts("mixed", 32, MAX_TOKENS, seed=99)
    await run_load(url, prompts, concurrency=16, rate=None, duration=180, model=None,
                   label="warm-up")


async def overload(url: str, pid: int, capacity: float, seconds: float) -> dict[str, Any]:
    out: dict[str, Any] = {"capacity_req_per_s": capacity}
    for factor in (1, 4):
        rate = capacity * factor
        prompts = make_prompts("mixed", int(rate * seconds), MAX_TOKENS, seed=factor)
        with RssSampler(pid) as rss:
            summary = await run_load(url, prompts, concurrency=None, rate=rate,
                                     duration=seconds + 30, model=None,
                                     label=f"overload {factor}x")
        out[f"{factor}x"] = {"summary": summary, "rss_kb_max": max(rss.samples, default=0),
                             "rss_kb_median": statistics.median(rss.samples or [0]),
                             "worker_rss_kb_max": max(rss.worker_samples, default=0),
                             "rejection_p99_s": summary.get("reject_p99")}
    return out


async def rejection_latency(url: str, n: int = 400) -> dict[str, Any]:
    """Fill the queue, then time the 503s: rejections must be answered at once."""
    import httpx

    lat: list[float] = []
    statuses: dict[int, int] = {}
    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(timeout=90, limits=limits) as client:
        body = {"prompt": "x " * 600, "max_tokens": MAX_TOKENS, "ignore_eos": True}

        async def one() -> None:
            t0 = time.monotonic()
            try:
                r = await client.post(url + "/v1/completions", json=body)
            except httpx.HTTPError:
                statuses[598] = statuses.get(598, 0) + 1
                return
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            # Door rejections (queue full), not requests that timed out in the queue.
            if r.status_code in (429, 503) and r.json()["error"]["code"] == "overloaded":
                assert "retry-after" in r.headers
                lat.append(time.monotonic() - t0)

        with trio.move_on_after(120):
            async with trio.open_nursery() as nursery:
                for _ in range(n):
                    nursery.start_soon(one)
                    await trio.sleep(0.002)
    return {"statuses": statuses, "rejections": len(lat),
            "rejection_p99_s": percentile(lat, 99), "rejection_p50_s": percentile(lat, 50)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer requests and levels")
    ap.add_argument("--layout", choices=["per_slot", "unified"], default="per_slot",
                    help="forged's engine.kv_layout (default: the shipped one)")
    ap.add_argument("--rejections", action="store_true",
                    help="only measure how fast a full queue answers 503")
    ap.add_argument("--resume", action="store_true",
                    help="keep the comparison runs of bench/results/partial.json and run "
                         "only the overload part")
    ap.add_argument("--only", action="append", default=[], metavar="MIX:C",
                    help="run only this comparison against the best llama-server config "
                         "(repeatable), e.g. mixed:32; no overload part")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a forged config key for this run, e.g. "
                         "limits.overtake_window=30 (value parsed as JSON if it can be)")
    args = ap.parse_args()
    if args.rejections:
        trio.run(_rejections_only)
        return
    binary = subprocess.run([str(ROOT / "bench" / "build-llama-server.sh")], check=True,
                            capture_output=True, text=True, cwd=ROOT).stdout.strip()
    RESULTS.mkdir(parents=True, exist_ok=True)
    levels = [1, 8, 32] if args.quick else [1, 8, 32, 128]
    tmp = Path(tempfile.mkdtemp())
    port = free_port()
    # Same model, threads and total context as llama-server; per_slot also matches its
    # 16 slots of CONTEXT / 16 cells.
    engine: dict[str, Any] = {"threads": THREADS, "kv_cells": CONTEXT, "kv_layout": args.layout}
    if args.layout == "per_slot":
        engine.update(slots=16, max_running=16, max_context=CONTEXT // 16)
    else:
        engine.update(slots=64, max_running=32, max_context=8192)
    limits: dict[str, Any] = {"max_queued": 32, "queue_timeout": 20.0} if args.resume else {}
    sections = {"engine": engine, "limits": limits}
    for item in args.set:
        key, _, value = item.partition("=")
        section, _, name = key.partition(".")
        sections.setdefault(section, {})[name] = _value(value)
    forged = DaemonProcess(write_config(tmp / "forged.toml", MODEL, port, **sections), port)
    best = LlamaServer(binary, BEST + (["--metrics"] if args.only else []), tmp / "best.log")
    default = LlamaServer(binary, ["-np", "16"], tmp / "default.log")
    result: dict[str, Any] = {"machine": os.uname().nodename, "threads": THREADS,
                              "layout": args.layout,
                              "context": CONTEXT, "max_tokens": MAX_TOKENS, "runs": []}
    if args.resume:
        result = json.loads((RESULTS / "partial.json").read_text())
        # The overload part: a short queue, so that 4x capacity meets it within a minute.
        result["overload_limits"] = {"max_queued": 32, "queue_timeout": 20.0}
    try:
        forged.wait_ready()
        best.wait_ready()
        default.wait_ready()
        if args.only:
            _only(args.only, args.set, forged.url, f"unix:{tmp}/admin.sock", best.url,
                  args.quick)
            return
        for mix in () if args.resume else ("mixed", "shared-prefix"):
            for c in levels:
                run = trio.run(compare, forged.url, best.url, mix, c, args.quick)
                run["against"] = "llama-server " + " ".join(BEST)
                result["runs"].append(run)
                print(json.dumps({k: run[k] for k in ("mix", "concurrency", "ratio")}))
                (RESULTS / "partial.json").write_text(json.dumps(result, indent=2))
            run = trio.run(compare, forged.url, default.url, mix, 32, args.quick)
            run["against"] = "llama-server -np 16"
            result["runs"].append(run)
            (RESULTS / "partial.json").write_text(json.dumps(result, indent=2))
        capacity = next(r["forged"]["req_per_s"] for r in result["runs"]
                        if r["mix"] == "mixed" and r["concurrency"] == 32)
        # Warm up: every slot used once, so the worker's KV pages are all touched
        # before the 1x baseline (llama.cpp allocates the cache once, pages fill as used).
        trio.run(compare_warmup, forged.url)
        result["overload"] = trio.run(overload, forged.url, forged.proc.pid, capacity,
                                      20.0 if args.quick else 60.0)
        (RESULTS / "partial.json").write_text(json.dumps(result, indent=2))
        result["rejections"] = trio.run(rejection_latency, forged.url)
    finally:
        forged.stop()
        best.stop()
        default.stop()
    (RESULTS / f"latest-{args.layout}.json").write_text(json.dumps(result, indent=2))
    (RESULTS / f"benchmarks-{args.layout}.md").write_text(tables(result))
    print(tables(result))


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def forged_counters(admin: str) -> dict[str, float]:
    t = fetch_stats(admin)["engine"]["totals"]
    return {"steps": t["steps"],
            "tokens": t["prompt_tokens_computed"] + t["tokens_generated"]}


def llama_metrics(url: str) -> dict[str, float]:
    """llama-server's /metrics (started with --metrics), by name."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {k: float(v) for k, _, v in (line.rpartition(" ") for line in text.splitlines()
                                       if line and not line.startswith("#"))}


def llama_counters(url: str) -> dict[str, float]:
    m = llama_metrics(url)
    return {"steps": m["llamacpp:n_decode_total"],
            "tokens": m["llamacpp:prompt_tokens_total"] + m["llamacpp:tokens_predicted_total"]}


def step_shape(before: dict[str, float], after: dict[str, float], wall: float
               ) -> dict[str, float]:
    """How a server batched one run: llama_decode calls, tokens computed per call, and
    wall time per computed token (both servers compute all the time at saturation)."""
    steps, tokens = after["steps"] - before["steps"], after["tokens"] - before["tokens"]
    return {"steps": steps, "tokens_computed": tokens,
            "tokens_per_step": tokens / steps if steps else 0.0,
            "ms_per_token": 1000 * wall / tokens if tokens else 0.0}


def _only(which: list[str], overrides: list[str], forged: str, admin: str, best: str,
          quick: bool) -> None:
    """Single comparisons, for trying a setting: ratios and each server's step shape,
    printed and kept in only.json."""
    runs = []
    for item in which:
        mix, _, c = item.partition(":")
        fa, la = forged_counters(admin), llama_counters(best)
        run = trio.run(compare, forged, best, mix, int(c), quick)
        run["shape"] = {
            "forged": step_shape(fa, forged_counters(admin), run["forged"]["wall_s"]),
            "llama_server": step_shape(la, llama_counters(best), run["llama_server"]["wall_s"]),
        }
        run["against"], run["overrides"] = "llama-server " + " ".join(BEST), overrides
        runs.append(run)
        print(json.dumps({k: run[k] for k in ("mix", "concurrency", "overrides", "ratio",
                                              "shape")}))
    (RESULTS / "only.json").write_text(json.dumps(runs, indent=2))
    print(tables({"runs": runs}))


async def _rejections_only() -> None:
    tmp = Path(tempfile.mkdtemp())
    port = free_port()
    engine = {"threads": THREADS, "kv_cells": CONTEXT}
    d = DaemonProcess(write_config(tmp / "forged.toml", MODEL, port, engine=engine,
                                   limits={"max_queued": 32, "queue_timeout": 20.0}), port)
    try:
        d.wait_ready()
        out = await rejection_latency(d.url)
    finally:
        d.stop()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "rejections.json").write_text(json.dumps(out, indent=2))
    print(json.dumps(out))


def _r(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} s"


def tables(result: dict[str, Any]) -> str:
    lines = ["| workload | C | vs | req/s | out tok/s | TTFT p50 | TTFT p95 | TTFT p99 | "
             "short TTFT p95 | ITL p50 | ITL p99 | ITL p99.9 | ITL max | forged ITL p99 | "
             "llama-server ITL p99 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in result["runs"]:
        r = run["ratio"]
        vs = "best" if "-b 256" in run["against"] else "default"
        lines.append(
            f"| {run['mix']} | {run['concurrency']} | {vs} | {_r(r['req_per_s'])} | "
            f"{_r(r['out_tok_per_s'])} | {_r(r['ttft_p50'])} | {_r(r['ttft_p95'])} | "
            f"{_r(r['ttft_p99'])} | {_r(r['short_ttft_p95'])} | {_r(r['itl_p50'])} | "
            f"{_r(r['itl_p99'])} | {_r(r['itl_p99_9'])} | {_r(r['itl_max'])} | "
            f"{_s(run['forged']['itl_p99'])} | "
            f"{_s(run['llama_server']['itl_p99'])} |")
    ov = result.get("overload")
    if ov:
        lines += ["", "| load | ok | errors | RSS max (MiB) |", "|---|---|---|---|"]
        for f in ("1x", "4x"):
            s = ov[f]["summary"]
            lines.append(f"| {f} ({ov['capacity_req_per_s'] * int(f[0]):.2f} req/s) | "
                         f"{s['ok']} | {s['errors'] or 'none'} | "
                         f"{ov[f]['rss_kb_max'] / 1024:.0f} |")
    rej = result.get("rejections")
    if rej:
        lines += ["", f"Rejections: {rej['rejections']} answered with Retry-After, p99 "
                  f"{_s(rej['rejection_p99_s'])}; statuses {rej['statuses']}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
