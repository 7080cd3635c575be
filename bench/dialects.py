"""The cost of a dialect (issue 32): the same chats, streamed by 16 callers, through
OpenAI's `/v1/chat/completions`, Ollama's `/api/chat`, Anthropic's `/v1/messages` and
OpenAI's `/v1/responses`, on one forged, in one run. One command:

    .venv/bin/python -m bench.dialects [--rounds 4] [--requests 32]

Each round runs every dialect in turn (the order rotating from round to round, so that
no dialect always goes first on a warm or a cold machine), each with ``--requests``
chats at 16 at once; the samples of all rounds are pooled per dialect. Goal: TTFT and
ITL p50/p99 of every dialect within 5% of the OpenAI route's.

Writes bench/results/dialects.json and the table for docs/benchmarks.md
(bench/results/dialects.md). Every run is bounded in requests and time.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import trio

from bench.daemonproc import DaemonProcess, free_port, write_config
from bench.run import MODEL, THREADS, write_results
from forged.observe.loadtest import Sample, summarise

CONCURRENCY = 16
MAX_TOKENS = 64
TOPICS = ["a binary search", "a retry loop with backoff", "reading a CSV file",
          "a thread pool", "parsing dates", "an LRU cache", "a trie", "rate limiting"]


def _messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write Python for {TOPICS[i % len(TOPICS)]}, "
                                        f"variant {i}."}]


# Per dialect: its path, its body for chat ``i``, and the text a streamed line carries.
def _openai(i: int) -> dict[str, Any]:
    return {"messages": _messages(i), "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True}


def _ollama(i: int) -> dict[str, Any]:
    return {"model": MODEL.stem, "messages": _messages(i), "stream": True,
            "options": {"num_predict": MAX_TOKENS, "temperature": 0}}


def _anthropic(i: int) -> dict[str, Any]:
    return {"model": MODEL.stem, "messages": _messages(i), "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": True}


def _responses(i: int) -> dict[str, Any]:
    return {"model": MODEL.stem, "input": _messages(i)[0]["content"],
            "max_output_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "store": False}


def _sse(line: str) -> dict[str, Any] | None:
    return json.loads(line[6:]) if line.startswith("data: {") else None


def _openai_text(line: str) -> str:
    data = _sse(line)
    return "" if data is None else "".join(
        (c.get("delta") or {}).get("content") or "" for c in data.get("choices") or [])


def _ollama_text(line: str) -> str:
    data = json.loads(line) if line.startswith("{") else {}
    return str((data.get("message") or {}).get("content") or "")


def _anthropic_text(line: str) -> str:
    data = _sse(line)
    ok = data is not None and data.get("type") == "content_block_delta"
    return str(data["delta"].get("text", "")) if ok and data else ""


def _responses_text(line: str) -> str:
    data = _sse(line)
    ok = data is not None and data.get("type") == "response.output_text.delta"
    return str(data["delta"]) if ok and data else ""


Dialect = tuple[str, Callable[[int], dict[str, Any]], Callable[[str], str]]
DIALECTS: dict[str, Dialect] = {
    "openai": ("/v1/chat/completions", _openai, _openai_text),
    "ollama": ("/api/chat", _ollama, _ollama_text),
    "anthropic": ("/v1/messages", _anthropic, _anthropic_text),
    "responses": ("/v1/responses", _responses, _responses_text),
}


async def one(c: httpx.AsyncClient, base: str, dialect: Dialect, i: int) -> Sample:
    path, body, text_of = dialect
    s = Sample("chat", 0)
    t0 = last = time.monotonic()
    try:
        async with c.stream("POST", base + path, json=body(i)) as r:
            s.status = r.status_code
            async for line in r.aiter_lines():
                if not text_of(line):
                    continue
                last = s.arrived(t0, last)
                s.out_tokens += 1
    except httpx.HTTPError:
        s.status = 598
    s.e2e = time.monotonic() - t0
    return s


async def run_dialect(base: str, dialect: Dialect, start: int, n: int) -> list[Sample]:
    out: list[Sample] = []
    todo = iter(range(start, start + n))
    limits = httpx.Limits(max_connections=CONCURRENCY)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(300, connect=30)) as c:

        async def caller() -> None:
            for i in todo:
                out.append(await one(c, base, dialect, i))

        with trio.fail_after(900):
            async with trio.open_nursery() as nursery:
                for _ in range(CONCURRENCY):
                    nursery.start_soon(caller)
    return out


async def bench(base: str, rounds: int, n: int) -> dict[str, Any]:
    names = list(DIALECTS)
    samples: dict[str, list[Sample]] = {name: [] for name in names}
    walls = dict.fromkeys(names, 0.0)
    await run_dialect(base, DIALECTS["openai"], 10_000, CONCURRENCY)  # warm-up
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.monotonic()
            # The same chats for every dialect in a round: the same greedy work.
            samples[name] += await run_dialect(base, DIALECTS[name], r * n, n)
            walls[name] += time.monotonic() - t0
    return {name: summarise(samples[name], walls[name]) for name in names}


def table(result: dict[str, Any]) -> str:
    ref = result["dialects"]["openai"]
    keys = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "itl_p99_9", "itl_max")
    lines = ["| route | requests (errors) | " + " | ".join(keys) + " | ratios to OpenAI's |",
             "|---|---|" + "---|" * len(keys) + "---|"]
    for name, s in result["dialects"].items():
        cells = [f"{1000 * s[k]:.1f} ms" if s[k] is not None else "-" for k in keys]
        ratios = [f"{s[k] / ref[k]:.2f}" if s[k] and ref[k] else "-" for k in keys]
        lines.append(f"| {DIALECTS[name][0]} | {s['requests']} ({sum(s['errors'].values())}) | "
                     + " | ".join(cells) + " | " + " / ".join(ratios) + " |")
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="forged-dialects-"))
    port = free_port()
    config = write_config(tmp / "forged.toml", MODEL, port, engine={"threads": THREADS})
    d = DaemonProcess(config, port)
    try:
        d.wait_ready(300)
        dialects = await bench(d.url, args.rounds, args.requests)
    finally:
        d.stop(60)
    return {"rounds": args.rounds, "requests_per_round": args.requests,
            "concurrency": CONCURRENCY, "max_tokens": MAX_TOKENS, "dialects": dialects}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--requests", type=int, default=32, help="chats per dialect per round")
    args = p.parse_args()
    result = trio.run(main_async, args)
    write_results("dialects", result, table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
