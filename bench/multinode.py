"""Three nodes behind HAProxy: what cache affinity and the agent's weights buy.

``python -m bench.multinode`` (about 5 minutes on 2 shared cores). Three forged nodes
with the tiny test model on loopback behind Debian's HAProxy with the shipped
configuration (bench/pool.py, as tests/test_multinode.py runs it). The three share
this machine's cores, so only ratios between runs of the same command mean anything.

1. **Affinity.** ``--users`` (24) users, each with a context of its own (about 600
   prompt tokens: a file of "their" code) and ``--turns`` (4) questions about it, asked
   by 3 callers in turn, each user sending its API key. The hit rate is the prompt
   tokens served from the prefix cache over all prompt tokens (``cached_tokens`` over
   ``prompt_tokens`` in ``usage``). Once with the shipped configuration (consistent
   hashing on the key, bounded load), once with its keyed backend's balancing replaced
   by ``balance roundrobin``. Each node has 8 slots: the users' contexts fit in the
   pool's cache when each node holds a third of them, not when each holds all.
2. **Agent weights with one slow node.** node3's every step is made ``--slow-ms`` (100)
   longer (a test hook, standing for a node with fewer or slower cores); ``--callers``
   (24) callers in a closed loop send ``--requests`` (360) streamed completions of
   ``--max-tokens`` (48), half with keys (``--keys``, 96 of them) and half anonymous.
   TTFT p95 with the shipped configuration, and with the agent check switched off
   (``agent-check`` removed from its server lines; the health checks stay). With
   ``--background N``, node3 also carries N long streams sent to it directly (a batch
   job on its own port, say): load HAProxy does not count, and only the agent reports.

``--only affinity`` or ``--only slow`` runs one part.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench.pool import SHIPPED, HAProxy, Node, held_streams, running_pool
from bench.run import RESULTS
from bench.tinymodel import write_tiny_llama
from forged.observe.stats import percentile

# One thread each: three nodes' llama.cpp threads spinning on 2 shared cores would
# slow every step many times over.
ENGINE = {"kv_layout": "unified", "kv_cells": 8192, "max_context": 1024, "slots": 8,
          "max_running": 8, "step_tokens": 64, "restart_backoff": 0.1, "threads": 1}
HASHING = "    balance hash var(txn.affinity)\n    hash-type consistent\n" \
          "    hash-balance-factor 150\n"
AGENT = " agent-check agent-port"


def variant(replace: str, by: str) -> str:
    text = SHIPPED.read_text()
    assert replace in text, replace
    return text.replace(replace, by)


def user_context(user: int) -> str:
    rng = random.Random(user)
    names = ["parse", "load", "merge", "route", "score", "index", "fetch", "close"]
    lines = [f"def {rng.choice(names)}_{user}_{i}(x):\n    return x * {rng.randint(2, 99)}\n"
             for i in range(24)]
    return "".join(lines)


def run_affinity(ha: HAProxy, users: int, turns: int) -> dict[str, float]:
    """Each user's turns in order, three callers; the pool's prefix-cache hit rate."""
    totals = {"prompt": 0, "cached": 0, "errors": 0}
    lock = threading.Lock()
    queue = list(range(users))

    def caller() -> None:
        with httpx.Client(base_url=ha.front, timeout=120) as c:
            while True:
                with lock:
                    if not queue:
                        return
                    user = queue.pop(0)
                for turn in range(turns):
                    r = c.post("/v1/completions", headers={"Authorization": f"Bearer u{user}"},
                               json={"prompt": user_context(user) + f"# question {turn}:",
                                     "max_tokens": 4, "temperature": 0})
                    with lock:
                        if r.status_code != 200:
                            totals["errors"] += 1
                            continue
                        usage = r.json()["usage"]
                        totals["prompt"] += usage["prompt_tokens"]
                        totals["cached"] += usage["prompt_tokens_details"]["cached_tokens"]

    threads = [threading.Thread(target=caller) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    return {**totals, "hit_rate": totals["cached"] / max(1, totals["prompt"])}


def run_slow_node(ha: HAProxy, nodes: list[Node], args: argparse.Namespace
                  ) -> dict[str, Any]:
    """A closed loop of streamed requests while node3 is slowed; TTFT percentiles."""
    with nodes[2].admin() as admin:
        admin.post("/debug/slow-steps", params={"seconds": str(args.slow_ms / 1000)})
    with held_streams((nodes[2].api_host, nodes[2].port), [None] * args.background):
        if args.background:
            time.sleep(3)  # a few agent checks: HAProxy sees the node's weight first
        return closed_loop(ha, args)


def closed_loop(ha: HAProxy, args: argparse.Namespace) -> dict[str, Any]:
    """``--callers`` callers through HAProxy until ``--requests`` are done: TTFT
    percentiles, and how many keyed requests each node served."""
    ttfts: list[float] = []
    errors = 0
    lock = threading.Lock()
    left = iter(range(args.requests))

    def caller() -> None:
        nonlocal errors
        with httpx.Client(base_url=ha.front, timeout=120) as c:
            for n in left:
                headers = {"Authorization": f"Bearer k{n % args.keys}"} if n % 2 else {}
                ttft = first_token(c, headers, args.max_tokens)
                with lock:
                    if ttft is None:
                        errors += 1
                    else:
                        ttfts.append(ttft)

    threads = [threading.Thread(target=caller) for _ in range(args.callers)]
    before = ha.servers()
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(1800)
    share = {s: int(r["stot"]) - int(before[(b, s)]["stot"])
             for (b, s), r in ha.servers().items() if b == "forged_keyed"}
    return {"requests": len(ttfts), "errors": errors, "wall_s": time.monotonic() - t0,
            "ttft_p50": percentile(ttfts, 50), "ttft_p95": percentile(ttfts, 95),
            "keyed_share": share}


def first_token(c: httpx.Client, headers: dict[str, str], max_tokens: int) -> float | None:
    t0 = time.monotonic()
    body = {"prompt": "Write a haiku about load balancers.", "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True}
    ttft = None
    with c.stream("POST", "/v1/completions", headers=headers, json=body) as r:
        if r.status_code != 200:
            return None
        for line in r.iter_lines():
            if ttft is None and line.startswith("data: {"):
                ttft = time.monotonic() - t0
    return ttft


def in_pool(tmp: Path, model: Path, name: str, config: str,
            work: Callable[[HAProxy, list[Node]], dict[str, Any]]) -> dict[str, Any]:
    (tmp / name).mkdir()
    with running_pool(tmp / name, model, engine=ENGINE, server={"drain_grace": 1.0},
                      config=config) as (nodes, ha):
        out = work(ha, nodes)
    print(f"{name}: {json.dumps(out)}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--users", type=int, default=24)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--callers", type=int, default=24)
    p.add_argument("--requests", type=int, default=360)
    p.add_argument("--keys", type=int, default=96)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--slow-ms", type=float, default=100.0)
    p.add_argument("--background", type=int, default=0)
    p.add_argument("--only", choices=["affinity", "slow"])
    args = p.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = write_tiny_llama(tmp / "tiny.gguf")
        result: dict[str, Any] = {"commit": commit, "args": vars(args)}
        if args.only in (None, "affinity"):
            roundrobin = variant(HASHING, "    balance roundrobin\n")
            aff = result["affinity"] = {
                name: in_pool(tmp, model, name, config,
                              lambda ha, _: run_affinity(ha, args.users, args.turns))
                for name, config in [("consistent", SHIPPED.read_text()),
                                     ("roundrobin", roundrobin)]}
            result["hit_rate_ratio"] = aff["consistent"]["hit_rate"] \
                / max(1e-9, aff["roundrobin"]["hit_rate"])
        if args.only in (None, "slow"):
            slow = result["slow_node"] = {
                name: in_pool(tmp, model, name, config,
                              lambda ha, nodes: run_slow_node(ha, nodes, args))
                for name, config in [("agent", SHIPPED.read_text()),
                                     ("no_agent", variant(AGENT, " agent-port"))]}
            result["ttft_p95_ratio_no_agent_over_agent"] = \
                (slow["no_agent"]["ttft_p95"] or 0) / max(1e-9, slow["agent"]["ttft_p95"] or 0)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"multinode-{args.only or 'all'}.json"
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k.endswith(("ratio", "agent"))},
                     indent=2))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
