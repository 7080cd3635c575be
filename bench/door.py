"""The front door's cost, against llama-server's: one command (issue 33).

    .venv/bin/python -m bench.door [--seconds 10] [--stream-seconds 20]

About 16 minutes on 2 cores; every server runs in turn, alone, with the same model and
threads. Five parts:

1. **Trivial requests.** Debian's ``wrk`` (one thread, 256 connections, ``--seconds``)
   on ``GET /health`` and ``GET /v1/models``: forged with the hot door, forged without
   it (``server.hot_door = false``, the general path) and llama-server. Per run: req/s,
   latency p50/p99, errors, the server's CPU per request (forged: its daemon process,
   which is the door; the workers apart) and wrk's own CPU apart.
2. **Streams on an accelerator's stand-in.** A tiny random-weight GGUF
   (bench/tinymodel.py) whose decode step costs about a millisecond, so what is left is
   the serving stack's own cost. 4, 16 and 64 closed-loop callers stream 256 tokens
   each (steps of about 1, 3 and 13 ms here):
   output tok/s, inter-token latency p50/p99 as the callers see it, and the door's CPU
   per streamed token (forged's daemon process alone, and with its workers), for forged
   with ``server.stream_coalesce_ms`` 5 (the default) and 0, forged with its streams
   through Quart, hypercorn and h11 (``server.hot_door = false``: no direct streams),
   and llama-server.
3. **Short generations** (``short``): 16 closed-loop callers on the stand-in, each
   streaming a 16-token chat answer, as an editor's completions come: requests a
   second and the door's CPU per request (the HTTP request, routing, the chat template
   and tokenizing, admission, the frames and the log: per request, not per token).
4. **Door traffic during decoding.** 16 SmolLM2 streams of 64 tokens alone, then
   beside 64 ``wrk`` connections on ``/v1/models``: ITL p99 with the traffic over
   ITL p99 without (tok/s counts whole streams only: read text events/s); for
   forged as configured by default and placed (``server.door_cpus = [0]``, the
   worker's one thread on the other core), and llama-server.

5. **Door processes** (``doors``): forged with ``server.door_processes`` 0 (the
   daemon accepts), 1 and 2, the CPUs shared: ``/health`` as in part 1, with the
   daemon's and the doors' CPU per request apart and the share of a core each door
   used; then part 3's short generations, each on a new connection that a door hands
   to the daemon.

The stream callers are a lean client (raw sockets, no JSON parsing) in this process;
its CPU is reported apart. Results: bench/results/door.json and door.md (the table for
docs/benchmarks.md).

``--forged-only``: each part's first server alone (forged as shipped), its rows
printed and nothing written: to set two commits side by side (run it in each, in
turn, a few times; the machine's slow spells move a single run by a fifth).
"""

from __future__ import annotations

import argparse
import random
import re
import resource
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from bench.daemonproc import DaemonProcess, free_port, write_config
from bench.frontdoor import children, cpu_seconds
from bench.run import MODEL, ROOT, THREADS, LlamaServer, write_results
from bench.tinymodel import write_tiny_llama
from forged.observe.stats import percentile

CONNECTIONS = 256
STREAM_TOKENS = 256  # the stand-in's; SmolLM2's streams (part 3) are shorter
TRAFFIC_TOKENS = 64
SHORT_TOKENS = 16  # an editor's completion
# The stand-in's callers: at 4 its steps are faster than a useful write cadence.
STANDIN_CALLERS = (4, 16, 64)
PARTS = ("trivial", "standin", "short", "traffic", "doors")
DOOR_PROCESSES = (0, 1, 2)
WORDS = ["value", "items", "index", "buffer", "parse", "route", "token", "stream", "cache",
         "query"]


@dataclass
class Server:
    name: str
    url: str
    pid: int
    stop: Any
    cpu_of: str = "process"  # forged: its daemon process (the door) alone


def _wrk(url: str, seconds: float, connections: int) -> dict[str, Any]:
    """One wrk run: its figures, and wrk's own CPU seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", "--latency",
                          "--timeout", "10s", url], capture_output=True, text=True,
                         check=True, timeout=seconds + 60).stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    wrk_cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    requests = int(re.search(r"(\d+) requests in", out)[1])  # type: ignore[index]
    errors = sum(int(n) for n in re.findall(r"(?:connect|read|write|timeout) (\d+)", out))
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {"requests": requests, "rps": round(requests / seconds),
            "p50_ms": _ms(out, "50%"), "p99_ms": _ms(out, "99%"),
            "errors": errors + (int(non_2xx[1]) if non_2xx else 0),
            "wrk_cpu_s": round(wrk_cpu, 2)}


def _ms(out: str, pct: str) -> float:
    value, unit = re.search(rf"{pct}\s+([\d.]+)(us|ms|s)\b", out).groups()  # type: ignore[union-attr]
    return round(float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit], 2)


def door_processes(pid: int) -> list[int]:
    """forged's door processes (server.door_processes); its other children are workers."""
    return [c for c in children(pid)
            if b"forged.daemon.doorproc" in Path(f"/proc/{c}/cmdline").read_bytes()]


def trivial(server: Server, path: str, seconds: float) -> dict[str, Any]:
    """wrk on ``path``, with the server's CPU per request (forged's door processes
    apart, if it runs any)."""
    _wrk(server.url + path, 1, 32)  # warm: connections, caches
    doors = door_processes(server.pid)
    cpu0, doors0 = cpu_seconds(server.pid), [cpu_seconds(d) for d in doors]
    run = _wrk(server.url + path, seconds, CONNECTIONS)
    cpu = cpu_seconds(server.pid) - cpu0
    door_cpu = [cpu_seconds(d) - c for d, c in zip(doors, doors0, strict=True)]
    run["server_cpu_us_per_request"] = round(cpu / max(1, run["requests"]) * 1e6, 1)
    run["door_processes"] = len(doors)
    run["doors_cpu_us_per_request"] = round(sum(door_cpu) / max(1, run["requests"]) * 1e6, 1)
    run["doors_busy"] = [round(c / seconds, 2) for c in door_cpu]  # cores each door used
    return {"server": server.name, "path": path, **run}


@dataclass
class Streams:
    completed: int = 0  # streams that reached [DONE]: max_tokens each (ignore_eos)
    pieces: int = 0  # SSE events with text (about a token each for a real model)
    itl: list[float] = field(default_factory=list)
    errors: int = 0


async def _stream_once(host: str, port: int, body: bytes, m: Streams) -> None:
    """One streamed chat. Each SSE event with text is timed when the read that
    completed it returned (tokens in one write arrive together). The tiny model's
    random bytes are often partial UTF-8, held back until whole, so tokens are counted
    by completed streams (``ignore_eos``: exactly max_tokens each)."""
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\n"
                              b"Content-Type: application/json\r\nConnection: close\r\n"
                              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        buf, last = b"", None
        while data := await stream.receive_some(65536):
            buf += data
            *events, buf = buf.split(b"\n\n")
            now = time.monotonic()
            for ev in events:
                if b"[DONE]" in ev:
                    m.completed += 1
                elif b'"content":"' in ev and b'"content":""' not in ev:
                    m.pieces += 1
                    if last is not None:
                        m.itl.append(now - last)
                    last = now
        m.errors += last is None


async def _caller(url: str, seed: int, stop: trio.Event, m: Streams, tokens: int) -> None:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    rng = random.Random(seed)
    while not stop.is_set():
        question = " ".join(rng.choice(WORDS) for _ in range(30))
        body = (b'{"messages":[{"role":"user","content":"Explain: %s"}],"max_tokens":%d,'
                b'"ignore_eos":true,"stream":true}' % (question.encode(), tokens))
        try:
            await _stream_once(host, int(port), body, m)
        except OSError:
            m.errors += 1
            await trio.sleep(0.5)


async def _streams(url: str, callers: int, seconds: float, tokens: int) -> Streams:
    m, stop = Streams(), trio.Event()
    async with trio.open_nursery() as nursery:
        for i in range(callers):
            nursery.start_soon(_caller, url, 1000 + i, stop, m, tokens)
        await trio.sleep(seconds)
        nursery.cancel_scope.cancel()  # a bounded run: every stream ends now
    return m


def streams(server: Server, callers: int, seconds: float, traffic: str | None = None,
            tokens: int = STREAM_TOKENS) -> dict[str, Any]:
    """``callers`` closed-loop streams for ``seconds``; with ``traffic``, beside wrk's
    64 connections on that path."""
    trio.run(_streams, server.url, callers, 2.0, tokens)  # warm: caches, the cost model
    doors = door_processes(server.pid)
    workers = [c for c in children(server.pid) if c not in doors]  # none: llama-server
    cpu0, client0 = cpu_seconds(server.pid), time.process_time()
    workers0 = sum(cpu_seconds(w) for w in workers)
    doors0 = sum(cpu_seconds(d) for d in doors)
    wrk = None
    if traffic is not None:
        wrk = subprocess.Popen(["wrk", "-t1", "-c64", f"-d{seconds + 2:g}s",
                                server.url + traffic], stdout=subprocess.DEVNULL)
    try:
        m = trio.run(_streams, server.url, callers, seconds, tokens)
    finally:
        if wrk is not None:
            wrk.wait(timeout=seconds + 60)
    cpu = cpu_seconds(server.pid) - cpu0
    worker_cpu = sum(cpu_seconds(w) for w in workers) - workers0
    door_cpu = sum(cpu_seconds(d) for d in doors) - doors0
    made = max(1, m.completed * tokens)
    requests = max(1, m.completed)
    return {"server": server.name, "callers": callers, "traffic": traffic,
            "tok_s": round(m.completed * tokens / seconds), "errors": m.errors,
            "pieces_s": round(m.pieces / seconds),
            "itl_p50_ms": _pct_ms(m.itl, 50), "itl_p99_ms": _pct_ms(m.itl, 99),
            "itl_p99_9_ms": _pct_ms(m.itl, 99.9), "itl_max_ms": _pct_ms(m.itl, 100),
            # forged: its door alone (the daemon process); llama-server: all of it.
            "server_cpu_us_per_token": round(cpu / made * 1e6, 1),
            "req_s": round(m.completed / seconds, 1),
            "server_cpu_us_per_request": round(cpu / requests * 1e6, 1),
            "doors_cpu_us_per_request": round(door_cpu / requests * 1e6, 1),
            "total_cpu_us_per_request": round((cpu + door_cpu + worker_cpu) / requests * 1e6,
                                              1),
            "total_cpu_us_per_token": round((cpu + door_cpu + worker_cpu) / made * 1e6, 1),
            "client_cpu_s": round(time.process_time() - client0, 2)}


def _pct_ms(values: list[float], pct: float) -> float | None:
    p = percentile(values, pct)
    return None if p is None else round(p * 1000, 2)


def start_forged(tmp: Path, model: Path, name: str, threads: int = THREADS,
                 **server: Any) -> Server:
    port = free_port()
    d = tmp / name
    d.mkdir()
    # llama-server's layout: 64 slots of 512 cells each (-np 64 -c 32768).
    engine = {"threads": threads, "kv_cells": 32768, "slots": 64, "max_running": 64,
              "max_context": 512}
    proc = DaemonProcess(write_config(d / "forged.toml", model, port, engine=engine,
                                      server=server), port)
    proc.wait_ready(120)
    return Server(name, proc.url, proc.proc.pid, proc.stop)


def start_llama(binary: str, tmp: Path, model: Path, name: str) -> Server:
    server = LlamaServer(binary, ["-np", "64", "-b", "256", "-ub", "256"], tmp / f"{name}.log",
                         model=model, context=32768)
    server.wait_ready()
    return Server(name, server.url, server.proc.pid, server.stop)


def _in_turn(starts: list[Any], run: Any) -> list[dict[str, Any]]:
    """Start each server alone, run ``run(server)`` (a list of results), stop it."""
    out: list[dict[str, Any]] = []
    for start in starts:
        server = start()
        try:
            out += run(server)
        finally:
            server.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="each wrk run")
    ap.add_argument("--stream-seconds", type=float, default=20.0, help="each stream run")
    ap.add_argument("--parts", default=",".join(PARTS),
                    help="which parts to run (comma-separated)")
    ap.add_argument("--forged-only", action="store_true",
                    help="only forged as shipped in each part, printed, nothing written")
    args = ap.parse_args()
    parts = args.parts.split(",")
    if shutil.which("wrk") is None:
        raise SystemExit("bench.door needs Debian's wrk: apt-get install wrk")
    binary = subprocess.run([str(ROOT / "bench" / "build-llama-server.sh")], check=True,
                            capture_output=True, text=True, cwd=ROOT).stdout.strip()
    tmp = Path(tempfile.mkdtemp())
    tiny = write_tiny_llama(tmp / "tiny.gguf")
    result: dict[str, Any] = {"threads": THREADS, "connections": CONNECTIONS,
                              "stream_tokens": STREAM_TOKENS,
                              "traffic_tokens": TRAFFIC_TOKENS}

    def trivial_runs(server: Server) -> list[dict[str, Any]]:
        return [trivial(server, path, args.seconds) for path in ("/health", "/v1/models")]

    def in_turn(starts: list[Any], run: Any) -> list[dict[str, Any]]:
        return _in_turn(starts[:1] if args.forged_only else starts, run)

    result["trivial"] = [] if "trivial" not in parts else in_turn([
        lambda: start_forged(tmp, MODEL, "forged"),
        lambda: start_forged(tmp, MODEL, "forged-general", hot_door=False),
        lambda: start_llama(binary, tmp, MODEL, "llama-server")], trivial_runs)

    def stream_runs(server: Server) -> list[dict[str, Any]]:
        return [streams(server, c, args.stream_seconds) for c in STANDIN_CALLERS]

    result["standin"] = [] if "standin" not in parts else in_turn([
        lambda: start_forged(tmp, tiny, "forged-tiny"),
        lambda: start_forged(tmp, tiny, "forged-tiny-nocoalesce", stream_coalesce_ms=0),
        # Streams through Quart, hypercorn and h11, as before direct streams.
        lambda: start_forged(tmp, tiny, "forged-tiny-general", hot_door=False),
        lambda: start_llama(binary, tmp, tiny, "llama-server-tiny")], stream_runs)

    def short_runs(server: Server) -> list[dict[str, Any]]:
        return [streams(server, 16, args.stream_seconds, tokens=SHORT_TOKENS)]

    result["short"] = [] if "short" not in parts else in_turn([
        lambda: start_forged(tmp, tiny, "forged-tiny-short"),
        lambda: start_forged(tmp, tiny, "forged-tiny-general-short", hot_door=False),
        lambda: start_llama(binary, tmp, tiny, "llama-server-tiny-short")], short_runs)

    def traffic_runs(server: Server) -> list[dict[str, Any]]:
        return [streams(server, 16, args.stream_seconds, tokens=TRAFFIC_TOKENS),
                streams(server, 16, args.stream_seconds, "/v1/models", TRAFFIC_TOKENS)]

    result["traffic"] = [] if "traffic" not in parts else in_turn([
        lambda: start_forged(tmp, MODEL, "forged-traffic"),
        # The door on CPU 0, the worker's one thread on the other (server.door_cpus).
        lambda: start_forged(tmp, MODEL, "forged-traffic-placed", threads=1, door_cpus=[0]),
        lambda: start_llama(binary, tmp, MODEL, "llama-server-traffic")], traffic_runs)
    def door_runs(server: Server) -> list[dict[str, Any]]:
        return [trivial(server, "/health", args.seconds),
                {"part": "short", **streams(server, 16, args.stream_seconds,
                                            tokens=SHORT_TOKENS)}]

    # Door processes (server.door_processes): the daemon alone, then one and two doors;
    # the CPUs shared in each (door_cpus = []), so that only the processes differ.
    result["doors"] = [] if "doors" not in parts else _in_turn([
        lambda n=n: start_forged(tmp, tiny, f"forged-doors-{n}", door_cpus=[],
                                 door_processes=n) for n in DOOR_PROCESSES], door_runs)
    if args.forged_only:
        for part in ("trivial", "standin", "short", "traffic", "doors"):
            for row in result[part]:
                print(part, row)
        return
    write_results("door" if parts == list(PARTS) else "door-" + "-".join(parts), result,
                  tables(result))


def tables(result: dict[str, Any]) -> str:
    lines = ["| server | path | req/s | p50 ms | p99 ms | errors | server CPU µs/request "
             "| wrk CPU s |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['server']} | `{r['path']}` | {r['rps']} | {r['p50_ms']} | {r['p99_ms']} "
              f"| {r['errors']} | {r['server_cpu_us_per_request']} | {r['wrk_cpu_s']} |"
              for r in result["trivial"]]
    lines += ["", "| server | callers | traffic | tok/s | text events/s | ITL p50 ms | ITL p99 ms "
              "| ITL p99.9 ms | ITL max ms | errors | door CPU µs/token | all CPU µs/token "
              "| client CPU s |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['server']} | {r['callers']} | {r['traffic'] or '-'} | {r['tok_s']} "
              f"| {r['pieces_s']} "
              f"| {r['itl_p50_ms']} | {r['itl_p99_ms']} | {r['itl_p99_9_ms']} "
              f"| {r['itl_max_ms']} | {r['errors']} "
              f"| {r['server_cpu_us_per_token']} | {r['total_cpu_us_per_token']} "
              f"| {r['client_cpu_s']} |"
              for r in result["standin"] + result["traffic"]]
    lines += ["", "| server | callers | tokens a request | req/s | door CPU µs/request "
              "| all CPU µs/request | errors | client CPU s |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['server']} | {r['callers']} | {SHORT_TOKENS} | {r['req_s']} "
              f"| {r['server_cpu_us_per_request']} "
              f"| {r['total_cpu_us_per_request']} | {r['errors']} "
              f"| {r['client_cpu_s']} |" for r in result.get("short", [])]
    return "\n".join(lines + _doors_table(result.get("doors", []))) + "\n"


def _doors_table(rows: list[dict[str, Any]]) -> list[str]:
    """Part 5: each forged run's /health row, then its short generations' row."""
    lines = ["", "| door processes | `/health` req/s | p99 ms | daemon CPU µs/request "
             "| doors' CPU µs/request | cores each door used | short generations req/s "
             "| daemon CPU µs/request | doors' CPU µs/request | all CPU µs/request |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for health, short in zip(rows[::2], rows[1::2], strict=True):
        lines.append(
            f"| {health['door_processes']} | {health['rps']} | {health['p99_ms']} "
            f"| {health['server_cpu_us_per_request']} | {health['doors_cpu_us_per_request']} "
            f"| {', '.join(map(str, health['doors_busy'])) or '-'} | {short['req_s']} "
            f"| {short['server_cpu_us_per_request']} | {short['doors_cpu_us_per_request']} "
            f"| {short['total_cpu_us_per_request']} |")
    return lines


if __name__ == "__main__":
    main()
