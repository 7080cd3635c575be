"""The engine's ceiling (issue 34): forged's computed tokens per second at saturation
beside what llama.cpp itself computes at the same batch size, one command.

    .venv/bin/python -m bench.ceiling [--seconds S]

forged (the comparison benchmark's configuration: same model, threads, 16 slots of
2,048 cells) serves a closed loop of 32 callers with the mixed prompts for ``S``
seconds (120): it runs its 16 sequences all the time, with more waiting. Its computed
tokens per second are the prompt tokens it computed (not those the caches served)
plus the tokens it generated, over the wall time, from its own counters.

``llama-batched-bench`` (built beside llama-server by bench/build-llama-server.sh)
then computes 16 sequences of the prompt length forged computed on average and 64
output tokens each, with per-sequence KV streams as forged's layout, in each of the
configurations that could be llama.cpp's best here: flash attention on and off, batch
256 and the default. Its best total speed (prompt plus output tokens over the time of
both phases) is the ceiling; the goal is forged at 95% of it or more. llama-server, in
the comparison's best configuration, serves the same closed loop for the same time,
so that the ceiling's distance from serving is seen on the peer too. The table goes
to bench/results/ceiling.md, the figures to ceiling.json.

``--forged-only``: forged's loop alone, printed, nothing written: to set two settings
(``--set``) or two commits side by side, run in turn.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from bench.daemonproc import DaemonProcess, free_port, write_config
from bench.run import (
    BEST,
    CONTEXT,
    MAX_TOKENS,
    MODEL,
    ROOT,
    THREADS,
    LlamaServer,
    _value,
    forged_counters,
    llama_counters,
    step_shape,
    write_results,
)
from forged.observe.loadtest import make_prompts, run_load

BATCH = 16  # forged's running sequences in the comparison configuration
CONFIGS = {  # llama-batched-bench's options beside the model, threads and context
    "fa on, -b 256 -ub 256": ["-fa", "on", "-b", "256", "-ub", "256"],
    "fa off, -b 256 -ub 256": ["-fa", "off", "-b", "256", "-ub", "256"],
    "fa on, default batch": ["-fa", "on"],
    "fa off, default batch": ["-fa", "off"],
}
# One row of its table: PP, TG, B, N_KV, then T_PP s, S_PP t/s, T_TG s, S_TG t/s, T s, S t/s.
_ROW = re.compile(r"^\|" + r"\s*(\d+)\s*\|" * 4 + r"\s*([\d.]+)\s*\|" * 6)


def closed_loop(url: str, counters: Callable[[], dict[str, float]], label: str,
                seconds: float) -> dict[str, Any]:
    """A server's computed tokens per second in a closed loop of 32 mixed callers,
    from its own ``counters`` (steps and tokens computed) before and after."""
    # More than the loop can take, refusals included: it must not run dry
    prompts = make_prompts("mixed", 8192, MAX_TOKENS, seed=34)
    before, t0 = counters(), time.monotonic()
    s = trio.run(lambda: run_load(url, prompts, concurrency=32, rate=None,
                                  duration=seconds, model=None, label=label))
    wall = time.monotonic() - t0
    shape = step_shape(before, counters(), wall)
    return {"requests": s["ok"], "errors": s["errors"], "wall_s": wall, **shape,
            "computed_tok_per_s": shape["tokens_computed"] / wall,
            # what it computed a request: the caches serve the mix's few shared lines
            "prompt_per_request": (s["prompt_tokens"] - (s["cached_tokens"] or 0))
            / max(1, s["ok"])}


def forged_saturated(seconds: float, engine_set: dict[str, Any]) -> dict[str, Any]:
    """forged (16 running) in the closed loop."""
    tmp = Path(tempfile.mkdtemp())
    port = free_port()
    engine = {"threads": THREADS, "kv_cells": CONTEXT, "slots": BATCH, "max_running": BATCH,
              "max_context": CONTEXT // BATCH, **engine_set}
    d = DaemonProcess(write_config(tmp / "forged.toml", MODEL, port, engine=engine), port)
    try:
        d.wait_ready()
        return closed_loop(d.url, lambda: forged_counters(f"unix:{tmp}/admin.sock"),
                           "forged c=32", seconds)
    finally:
        d.stop()


def llama_server_saturated(server: str, seconds: float) -> dict[str, Any]:
    """llama-server (the comparison's best configuration) in the same closed loop."""
    tmp = Path(tempfile.mkdtemp())
    ls = LlamaServer(server, [*BEST, "--metrics"], tmp / "llama-server.log")
    try:
        ls.wait_ready()
        return closed_loop(ls.url, lambda: llama_counters(ls.url), "llama-server c=32",
                           seconds)
    finally:
        ls.stop()


def batched_bench(binary: Path, options: list[str], pp: int) -> dict[str, float]:
    """One llama-batched-bench run at BATCH sequences of ``pp`` + MAX_TOKENS tokens."""
    out = subprocess.run(
        [str(binary), "-m", str(MODEL), "-t", str(THREADS), "-tb", str(THREADS),
         "-c", str(CONTEXT), "-no-kvu", "-npp", str(pp), "-ntg", str(MAX_TOKENS),
         "-npl", str(BATCH), *options],
        check=True, capture_output=True, text=True, timeout=900).stdout
    for line in out.splitlines():
        m = _ROW.match(line.strip())
        if m:
            return {"pp_tok_per_s": float(m[6]), "tg_tok_per_s": float(m[8]),
                    "total_s": float(m[9]), "tok_per_s": float(m[10])}
    raise RuntimeError(f"no result row in llama-batched-bench's output:\n{out}")


def table(r: dict[str, Any]) -> str:
    f = r["forged"]
    lines = [f"forged, closed loop of 32 (16 running): {f['computed_tok_per_s']:.1f} computed "
             f"tok/s ({f['tokens_computed']:.0f} tokens in {f['wall_s']:.0f} s, "
             f"{f['tokens_per_step']:.1f} a step, {f['requests']} requests answered, "
             f"refused {f['errors'] or 'none'}, "
             f"{f['prompt_per_request']:.0f} prompt tokens a request).", "",
             f"| llama-batched-bench, {BATCH} x ({r['pp']} + {MAX_TOKENS}) | prompt tok/s | "
             "output tok/s | total tok/s | forged ÷ it |", "|---|---|---|---|---|"]
    for name, b in r["llama"].items():
        lines.append(f"| {name} | {b['pp_tok_per_s']:.1f} | {b['tg_tok_per_s']:.1f} | "
                     f"{b['tok_per_s']:.1f} | {f['computed_tok_per_s'] / b['tok_per_s']:.2f} |")
    p, best = r["llama_server"], r["llama"][r["best"]]["tok_per_s"]
    lines += ["", f"Ceiling: {r['best']}; forged at {r['fraction']:.2f} of it (goal 0.95). "
              f"llama-server ({' '.join(BEST)}) in the same loop: {p['computed_tok_per_s']:.1f} "
              f"computed tok/s ({p['tokens_per_step']:.1f} a step, {p['requests']} requests "
              f"answered), {p['computed_tok_per_s'] / best:.2f} of the ceiling."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an [engine] key for forged, e.g. target_step_ms=1000")
    ap.add_argument("--forged-only", action="store_true",
                    help="only forged's closed loop, printed, nothing written")
    args = ap.parse_args()
    engine_set = {k: _value(v) for k, _, v in (item.partition("=") for item in args.set)}
    if args.forged_only:
        f = forged_saturated(args.seconds, engine_set)
        print(f"forged {engine_set}: {f['computed_tok_per_s']:.1f} computed tok/s, "
              f"{f['tokens_per_step']:.1f} a step, {f['requests']} requests answered")
        return
    server = subprocess.run([str(ROOT / "bench" / "build-llama-server.sh")], check=True,
                            capture_output=True, text=True, cwd=ROOT).stdout.strip()
    binary = Path(server).parent / "llama-batched-bench"
    forged = forged_saturated(args.seconds, engine_set)
    peer = llama_server_saturated(server, args.seconds)
    pp = round(forged["prompt_per_request"])
    llama = {name: batched_bench(binary, opts, pp) for name, opts in CONFIGS.items()}
    best = max(llama, key=lambda name: llama[name]["tok_per_s"])
    result = {"threads": THREADS, "batch": BATCH, "engine_set": engine_set, "pp": pp,
              "forged": forged, "llama_server": peer, "llama": llama, "best": best,
              "fraction": forged["computed_tok_per_s"] / llama[best]["tok_per_s"]}
    write_results("ceiling", result, table(result))


if __name__ == "__main__":
    main()
