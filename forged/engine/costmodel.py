"""How long a decode step takes on this machine and model, learnt while serving.

Theory of operation
-------------------
The scheduler bounds every step by time (``engine.target_step_ms``), not by a token
count, so it must predict a step's time before running it. A step's time is modelled
as linear in six features of its batch (:class:`StepShape`):

* ``fixed``: 1 per step (graph build, a pass over the weights, synchronisation);
* ``decoders``: sequences decoding one token each;
* ``prompt_tokens``: prompt tokens computed (chunked prefill);
* ``chunks``: with per-slot KV streams, the passes over the weights beyond the first:
  llama.cpp splits such a batch into micro-batches of consecutive sequence ids that
  take equal rows from each, which :func:`micro_batches` simulates (so a prompt chunk
  costs one more pass for each distinct length, and a gap in the ids of the running
  slots one more); in the unified layout, prompt chunks;
* ``kpairs``: thousands of query-key pairs attended by decoders and short chunks, the
  part that grows with context;
* ``tiled_kpairs``: the same for chunks computed as matrices. Whether a chunk is depends
  on the attention: llama.cpp's CPU flash attention takes one query at a time unless a
  micro-batch holds at least 64 rows of one stream (then tiles of 64 queries), and at
  position 1,000 beside 15 decoders a 63-token chunk added 899 ms to a step and an
  80-token one 377 ms; without flash attention every chunk is a matrix product
  (docs/engine.md). One query at a time costs about three times as much per pair
  without flash attention and ten times as much with it. With flash attention and
  several chunks in one run of consecutive slots this is approximate: llama.cpp gives
  each of them the rows of the shortest in a shared micro-batch, so a long chunk's
  first rows may go one query at a time although it is priced as tiled.

The coefficients start from a seed and are refitted after every step by exponentially
weighted least squares (recent steps count more: the machine is shared and its speed
drifts), regularised towards the seed so that a feature the traffic has not exercised
yet keeps a sensible value instead of whatever the other features leave over. This
module is plain arithmetic: no clock, no I/O, no llama.cpp.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from forged.engine.decoding import Backend, DecodeItem
from forged.engine.stats import WorkerStats

FEATURES = ("fixed_ms", "decoder_ms", "prompt_token_ms", "chunk_ms", "kpair_ms",
            "tiled_kpair_ms")

# ggml's GGML_FA_TILE_Q: the fewest query rows of one stream that flash attention
# computes as tiles. A chunk beside other sequences gives its first token to their
# micro-batch (llama.cpp splits per-slot batches into equal shares per sequence), so a
# chunk is tiled from TILE_ROWS + 1 tokens on.
TILE_ROWS = 64

# Measured on the reference machine kind (2 cores) with SmolLM2-135M Q4_1 and per-slot
# streams, by bench.engine (docs/engine.md): without flash attention (the default) and
# with it. Any other machine or model corrects them within a few dozen steps; the
# start-up calibration does most of that at once.
SEED = (8.0, 2.6, 3.0, 3.0, 3.4, 1.2)
SEED_FLASH = (8.0, 2.6, 3.0, 3.0, 12.0, 1.1)
# A typical size of each feature: the prior's weight is one pseudo-step of this shape,
# so that it is equally strong, relative to the data, for every coefficient.
_SCALE = np.array([1.0, 8.0, 48.0, 2.0, 20.0, 30.0])
_PRIOR_STEPS = 0.5
# Weight of the past after each new step: an effective memory of about 100 steps.
_DECAY = 0.99


@dataclass(frozen=True)
class StepShape:
    decoders: int = 0
    prompt_tokens: int = 0
    chunks: int = 0
    kpairs: float = 0.0
    tiled_kpairs: float = 0.0

    def features(self) -> np.ndarray:
        return np.array([1.0, self.decoders, self.prompt_tokens, self.chunks, self.kpairs,
                         self.tiled_kpairs])

    def plus(self, other: StepShape) -> StepShape:
        return StepShape(self.decoders + other.decoders,
                         self.prompt_tokens + other.prompt_tokens,
                         self.chunks + other.chunks, self.kpairs + other.kpairs,
                         self.tiled_kpairs + other.tiled_kpairs)


def decode_shape(positions: list[int]) -> StepShape:
    """One decoding token per sequence, each attending over its ``pos`` earlier cells."""
    return StepShape(decoders=len(positions), kpairs=sum(p + 1 for p in positions) / 1000)


def micro_batches(runs: Sequence[tuple[int, int]], n_ubatch: int) -> int:
    """How many micro-batches llama.cpp computes a per-slot batch of ``runs`` in: each
    ``(seq, tokens)``, one per sequence, the batch in sequence order (the scheduler
    sorts it). ``llama_kv_cache::init_batch`` splits it with
    ``llama_batch_allocr::split_equal(n_ubatch, sequential=true)``: a micro-batch takes
    the first sequence with rows left and each following one whose id is exactly one
    more, then as many rows from each as the shortest has left (at most n_ubatch in
    all, at least one each). Each micro-batch is a pass over the weights."""
    runs = sorted(runs)
    seqs, left = [s for s, _ in runs], [n for _, n in runs]
    passes = 0
    while any(left):
        members = [next(i for i, n in enumerate(left) if n)]
        for i in range(members[0] + 1, len(runs)):
            if not left[i]:
                continue  # spent: the next id is then not one more than the last taken
            if seqs[i] != seqs[members[-1]] + 1 or len(members) > n_ubatch:
                break
            members.append(i)
        rows = min(min(left[i] for i in members), max(1, n_ubatch // len(members)))
        for i in members:
            left[i] -= rows
        passes += 1
    return passes


def with_passes(shape: StepShape, runs: Sequence[tuple[int, int]], n_ubatch: int
                ) -> StepShape:
    """``shape`` of a per-slot batch of ``runs``, with its extra passes counted exactly."""
    return replace(shape, chunks=max(0, micro_batches(runs, n_ubatch) - 1))


def chunk_shape(pos: int, n: int, *, tile_rows: int) -> StepShape:
    """``n`` prompt tokens written at ``pos``: token ``i`` attends over ``pos + i + 1``;
    as matrices if there are more than ``tile_rows`` of them."""
    pairs = (n * pos + n * (n + 1) / 2) / 1000
    if n > tile_rows:
        return StepShape(prompt_tokens=n, chunks=1, tiled_kpairs=pairs)
    return StepShape(prompt_tokens=n, chunks=1, kpairs=pairs)


class CostModel:
    """Predicts a step's milliseconds from its shape; ``observe`` refits it."""

    def __init__(self, seed: tuple[float, ...] | None = None, *,
                 flash_attn: bool = False, per_slot: bool = True) -> None:
        self._seed = np.array(seed or (SEED_FLASH if flash_attn else SEED), dtype=float)
        # Without flash attention any chunk of two rows or more is a matrix product. In
        # the unified layout a micro-batch is one stream holding every sequence's rows,
        # so flash attention tiles a step's chunks (and its decoders) together once the
        # step has 64 rows: chunks are priced as matrices there, which is rough.
        self.tile_rows = TILE_ROWS if flash_attn and per_slot else 1
        self._prior = np.diag(_PRIOR_STEPS * _SCALE**2)
        self._xtx = np.zeros((len(FEATURES), len(FEATURES)))
        self._xty = np.zeros(len(FEATURES))
        self.coef = self._seed.copy()
        self.observed = 0

    def predict(self, shape: StepShape) -> float:
        return float(self.coef @ shape.features())

    def observe(self, shape: StepShape, ms: float) -> None:
        """Record that a step of ``shape`` took ``ms`` and refit."""
        x = shape.features()
        self._xtx = _DECAY * self._xtx + np.outer(x, x)
        self._xty = _DECAY * self._xty + ms * x
        # Ridge towards the seed: minimise sum w (y - x.c)^2 + (c - seed)' P (c - seed).
        lhs = self._xtx + self._prior
        rhs = self._xty + self._prior @ self._seed
        # A coefficient below zero is never physical; it only appears while features
        # move together. Clamping keeps every prediction monotone in every feature.
        self.coef = np.maximum(np.linalg.solve(lhs, rhs), 0.0)
        self.observed += 1

    def max_prompt_tokens(self, pos: int, room_ms: float, cap: int) -> int:
        """The most prompt tokens (at most ``cap``) a chunk at ``pos`` may take so that it
        costs no more than ``room_ms``. Cost grows with the length within each attention
        path, not across them (a tiled chunk can cost less than a shorter one), so each
        path is searched on its own, the tiled one first."""
        tiled = self._longest_within(pos, room_ms, self.tile_rows + 1, cap)
        return tiled or self._longest_within(pos, room_ms, 0, min(cap, self.tile_rows))

    def _longest_within(self, pos: int, room_ms: float, lo: int, hi: int) -> int:
        """Binary search in ``lo..hi`` (0 if even ``lo`` does not fit)."""
        if hi < lo or self.predict_extra(self.chunk(pos, lo)) > room_ms:
            return 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.predict_extra(self.chunk(pos, mid)) <= room_ms:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def chunk(self, pos: int, n: int) -> StepShape:
        """:func:`chunk_shape` with this machine's attention."""
        return chunk_shape(pos, n, tile_rows=self.tile_rows)

    def predict_extra(self, shape: StepShape) -> float:
        """What adding ``shape`` to a step costs (no fixed part)."""
        return float(self.coef[1:] @ shape.features()[1:])

    def report(self, out: WorkerStats) -> None:
        """Its fields of the worker's statistics: the coefficients, in FEATURES' order."""
        (out.cost_fixed_ms, out.cost_decoder_ms, out.cost_prompt_token_ms, out.cost_chunk_ms,
         out.cost_kpair_ms, out.cost_tiled_kpair_ms) = (float(c) for c in self.coef)
        out.cost_steps_observed = float(self.observed)


def calibrate(backend: Backend, slots: int, *, flash_attn: bool, per_slot: bool,
              clock: Callable[[], float] = time.perf_counter) -> CostModel:
    """A cost model seeded from a few steps of typical shapes run now, on empty
    sequences that are removed afterwards, so that the first real steps are already
    bounded by this machine's and this model's speed rather than by the built-in seed."""
    model = CostModel(flash_attn=flash_attn, per_slot=per_slot)
    n_batch = backend.n_batch
    # (decoders, prompt tokens in place of one of them), each within one batch
    shapes = [(d, min(p, n_batch - d + 1)) for d, p in
              ((1, 0), (min(slots, 8), 0), (1, 32), (1, 128), (min(slots, 4), 64))]
    backend.decode([(0, 0, [0], True)])  # the first decode allocates; do not time it
    backend.seq_rm(0, 0)
    for _ in range(2):
        for decoders, prompt in shapes:
            items: list[DecodeItem] = [(s, 0, [0], True) for s in range(decoders)]
            shape = decode_shape([0] * decoders)
            if prompt:
                items[0] = (0, 0, [0] * prompt, True)
                shape = decode_shape([0] * (decoders - 1)).plus(model.chunk(0, prompt))
            if per_slot:
                shape = with_passes(shape, [(s, len(t)) for s, _, t, _ in items], n_batch)
            t0 = clock()
            backend.decode(items)
            model.observe(shape, (clock() - t0) * 1000)
            for s in range(decoders):
                backend.seq_rm(s, 0)
    return model
