"""Consistency at the load that really arrives: forged against llama-server's best
configuration, below capacity (open loop), past it, and in closed loops. One command:

    .venv/bin/python -m bench.consistency [--quick] [--set SECTION.KEY=VALUE ...]

1. Capacity: llama-server (and forged) in a closed loop of 32 callers, mixed prompts.
   llama-server's requests/s there is "capacity" for the open-loop rates.
2. Closed loops at 8 callers, and one caller taking turns request by request.
3. Open loop (Poisson arrivals) at 0.5x and 0.8x of capacity, each run twice with
   different prompts and arrivals, the servers taking turns (forged first, then
   llama-server first), so that a slow spell of the machine reaches both.
4. Open loop at 1.5x capacity: what forged admits keeps its pace, what it refuses is
   answered at once with Retry-After; llama-server's latencies beside it.
5. Where a short request's first token went, from forged's access log at 0.8x: waiting
   for a slot, admission to first token (and how many steps), and the rest (HTTP,
   tokenizing, delivery).

Writes bench/results/consistency.json and the tables for docs/benchmarks.md
(bench/results/consistency.md). Same model, threads and total KV for both servers.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import trio

from bench.daemonproc import DaemonProcess, free_port, write_config
from bench.run import (
    BEST,
    CONTEXT,
    MAX_TOKENS,
    MODEL,
    RESULTS,
    ROOT,
    THREADS,
    LlamaServer,
    _value,
)
from forged.observe.loadtest import make_prompts, ratios, run_alternating, run_load
from forged.observe.stats import percentile


async def closed(forged: str, ls: str, c: int, n: int, seed: int) -> dict[str, Any]:
    prompts = make_prompts("mixed", n, MAX_TOKENS, seed=seed)
    if c == 1:
        a, b = await run_alternating((forged, ls), prompts, duration=900)
    else:
        a = await run_load(forged, prompts, concurrency=c, rate=None, duration=600,
                           model=None, label=f"forged closed c={c}")
        b = await run_load(ls, prompts, concurrency=c, rate=None, duration=600, model=None,
                           label=f"llama-server closed c={c}")
    return {"kind": "closed", "concurrency": c, "forged": a, "llama_server": b,
            "ratio": ratios(a, b)}


async def open_loop(forged: str, ls: str, rate: float, n: int, seed: int, forged_first: bool
                    ) -> dict[str, Any]:
    prompts = make_prompts("mixed", n, MAX_TOKENS, seed=seed)
    out: dict[str, Any] = {"kind": "open", "rate": rate, "seed": seed,
                           "order": "forged first" if forged_first else "llama-server first"}
    for name in (("forged", "llama_server") if forged_first else ("llama_server", "forged")):
        url = forged if name == "forged" else ls
        out[name] = await run_load(url, prompts, concurrency=None, rate=rate,
                                   duration=n / rate + 240, model=None, seed=seed,
                                   label=f"{name} open {rate:.2f}/s")
    out["ratio"] = ratios(out["forged"], out["llama_server"])
    return out


_FIELD = re.compile(r'(\w+)=("[^"]*"|\S+)')


def breakdown(log: Path, start: int) -> dict[str, Any]:
    """Short requests' TTFT from the access log lines written since byte ``start``."""
    rows = []
    with log.open("rb") as f:
        f.seek(start)
        for raw in f:
            fields = dict(_FIELD.findall(raw.decode("utf-8", "replace")))
            if fields.get("logger") != "forged.access" or fields.get("status") != "200":
                continue
            if int(fields.get("prompt_tokens", "0")) > 200 or fields.get("ttft", "-") == "-":
                continue
            rows.append((float(fields["ttft"]), _num(fields, "queue"), _num(fields, "prefill"),
                         int(_num(fields, "prefill_steps"))))
    if not rows:
        return {}
    out: dict[str, Any] = {"requests": len(rows)}
    for i, name in enumerate(("ttft", "queue", "prefill", "prefill_steps")):
        vals = [r[i] for r in rows]
        out[f"{name}_mean"] = statistics.fmean(vals)
        out[f"{name}_p99"] = percentile(vals, 99)
    out["rest_mean"] = out["ttft_mean"] - out["queue_mean"] - out["prefill_mean"]
    worst = max(rows)
    out["worst"] = dict(zip(("ttft", "queue", "prefill", "prefill_steps"), worst, strict=True))
    return out


def shipped_sections(overrides: list[str]) -> dict[str, dict[str, Any]]:
    """forged's shipped configuration with llama-server's threads, context and slots,
    then ``SECTION.KEY=VALUE`` overrides (values parsed as JSON when they parse)."""
    sections: dict[str, dict[str, Any]] = {"engine": {
        "threads": THREADS, "kv_cells": CONTEXT, "slots": 16, "max_running": 16,
        "max_context": CONTEXT // 16}}
    for item in overrides:
        key, _, value = item.partition("=")
        section, _, name = key.partition(".")
        sections.setdefault(section, {})[name] = _value(value)
    return sections


def _num(fields: dict[str, str], key: str) -> float:
    value = fields.get(key, "-")
    return 0.0 if value == "-" else float(value)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer requests per run")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a forged config key, e.g. engine.target_step_ms=120")
    args = ap.parse_args()
    binary = subprocess.run([str(ROOT / "bench" / "build-llama-server.sh")], check=True,
                            capture_output=True, text=True, cwd=ROOT).stdout.strip()
    RESULTS.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp())
    port = free_port()
    cfg = write_config(tmp / "forged.toml", MODEL, port, **shipped_sections(args.set))
    forged = DaemonProcess(cfg, port)
    ls = LlamaServer(binary, BEST, tmp / "llama-server.log")
    n = 32 if args.quick else 48
    result: dict[str, Any] = {"against": "llama-server " + " ".join(BEST),
                              "overrides": args.set, "runs": []}

    def keep(run: dict[str, Any]) -> None:
        result["runs"].append(run)
        print(json.dumps({k: run[k] for k in run if k not in ("forged", "llama_server")}),
              flush=True)
        (RESULTS / "consistency.json").write_text(json.dumps(result, indent=2))

    try:
        forged.wait_ready()
        ls.wait_ready()
        trio.run(closed, forged.url, ls.url, 16, 32, 99)  # warm-up: every slot used once
        sat = trio.run(closed, forged.url, ls.url, 32, 2 * n, 1)
        keep(sat)
        capacity = sat["llama_server"]["req_per_s"]
        result["capacity_req_per_s"] = capacity
        keep(trio.run(closed, forged.url, ls.url, 8, n, 2))
        keep(trio.run(closed, forged.url, ls.url, 1, n // 2, 3))
        for seed, factor in ((10, 0.5), (11, 0.8), (12, 0.5), (13, 0.8)):
            start = forged.log.stat().st_size
            run = trio.run(open_loop, forged.url, ls.url, factor * capacity, n, seed,
                           seed < 12)
            run["factor"] = factor
            if factor == 0.8:
                run["forged_short_ttft_breakdown"] = breakdown(forged.log, start)
            keep(run)
        run = trio.run(open_loop, forged.url, ls.url, 1.5 * capacity, n, 20, True)
        run["factor"] = 1.5
        keep(run)
    finally:
        forged.stop()
        ls.stop()
    (RESULTS / "consistency.md").write_text(tables(result))
    print(tables(result))


def _r(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _pair(run: dict[str, Any], key: str, unit: str = "s") -> str:
    a, b = run["forged"].get(key), run["llama_server"].get(key)
    if a is None or b is None:
        return "-"
    return f"{a:.2f} / {b:.2f}" + (f" {unit}" if unit else "")


def tables(result: dict[str, Any]) -> str:
    lines = [f"Against {result['against']}; capacity (its req/s at 32 callers) "
             f"{result.get('capacity_req_per_s', 0):.3f} req/s. Cells: forged / llama-server, "
             "then the ratio.", "",
             "| load | short TTFT p50 | short TTFT p99 | ITL p50 | ITL p99 | ITL p99.9 | "
             "ITL max | out tok/s | ratios (TTFT p50, p99, ITL p50, p99, tok/s) | "
             "errors (forged; llama-server) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for run in result["runs"]:
        if run["kind"] == "closed":
            load = f"closed, {run['concurrency']} caller" + ("s" if run["concurrency"] > 1
                                                            else "")
        else:
            load = f"open {run['factor']}x ({run['rate']:.2f} req/s, {run['order']})"
        r = run["ratio"]
        lines.append(
            f"| {load} | {_pair(run, 'short_ttft_p50')} | {_pair(run, 'short_ttft_p99')} | "
            f"{_pair(run, 'itl_p50')} | {_pair(run, 'itl_p99')} | "
            f"{_pair(run, 'itl_p99_9')} | {_pair(run, 'itl_max')} | "
            f"{_pair(run, 'out_tok_per_s', '')} | {_r(r.get('short_ttft_p50'))}, "
            f"{_r(r.get('short_ttft_p99'))}, {_r(r.get('itl_p50'))}, {_r(r.get('itl_p99'))}, "
            f"{_r(r.get('out_tok_per_s'))} | {run['forged']['errors'] or '-'}; "
            f"{run['llama_server']['errors'] or '-'} |")
    over = [r for r in result["runs"] if r.get("factor") == 1.5]
    if over:
        f = over[0]["forged"]
        lines += ["", f"At 1.5x forged answered {f['ok']} requests and refused "
                  f"{sum(v for k, v in f['errors'].items() if k in ('503', '429'))} "
                  f"({f['rejections_with_retry_after']} with Retry-After, answered in "
                  f"p99 {_r(f['reject_p99'])} s)."]
    for run in result["runs"]:
        b = run.get("forged_short_ttft_breakdown")
        if b:
            lines.append(
                f"Short requests at {run['rate']:.2f} req/s ({b['requests']}): TTFT mean "
                f"{b['ttft_mean']:.3f} s = queue {b['queue_mean']:.3f} + admission to first "
                f"token {b['prefill_mean']:.3f} ({b['prefill_steps_mean']:.1f} steps) + rest "
                f"{b['rest_mean']:.3f}; p99 TTFT {b['ttft_p99']:.3f} s, queue p99 "
                f"{b['queue_p99']:.3f} s, prefill p99 {b['prefill_p99']:.3f} s; worst "
                f"{b['worst']}.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
