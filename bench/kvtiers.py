"""KV tiers (issue 17): forged's host-RAM and disk tiers against llama-server's
``--cache-ram`` (its default, 8,192 MiB), in one run. One command:

    .venv/bin/python -m bench.kvtiers [--quick]

Same model, threads (2) and total KV for both servers: 32,768 cells in 16 slots of
2,048 (llama-server ``-c 32768 -np 16``; forged ``kv_layout = "per_slot"``,
``slots = 16``). Otherwise each server runs its defaults (forged: ``cache_ram_mib =
4096``, ``cache_disk_mib = 8192``; llama-server: ``--cache-ram 8192``, ``-b 2048 -ub
512``, started with ``--metrics`` to count the prompt tokens it computes).

1. Many contexts: eight different repository contexts of about 1,500 tokens; 32
   callers in a closed loop, each request one context picked at random plus a short
   question, ``max_tokens`` 16. Goal: forged's TTFT p50 at most 0.5x llama-server's,
   output tok/s at least 1.2x.
2. Conversations: 64 conversations of 4 turns, at 16 callers, the history growing
   with each turn (a ~480-token file first, then ~90-token follow-ups, 32-token
   replies, the server's own reply in the history). The turns go in rounds (every
   conversation's turn 1, in a shuffled order, then every turn 2, ...), so between
   two turns of one conversation the 16 slots serve the 63 others: what it had
   computed has left its slot. forged gets ``session`` per conversation, llama-server
   ``cache_prompt``. Goal: TTFT p50 at most 0.5x from turn 2 on.
3. After a restart of each server: forged stops on SIGTERM (writing the sessions'
   states to disk under ``state_dir/kvcache``) and starts again with the same
   ``state_dir``; llama-server restarts. Then every conversation's turn 5, the same
   way, TTFT side by side.

``--quick``: 64 requests in part 1 (not 192) and 32 conversations (not 64), still
twice the slots. ``--threads N`` for both servers (default 2). The run is bounded: each
server's time in each part is capped (``--quick``: 300 s, 600 s and 300 s), and a
part cut at its cap counts only the requests answered by then. The counts were meant
for about 15 minutes on a quiet 2-core machine; on the shared machine of 2026-12-02
``--quick --threads 1`` took 43 minutes (docs/benchmarks.md). The parts alternate
which server goes first, so that a slow spell of the machine does not land on one
server only. Writes bench/results/kvtiers.json and the tables for docs/benchmarks.md
(bench/results/kvtiers.md); ``--tables JSON`` prints the tables of a saved result.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

from bench.daemonproc import DaemonProcess, free_port, write_config
from bench.run import CONTEXT, MODEL, RESULTS, ROOT, THREADS, LlamaServer, llama_metrics
from forged.observe.loadtest import (
    Prompt,
    Sample,
    make_prompts,
    one_request,
    ratios,
    repo_context,
    run_load,
    summarise,
)
from forged.observe.status import fetch_stats

SLOTS = 16
# queue_timeout: forged refuses at once (503) a request it expects to wait longer than
# this, and llama-server queues without a limit. Its estimate counts every queued
# prompt in full, cached or not, so at 32 callers of 1,500-token prompts on a slow
# machine it refused half the requests at once even at 600 s; the largest value keeps
# forged queueing like llama-server, so that both answer every request and the TTFTs
# compare like with like.
ENGINE = {"kv_cells": CONTEXT, "kv_layout": "per_slot", "slots": SLOTS,
          "max_running": SLOTS, "max_context": CONTEXT // SLOTS}
LIMITS = {"queue_timeout": 86400.0}
LLAMA_ARGS = ["-np", str(SLOTS), "--metrics"]
CONTEXTS, CONTEXT_LINES = 8, 124  # 124 lines: 1,492 to 1,521 tokens
QUESTION_TOKENS, REPLY_TOKENS, TURNS = 16, 32, 4
SYSTEM = {"role": "system", "content": "You are a coding assistant."}
# forged's counters reported per part (differences over the part).
FORGED_KEYS = ("prompt_tokens_computed", "prefix_cache_tokens_saved", "session_resumes",
               "kv_saves", "kv_ram_restores", "kv_disk_restores", "kv_restored_tokens",
               "kv_restore_failures", "kv_demotions", "kv_drops", "kv_swaps",
               "early_rejections")


@dataclass
class Server:
    """One server under test, and how to read what it computed."""

    name: str
    url: str
    admin: str = ""  # forged's admin listener; llama-server's counters come from /metrics
    session: bool = False  # forged: each conversation sends ``session``

    def counters(self) -> dict[str, float]:
        if self.admin:
            t = fetch_stats(self.admin)["engine"]["totals"]
            return {k: float(t.get(k, 0)) for k in FORGED_KEYS}
        m = llama_metrics(self.url)
        return {"prompt_tokens_computed": m["llamacpp:prompt_tokens_total"],
                "prompt_tokens_cached": m.get("llamacpp:prompt_tokens_cached_total", 0.0)}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


# --- 1. many contexts ----------------------------------------------------------------


def context_prompts(n: int, seed: int | None) -> list[Prompt]:
    """``n`` requests, each one of the eight contexts (at random, or each in turn when
    ``seed`` is None) and a question."""
    rng = random.Random(seed)
    contexts = [repo_context(100 + i, CONTEXT_LINES) for i in range(CONTEXTS)]
    shape = make_prompts("short", 1, QUESTION_TOKENS)[0].body  # streamed, usage, greedy
    return [Prompt("long", {**shape, "prompt": (contexts[i % CONTEXTS] if seed is None
                                                else rng.choice(contexts))
                            + f"# Question {i}: what does line {rng.randint(0, 120)} do?\n"})
            for i in range(n)]


async def many_contexts(server: Server, prompts: list[Prompt], limit: float) -> dict[str, Any]:
    """The contexts are computed once first (one request each, 8 callers, not
    measured): what is measured is serving them again, not the first fill."""
    primed = await run_load(server.url, context_prompts(CONTEXTS, None), concurrency=CONTEXTS,
                            rate=None, duration=limit, model=None, label="priming")
    before = server.counters()
    summary = await run_load(server.url, prompts, concurrency=32, rate=None, duration=limit,
                             model=None, label=f"{server.name} many contexts")
    return {"summary": summary, "counters": delta(before, server.counters()),
            "priming": {k: primed[k] for k in ("ok", "wall_s", "ttft_p50")}}


# --- 2 and 3. conversations ----------------------------------------------------------


@dataclass
class Conversation:
    index: int
    messages: list[dict[str, str]] = field(default_factory=lambda: [SYSTEM])

    def user_turn(self, turn: int) -> str:
        if turn == 1:
            return ("Here is a file of my project:\n" + repo_context(1000 + self.index, 40)
                    + "What does it do?")
        return (f"And this part (change {turn}):\n"
                + repo_context(10_000 + 10 * self.index + turn, 8)
                + "How does it change your answer?")


def turn_body(conv: Conversation, turn: int, session: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": [*conv.messages, {"role": "user", "content": conv.user_turn(turn)}],
        "max_tokens": REPLY_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}, "cache_prompt": True}
    if session:
        body["session"] = f"conversation-{conv.index}"
    return body


async def one_round(server: Server, convs: list[Conversation], turn: int, callers: int,
                    limit: float) -> tuple[list[Sample], float]:
    """Every conversation's ``turn``, in a shuffled order (the same for each server),
    at ``callers``; each conversation's history then gets the turn and its reply."""
    order = list(convs)
    random.Random(turn).shuffle(order)
    queue = iter(order)
    samples: list[Sample] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)

    async def caller(client: httpx.AsyncClient) -> None:
        for conv in queue:
            body = turn_body(conv, turn, server.session)
            s = await one_request(client, server.url, None, Prompt(f"turn {turn}", body))
            samples.append(s)
            conv.messages += [body["messages"][-1], {"role": "assistant", "content": s.text}]

    t0 = time.monotonic()
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(limit, connect=30)
                                 ) as client:
        with trio.move_on_after(limit):
            async with trio.open_nursery() as nursery:
                for _ in range(callers):
                    nursery.start_soon(caller, client)
    return samples, time.monotonic() - t0


async def conversations(server: Server, convs: list[Conversation], turns: range,
                        limit: float) -> dict[str, Any]:
    before = server.counters()
    by_turn: dict[int, list[Sample]] = {}
    walls: dict[int, float] = {}
    deadline = trio.current_time() + limit
    for turn in turns:
        left = deadline - trio.current_time()
        if left <= 0:
            break
        by_turn[turn], walls[turn] = await one_round(server, convs, turn, 16, left)
        print(f"{server.name} turn {turn}: {len(by_turn[turn])} answers in "
              f"{walls[turn]:.1f} s", flush=True)
    later = [s for t, ss in by_turn.items() if t > turns[0] for s in ss]
    out: dict[str, Any] = {
        "turns": {t: summarise(ss, walls[t]) for t, ss in by_turn.items()},
        "all": summarise([s for ss in by_turn.values() for s in ss], sum(walls.values())),
        "counters": delta(before, server.counters())}
    if later:
        out["from_turn_2"] = summarise(later, sum(w for t, w in walls.items() if t > turns[0]))
    return out


# --- the run -------------------------------------------------------------------------


def forged_config(tmp: Path, name: str, threads: int) -> tuple[Path, int]:
    """A config in ``tmp`` (so every one shares ``tmp/state``, the state_dir)."""
    port = free_port()
    return write_config(tmp / f"{name}.toml", MODEL, port, limits=LIMITS,
                        engine={**ENGINE, "threads": threads}), port


def start_forged(tmp: Path, name: str, threads: int) -> tuple[DaemonProcess, Server, float]:
    cfg, port = forged_config(tmp, name, threads)
    t0 = time.monotonic()
    daemon = DaemonProcess(cfg, port)
    daemon.wait_ready(180)
    return daemon, Server("forged", daemon.url, f"unix:{tmp}/admin.sock", True), \
        time.monotonic() - t0


def start_llama(binary: str, tmp: Path, name: str, threads: int
                ) -> tuple[LlamaServer, Server, float]:
    t0 = time.monotonic()
    ls = LlamaServer(binary, LLAMA_ARGS, tmp / f"{name}.log", threads=threads)
    ls.wait_ready()
    return ls, Server("llama-server", ls.url), time.monotonic() - t0


async def warm_up(url: str) -> None:
    """Every slot used once (llama.cpp touches its KV pages as they are first used)."""
    await run_load(url, make_prompts("short", SLOTS, 4, seed=99), concurrency=SLOTS,
                   rate=None, duration=120, model=None, label="warm-up")


def log_findings(path: Path) -> dict[str, Any]:
    """Lines of a server log that name an error, a warning or a traceback."""
    keys = ("error", "warning", "traceback", "exception", "refused", "failed")
    lines = [line for line in path.read_text(errors="replace").splitlines()
             if any(k in line.lower() for k in keys)]
    return {"log": str(path), "count": len(lines), "first": lines[:20]}


def kv_files(tmp: Path) -> dict[str, float]:
    files = list((tmp / "state" / "kvcache").rglob("*.kv"))
    return {"files": len(files), "mib": sum(f.stat().st_size for f in files) / (1 << 20)}


def run(args: argparse.Namespace, binary: str, tmp: Path) -> dict[str, Any]:
    n_requests, n_convs = (64, 32) if args.quick else (192, 64)
    # Each server's time for each part, at most (a part cut short says so).
    cap = {"contexts": 300.0, "conversations": 600.0, "restart": 300.0} if args.quick else \
        {"contexts": 420.0, "conversations": 900.0, "restart": 420.0}
    t = args.threads
    result: dict[str, Any] = {
        "quick": args.quick, "threads": t, "kv_cells": CONTEXT, "slots": SLOTS,
        "forged_engine": ENGINE, "forged_limits": LIMITS, "llama_server_args": LLAMA_ARGS,
        "requests_many_contexts": n_requests, "conversations": n_convs, "caps_s": cap,
        "load_average_at_start": os.getloadavg()}

    def keep() -> None:
        (RESULTS / "kvtiers.json").write_text(json.dumps(result, indent=2))

    forged, fs, result["forged_start_s"] = start_forged(tmp, "forged", t)
    ls, lss, result["llama_server_start_s"] = start_llama(binary, tmp, "llama-server", t)
    logs = [forged.log, tmp / "llama-server.log"]
    try:
        trio.run(warm_up, fs.url)
        trio.run(warm_up, lss.url)
        # 1. Many contexts: forged first.
        prompts = context_prompts(n_requests, seed=17)
        part: dict[str, Any] = {}
        for server in (fs, lss):
            part[server.name] = trio.run(many_contexts, server, prompts, cap["contexts"])
            print(server.name, json.dumps(part[server.name]["counters"]), flush=True)
        part["ratio"] = ratios(part["forged"]["summary"], part["llama-server"]["summary"])
        result["many_contexts"] = part
        keep()
        # 2. Conversations: llama-server first.
        convs = {s.name: [Conversation(i) for i in range(n_convs)] for s in (fs, lss)}
        part = {}
        for server in (lss, fs):
            part[server.name] = trio.run(conversations, server, convs[server.name],
                                         range(1, TURNS + 1), cap["conversations"])
        part["ratio_from_turn_2"] = ratios(part["forged"]["from_turn_2"],
                                           part["llama-server"]["from_turn_2"])
        part["ratio_turn_1"] = ratios(part["forged"]["turns"][1],
                                      part["llama-server"]["turns"][1])
        result["conversations"] = part
        keep()
        # 3. Restart each server, then every conversation's next turn: forged first.
        part = {}
        t0 = time.monotonic()
        part["forged_stop"] = {"exit": forged.stop(180), "seconds": time.monotonic() - t0,
                               "kvcache": kv_files(tmp)}
        forged, fs, part["forged_restart_s"] = start_forged(tmp, "forged-restarted", t)
        logs.append(forged.log)
        part["forged_after_start"] = {k: fetch_stats(fs.admin)["engine"]["totals"].get(k)
                                      for k in ("kv_disk_entries", "kv_disk_bytes")}
        part["forged"] = trio.run(conversations, fs, convs["forged"],
                                  range(TURNS + 1, TURNS + 2), cap["restart"])
        ls.stop()
        ls, lss, part["llama_server_restart_s"] = start_llama(binary, tmp,
                                                              "llama-server-restarted", t)
        logs.append(tmp / "llama-server-restarted.log")
        part["llama-server"] = trio.run(conversations, lss, convs["llama-server"],
                                        range(TURNS + 1, TURNS + 2), cap["restart"])
        part["ratio"] = ratios(part["forged"]["all"], part["llama-server"]["all"])
        result["restart"] = part
    finally:
        forged.stop()
        ls.stop()
        result["logs"] = [log_findings(p) for p in logs]
        keep()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="64 requests over the contexts, 32 conversations")
    ap.add_argument("--threads", type=int, default=THREADS,
                    help=f"threads of both servers (default {THREADS}, the issue's)")
    ap.add_argument("--tables", type=Path, metavar="JSON",
                    help="only print the tables of a saved result")
    args = ap.parse_args()
    if args.tables:
        print(tables(json.loads(args.tables.read_text())))
        return
    binary = subprocess.run([str(ROOT / "bench" / "build-llama-server.sh")], check=True,
                            capture_output=True, text=True, cwd=ROOT).stdout.strip()
    RESULTS.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="kvtiers-"))
    t0 = time.monotonic()
    result = run(args, binary, tmp)
    result["wall_s"] = time.monotonic() - t0
    (RESULTS / "kvtiers.json").write_text(json.dumps(result, indent=2))
    (RESULTS / "kvtiers.md").write_text(tables(result))
    print(tables(result))


# --- tables --------------------------------------------------------------------------


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _computed(counters: dict[str, float]) -> str:
    return f"{counters['prompt_tokens_computed']:.0f}" if counters else "-"


def _row(label: str, a: dict[str, Any], b: dict[str, Any], ca: dict[str, float],
         cb: dict[str, float]) -> str:
    r = ratios(a, b)
    return (f"| {label} | {_s(a['ttft_p50'])} / {_s(b['ttft_p50'])} s | {_s(r['ttft_p50'])} | "
            f"{_s(a['ttft_p95'])} / {_s(b['ttft_p95'])} s | {_s(r['ttft_p95'])} | "
            f"{a['out_tok_per_s']:.1f} / {b['out_tok_per_s']:.1f} | {_s(r['out_tok_per_s'])} | "
            f"{a['prompt_tokens']} / {b['prompt_tokens']} | "
            f"{a['cached_tokens']} / {b['cached_tokens']} | "
            f"{_computed(ca)} / {_computed(cb)} | "
            f"{a['ok']}/{a['requests']}; {b['ok']}/{b['requests']} |")


def tables(result: dict[str, Any]) -> str:
    lines = ["Cells: forged / llama-server, then forged ÷ llama-server. Prompt tokens: "
             "of the answered requests; from cache: what each server reports per request "
             "(usage cached_tokens; llama-server timings.cache_n), summed; computed: each "
             "server's counter over the part (it includes requests cut at the cap).", "",
             "| part | TTFT p50 | ratio | TTFT p95 | ratio | out tok/s | ratio | "
             "prompt tokens | from cache | computed | ok |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    parts: list[tuple[str, dict[str, Any], dict[str, Any], dict[str, float],
                      dict[str, float]]] = []
    if "many_contexts" in result:
        m = result["many_contexts"]
        parts.append(("many contexts, 32 callers", m["forged"]["summary"],
                      m["llama-server"]["summary"], m["forged"]["counters"],
                      m["llama-server"]["counters"]))
    if "conversations" in result:
        c = result["conversations"]
        f, ls = c["forged"], c["llama-server"]
        for side in (f, ls):  # turns are numbers; JSON made them strings
            side["turns"] = {int(t): v for t, v in side["turns"].items()}
        parts.append(("conversations, turn 1", f["turns"][1], ls["turns"][1], {}, {}))
        parts.append(("conversations, turns 2-4", f["from_turn_2"], ls["from_turn_2"],
                      f["counters"], ls["counters"]))
        for t in sorted(f["turns"]):
            if t > 1 and t in ls["turns"]:
                parts.append((f"conversations, turn {t}", f["turns"][t], ls["turns"][t],
                              {}, {}))
    if "restart" in result and "llama-server" in result["restart"]:
        r = result["restart"]
        parts.append(("after a restart, turn 5", r["forged"]["all"], r["llama-server"]["all"],
                      r["forged"]["counters"], r["llama-server"]["counters"]))
    lines += [_row(*p) for p in parts]
    for name in ("many_contexts", "conversations", "restart"):
        part = result.get(name, {})
        if "forged" in part:
            lines.append(f"\nforged's tier counters, {name.replace('_', ' ')}: "
                         + json.dumps({k: int(v) for k, v in part["forged"]["counters"].items()}))
    r = result.get("restart", {})
    if "forged_stop" in r:
        lines.append(f"\nforged stopped in {r['forged_stop']['seconds']:.1f} s (exit "
                     f"{r['forged_stop']['exit']}), leaving {r['forged_stop']['kvcache']['files']} "
                     f"state files ({r['forged_stop']['kvcache']['mib']:.0f} MiB); ready again "
                     f"in {r['forged_restart_s']:.1f} s with {r['forged_after_start']}; "
                     f"llama-server ready again in {r['llama_server_restart_s']:.1f} s.")
    for log in result.get("logs", []):
        lines.append(f"\n{log['log']}: {log['count']} lines naming an error or warning")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
