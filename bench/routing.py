"""Cache-aware against least-loaded routing, two workers: ``python -m bench.routing``.

One daemon per routing policy and workload (``engine.workers = 2``, one thread each, so
the two workers share this 2-core machine), each started cold, with the same prompts
and seeds:

* ``shared-prefix``: ``--teams`` (16) repository contexts of about 600 tokens; each
  request is one team's context and a new question, ``--callers`` (4) at once, closed
  loop, ``--requests`` (64) in all.
* ``conversation``: ``--sessions`` (8) conversations of ``--turns`` (4) turns each, a
  turn being the whole history, a new question and ``session``; ``--callers`` at once,
  each taking its conversations' turns in order.

Measured, per run: the cache hit rate (prompt tokens served from a cache, of all prompt
tokens: ``usage.prompt_tokens_details.cached_tokens``), TTFT p50, and how the daemon
routed (``forged_routed_requests``). By default on the shipped SmolLM2-135M;
``--tiny`` uses the test suite's tiny model (cheap steps: the hit rates mean the same,
the TTFTs much less), whose byte-level vocabulary makes every text about three times
as many tokens: its contexts are a quarter as long.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import trio

from bench.daemonproc import DaemonProcess, free_port, write_config
from bench.run import MODEL
from bench.tinymodel import write_tiny_llama
from forged.observe.loadtest import _code
from forged.observe.stats import percentile

POLICIES = ("cache_aware", "least_loaded")
MAX_TOKENS = 16

Turn = dict[str, Any]  # a request body
# One caller's requests, in order; a conversation's turn is built from the last answer.
Script = list[Callable[[list[str]], Turn]]


def _fixed(text: str) -> Callable[[list[str]], Turn]:
    """A turn that sends ``text`` whatever came before."""
    return lambda _history: {"prompt": text}


def shared_prefix(args: argparse.Namespace) -> list[Script]:
    rng = random.Random(args.seed)
    contexts = [f"# repository {t}\n" + _code(random.Random(t), 12 if args.tiny else 45) + "\n"
                for t in range(args.teams)]
    prompts = [contexts[rng.randrange(args.teams)] + f"# Question {i}: what does line "
               f"{i % 40} do?\n" for i in range(args.requests)]
    turns: Script = [_fixed(text) for text in prompts]
    return [turns[c::args.callers] for c in range(args.callers)]


def conversation(args: argparse.Namespace) -> list[Script]:
    def turn(s: int, k: int) -> Callable[[list[str]], Turn]:
        def body(history: list[str]) -> Turn:
            if k == 0:
                history.clear()
                lines = 4 if args.tiny else 12
                history.append(f"# conversation {s}\n" + _code(random.Random(s), lines) + "\n")
            history.append(f"# Turn {k}: and what about line {k}?\n")
            return {"prompt": "".join(history), "session": f"chat-{s}"}
        return body
    scripts: list[Script] = [[] for _ in range(args.callers)]
    for s in range(args.sessions):
        scripts[s % args.callers] += [turn(s, k) for k in range(args.turns)]
    return scripts


WORKLOADS = {"shared-prefix": shared_prefix, "conversation": conversation}


async def one(c: httpx.AsyncClient, body: Turn, history: list[str]) -> dict[str, float]:
    body = {**body, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0, ttft, text = time.monotonic(), None, []
    usage: dict[str, Any] = {}
    async with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            usage = data.get("usage") or usage
            for ch in data.get("choices", []):
                if ch.get("text"):
                    ttft = ttft if ttft is not None else time.monotonic() - t0
                    text.append(ch["text"])
    history.append("".join(text) + "\n")
    return {"ttft": ttft if ttft is not None else time.monotonic() - t0,
            "prompt": usage["prompt_tokens"],
            "cached": usage["prompt_tokens_details"]["cached_tokens"]}


async def drive(url: str, scripts: list[Script]) -> list[dict[str, float]]:
    out: list[dict[str, float]] = []

    async def caller(script: Script) -> None:
        history: list[str] = []
        for make in script:
            out.append(await one(c, make(history), history))

    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        with trio.fail_after(1800):
            async with trio.open_nursery() as nursery:
                for script in scripts:
                    nursery.start_soon(caller, script)
    return out


def routed(d: DaemonProcess) -> dict[str, float]:
    sock = str(d.config.parent / "admin.sock")
    with httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://admin") as a:
        totals = a.get("/stats").json()["engine"]["totals"]
    return {k.removeprefix("routed_by_"): v for k, v in totals.items()
            if k.startswith("routed_by_")}


def run_one(model: Path, tmp: Path, policy: str, workload: str,
            args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    folder = tmp / f"{policy}-{workload}"
    folder.mkdir()
    engine = {"workers": 2, "threads": 1, "routing": policy}
    d = DaemonProcess(write_config(folder / "forged.toml", model, port, engine=engine), port)
    try:
        d.wait_ready(300)
        samples = trio.run(drive, d.url, WORKLOADS[workload](args))
        by = routed(d)
    finally:
        d.stop()
    prompt = sum(s["prompt"] for s in samples)
    return {"policy": policy, "workload": workload, "requests": len(samples),
            "hit_rate": sum(s["cached"] for s in samples) / prompt if prompt else 0.0,
            "ttft_p50": percentile([s["ttft"] for s in samples], 50) or 0.0, "routed": by}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--only", choices=tuple(WORKLOADS))
    p.add_argument("--callers", type=int, default=4)
    p.add_argument("--teams", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        model = write_tiny_llama(tmp / "tiny.gguf") if args.tiny else MODEL
        for workload in [args.only] if args.only else list(WORKLOADS):
            for policy in POLICIES:
                rows.append(row := run_one(model, tmp, policy, workload, args))
                print(f"{workload:<14} {policy:<13} {row['requests']:>4} requests  "
                      f"hit rate {100 * row['hit_rate']:5.1f}%  "
                      f"TTFT p50 {row['ttft_p50']:.3f} s  routed {row['routed']}",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
