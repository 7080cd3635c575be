"""One caller: where a lone stream's time goes, against llama-server (issue 34).

    .venv/bin/python -m bench.onecaller [--reps 5]

About 3 minutes on 2 cores. Four parts, every server alone in turn, same model and
threads, 16 slots of 2,048 cells:

1. **Served.** One stream of 256 greedy tokens at a time (``ignore_eos``), ``--reps``
   times, through forged as shipped and llama-server with flash attention on and off:
   time to first token and the median gap, as a caller sees them; forged's daemon CPU
   per token (the door) apart.
2. **Decode alone.** forged's own llama.cpp binding (forged/engine/backend.py) decoding
   one sequence 256 times from depth 40, with nothing else running, in forged's
   layout: the step the served stream would take with no serving around it.
3. **llama.cpp's own.** ``llama-batched-bench`` at one sequence of 40 + 256 tokens.
4. **Python after a decode.** One refit of the cost model timed right after a decode
   step and again at once: what the worker's own Python costs once the step has
   filled the caches with weights.

``--forged-only``: part 1 for forged alone, printed, nothing written: to set two
commits side by side (run it in each checkout, in turn, a few times).

Results: bench/results/onecaller.json and onecaller.md.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.daemonproc import DaemonProcess, free_port, write_config
from bench.frontdoor import cpu_seconds
from bench.run import CONTEXT, MODEL, ROOT, THREADS, LlamaServer, write_results
from forged.engine.backend import ContextParams, Llama
from forged.engine.costmodel import CostModel, decode_shape

TOKENS = 256
DEPTH = 40  # the prompt before the stream, as a short chat's


def one_stream(port: int, tokens: int = TOKENS) -> tuple[float, float]:
    """Time to first token and the median gap between tokens, in ms."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = json.dumps({"messages": [{"role": "user", "content": "Write a long story."}],
                       "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    times = []
    while line := response.readline():
        if line.startswith(b"data: {") and b'"content":"' in line:
            times.append(time.perf_counter())
    conn.close()
    gaps = [(b - a) * 1000 for a, b in itertools.pairwise(times)]
    return (times[0] - t0) * 1000, statistics.median(gaps)


def served(name: str, port: int, pid: int, reps: int, door: bool) -> dict[str, Any]:
    one_stream(port, 16)  # warm
    cpu0 = cpu_seconds(pid)
    runs = [one_stream(port) for _ in range(reps)]
    door_us = (cpu_seconds(pid) - cpu0) / (reps * TOKENS) * 1e6
    return {"server": name, "ttft_ms": [round(r[0], 1) for r in runs],
            "itl_p50_ms": [round(r[1], 2) for r in runs],
            "itl_p50_median_ms": round(statistics.median(r[1] for r in runs), 2),
            "ttft_median_ms": round(statistics.median(r[0] for r in runs), 1),
            "door_cpu_us_per_token": round(door_us, 1) if door else None}


def forged_served(reps: int) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp())
    port = free_port()
    engine = {"threads": THREADS, "kv_cells": CONTEXT, "slots": 16, "max_running": 16,
              "max_context": CONTEXT // 16}
    d = DaemonProcess(write_config(tmp / "forged.toml", MODEL, port, engine=engine), port)
    d.wait_ready(120)
    try:
        out = served("forged", port, d.proc.pid, reps, door=True)
        status = subprocess.run([str(ROOT / ".venv" / "bin" / "forged"), "status", "--admin",
                                 f"unix:{tmp}/admin.sock"], capture_output=True, text=True)
        attention = re.search(r"flash attention[^\n]*", status.stdout)
        out["flash_attention"] = attention[0] if attention else "?"
        return out
    finally:
        d.stop()


def llama_served(binary: str, fa: str, reps: int) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp())
    server = LlamaServer(binary, ["-np", "16", "-fa", fa], tmp / "llama.log")
    server.wait_ready()
    try:
        return served(f"llama-server -fa {fa}", server.port, server.proc.pid, reps, door=False)
    finally:
        server.stop()


def decode_alone(flash_attn: bool) -> dict[str, Any]:
    llama = Llama(str(MODEL), ContextParams(n_ctx=CONTEXT, n_seq_max=16, n_batch=512,
                                            threads=THREADS, flash_attn=flash_attn,
                                            kv_unified=False))
    try:
        llama.decode([(0, 0, list(range(100, 100 + DEPTH)), 1)])
        steps, after, again = [], [], []
        model, shape = CostModel(), decode_shape([DEPTH + TOKENS // 2])
        for i in range(TOKENS):
            t0 = time.perf_counter()
            llama.decode([(0, DEPTH + i, [200 + i % 50], 1)])
            t1 = time.perf_counter()
            model.observe(shape, 8.0)
            t2 = time.perf_counter()
            model.observe(shape, 8.0)
            t3 = time.perf_counter()
            steps.append((t1 - t0) * 1000)
            after.append((t2 - t1) * 1e6)
            again.append((t3 - t2) * 1e6)
    finally:
        llama.close()
    return {"flash_attn": flash_attn, "decode_p50_ms": round(statistics.median(steps), 2),
            "refit_after_decode_us": round(statistics.median(after)),
            "refit_again_us": round(statistics.median(again))}


def batched_bench(binary: str, fa: str) -> dict[str, Any]:
    bench = Path(binary).with_name("llama-batched-bench")
    out = subprocess.run([str(bench), "-m", str(MODEL), "-c", str(CONTEXT), "-npl", "1",
                          "-npp", str(DEPTH), "-ntg", str(TOKENS), "-t", str(THREADS),
                          "-fa", fa], capture_output=True, text=True, check=True).stdout
    row = [line for line in out.splitlines() if line.startswith("|") and "PP" not in line
           and "---" not in line][-1]
    tg_speed = float(row.strip("|").split("|")[7])
    return {"fa": fa, "decode_ms": round(1000 / tg_speed, 2), "tg_tok_s": tg_speed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5, help="streams per server")
    ap.add_argument("--forged-only", action="store_true",
                    help="only forged's served streams: TTFT, ITL p50, door CPU a token")
    args = ap.parse_args()
    if args.forged_only:
        r = forged_served(args.reps)
        print(f"forged: TTFT {r['ttft_median_ms']} ms, ITL p50 {r['itl_p50_median_ms']} ms, "
              f"door CPU {r['door_cpu_us_per_token']} µs a token")
        return
    binary = subprocess.run([str(ROOT / "bench" / "build-llama-server.sh")], check=True,
                            capture_output=True, text=True, cwd=ROOT).stdout.strip()
    result = {"threads": THREADS, "tokens": TOKENS, "depth": DEPTH,
              "served": [forged_served(args.reps), llama_served(binary, "on", args.reps),
                         llama_served(binary, "off", args.reps)],
              "alone": [decode_alone(False), decode_alone(True)],
              "batched_bench": [batched_bench(binary, "off"), batched_bench(binary, "on")]}
    write_results("onecaller", result, tables(result))


def tables(result: dict[str, Any]) -> str:
    lines = ["| served, one stream of 256 tokens | TTFT ms (median) | ITL p50 ms (median) "
             "| ITL p50 each run | door CPU µs/token |", "|---|---|---|---|---|"]
    lines += [f"| {r['server']} | {r['ttft_median_ms']} | {r['itl_p50_median_ms']} "
              f"| {', '.join(str(x) for x in r['itl_p50_ms'])} "
              f"| {r['door_cpu_us_per_token'] or '-'} |" for r in result["served"]]
    lines += ["", "| decode alone | ms a token (p50) | cost-model refit right after a "
              "decode, µs | the same refit again, µs |", "|---|---|---|---|"]
    lines += [f"| forged's binding, flash attention {'on' if r['flash_attn'] else 'off'} "
              f"| {r['decode_p50_ms']} | {r['refit_after_decode_us']} | {r['refit_again_us']} |"
              for r in result["alone"]]
    lines += [f"| llama-batched-bench, -fa {r['fa']} | {r['decode_ms']} | - | - |"
              for r in result["batched_bench"]]
    forged = result["served"][0]
    lines += ["", f"forged's worker chose: {forged['flash_attention']}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
