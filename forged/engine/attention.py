"""Flash attention or not: chosen by measurement when a worker starts (issue 34).

Whether llama.cpp's flash attention helps depends on the CPU and on the depth. On one
machine of this project it made 15 streams 1,000 tokens deep twice as slow (it takes
one query at a time for decoding streams and short chunks); on an AVX-512 machine
llama-server was faster with it on at every load. A fixed default is wrong on one of
them, so with ``engine.flash_attn = "auto"`` the worker times the same small piece of
work both ways, on scratch contexts of the model it serves, before it creates its
own: a few decoding steps and a short prompt chunk at :data:`PROBE_DEPTH`, the rounds
alternated so that a slow spell of the machine reaches both. On 2 cores with SmolLM2
this adds about 5 s to a worker's start (two fills of 512 tokens).

Flash attention must win by :data:`MARGIN` to be chosen: the choice also names the
disk tier's saved states (a state saved with one setting does not load in the
other), so two starts on a noisy machine should not flip it over a tie. And where
the worker keeps saved states, it keeps the choice beside them (:func:`recall`,
:func:`remember`) for the same model file, llama.cpp, CPU and threads: measured once,
so a restart neither pays for the probe again nor drops the states over a flip.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec

from forged.engine.backend import BackendError, Context, ContextParams, Model

# Deep enough that attention weighs as in a coding assistant's streams (history and
# retrieved code: 500 to 2,000 tokens) without a long start: two fills of it.
PROBE_DEPTH = 512  # tokens computed before the timed work (not timed)
PROBE_DECODES = 8  # one-token steps timed at that depth
PROBE_CHUNK = 32  # then one prompt chunk of this many tokens
ROUNDS = 2  # each setting measured this many times, alternated; the fastest counts
MARGIN = 0.10  # flash attention is chosen only when at least this much faster
_BATCH = 128


@dataclass(frozen=True)
class Choice:
    flash_attn: bool
    why: str  # for forged status: what was measured, or why nothing was


class _Kept(msgspec.Struct, frozen=True):
    identity: str
    flash_attn: bool
    why: str


def recall(path: Path, identity: str) -> Choice | None:
    """The choice an earlier start kept at ``path`` for ``identity``, if any."""
    try:
        kept = msgspec.json.decode(path.read_bytes(), type=_Kept)
    except (OSError, msgspec.DecodeError):
        return None  # none yet, or unreadable: measure again
    if kept.identity != identity:
        return None
    return Choice(kept.flash_attn, f"{kept.why}, at an earlier start")


def remember(path: Path, identity: str, choice: Choice) -> None:
    """Keep ``choice`` for the next start (written whole, then renamed in place)."""
    tmp = path.with_suffix(".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp.write_bytes(msgspec.json.encode(_Kept(identity, choice.flash_attn, choice.why)))
        os.replace(tmp, path)
    except OSError as exc:  # the disk tier will say more; the choice still holds now
        print(f"forged worker: cannot keep the flash attention choice: {exc}",
              file=sys.stderr, flush=True)


def choose(measure: Callable[[bool], float], rounds: int = ROUNDS) -> Choice:
    """Flash attention if its fastest time beats the other's by :data:`MARGIN`.
    ``measure(flash_attn)``: milliseconds of the probe's work; it may raise
    :class:`BackendError` when llama.cpp cannot run a setting (then the other)."""
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for on in (False, True):
            try:
                times[on].append(measure(on))
            except BackendError as exc:
                return Choice(not on, f"flash attention {'on' if on else 'off'} failed: {exc}")
    without, with_fa = min(times[False]), min(times[True])
    return Choice(with_fa < without * (1 - MARGIN),
                  f"measured {with_fa:.1f} ms with flash attention, {without:.1f} ms without "
                          f"({PROBE_DECODES} steps and a {PROBE_CHUNK}-token chunk "
                          f"{PROBE_DEPTH} tokens deep)")


class Probe:
    """The probe's work, timed on scratch contexts of ``model``, one per setting, each
    made and filled to :data:`PROBE_DEPTH` at its first measure (not timed); each
    measure then times the work and takes it back off, so the rounds share one fill."""

    def __init__(self, model: Model, threads: int,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.model, self.threads, self.clock = model, threads, clock
        self.token = model.eog_tokens[0] if model.eog_tokens else 0
        self.contexts: dict[bool, Context] = {}  # by setting, made at first measure

    def measure(self, flash_attn: bool) -> float:
        """Milliseconds of the work with ``flash_attn``."""
        ctx = self.contexts.get(flash_attn) or self._filled(flash_attn)
        pos, start = PROBE_DEPTH, self.clock()
        for _ in range(PROBE_DECODES):
            ctx.decode([(0, pos, [self.token], 1)])
            pos += 1
        ctx.decode([(0, pos, [self.token] * PROBE_CHUNK, 1)])
        ms = (self.clock() - start) * 1000
        ctx.seq_rm(0, PROBE_DEPTH)
        return ms

    def _filled(self, flash_attn: bool) -> Context:
        ctx = Context(self.model, ContextParams(
            n_ctx=PROBE_DEPTH + PROBE_DECODES + PROBE_CHUNK, n_seq_max=1, n_batch=_BATCH,
            threads=self.threads, flash_attn=flash_attn))
        self.contexts[flash_attn] = ctx
        for pos in range(0, PROBE_DEPTH, _BATCH):
            ctx.decode([(0, pos, [self.token] * min(_BATCH, PROBE_DEPTH - pos), 1)])
        return ctx

    def close(self) -> None:
        for ctx in self.contexts.values():
            ctx.close()
        self.contexts.clear()
