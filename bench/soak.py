"""Reliability: a long soak at 0.8x capacity with a realistic mix and hostile requests,
optionally with a worker killed every minute. One command:

    .venv/bin/python -m bench.soak [--minutes 60] [--kill-every 60] [--quick]

1. Capacity: forged's requests/s in a closed loop of 32 callers (mixed prompts).
2. The soak: Poisson arrivals at ``--load`` x capacity for ``--minutes``: chat, plain
   completions, chat with retrieval over an index of forged's own source, and fill-in-
   the-middle on a second, tiny model with FIM tokens (SmolLM2 has none); a few hostile
   requests a minute (schema bombs, unicode digits, deep JSON, a tokenizer flood), each
   of which must be a 4xx.
3. Every 30 s: the RSS of the daemon and of each worker. Flat means the mean of the
   last ten minutes is within 10% of that of minute 10 to minute 20 (or, shorter runs,
   the second sixth against the last).
4. With ``--kill-every S``: SIGKILL one SmolLM2 worker every S seconds, of two (one
   thread each; the soak alone runs one of two threads). Only streams on that worker
   may fail, each with a clean error event (a 599 here); nothing else: requests it had
   not started go to the other worker, and new ones go there while it restarts.

Writes bench/results/soak.json and a table for docs/benchmarks.md (soak.md). Every
loop is bounded by the duration and stops by itself.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from bench.daemonproc import DaemonProcess, free_port, write_config
from bench.run import MAX_TOKENS, MODEL, RESULTS, ROOT, THREADS, rss_kb
from bench.tinymodel import write_tiny_llama
from forged.observe.loadtest import Prompt, Sample, make_prompts, one_request, summarise

# The hostile requests: (path, body). Each must be answered with a 4xx, but the last:
# a tokenizer flood is a valid request (200, or 429 over the key's limit) that must
# stall nobody.
_DEEP = "[" * 1001 + "]" * 1001
HOSTILE: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "x", "schema": {"type": "string",
                                                          "maxLength": 200000}}}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "json_schema": {"type": "array", "minItems": 4000000}}),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"\u00b2": 1}}),
    ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "c", "type": "function", "function": {"name": "f", "arguments": _DEEP}}]},
        {"role": "tool", "tool_call_id": "c", "content": "x"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "grammar": "root ::= " + "(" * 20000 + '"a"' + ")" * 20000}),
    ("/tokenize", {"content": "def f(x):\n    return x\n" * 40000, "with_pieces": True}),
]


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _workers(d: DaemonProcess) -> list[dict[str, Any]]:
    sock = str(d.config.parent / "admin.sock")
    with httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://admin",
                      timeout=10) as a:
        workers: list[dict[str, Any]] = a.get("/stats").json()["engine"]["workers"]
        return workers


def _index(config: Path) -> None:
    """An index of forged's own source (under the config's state_dir), for the
    requests that retrieve."""
    subprocess.run([sys.executable, "-m", "forged", "index", "add", "forged",
                    str(ROOT / "forged"), "--config", str(config)],
                   check=True, timeout=600, capture_output=True)


def _mix(n: int, seed: int) -> list[Prompt]:
    """Chat and completions (forged's mixed prompts), a quarter of chats drawing on the
    index, and a fifth of all requests fill-in-the-middle on the FIM model."""
    rng = random.Random(seed)
    out = []
    for p in make_prompts("mixed", n, MAX_TOKENS, seed=seed):
        body = dict(p.body)
        roll = rng.random()
        if roll < 0.2:
            body = {"model": "fim", "prompt": "def add(a, b):\n    ", "suffix": "\n",
                    "max_tokens": 16, "stream": True}
        elif roll < 0.35 and "messages" in body:
            body["repo"] = "forged"
        out.append(Prompt(p.kind, body))
    return out


async def _hostile(client: httpx.AsyncClient, base: str, every: float,
                   answers: list[tuple[str, int]]) -> None:
    i = 0
    while True:
        await trio.sleep(every)
        path, body = HOSTILE[i % len(HOSTILE)]
        try:
            r = await client.post(base + path, json=body)
            answers.append((path, r.status_code))
        except httpx.HTTPError:
            answers.append((path, 598))
        i += 1


async def _watch(d: DaemonProcess, every: float, rows: list[dict[str, Any]]) -> None:
    """RSS every ``every`` s; the workers' also less their RAM tier of saved KV states,
    a cache that grows by design up to engine.cache_ram_mib (what must stay flat is
    the rest)."""
    t0 = time.monotonic()
    while True:
        workers = [w for w in _children(d.proc.pid) if rss_kb(w)]
        stats = await trio.to_thread.run_sync(_workers, d)
        tier = sum(w["stats"].get("kv_ram_bytes", 0) for w in stats) // 1024
        total = sum(rss_kb(w) for w in workers)
        rows.append({"t": time.monotonic() - t0, "daemon_kib": rss_kb(d.proc.pid),
                     "workers_kib": total, "tier_kib": tier,
                     "workers_less_tier_kib": total - tier})
        await trio.sleep(every)


async def _kill(d: DaemonProcess, every: float, kills: list[float]) -> None:
    t0 = time.monotonic()
    while True:
        await trio.sleep(every)
        ready = [w for w in await trio.to_thread.run_sync(_workers, d)
                 if w.get("ready") and w.get("model", "") != "fim"]
        if ready:
            os.kill(int(ready[0]["pid"]), signal.SIGKILL)
            kills.append(time.monotonic() - t0)


async def soak(base: str, d: DaemonProcess, prompts: list[Prompt], rate: float,
               args: argparse.Namespace) -> dict[str, Any]:
    samples: list[Sample] = []
    hostile: list[tuple[str, int]] = []
    rss: list[dict[str, Any]] = []
    kills: list[float] = []
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
    t0 = time.monotonic()
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600, connect=30)) as c:
        with trio.move_on_after(args.minutes * 60):
            async with trio.open_nursery() as n:
                n.start_soon(_hostile, c, base, 60 / args.hostile_per_minute, hostile)
                n.start_soon(_watch, d, 30.0, rss)
                if args.kill_every:
                    n.start_soon(_kill, d, args.kill_every, kills)
                for p in prompts:
                    n.start_soon(_one, c, base, p, samples)
                    await trio.sleep(rng.expovariate(rate))
                await trio.sleep_forever()
    return {"load": summarise(samples, time.monotonic() - t0), "hostile": hostile,
            "rss": rss, "kills": kills}


async def _one(c: httpx.AsyncClient, base: str, p: Prompt, out: list[Sample]) -> None:
    out.append(await one_request(c, base, None, p))


def flat(rss: list[dict[str, Any]], key: str) -> float | None:
    """The RSS of the last part of the run over that of its early steady part (minute
    10 to 20 of an hour; the second sixth of a shorter run)."""
    if len(rss) < 6:
        return None
    sixth = len(rss) // 6
    early = rss[sixth:2 * sixth] if len(rss) < 120 else rss[20:40]
    late = rss[-sixth:] if len(rss) < 120 else rss[-20:]
    before = sum(r[key] for r in early) / len(early)
    after = sum(r[key] for r in late) / len(late)
    return after / before if before else None


async def capacity(base: str, seed: int, n: int) -> float:
    from forged.observe.loadtest import run_load
    prompts = make_prompts("mixed", n, MAX_TOKENS, seed=seed)
    r = await run_load(base, prompts, concurrency=32, rate=None, duration=900, model=None,
                       label="capacity")
    return float(r["req_per_s"])


def report(result: dict[str, Any]) -> str:
    load, hostile = result["load"], result["hostile"]
    bad_hostile = [h for h in hostile if not (400 <= h[1] < 500 or
                                               (h[0] == "/tokenize" and h[1] == 200))]
    lines = [
        "| minutes | load | requests | ok | errors | hostile (4xx / all) | kills | "
        "daemon RSS late/early | workers RSS late/early (less the RAM tier) |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {result['minutes']:g} | {result['rate']:.2f}/s ({result['load_factor']:g}x) | "
        f"{load['requests']} | {load['ok']} | {load['errors'] or 0} | "
        f"{len(hostile) - len(bad_hostile)} / {len(hostile)} | {len(result['kills'])} | "
        f"{_ratio(result['daemon_flat'])} | {_ratio(result['workers_flat'])} "
        f"({_ratio(result.get('workers_less_tier_flat'))}) |",
        "",
        f"TTFT p50 {load['ttft_p50']}, p99 {load['ttft_p99']}; "
        f"ITL p50 {load['itl_p50']}, p99 {load['itl_p99']}",
    ]
    if bad_hostile:
        lines.append(f"hostile requests not answered 4xx: {bad_hostile}")
    return "\n".join(lines)


def _ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="forged-soak-"))
    fim = write_tiny_llama(tmp / "fim.gguf", fim=True)
    port = free_port()
    # The kill loop runs two SmolLM2 workers (the same threads in all): with one, the
    # requests that arrive while it restarts find no worker and get a 503.
    engine = ({"threads": THREADS // args.workers, "workers": args.workers}
              if args.workers > 1 else {"threads": THREADS})
    config = write_config(tmp / "forged.toml", MODEL, port, engine=engine)
    with config.open("a") as f:  # the FIM model beside SmolLM2
        f.write(f'[[models]]\npath = "{fim}"\nname = "fim"\n')
    _index(config)
    d = DaemonProcess(config, port)
    try:
        d.wait_ready(300)
        cap = args.capacity or await capacity(d.url, args.seed, 32 if args.quick else 96)
        if cap <= 0:
            raise SystemExit("capacity measured as 0 requests/s (every request refused): "
                             "is the machine busy? Give --capacity")
        rate = cap * args.load
        n = int(rate * args.minutes * 60 * 1.5) + 10
        result = await soak(d.url, d, _mix(n, args.seed), rate, args)
    finally:
        rc = d.stop(60)
    result.update(minutes=args.minutes, capacity=cap, rate=rate, load_factor=args.load,
                  workers=args.workers,
                  daemon_exit=rc, daemon_flat=flat(result["rss"], "daemon_kib"),
                  workers_flat=flat(result["rss"], "workers_kib"),
                  workers_less_tier_flat=flat(result["rss"], "workers_less_tier_kib"))
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--load", type=float, default=0.8, help="x capacity")
    p.add_argument("--kill-every", type=float, default=0.0,
                   help="SIGKILL a SmolLM2 worker every this many seconds (0: never)")
    p.add_argument("--workers", type=int, default=0,
                   help="SmolLM2 workers (default: 2 with --kill-every, else 1)")
    p.add_argument("--hostile-per-minute", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--quick", action="store_true", help="a short capacity run")
    p.add_argument("--capacity", type=float, default=0.0,
                   help="requests/s to take as capacity instead of measuring it")
    args = p.parse_args()
    args.workers = args.workers or (2 if args.kill_every else 1)
    result = trio.run(main_async, args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "soak-kill" if args.kill_every else "soak"
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1))
    table = report(result)
    (RESULTS / f"{name}.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
