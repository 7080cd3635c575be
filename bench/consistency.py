"""Consistency at the load that really arrives: forged against llama-server's best
configuration, below capacity (open loop), past it, and in closed loops. One command:

    .venv/bin/python -m bench.consistency [--quick] [--loads 0.3,0.5,0.8]
                                          [--set SECTION.KEY=VALUE ...]

The anchor is not one llama-server but the best of several (issue 34): flash attention
on and off, ``-b``/``-ub`` 256 and llama.cpp's default batch (``ANCHORS``), each with
16 slots. Every load is run against each of them, and forged is compared, metric by
metric, with the best any of them reached there (lowest latency, highest rate); the
tables name which configuration that was.

1. Capacity: every server in a closed loop of 32 callers, mixed prompts. The best
   llama-server's requests/s there is "capacity" for the open-loop rates.
2. Closed loops at 8 callers, and one caller taking turns request by request.
3. Open loop (Poisson arrivals) at each of ``--loads`` times capacity, each run twice
   with different prompts and arrivals, the servers taking turns in an order that
   rotates from run to run, so that a slow spell of the machine reaches all.
4. Open loop at 1.5x capacity: what forged admits keeps its pace, what it refuses is
   answered at once with Retry-After; llama-server's latencies beside it.
5. Where a short request's first token went, from forged's access log at the highest
   open-loop load: waiting for a slot, admission to first token (and how many steps),
   and the rest (HTTP, tokenizing, delivery).

Writes bench/results/consistency.json and the tables for docs/benchmarks.md
(bench/results/consistency.md). Same model, threads and total KV for all servers.
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
    CONTEXT,
    MAX_TOKENS,
    MODEL,
    RESULTS,
    ROOT,
    THREADS,
    LlamaServer,
    _value,
)
from forged.observe.loadtest import (
    RATIO_KEYS,
    Prompt,
    make_prompts,
    ratios,
    run_alternating,
    run_load,
)
from forged.observe.stats import percentile

# The configurations that could be llama-server's best on this machine kind.
ANCHORS: dict[str, list[str]] = {
    "fa on, b/ub 256": ["-np", "16", "-b", "256", "-ub", "256", "-fa", "on"],
    "fa off, b/ub 256": ["-np", "16", "-b", "256", "-ub", "256", "-fa", "off"],
    "fa on, default batch": ["-np", "16", "-fa", "on"],
    "fa off, default batch": ["-np", "16", "-fa", "off"],
}
# How a metric improves: the rates up, everything else (latencies) down.
_HIGHER = frozenset(("req_per_s", "out_tok_per_s", "decode_tok_per_s"))


def best_of(anchors: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], dict[str, str]]:
    """The best figure any anchor reached, metric by metric, and which anchor it was.
    Only anchors that served every request count: one that failed some is faster for
    having done less."""
    whole = {n: r for n, r in anchors.items() if r["ok"] == r["requests"]} or anchors
    best: dict[str, Any] = {"errors": {}, "ok": max(r["ok"] for r in whole.values())}
    winner: dict[str, str] = {}
    for key in RATIO_KEYS:
        have = {n: r[key] for n, r in whole.items() if r.get(key)}
        if have:
            pick = (max if key in _HIGHER else min)(have, key=lambda n: have[n])
            best[key], winner[key] = have[pick], pick
    return best, winner


def _compared(out: dict[str, Any], got: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``out`` with forged's figures (``got``'s "forged"), the anchors' and their best."""
    anchors = {name: r for name, r in got.items() if name != "forged"}
    best, winner = best_of(anchors)
    out.update(forged=got["forged"], anchors=anchors, llama_server=best, winner=winner,
               ratio=ratios(got["forged"], best))
    return out


def _rotated(names: list[str], by: int) -> list[str]:
    by %= len(names)
    return names[by:] + names[:by]


async def _in_turn(urls: dict[str, str], order: list[str], prompts: list[Prompt],
                   label: str, **load: Any) -> dict[str, dict[str, Any]]:
    """The same load on each server in ``order``, one after the other."""
    return {name: await run_load(urls[name], prompts, model=None, label=f"{name} {label}",
                                 **load) for name in order}


async def closed(forged: str, ls: dict[str, str], c: int, n: int, seed: int
                 ) -> dict[str, Any]:
    prompts = make_prompts("mixed", n, MAX_TOKENS, seed=seed)
    urls = {"forged": forged, **ls}
    if c == 1:
        summaries = await run_alternating(tuple(urls.values()), prompts, duration=1800)
        got = dict(zip(urls, summaries, strict=True))
    else:
        got = await _in_turn(urls, _rotated(list(urls), seed), prompts, f"closed c={c}",
                             concurrency=c, rate=None, duration=600)
    return _compared({"kind": "closed", "concurrency": c}, got)


async def open_loop(forged: str, ls: dict[str, str], rate: float, n: int, seed: int
                    ) -> dict[str, Any]:
    prompts = make_prompts("mixed", n, MAX_TOKENS, seed=seed)
    urls = {"forged": forged, **ls}
    order = _rotated(list(urls), seed)
    got = await _in_turn(urls, order, prompts, f"open {rate:.2f}/s", concurrency=None,
                         rate=rate, duration=n / rate + 240, seed=seed)
    return _compared({"kind": "open", "rate": rate, "seed": seed, "order": ", ".join(order)},
                     got)


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
    ap.add_argument("--loads", default="0.3,0.5,0.8",
                    help="open-loop rates as fractions of capacity (each run twice)")
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
    servers = {name: LlamaServer(binary, flags, tmp / f"llama-server-{i}.log")
               for i, (name, flags) in enumerate(ANCHORS.items())}
    n = 32 if args.quick else 48
    result: dict[str, Any] = {
        "against": {name: "llama-server " + " ".join(flags) for name, flags in ANCHORS.items()},
        "overrides": args.set, "runs": []}

    def keep(run: dict[str, Any]) -> None:
        result["runs"].append(run)
        print(json.dumps({k: run[k] for k in run
                          if k not in ("forged", "llama_server", "anchors")}), flush=True)
        (RESULTS / "consistency.json").write_text(json.dumps(result, indent=2))

    try:
        forged.wait_ready()
        for server in servers.values():
            server.wait_ready()
        ls = {name: server.url for name, server in servers.items()}
        trio.run(closed, forged.url, ls, 16, 32, 99)  # warm-up: every slot used once
        sat = trio.run(closed, forged.url, ls, 32, 2 * n, 1)
        keep(sat)
        capacity = sat["llama_server"]["req_per_s"]
        result["capacity_req_per_s"] = capacity
        keep(trio.run(closed, forged.url, ls, 8, n, 2))
        keep(trio.run(closed, forged.url, ls, 1, n // 2, 3))
        loads = [float(f) for f in args.loads.split(",")]
        for seed, factor in enumerate(loads + loads, 10):
            start = forged.log.stat().st_size
            run = trio.run(open_loop, forged.url, ls, factor * capacity, n, seed)
            run["factor"] = factor
            if factor == max(loads):
                run["forged_short_ttft_breakdown"] = breakdown(forged.log, start)
            keep(run)
        run = trio.run(open_loop, forged.url, ls, 1.5 * capacity, n, 20)
        run["factor"] = 1.5
        keep(run)
    finally:
        forged.stop()
        for server in servers.values():
            server.stop()
    (RESULTS / "consistency.md").write_text(tables(result))
    print(tables(result))


# The metrics whose winner the second table names: header, key.
_WON = {"short TTFT p50": "short_ttft_p50", "short TTFT p99": "short_ttft_p99",
        "ITL p50": "itl_p50", "ITL p99": "itl_p99", "ITL max": "itl_max",
        "out tok/s": "out_tok_per_s"}


def _r(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _pair(run: dict[str, Any], key: str, unit: str = "s") -> str:
    a, b = run["forged"].get(key), run["llama_server"].get(key)
    if a is None or b is None:
        return "-"
    return f"{a:.2f} / {b:.2f}" + (f" {unit}" if unit else "")


def _load(run: dict[str, Any]) -> str:
    if run["kind"] == "closed":
        return f"closed, {run['concurrency']} caller" + ("s" if run["concurrency"] > 1 else "")
    return f"open {run['factor']}x ({run['rate']:.2f} req/s, seed {run['seed']})"


def _errors(run: dict[str, Any]) -> str:
    failed = {name: r["errors"] for name, r in run["anchors"].items() if r["errors"]}
    return f"{run['forged']['errors'] or '-'}; {failed or '-'}"


def tables(result: dict[str, Any]) -> str:
    anchors = result["against"]
    lines = ["The anchors: " + "; ".join(f"{name} (`{cmd}`)" for name, cmd in anchors.items())
             + f". Capacity (the best anchor's req/s at 32 callers) "
             f"{result.get('capacity_req_per_s', 0):.3f} req/s. Cells: forged / the best "
             "anchor at that load and metric, then the ratio.", "",
             "| load | short TTFT p50 | short TTFT p99 | ITL p50 | ITL p99 | ITL p99.9 | "
             "ITL max | out tok/s | ratios (TTFT p50, p99, ITL p50, p99, max, tok/s) | "
             "errors (forged; anchors) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for run in result["runs"]:
        r = run["ratio"]
        lines.append(
            f"| {_load(run)} | {_pair(run, 'short_ttft_p50')} | "
            f"{_pair(run, 'short_ttft_p99')} | "
            f"{_pair(run, 'itl_p50')} | {_pair(run, 'itl_p99')} | "
            f"{_pair(run, 'itl_p99_9')} | {_pair(run, 'itl_max')} | "
            f"{_pair(run, 'out_tok_per_s', '')} | {_r(r.get('short_ttft_p50'))}, "
            f"{_r(r.get('short_ttft_p99'))}, {_r(r.get('itl_p50'))}, {_r(r.get('itl_p99'))}, "
            f"{_r(r.get('itl_max'))}, {_r(r.get('out_tok_per_s'))} | {_errors(run)} |")
    lines += ["", "Which anchor was best, by load and metric:", "",
              "| load | " + " | ".join(_WON) + " |", "|---|" + "---|" * len(_WON)]
    for run in result["runs"]:
        won = run["winner"]
        lines.append(f"| {_load(run)} | " + " | ".join(won.get(k, "-") for k in _WON.values())
                     + " |")
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
