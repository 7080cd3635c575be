"""Where short requests' time to first token goes, for forged alone, in one open loop.

    .venv/bin/python -m bench.trace RATE [--requests N] [--seed S] [--set SECTION.KEY=VALUE]
                                         [--tree PATH]
    .venv/bin/python -m bench.trace --callers C [--requests N] ...

Starts forged (the shipped configuration with the comparison benchmark's threads,
slots and context), warms it up, sends N mixed requests as Poisson arrivals at RATE
requests/s (or from C callers in a closed loop), and prints the callers' latencies,
the breakdown of short requests' TTFT from the access log (bench.consistency's), and
the steps that carried prompt work against those that decoded alone (``/stats``).
``--tree`` runs the daemon from another checkout (for instance an older commit, to
compare).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import msgspec
import trio

from bench.consistency import breakdown, shipped_sections
from bench.daemonproc import DaemonProcess, free_port, write_config
from bench.run import MAX_TOKENS, MODEL
from forged.engine.stats import Counts, Totals, prompt_step_shares
from forged.observe.loadtest import make_prompts, run_load
from forged.observe.status import fetch_stats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("rate", type=float, nargs="?", help="arrivals a second (open loop)")
    ap.add_argument("--callers", type=int, help="a closed loop of this many callers instead")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--tree", help="run the daemon from this checkout")
    args = ap.parse_args()
    if (args.rate is None) == (args.callers is None):
        ap.error("give either RATE or --callers")
    tmp = Path(tempfile.mkdtemp())
    port = free_port()
    cfg = write_config(tmp / "forged.toml", MODEL, port, **shipped_sections(args.set))
    d = DaemonProcess(cfg, port,
                      env={"PYTHONPATH": args.tree} if args.tree else None)
    try:
        d.wait_ready()
        warm = make_prompts("mixed", 16, MAX_TOKENS, seed=99)
        trio.run(lambda: run_load(d.url, warm, concurrency=16, rate=None, duration=300,
                                  model=None))
        start = d.log.stat().st_size
        admin = f"unix:{cfg.parent / 'admin.sock'}"
        before = _totals(admin)
        prompts = make_prompts("mixed", args.requests, MAX_TOKENS, seed=args.seed)
        duration = 600 if args.callers else args.requests / args.rate + 240
        s = trio.run(lambda: run_load(d.url, prompts, concurrency=args.callers,
                                      rate=args.rate, duration=duration, model=None,
                                      seed=args.seed))
        mix = step_mix(before, _totals(admin))
    finally:
        d.stop()
    keys = ("ok", "errors", "wall_s", "out_tok_per_s", "short_ttft_p50", "short_ttft_p99",
            "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "itl_p99_9", "itl_max")
    print(json.dumps({k: s[k] for k in keys}))
    print(json.dumps(breakdown(d.log, start)))
    print(json.dumps(mix))


def _totals(admin: str) -> Totals:
    return msgspec.convert(fetch_stats(admin)["engine"]["totals"], Totals)


def step_mix(a: Totals, b: Totals) -> dict[str, float]:
    """The steps between two reports: how many carried prompt work, their share of the
    time and of the tokens generated, and each kind's mean time and tokens (decoders)."""
    d = Counts(**{f: getattr(b, f) - getattr(a, f) for f in (
        "steps", "prompt_steps", "step_seconds", "prompt_step_seconds", "tokens_generated",
        "prompt_step_tokens")})
    steps_share, time_share, tokens_share = prompt_step_shares(d) or (0.0, 0.0, 0.0)
    prompt, prompt_s, prompt_t = d.prompt_steps, d.prompt_step_seconds, d.prompt_step_tokens
    decode = max(1.0, d.steps - prompt)
    return {"prompt_steps_share": round(steps_share, 3),
            "prompt_time_share": round(time_share, 3),
            "prompt_tokens_share": round(tokens_share, 3),
            "prompt_step_ms": round(prompt_s / max(1.0, prompt) * 1000, 1),
            "prompt_step_tokens": round(prompt_t / max(1.0, prompt), 2),
            "decode_step_ms": round((d.step_seconds - prompt_s) / decode * 1000, 1),
            "decode_step_tokens": round((d.tokens_generated - prompt_t) / decode, 2)}


if __name__ == "__main__":
    main()
