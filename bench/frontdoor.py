"""Where the CPU goes while chats stream: the front door against the llama.cpp worker.

``python -m bench.frontdoor`` (about 1 minute). In one run, forged serves ``--chats``
(16) streaming chat callers for ``--seconds`` (20) on the editors benchmark's model and
engine (bench/editors.py), once with the engine's default ``threads`` (2) and once
with ``threads = 1``. Measured for each: the tokens streamed, the CPU seconds of the
daemon process (the HTTP front door and the pool), of its worker process(es) and of
this client, read from /proc, and the chats' inter-token latency p50/p99.

First, the worker's core alone (no HTTP, no worker process): ``--chats`` streams of
200 tokens through :class:`forged.engine.core.WorkerCore` on the real backend, timing
each step and the ``llama_decode`` inside it, so the Python around llama.cpp shows as
the difference.

Why: on this 2-core machine the chat ITL p99 in ``bench.editors`` is worse than
llama-server's (docs/benchmarks.md). This run shows what the front door costs per
streamed token and whether a llama.cpp thread spinning on the core the front door
needs is the cause.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import trio

from bench.daemonproc import DaemonProcess, free_port, write_config
from bench.editors import CONTEXT, FORGED_ENGINE, Measures, chat, fim_model
from bench.run import RESULTS
from forged.config import Config, EngineConfig, ModelConfig
from forged.engine import frames as fr
from forged.engine.backend import ContextParams, Llama
from forged.engine.core import WorkerCore
from forged.engine.costmodel import calibrate
from forged.engine.limits import scheduler_limits
from forged.engine.request import Request
from forged.observe.stats import percentile

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of one process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


async def streams(url: str, chats: int, seconds: float) -> Measures:
    m = Measures()
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        for i in range(chats):
            nursery.start_soon(chat, url, 1000 + i, stop, m)
        await trio.sleep(seconds)
        nursery.cancel_scope.cancel()  # every stream ends now; a bounded run
    return m


def measure(url: str, pid: int, chats: int, seconds: float) -> dict[str, Any]:
    trio.run(streams, url, chats, 3.0)  # warm: worker caches and the cost model
    workers = children(pid)
    before = (cpu_seconds(pid), sum(cpu_seconds(w) for w in workers), time.process_time())
    m = trio.run(streams, url, chats, seconds)
    after = (cpu_seconds(pid), sum(cpu_seconds(w) for w in workers), time.process_time())
    daemon, worker, client = (a - b for a, b in zip(after, before, strict=True))
    # Counted as the gaps between tokens: each answer's first token (one in about 200)
    # is left out, which overstates the CPU per token by about 0.5%.
    tokens = len(m.chat_itl)
    return {"tokens": tokens, "daemon_cpu_s": round(daemon, 2),
            "worker_cpu_s": round(worker, 2), "client_cpu_s": round(client, 2),
            "daemon_cpu_us_per_token": round(daemon / tokens * 1e6, 1),
            "worker_cores": round(worker / seconds, 2),
            "chat_itl_p50": percentile(m.chat_itl, 50),
            "chat_itl_p99": percentile(m.chat_itl, 99)}


class TimedDecode:
    """The real backend, with the time spent in ``llama_decode`` added up."""

    def __init__(self, llama: Llama) -> None:
        self.llama = llama
        self.decode_s = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.llama, name)

    def decode(self, items: Any) -> list[int]:
        t0 = time.perf_counter()
        try:
            return self.llama.decode(items)
        finally:
            self.decode_s += time.perf_counter() - t0


def core_alone(model: Path, streams: int, tokens: int = 200) -> dict[str, Any]:
    """ms per step of the worker's core, and of the decode within it."""
    cfg = Config(model=ModelConfig(path=str(model)),
                 engine=msgspec.convert(FORGED_ENGINE, EngineConfig))
    lim = scheduler_limits(cfg, n_ctx_train=CONTEXT)
    llama = Llama(str(model), ContextParams(
        n_ctx=lim.kv_cells, n_seq_max=lim.slots,
        n_batch=max(lim.step_tokens, lim.prefill_step_tokens),
        threads=cfg.engine.threads, flash_attn=False, kv_unified=not lim.per_slot))
    backend = TimedDecode(llama)
    cost = calibrate(backend, lim.slots, flash_attn=False,
                     per_slot=lim.per_slot)
    core = WorkerCore(backend, lim, cost)
    backend.decode_s = 0.0
    prompt = llama.model.tokenize("Explain: " + "value items index " * 20,
                                  add_special=True, parse_special=False)
    for rid in range(streams):
        req = Request(prompt=prompt, max_tokens=tokens, ignore_eos=True)
        core.handle(fr.Submit(rid=rid, request=req), time.monotonic())
    t0, steps = time.perf_counter(), 0
    while core.busy and steps < 100 * tokens:  # bounded
        core.step(time.monotonic())
        core.frame(time.monotonic())
        steps += 1
    total = time.perf_counter() - t0
    core.close()
    llama.close()
    return {"steps": steps, "step_ms": round(total / steps * 1000, 2),
            "decode_ms": round(backend.decode_s / steps * 1000, 2),
            "around_decode_ms": round((total - backend.decode_s) / steps * 1000, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chats", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=20.0)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    model = fim_model(tmp, smollm2=False)
    results: dict[str, Any] = {"chats": args.chats, "seconds": args.seconds,
                               "core_alone": core_alone(model, args.chats)}
    for threads in (FORGED_ENGINE["threads"], 1):
        port = free_port()
        cfg = write_config(tmp / f"forged-{threads}.toml", model, port,
                           engine={**FORGED_ENGINE, "threads": threads})
        daemon = DaemonProcess(cfg, port)
        try:
            daemon.wait_ready(120)
            results[f"threads_{threads}"] = measure(daemon.url, daemon.proc.pid,
                                                    args.chats, args.seconds)
        finally:
            daemon.stop()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "frontdoor.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
