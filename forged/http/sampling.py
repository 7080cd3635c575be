"""A body's sampling fields as the engine's :class:`Sampling`: llama.cpp's whole chain.

Every generation route takes llama.cpp's server's sampling fields (``top_k``,
``top_p``, ``min_p``, ``typical_p``, ``top_n_sigma``, ``temperature`` with
``dynatemp_range`` and ``dynatemp_exponent``, XTC, DRY, the penalties with
``repeat_last_n``, mirostat) with its meanings and its "off" values, and ``samplers``,
the chain's order, as a list of names or as llama.cpp's string of letters
(``"edkypmxt"``, common/sampling.cpp's codes). llama.cpp's own samplers do the work
(:mod:`forged.engine.backend`); this module only checks and translates.

Two of llama.cpp's "the whole context" values, ``repeat_last_n: -1`` and
``dry_penalty_last_n: -1``, are resolved here to the model's context, and so is any
larger window: a window is never longer than what a sequence holds, and llama.cpp
allocates it whole.
"""

from __future__ import annotations

import re
from typing import Any, get_args

from forged import errors as e
from forged.engine.groups import ModelGroup
from forged.engine.request import DRY_BREAKERS, SAMPLER_ORDER, SamplerName, Sampling
from forged.http.schemas import GenerationFields
from forged.http.state import AppState

# llama.cpp's letters for its samplers (common_sampler_type_to_chr).
SAMPLER_LETTERS: dict[str, SamplerName] = {
    "e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typical_p",
    "p": "top_p", "m": "min_p", "x": "xtc", "t": "temperature", "i": "infill"}
# llama.cpp's other names for them (common_sampler_types_from_names): its canonical
# "typ_p", the kebab-case and no-dash forms, and its few nicknames.
_ALIASES: dict[str, SamplerName] = {
    "typ_p": "typical_p", "typ": "typical_p", "temp": "temperature",
    "nucleus": "top_p", **{alias: name for name in get_args(SamplerName) if "_" in name
                           for alias in (name.replace("_", "-"), name.replace("_", ""))}}
# DRY's base below 1 asks for llama.cpp's server default, as it does there.
_DRY_BASE = 1.75
# llama.cpp's infill sampler compares each candidate's text with every other's: over
# SmolLM2's 49k tokens its first draw took 16.5 s, and the worker's heartbeat ran out
# with every stream on it. A top_k before it bounds that: 256 candidates take about a
# millisecond a draw (1,024 took 18 ms, a whole step), and editors send 40 (llama.vim,
# llama.vscode). forged's top_k is off unless given (llama-server's default is 40).
MAX_INFILL_TOP_K = 256


def sampling(state: AppState, group: ModelGroup, req: GenerationFields) -> Sampling:
    """The engine's sampling settings for a body of any generation route."""
    context = group.max_context
    return Sampling(
        temperature=1.0 if req.temperature is None else req.temperature,
        dynatemp_range=req.dynatemp_range or 0.0,
        dynatemp_exponent=_given(req.dynatemp_exponent, 1.0),
        top_k=max(0, req.top_k or 0), top_p=req.top_p or 1.0, min_p=req.min_p or 0.0,
        typical_p=_given(req.typical_p, 1.0), top_n_sigma=_given(req.top_n_sigma, -1.0),
        xtc_probability=req.xtc_probability or 0.0,
        xtc_threshold=_given(req.xtc_threshold, 0.1),
        repeat_penalty=_repeat_penalty(req),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repeat_last_n=_window(req.repeat_last_n, context),
        dry_multiplier=req.dry_multiplier or 0.0,
        dry_base=_DRY_BASE if req.dry_base is None or req.dry_base < 1.0 else req.dry_base,
        dry_allowed_length=_given(req.dry_allowed_length, 2),
        dry_penalty_last_n=_window(req.dry_penalty_last_n, context),
        dry_sequence_breakers=tuple(req.dry_sequence_breakers or DRY_BREAKERS),
        mirostat=req.mirostat or 0, mirostat_tau=_given(req.mirostat_tau, 5.0),
        mirostat_eta=_given(req.mirostat_eta, 0.1), min_keep=max(1, req.min_keep or 0),
        seed=None if req.seed is None else req.seed & 0xFFFFFFFF,
        logit_bias=_logit_bias(state.cfg.limits.max_logit_bias, group, req.logit_bias),
        order=SAMPLER_ORDER if req.samplers is None else _checked_order(req.samplers, req),
        min_tokens=req.min_tokens,
    )


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value


def _window(last_n: int | None, context: int) -> int:
    """A penalty's window: llama.cpp's 64 by default; -1, or more than the context,
    the whole context."""
    if last_n is None:
        return 64
    return context if last_n < 0 else min(last_n, context)


def _logit_bias(most: int, group: ModelGroup, given: dict[str, float] | None
                ) -> list[tuple[int, float]]:
    bias: list[tuple[int, float]] = []
    if not given:
        return bias
    if len(given) > most:
        raise e.BadRequest("too many logit_bias entries", param="logit_bias")
    for key, value in given.items():
        token = _token_id(key)
        if token is None or not 0 <= token < group.prompter.n_vocab:
            raise e.BadRequest(f"logit_bias key {key!r} is not a token id", "logit_bias")
        bias.append((token, float(value)))
    return bias


_TOKEN_ID = re.compile(r"[0-9]{1,10}")


def _token_id(key: str) -> int | None:
    """A logit_bias key as a token id: ASCII digits only (``str.isdigit`` is true of
    "²", which ``int`` refuses)."""
    return int(key) if _TOKEN_ID.fullmatch(key) else None


def _repeat_penalty(req: GenerationFields) -> float:
    """llama.cpp's repeat_penalty, or vLLM's name for it, repetition_penalty."""
    given = {p for p in (req.repeat_penalty, req.repetition_penalty) if p is not None}
    if len(given) > 1:
        raise e.BadRequest("repeat_penalty and repetition_penalty are one setting; they "
                           "differ", param="repetition_penalty")
    return given.pop() if given else 1.0


def sampler_order(samplers: list[str] | str) -> tuple[SamplerName, ...]:
    """llama.cpp's ``samplers``: the chain's samplers in order, by name (any of
    llama.cpp's spellings, in any case) or as a string of its letters. llama.cpp skips
    a name or letter it does not know; forged says so instead."""
    if isinstance(samplers, str):
        return tuple(_letter(c) for c in samplers)
    return tuple(_name(n) for n in samplers)


def _checked_order(samplers: list[str] | str, req: GenerationFields
                   ) -> tuple[SamplerName, ...]:
    """``samplers``, refused if the infill sampler would see more than
    :data:`MAX_INFILL_TOP_K` candidates (mirostat does not run the chain)."""
    order = sampler_order(samplers)
    if "infill" not in order or req.mirostat:
        return order
    before = order[:order.index("infill")]
    if "top_k" in before and 1 <= (req.top_k or 0) <= MAX_INFILL_TOP_K:
        return order
    raise e.BadRequest(f"the infill sampler needs top_k (1 to {MAX_INFILL_TOP_K}) before it "
                       "in samplers: it compares every candidate with every other",
                       param="samplers")


def _letter(c: str) -> SamplerName:
    if c not in SAMPLER_LETTERS:
        raise e.BadRequest(f"the sampler letter {c!r} is not one of llama.cpp's "
                           f"({''.join(SAMPLER_LETTERS)})", param="samplers")
    return SAMPLER_LETTERS[c]


def _name(name: str) -> SamplerName:
    lower = name.lower()
    if lower in get_args(SamplerName):
        return lower  # type: ignore[return-value]
    if lower in _ALIASES:
        return _ALIASES[lower]
    raise e.BadRequest(f"the sampler {name!r} is not supported; forged has "
                       f"{', '.join(get_args(SamplerName))}", param="samplers")
