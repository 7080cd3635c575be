"""What a lazy tool-call grammar costs a token before it triggers.

``python -m bench.trigger`` (under a minute). Until the model writes ``<tool_call>``,
llama.cpp searches the whole text generated so far with the grammar's trigger pattern
at every token. This feeds the default model's vocabulary-only grammar sampler the
tokens of README.md's prose (no call) and prints the time a token costs at 500, 1,000
and 1,500 tokens, for forged's pattern (the literal), for a marker token (what forged
uses where the vocabulary has ``<tool_call>`` as one special token: no pattern, a token
compared; measured here with another special token standing for it) and the
whole-text form forged used before (``[\\s\\S]*?(<tool_call>)[\\s\\S]*``), which
std::regex backtracks through. In-process, no daemon.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import llama_cpp as ll
import msgspec

from forged.engine.backend import Model, grammar_sampler
from forged.engine.callgrammar import call_grammar

MODEL = Path(__file__).resolve().parent.parent / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
OLD = r"[\s\S]*?(<tool_call>)[\s\S]*"
MARKS = (500, 1000, 1500)


def per_token(model: Model, tokens: list[int], pattern: str | None,
              marker: int | None = None) -> dict[int, float]:
    """Microseconds a token, over the 100 tokens before each of MARKS; the grammar
    triggered by ``pattern`` (None: forged's), or by the token ``marker`` alone."""
    g = call_grammar([{"name": "f", "parameters": {"type": "object", "properties": {}}}],
                     many=True, lazy=True)
    if pattern is not None:
        g = msgspec.structs.replace(g, trigger_patterns=[pattern])
    if marker is not None:
        g = msgspec.structs.replace(g, trigger_patterns=[], trigger_tokens=[marker])
    ptr = grammar_sampler(model, g)
    out: dict[int, float] = {}
    try:
        t0 = 0.0
        for i, tok in enumerate(tokens[:max(MARKS)], 1):
            if i % 500 == 401:
                t0 = time.perf_counter()
            ll.llama_sampler_accept(ptr, tok)
            if i in MARKS:
                out[i] = (time.perf_counter() - t0) / 100 * 1e6
    finally:
        ll.llama_sampler_free(ptr)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=MODEL)
    args = p.parse_args()
    model = Model(str(args.model), vocab_only=True)
    text = (Path(__file__).parent.parent / "README.md").read_text()[:20000]
    text = text.replace("<tool_call>", "")  # prose: nothing triggers
    buf = (ll.llama_token * 10000)()
    n = ll.llama_tokenize(model.vocab, text.encode(), len(text.encode()), buf, 10000,
                          False, False)
    tokens = list(buf[:n])
    print("| tokens of prose | the literal (us/token) | a marker token (us/token) "
          "| whole-text form (us/token) |")
    print("|---|---|---|---|")
    new, old = per_token(model, tokens, None), per_token(model, tokens, OLD)
    token = per_token(model, tokens, None, marker=model.eos)  # never in the prose
    for mark in MARKS:
        print(f"| {mark} | {new[mark]:.1f} | {token[mark]:.1f} | {old[mark]:.0f} |")


if __name__ == "__main__":
    main()
