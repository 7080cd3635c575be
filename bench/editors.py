"""The editor workload: inline completions while others chat, forged against llama-server.

``python -m bench.editors`` (about 6 minutes; ``--quick``: about 3). In one run, against
each server in turn with the same model, threads, context and seeds:

* ``--editors`` (16) simulated editors replay llama.vscode's sequence over a file of
  their own: a warm-up (``n_predict: 0``) when the cursor lands, then, as the engineer
  types, an ``/infill`` at each pause; a new pause cancels the request it supersedes
  (the connection is closed, as the editor does). Every few pauses the cursor moves to
  another line (a new warm-up).
* ``--chats`` (16) chat callers stream long answers, one after another.

Measured: the infill TTFT (first content, or the answer when it is empty) of the
requests that were not superseded, p50/p95/p99, and the chat streams' inter-token
latency p50/p99. Goal (issue 14): forged's infill TTFT p95 at most 0.3 of
llama-server's, with no worse chat ITL p99.

The model: no FIM-trained GGUF is on this machine. By default the benchmark uses the
test suite's tiny random-weight llama with FIM tokens (bench/tinymodel.py), as issue 14
allows: its steps are cheap, so the 16 editors and 16 chats fit this 2-core machine,
and what is measured is scheduling and caching rather than arithmetic. ``--smollm2``
uses the shipped SmolLM2-135M instead, with three of its unused special tokens
(``<issue_start>``, ``<issue_comment>``, ``<issue_closed>``) named as FIM prefix,
suffix and middle by gguf's ``gguf_new_metadata``: real per-token costs (the workload
is then several times this machine's capacity; see docs/benchmarks.md). Completions
are nonsense either way, for both servers alike.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

from bench.daemonproc import DaemonProcess, free_port, write_config
from bench.run import MODEL, RESULTS, THREADS, LlamaServer
from bench.tinymodel import write_tiny_llama
from forged.observe.stats import percentile

CONTEXT, SLOTS, INFILL_BATCH = 65536, 32, 1024
# llama-server: one slot per caller, 2,048 cells each, the same layout budget as forged.
LLAMA_ARGS = ["-np", str(SLOTS), "-b", str(INFILL_BATCH), "-ub", "256"]
FORGED_ENGINE = {"threads": THREADS, "kv_cells": CONTEXT, "kv_layout": "per_slot",
                 "slots": SLOTS, "max_running": SLOTS, "max_context": CONTEXT // SLOTS}
FIM_IDS = {"fim_pre": 8, "fim_suf": 9, "fim_mid": 10, "fim_rep": 3, "fim_sep": 5}
N_PREDICT = 24
WORDS = ("value", "items", "index", "result", "config", "request", "cache", "worker",
         "queue", "limit", "stream", "token", "data", "key")


def fim_model(tmp: Path, smollm2: bool) -> Path:
    if not smollm2:
        return write_tiny_llama(tmp / "tiny-fim.gguf", fim=True)
    out = tmp / "smollm2-fim.gguf"
    args = [a for name, tok in FIM_IDS.items()
            for a in ("--special-token-by-id", name, str(tok))]
    subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", *args,
                    "--force", str(MODEL), str(out)], check=True, capture_output=True)
    return out


def source_file(rng: random.Random, lines: int) -> list[str]:
    out = []
    for i in range(lines):
        if i % 8 == 0:
            out.append(f"def {rng.choice(WORDS)}_{i}({rng.choice(WORDS)}, {rng.choice(WORDS)}):")
        else:
            a, b, c = (rng.choice(WORDS) for _ in range(3))
            out.append(f"    {a} = {b}.get({c!r}, {rng.randint(0, 99)})")
    return out


@dataclass
class Measures:
    infill_ttft: list[float] = field(default_factory=list)
    superseded: int = 0
    infill_errors: int = 0
    chat_itl: list[float] = field(default_factory=list)
    chat_errors: int = 0


async def infill(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                 m: Measures) -> None:
    """One streamed /infill; its TTFT is recorded only if it is not cancelled."""
    t0 = time.monotonic()
    async with client.stream("POST", url + "/infill", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            m.infill_errors += 1
            return
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                if event.get("content") or event.get("stop"):
                    m.infill_ttft.append(time.monotonic() - t0)
                    return


async def editor(url: str, seed: int, pauses: int, m: Measures) -> None:
    rng = random.Random(seed)
    lines = source_file(rng, 60)
    extra = [{"filename": f"lib/{rng.choice(WORDS)}.py",
              "text": "\n".join(source_file(rng, 12))} for _ in range(2)]
    async with httpx.AsyncClient(timeout=120) as client:
        for pause in range(pauses):
            if pause % 6 == 0:  # the cursor lands on a line: llama.vscode warms up
                row, typed = rng.randint(10, 50), ""
                await _send(client, url, _body(lines, row, typed, extra, 0), m, None)
            typed += "".join(rng.choice("abcdefghij_. (") for _ in range(rng.randint(2, 6)))
            await trio.sleep(0.15 * len(typed) / 4)  # typing
            body = _body(lines, row, typed, extra, N_PREDICT)
            # The next pause comes after 0.3 to 1.2 s: a request still running then is
            # superseded (the editor drops it).
            await _send(client, url, body, m, rng.uniform(0.3, 1.2))


async def _send(client: httpx.AsyncClient, url: str, body: dict[str, Any], m: Measures,
                pause: float | None) -> None:
    with trio.move_on_after(60 if pause is None else pause) as scope:
        try:
            await infill(client, url, body, m)
        except httpx.HTTPError:  # llama-server drops connections past its HTTP threads
            m.infill_errors += 1
    if scope.cancelled_caught:
        m.superseded += 1
    elif pause is not None:
        await trio.sleep(pause * 0.5)  # reading the suggestion


def _body(lines: list[str], row: int, typed: str, extra: list[dict[str, str]],
          n_predict: int) -> dict[str, Any]:
    return {"input_prefix": "\n".join(lines[max(0, row - 32):row]) + "\n",
            "input_suffix": "\n".join(lines[row + 1:row + 16]) + "\n", "prompt": typed,
            "input_extra": extra, "n_predict": n_predict, "t_max_predict_ms": 1000,
            "n_indent": 4, "stream": True, "samplers": ["top_k", "top_p", "infill"],
            "top_k": 40, "top_p": 0.99, "cache_prompt": True}


async def chat(url: str, seed: int, stop: trio.Event, m: Measures) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=300) as client:
        while not stop.is_set():
            question = " ".join(rng.choice(WORDS) for _ in range(60))
            body = {"messages": [{"role": "user", "content": f"Explain: {question}"}],
                    "max_tokens": 200, "ignore_eos": True, "stream": True}
            try:
                await _chat_once(client, url, body, m)
            except httpx.HTTPError:
                m.chat_errors += 1
                await trio.sleep(1)


async def _chat_once(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                     m: Measures) -> None:
    last = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            raise httpx.HTTPStatusError("refused", request=r.request, response=r)
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"content"' in line:
                now = time.monotonic()
                if last is not None:
                    m.chat_itl.append(now - last)
                last = now


async def workload(url: str, editors: int, chats: int, pauses: int) -> Measures:
    m = Measures()
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        for i in range(chats):
            nursery.start_soon(chat, url, 1000 + i, stop, m)
        await trio.sleep(3)  # the chats are streaming when the editors start
        async with trio.open_nursery() as eds:
            for i in range(editors):
                eds.start_soon(editor, url, i, pauses, m)
        stop.set()
        nursery.cancel_scope.deadline = trio.current_time() + 120
    return m


def summary(m: Measures) -> dict[str, Any]:
    return {"infill_requests": len(m.infill_ttft), "superseded": m.superseded,
            "infill_errors": m.infill_errors, "chat_errors": m.chat_errors,
            **{f"infill_ttft_p{q}": percentile(m.infill_ttft, q) for q in (50, 95, 99)},
            **{f"chat_itl_p{q}": percentile(m.chat_itl, q) for q in (50, 99)}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--editors", type=int, default=16)
    ap.add_argument("--chats", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="12 pauses per editor, not 30")
    ap.add_argument("--smollm2", action="store_true",
                    help="SmolLM2-135M with FIM metadata instead of the tiny model")
    args = ap.parse_args()
    pauses = 12 if args.quick else 30
    tmp = Path(tempfile.mkdtemp())
    model = fim_model(tmp, args.smollm2)
    binary = subprocess.run(["sh", "bench/build-llama-server.sh"], check=True,
                            capture_output=True, text=True).stdout.strip().splitlines()[-1]
    results: dict[str, Any] = {"editors": args.editors, "chats": args.chats,
                               "pauses": pauses, "model": model.name}
    port = free_port()
    forged = DaemonProcess(write_config(tmp / "forged.toml", model, port,
                                        engine=FORGED_ENGINE,
                                        limits={"infill_batch": INFILL_BATCH}), port)
    try:
        forged.wait_ready(120)
        results["forged"] = summary(trio.run(workload, forged.url, args.editors,
                                             args.chats, pauses))
    finally:
        forged.stop()
    server = LlamaServer(binary, LLAMA_ARGS, tmp / "llama.log", model=model,
                         context=CONTEXT)
    try:
        server.wait_ready()
        results["llama_server"] = summary(trio.run(workload, server.url, args.editors,
                                                   args.chats, pauses))
    finally:
        server.stop()
    f, ls = results["forged"], results["llama_server"]
    results["ratio"] = {k: f[k] / ls[k] if f[k] and ls[k] else None
                        for k in f if k.startswith(("infill_ttft", "chat_itl"))}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "editors.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
