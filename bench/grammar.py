"""What a grammar costs per token: constrained against free decoding, in one run.

``python -m bench.grammar`` (about a minute). forged serves the default model
(SmolLM2-135M, 49k tokens); one caller at a time streams ``--requests`` (6) chat answers
of each kind, at temperature 0:

* **free**: plain text, ``ignore_eos``, ``--tokens`` (96) tokens;
* **json_object**: ``response_format: {"type": "json_object"}`` (llama.cpp's grammar
  sampler, and forged's UTF-8 guard), up to ``--tokens``.

Measured: the mean time per streamed token after the first, per kind, and the
difference (what the grammar and the guard add to each constrained token). One caller
at a time, so the figure is a sequence's own cost, not the batch's.

Then, in-process on the same model, the parts of a draw whose first pick the grammar
refuses (median of 20): forged's copy of the logits into its candidate array, the
UTF-8 guard, llama.cpp's grammar over every candidate, and the request's chain;
and what that grammar pass costs for a large enum (:func:`enum_ms`) and for many
tools (:func:`tools_ms`).
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import random
import statistics
import string
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import llama_cpp as ll
import numpy as np

from bench.daemonproc import DaemonProcess, free_port, write_config
from forged.engine.backend import (
    ContextParams,
    Llama,
    Model,
    Sampler,
    _Candidates,
    gbnf_literal,
    grammar_sampler,
)
from forged.engine.callgrammar import call_grammar
from forged.engine.grammar import json_object_grammar, schema_grammar
from forged.engine.request import Grammar, Sampling

MODEL = Path(__file__).resolve().parent.parent / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
KINDS: dict[str, dict[str, Any]] = {
    "free": {"ignore_eos": True},
    "json_object": {"response_format": {"type": "json_object"}},
}


def per_token_ms(url: str, tokens: int, extra: dict[str, Any]) -> tuple[float, int]:
    """Mean ms between streamed chunks after the first, and the chunks counted."""
    body = {"messages": [{"role": "user", "content": "Describe a small Python project."}],
            "max_tokens": tokens, "temperature": 0, "stream": True, **extra}
    stamps = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content":"' in line:
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return (1000 * statistics.fmean(gaps) if gaps else float("nan")), len(stamps)


def full_draw_ms(draws: int = 20) -> dict[str, float]:
    """The parts of a draw that filters the whole vocabulary (reaches into the
    sampler: this is what ``Sampler.sample`` does when the first pick does not fit)."""
    llm = Llama(str(MODEL), ContextParams(n_ctx=512, n_seq_max=1, n_batch=512, threads=2))
    prompt = llm.model.tokenize("Describe a project as JSON.", add_special=True,
                                parse_special=False)
    index = llm.decode([(0, 0, prompt, 1)])[0]
    s = Sampler(llm.model, Sampling(temperature=0, grammar=json_object_grammar()), prompt)
    c, guard = s._candidates, s._guard
    assert c is not None and guard is not None
    row = np.ctypeslib.as_array(ll.llama_get_logits_ith(llm.ctx.ptr, index),
                                shape=(llm.model.n_vocab,))
    parts: dict[str, list[float]] = {}
    for _ in range(draws):
        t = [time.perf_counter()]
        logits = c.fill(row)
        t.append(time.perf_counter())
        guard.ban(logits)
        t.append(time.perf_counter())
        ll.llama_sampler_apply(s._grammar, ctypes.byref(c.array))
        t.append(time.perf_counter())
        ll.llama_sampler_apply(s._ptr, ctypes.byref(c.array))
        t.append(time.perf_counter())
        for name, a, b in zip(("copy", "guard", "grammar", "chain"), t, t[1:], strict=False):
            parts.setdefault(name, []).append(1000 * (b - a))
    s.close()
    llm.close()
    return {name: round(statistics.median(v), 2) for name, v in parts.items()}


def enum_ms(sizes: tuple[int, ...] = (100, 1000, 3500)) -> list[dict[str, Any]]:
    """An enum of N random words (6-14 letters): llama.cpp's grammar over the whole
    vocabulary at each token of one value (the pass a draw makes when its first pick
    does not fit), the enum as a flat list of alternatives (llama-cpp-python's
    converter, forged before) against forged's prefix tree, each shape on the same
    words; ms at the value's first two tokens (the opening quote and the first
    letters, where the flat list's stacks are all alive) and the mean of the rest."""
    model = Model(str(MODEL), vocab_only=True)
    row = np.random.default_rng(0).standard_normal(model.n_vocab).astype(np.float32)
    out = []
    for n in sizes:
        rng = random.Random(n)
        words = sorted({"".join(rng.choice(string.ascii_lowercase)
                                for _ in range(rng.randint(6, 14))) for _ in range(n)})
        tree = schema_grammar({"type": "string", "enum": words}, "enum").gbnf
        flat = "root ::= " + " | ".join(gbnf_literal(json.dumps(w)) for w in words)
        value = model.tokenize(json.dumps(words[n // 2]), add_special=False,
                               parse_special=False)
        for shape, gbnf in (("flat", flat), ("tree", tree)):
            ms = _apply_ms(model, gbnf, value, row)
            out.append({"values": n, "shape": shape, "first_ms": ms[0], "second_ms": ms[1],
                        "rest_mean_ms": round(statistics.fmean(ms[2:]), 2)})
    model.close()
    return out


def tools_ms(sizes: tuple[int, ...] = (10, 50, 150)) -> list[dict[str, Any]]:
    """N tools (``tool_000``...; a path or a count each): the grammar's pass over the
    whole vocabulary before each token of one call, the call as the converter's anyOf
    of one object per function (forged before) against forged's (the shared part once,
    the names as a prefix tree); the slowest token and the mean."""
    model = Model(str(MODEL), vocab_only=True)
    row = np.random.default_rng(0).standard_normal(model.n_vocab).astype(np.float32)
    out = []
    for n in sizes:
        fns = [{"name": f"tool_{i:03d}", "parameters": {
            "type": "object", "properties": {"path": {"type": "string"}},
            "required": ["path"]}} for i in range(n)]
        tree = call_grammar(fns, many=False, lazy=False).gbnf
        flat = "\n".join("call ::= calls" if line.startswith("call ::=") else line
                         for line in tree.splitlines())
        text = f'<tool_call>\n{{"name": "tool_{n // 2:03d}", "arguments": {{"path": "a"}}}}'
        value = model.tokenize(text, add_special=False, parse_special=True)
        for shape, gbnf in (("anyOf", flat), ("tree", tree)):
            ms = _apply_ms(model, gbnf, value, row)
            out.append({"tools": n, "shape": shape, "max_ms": max(ms),
                        "mean_ms": round(statistics.fmean(ms), 2)})
    model.close()
    return out


def _apply_ms(model: Model, gbnf: str, value: list[int], row: Any) -> list[float]:
    """ms of the grammar over every candidate before each of ``value``'s tokens."""
    ptr = grammar_sampler(model, Grammar(gbnf=gbnf))
    c = _Candidates(model.n_vocab)
    ms = []
    for token in value:
        c.fill(row)
        t = time.perf_counter()
        ll.llama_sampler_apply(ptr, ctypes.byref(c.array))
        ms.append(round(1000 * (time.perf_counter() - t), 2))
        ll.llama_sampler_accept(ptr, token)
    ll.llama_sampler_free(ptr)
    return ms


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--enum-only", action="store_true",
                    help="only the in-process parts: a large enum, many tools")
    args = ap.parse_args(argv)
    if args.enum_only:
        json.dump({"enum": enum_ms(), "tools": tools_ms()}, sys.stdout, indent=1)
        print()
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        d = DaemonProcess(write_config(Path(tmp) / "forged.toml", MODEL, port), port)
        try:
            d.wait_ready(180)
            per_token_ms(d.url, 8, {})  # warm-up (and the guard's table, built once)
            per_token_ms(d.url, 8, KINDS["json_object"])
            out: dict[str, Any] = {}
            for kind, extra in KINDS.items():
                runs = [per_token_ms(d.url, args.tokens, extra) for _ in range(args.requests)]
                out[kind] = {"ms_per_token": round(statistics.median(r[0] for r in runs), 2),
                             "tokens": [r[1] for r in runs]}
            out["grammar_ms_per_token"] = round(
                out["json_object"]["ms_per_token"] - out["free"]["ms_per_token"], 2)
        finally:
            assert d.stop() == 0
    out["full_draw_ms"] = full_draw_ms()
    out["enum"] = enum_ms()
    out["tools"] = tools_ms()
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
