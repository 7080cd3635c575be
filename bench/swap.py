"""Latency across a model swap: ``python -m bench.swap``.

One daemon, a closed-loop load of ``--callers`` (8) streamed completions (a short
prompt, ``--max-tokens`` 32), for two windows of ``--window`` (40) seconds each, one
after the other:

* ``steady``: nothing else happens;
* ``swap``: ``--after`` (5) seconds in, ``POST /models/swap`` (what ``forged model
  swap`` sends) to a second model file; it loads beside the first, takes new
  requests once it has answered one, and the first drains.

Reported per window: requests, failures, TTFT and inter-token latency percentiles, and
for the swap, how long it took until the new model served. The ratios (swap ÷ steady)
are what to read: both windows share the machine's noise. By default the second model
is a copy of the shipped SmolLM2-135M (a package upgrade that brings the same weights
is the common case, and loads as long); ``--tiny`` uses two tiny test models.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from bench.daemonproc import DaemonProcess, free_port, write_config
from bench.run import MODEL
from bench.tinymodel import write_tiny_llama
from forged.observe.stats import percentile

Sample = dict[str, Any]
STALL = 0.5  # seconds between two tokens of a stream that count as a pause


async def one(c: httpx.AsyncClient, i: int, max_tokens: int) -> Sample:
    body = {"prompt": f"# Task {i}: write a function that adds two numbers.\ndef",
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0, times, prints = time.monotonic(), [], set()
    try:
        async with c.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"ok": False, "why": f"status {r.status_code}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    return {"ok": False, "why": data["error"]["message"]}
                prints.add(data["system_fingerprint"])
                if any(ch.get("text") for ch in data["choices"]):
                    times.append(time.monotonic())
    except httpx.HTTPError as exc:
        return {"ok": False, "why": repr(exc)}
    return {"ok": True, "ttft": (times[0] if times else time.monotonic()) - t0,
            "gaps": [b - a for a, b in itertools.pairwise(times)], "models": len(prints),
            "stalls": [(a, b - a) for a, b in itertools.pairwise(times) if b - a > STALL]}


async def window(url: str, admin_sock: str, args: argparse.Namespace,
                 swap_to: Path | None) -> dict[str, Any]:
    samples: list[Sample] = []
    swap: dict[str, Any] = {}
    end = time.monotonic() + args.window

    async def caller(k: int) -> None:
        i = k
        while time.monotonic() < end and len(samples) < args.max_requests:
            samples.append(await one(c, i, args.max_tokens))
            i += args.callers

    async def swapper() -> None:
        await trio.sleep(args.after)
        transport = httpx.AsyncHTTPTransport(uds=admin_sock)
        async with httpx.AsyncClient(transport=transport, base_url="http://admin",
                                     timeout=600) as a:
            t0 = swap["t0"] = time.monotonic()
            r = await a.post("/models/swap", json={"path": str(swap_to)})
            swap.update(status=r.status_code, seconds=time.monotonic() - t0,
                        answer=r.text[:300])

    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        with trio.fail_after(args.window + 600):
            async with trio.open_nursery() as nursery:
                for k in range(args.callers):
                    nursery.start_soon(caller, k)
                if swap_to is not None:
                    nursery.start_soon(swapper)
    return summary(samples, swap)


def summary(samples: list[Sample], swap: dict[str, Any]) -> dict[str, Any]:
    ok = [s for s in samples if s["ok"]]
    ttft = [s["ttft"] for s in ok]
    gaps = [g for s in ok for g in s["gaps"]]
    out = {"requests": len(samples), "failed": len(samples) - len(ok),
           "mixed": sum(1 for s in ok if s["models"] > 1),
           "why": sorted({s["why"] for s in samples if not s["ok"]})[:3]}
    for name, values in (("ttft", ttft), ("itl", gaps)):
        for q in (50, 95, 99):
            out[f"{name}_p{q}"] = percentile(values, q) or 0.0
    if swap:
        # When streams paused, from the swap's start: loading, or the switch, or after.
        out["stalls"] = sorted({(round(t - swap["t0"], 1), round(g, 2))
                                for s in ok for t, g in s["stalls"]})
        out["swap"] = {"status": swap["status"], "seconds": round(swap["seconds"], 2),
                       **({} if swap["status"] == 200 else {"answer": swap["answer"]})}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--callers", type=int, default=8)
    p.add_argument("--window", type=float, default=40.0)
    p.add_argument("--after", type=float, default=5.0)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-requests", type=int, default=5000)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        if args.tiny:
            first, second = (write_tiny_llama(tmp / "a.gguf"),
                             write_tiny_llama(tmp / "b.gguf", seed=1))
        else:
            first, second = MODEL, tmp / "upgraded.gguf"
            shutil.copy(MODEL, second)
        port = free_port()
        # The drain deadline outlasts any stream of this load.
        d = DaemonProcess(write_config(tmp / "forged.toml", first, port,
                                       server={"drain_timeout": 60.0},
                                       engine={"threads": args.threads}), port)
        try:
            d.wait_ready(300)
            admin = str(tmp / "admin.sock")
            rows = {"steady": trio.run(window, d.url, admin, args, None),
                    "swap": trio.run(window, d.url, admin, args, second)}
        finally:
            d.stop()
    for name, row in rows.items():
        print(f"{name:<7} {json.dumps(row)}", flush=True)
    s, w = rows["steady"], rows["swap"]
    print("ratios swap/steady: " + "  ".join(
        f"{k} {w[k] / s[k]:.2f}" for k in ("ttft_p50", "ttft_p95", "ttft_p99",
                                           "itl_p50", "itl_p95", "itl_p99") if s[k]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
