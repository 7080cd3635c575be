"""What a request for generation is: one shape from the HTTP edge to the scheduler.

The HTTP layer builds a :class:`Request` once, from the caller's body, its API key and
the config. The pool sends it to a worker unchanged (inside a ``Submit`` frame, beside
the routing id), the worker's core hands it to the scheduler, and the scheduler keeps
its own bookkeeping (queue place, slot, progress) beside it, privately.

Sans-IO: this module imports msgspec and forged's config schema only.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from forged.config import PRIORITIES, Priority

# The samplers of llama.cpp's chain (common/sampling.cpp's names), and llama.cpp's
# default order. Mirostat is not among them: it replaces the chain (Sampling.mirostat).
SamplerName = Literal["penalties", "dry", "top_n_sigma", "top_k", "typical_p", "top_p",
                      "min_p", "xtc", "temperature", "infill"]
SAMPLER_ORDER: tuple[SamplerName, ...] = ("penalties", "dry", "top_n_sigma", "top_k",
                                          "typical_p", "top_p", "min_p", "xtc",
                                          "temperature")
# DRY's default sequence breakers (llama.cpp's): a repetition does not run across them.
DRY_BREAKERS = ("\n", ":", "\"", "*")


class Grammar(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """A GBNF grammar the output must match (llama.cpp's grammar sampler).

    Lazy, it constrains nothing until the text generated matches one of
    ``trigger_patterns`` (regexes searched in the text so far; the grammar applies from
    the match on) or one of ``trigger_tokens`` is sampled: how a tool call is
    constrained once the model starts one of its own accord.
    """

    gbnf: str
    lazy: bool = False
    trigger_patterns: list[str] = []
    trigger_tokens: list[int] = []


class Sampling(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """How the next token is chosen; llama.cpp's sampler chain is built from this. The
    fields are llama.cpp's server's, with its meanings (tools/server/README.md)."""

    temperature: Annotated[float, Meta(ge=0.0)] = 1.0  # 0: greedy
    # Dynamic temperature: between temperature -/+ range, by the entropy of the
    # candidates raised to the exponent.
    dynatemp_range: Annotated[float, Meta(ge=0.0)] = 0.0
    dynatemp_exponent: Annotated[float, Meta(ge=0.0)] = 1.0
    # Each default below leaves its sampler out of the chain.
    top_k: Annotated[int, Meta(ge=0)] = 0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    typical_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 1.0
    top_n_sigma: float = -1.0  # <= 0: off
    # XTC removes the most likely tokens above the threshold (all but the least likely
    # of them), with this probability per draw; a threshold over 0.5 removes nothing.
    xtc_probability: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    xtc_threshold: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.1
    # Penalties over the prompt and the last tokens made, as llama.cpp's server applies
    # them: the last ``repeat_last_n`` tokens (the HTTP layer resolves -1, the context).
    repeat_penalty: Annotated[float, Meta(gt=0.0)] = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_last_n: Annotated[int, Meta(ge=0)] = 64
    # DRY ("don't repeat yourself"): a token that would extend a repetition of more than
    # ``dry_allowed_length`` tokens, within the last ``dry_penalty_last_n``, loses
    # multiplier * base ** (length - allowed_length) of its logit.
    dry_multiplier: Annotated[float, Meta(ge=0.0)] = 0.0
    dry_base: Annotated[float, Meta(ge=1.0)] = 1.75
    dry_allowed_length: Annotated[int, Meta(ge=0)] = 2
    dry_penalty_last_n: Annotated[int, Meta(ge=0)] = 64
    dry_sequence_breakers: tuple[str, ...] = DRY_BREAKERS
    # Mirostat 1 or 2 replaces the chain (as in llama.cpp: temperature, then mirostat
    # draws, aiming at a surprise of tau, learning at the rate eta); 0: off.
    mirostat: Literal[0, 1, 2] = 0
    mirostat_tau: Annotated[float, Meta(ge=0.0)] = 5.0
    mirostat_eta: Annotated[float, Meta(ge=0.0)] = 0.1
    # What top_p, min_p, typical_p and XTC keep at least (llama.cpp's min_keep).
    min_keep: Annotated[int, Meta(ge=0)] = 1
    # None: a fresh random seed per request.
    seed: Annotated[int, Meta(ge=0, le=0xFFFFFFFF)] | None = None
    # (token, bias) pairs; -inf bans a token.
    logit_bias: list[tuple[int, float]] = []
    # The chain, in order (llama.cpp's `samplers`): a sampler not named is left out.
    order: tuple[SamplerName, ...] = SAMPLER_ORDER
    # Structured output and tool calls: applied before every other sampler.
    grammar: Grammar | None = None
    # vLLM's min_tokens: the first this many draws cannot draw a token of ``suppress``
    # (the core fills it with the end-of-generation and stop tokens).
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    suppress: list[int] = []

    def for_choice(self, index: int) -> Sampling:
        """Choice ``index`` of a request with ``n`` > 1 samples with ``seed + index``:
        the choices differ, and the whole response is reproducible from one seed."""
        if self.seed is None or index == 0:
            return self
        return msgspec.structs.replace(self, seed=(self.seed + index) & 0xFFFFFFFF)


class Request(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    prompt: list[int]
    # Choices (OpenAI's ``n``): the prompt is computed once, then its KV is copied to a
    # sequence per choice, each with a sampler of its own (Sampling.for_choice).
    n: Annotated[int, Meta(ge=1)] = 1
    # 0: fill the cache with the prompt and answer at once (an editor's warm-up).
    max_tokens: Annotated[int, Meta(ge=0)]
    priority: Priority = "interactive"
    sampling: Sampling = Sampling()
    stop: list[str] = []
    # vLLM's stop_token_ids: tokens that end the answer as end-of-generation does.
    stop_tokens: list[int] = []
    # vLLM's include_stop_str_in_output: the stop string (or the stop token's text)
    # ends the answer's text.
    include_stop: bool = False
    ignore_eos: bool = False
    # Keep the KV after the request ends, so later requests can reuse it.
    cache: bool = True
    # A conversation's name: its KV is kept, pinned, for the next turn.
    session: str | None = None
    # Prefix caches are shared within a tenant only (what one tenant sent must not
    # show in another's ``cached_tokens``).
    tenant: str = ""
    # Seconds it may wait for admission (and again after a preemption).
    queue_timeout: float = math.inf
    # Editor completions (llama.cpp's /infill): stop at the first newline generated
    # after this many milliseconds of generation (0: never), and stop before a line
    # that starts with fewer than this many spaces or tabs (0: never).
    max_predict_ms: Annotated[float, Meta(ge=0)] = 0.0
    n_indent: Annotated[int, Meta(ge=0)] = 0
    # Special tokens whose text is part of the answer (llama.cpp's preserved tokens):
    # a tool call's <tool_call> where the vocabulary has it as one special token.
    preserve: list[int] = []
    # Tool calls: the opening and closing markers of a call. A call written again
    # verbatim ends the choice where it begins (forged.engine.textstream), and a call
    # is sent only once it is whole.
    unique_blocks: tuple[str, str] | None = None
    # Log-probabilities (forged.engine.logprobs): None asks for none; a number asks for
    # each generated token's and that many most likely alternatives'. With
    # ``prompt_logprobs`` every prompt token after the first is scored too (echo on
    # /v1/completions); such a prompt is computed whole, never from the prefix cache,
    # whose cells kept no logits.
    logprobs: Annotated[int, Meta(ge=0)] | None = None
    prompt_logprobs: bool = False
    # An embedding request (forged.engine.embedcore): the lengths of the inputs that
    # ``prompt`` holds one after another; each is embedded apart. Empty: generation.
    inputs: list[Annotated[int, Meta(ge=1)]] = []

    @property
    def rank(self) -> int:
        """Its class's place in the serving order: 0 is served first."""
        return PRIORITIES.index(self.priority)
