"""Engine figures for docs/engine.md: decode step times, KV state save and restore, and
single-stream decode speed.

    .venv/bin/python -m bench.engine [--model PATH] [--threads 2]

Measures llama.cpp through forged's backend (no HTTP), then one stream through a
running forged daemon started here on loopback, so the Python/HTTP cost shows as a
ratio. Every loop is bounded.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from bench.daemonproc import DaemonProcess, free_port, write_config
from forged.engine.backend import Context, ContextParams, Model, Sampler
from forged.engine.decoding import DecodeItem
from forged.engine.request import Sampling

MODEL = Path("models/SmolLM2-135M-Instruct.Q4_1.gguf")


def decode_steps(model: Model, threads: int, n_seqs: int, steps: int = 24) -> float:
    """Median ms of one decode step with ``n_seqs`` sequences (128-token prompts each)."""
    ctx = Context(model, ContextParams(n_ctx=16384, n_seq_max=64, n_batch=128, threads=threads))
    prompt = model.tokenize("def quicksort(items):\n" * 16, add_special=True,
                            parse_special=True)[:127]
    for s in range(n_seqs):
        ctx.decode([(s, 0, prompt, False)])
    pos, times = len(prompt), []
    for _ in range(steps):
        t0 = time.perf_counter()
        ctx.decode([(s, pos, [42], True) for s in range(n_seqs)])
        times.append(time.perf_counter() - t0)
        pos += 1
    ctx.close()
    return statistics.median(times) * 1000


def budget_step(model: Model, threads: int, budget: int, decoders: int) -> float:
    """Median ms of a full step: ``decoders`` decode tokens plus a prompt chunk."""
    ctx = Context(model, ContextParams(n_ctx=16384, n_seq_max=decoders + 1, n_batch=budget,
                                      threads=threads))
    for s in range(decoders):
        ctx.decode([(s, 0, [1, 2, 3, 4], False)])
    chunk = budget - decoders
    times = []
    for i in range(8):
        items = [(s, 4 + i, [42], True) for s in range(decoders)]
        items.append((decoders, i * chunk, [7] * chunk, True))
        t0 = time.perf_counter()
        ctx.decode(items)
        times.append(time.perf_counter() - t0)
    ctx.close()
    return statistics.median(times) * 1000


def per_slot_step(model: Model, threads: int, flash_attn: bool, chunks: list[int]) -> float:
    """Median ms of a step of the shipped layout (16 streams of 2,048 cells): 12 sequences
    with 128-token contexts decode one token each, plus prompt chunks of these lengths."""
    ctx = Context(model, ContextParams(n_ctx=32768, n_seq_max=16, n_batch=256,
                                      threads=threads, flash_attn=flash_attn,
                                      kv_unified=False))
    prompt = model.tokenize("def quicksort(items):\n" * 16, add_special=True,
                            parse_special=True)[:128]
    for s in range(12):
        ctx.decode([(s, 0, prompt, False)])
    times = []
    for i in range(12):
        items = [(s, len(prompt) + i, [42], True) for s in range(12)]
        for j, n in enumerate(chunks):
            ctx.seq_rm(12 + j, 0)
            items.append((12 + j, 0, [7] * n, True))
        t0 = time.perf_counter()
        ctx.decode(items)
        times.append(time.perf_counter() - t0)
    ctx.close()
    return statistics.median(times) * 1000


def deep_prompt(model: Model) -> list[int]:
    return model.tokenize("def quicksort(items):\n" * 400, add_special=True,
                          parse_special=True)


def per_slot_context(model: Model, threads: int, depth: int, flash_attn: bool) -> Context:
    """The shipped layout (16 streams of 2,048 cells) with every sequence holding
    ``depth`` tokens."""
    ctx = Context(model, ContextParams(n_ctx=32768, n_seq_max=16, n_batch=512,
                                      threads=threads, flash_attn=flash_attn,
                                      kv_unified=False))
    prompt = deep_prompt(model)[:depth]
    for s in range(16):
        for a in range(0, depth, 512):
            ctx.decode([(s, a, prompt[a:a + 512], False)])
    return ctx


def timed_step(ctx: Context, items: Sequence[DecodeItem], reps: int = 6) -> float:
    """Median ms of one ``decode(items)``, each rep on the same cells (the first rep,
    which may build the graph, is not counted)."""
    times = []
    for i in range(reps + 1):
        for s, pos, _, _ in items:
            ctx.seq_rm(s, pos)
        t0 = time.perf_counter()
        ctx.decode(items)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def batch_order(model: Model, threads: int, depth: int) -> tuple[float, float]:
    """Ms of a decode step of 16 sequences listed in slot order, and shuffled: llama.cpp
    makes one micro-batch of each run of consecutive sequence ids in batch order."""
    ctx = per_slot_context(model, threads, depth, flash_attn=False)
    order = list(range(16))
    random.Random(1).shuffle(order)
    out = (timed_step(ctx, [(s, depth, [42], True) for s in range(16)]),
           timed_step(ctx, [(s, depth, [42], True) for s in order]))
    ctx.close()
    return out


def deep_chunks(model: Model, threads: int, depth: int, sizes: list[int],
                flash_attn: bool) -> list[float]:
    """A step of 15 decoders at ``depth``, then what a prompt chunk of each size at
    ``depth`` adds to it: below 64 rows per stream flash attention goes one query at a
    time."""
    ctx = per_slot_context(model, threads, depth, flash_attn)
    decoders: list[DecodeItem] = [(s, depth, [42], True) for s in range(15)]
    alone = timed_step(ctx, decoders)
    deep = deep_prompt(model)
    out = [timed_step(ctx, [*decoders, (15, depth, deep[depth:depth + n], True)]) - alone
           for n in sizes]
    ctx.close()
    return [alone, *out]


def single_stream_backend(model: Model, threads: int, n: int = 128) -> float:
    ctx = Context(model, ContextParams(n_ctx=16384, n_seq_max=64, n_batch=64, threads=threads))
    smp = Sampler(model, Sampling(temperature=0))
    prompt = model.tokenize("def fibonacci(n):\n", add_special=True, parse_special=True)
    idx = ctx.decode([(0, 0, prompt, True)])
    pos = len(prompt)
    t0 = time.perf_counter()
    for _ in range(n):
        tok = smp.sample(ctx, idx[0])
        model.piece(tok)
        idx = ctx.decode([(0, pos, [tok], True)])
        pos += 1
    dt = time.perf_counter() - t0
    ctx.close()
    return n / dt


def state_copy(model: Model, threads: int, tokens: int,
               repeats: int = 5) -> tuple[float, float, int]:
    """Median ms to save one sequence's KV state of ``tokens`` tokens (the RAM tier's
    SeqSave) and to restore it into another sequence (SeqLoad), and its bytes."""
    ctx = Context(model, ContextParams(n_ctx=4 * tokens, n_seq_max=4, n_batch=256,
                                       threads=threads))
    prompt = (model.tokenize("def quicksort(items):\n" * tokens, add_special=True,
                             parse_special=False) * 2)[:tokens]
    for pos in range(0, tokens, 256):
        ctx.decode([(0, pos, prompt[pos:pos + 256], 1)])
    saves, loads = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state = ctx.seq_save(0)
        t1 = time.perf_counter()
        assert ctx.seq_load(1, state, tokens)
        loads.append(time.perf_counter() - t1)
        saves.append(t1 - t0)
        ctx.seq_rm(1, 0)
    ctx.close()
    return statistics.median(saves) * 1000, statistics.median(loads) * 1000, len(state)


def single_stream_http(url: str, n: int = 128) -> float:
    body = json.dumps({"prompt": "def fibonacci(n):\n", "max_tokens": n, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    first = last = None
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if line.startswith(b"data: {"):
                last = time.perf_counter()
                first = first or last
    assert first is not None and last is not None
    return (n - 1) / (last - first)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    model = Model(str(args.model))
    print(f"model {args.model.name}, {args.threads} threads")
    for n in (1, 8, 16, 32):
        ms = decode_steps(model, args.threads, n)
        print(f"decode step, {n:2d} sequences: {ms:6.1f} ms  ({n / ms * 1000:5.0f} tok/s)")
    for budget in (32, 64, 128):
        ms = budget_step(model, args.threads, budget, 8)
        print(f"full step, budget {budget:3d} (8 decoding): {ms:6.1f} ms")
    for fa, chunks in ((False, []), (False, [52]), (True, []), (True, [52]), (True, [26, 26]),
                       (True, [10, 12, 14, 16]), (True, [120])):
        ms = per_slot_step(model, args.threads, fa, chunks)
        print(f"per-slot step, 12 decoding + prompt chunks {chunks}, flash attention "
              f"{'on' if fa else 'off'}: {ms:6.1f} ms")
    for tokens in (200, 1500):
        save, load, size = state_copy(model, args.threads, tokens)
        print(f"KV state of {tokens} tokens ({size / 1e6:.1f} MB): save {save:5.1f} ms, "
              f"restore {load:5.1f} ms")
    for depth in (128, 1000):
        ordered, shuffled = batch_order(model, args.threads, depth)
        print(f"per-slot decode of 16 at depth {depth}: in slot order {ordered:6.1f} ms, "
              f"shuffled {shuffled:6.1f} ms")
    for fa in (False, True):
        for depth in (128, 1000):
            sizes = [16, 32, 63, 64, 65, 80, 128, 256]
            alone, *added = deep_chunks(model, args.threads, depth, sizes, fa)
            print(f"flash attention {'on' if fa else 'off'}, depth {depth}: 15 decoders "
                  f"{alone:.0f} ms; a chunk beside them adds " + ", ".join(
                      f"{n}: {ms:.0f} ms" for n, ms in zip(sizes, added, strict=True)))
    backend = single_stream_backend(model, args.threads)
    model.close()
    print(f"single stream, backend only: {backend:6.1f} tok/s")

    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        d = DaemonProcess(write_config(Path(tmp) / "forged.toml", args.model.resolve(), port,
                                       engine={"threads": args.threads}), port)
        try:
            d.wait_ready()
            single_stream_http(d.url, 16)  # warm up
            http = statistics.median(single_stream_http(d.url) for _ in range(3))
        finally:
            d.stop()
    print(f"single stream, through forged's HTTP API: {http:6.1f} tok/s "
          f"({http / backend:.2f}x the backend alone)")


if __name__ == "__main__":
    main()
