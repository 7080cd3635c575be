"""What a worker says of itself, and what a model's workers add up to.

A worker sends :class:`WorkerStats` with its steps (``forged.engine.frames.Step``): the
scheduler, its slot cache, the KV tiers and the cost model each write their own fields
(their ``report`` methods). The pool keeps each worker's last report; a model's
:class:`Totals` are the :class:`Counts` summed (the gauges over its ready workers, the
counters over every worker and its lost processes: ``COUNTERS``) plus the pool's own
counters. Metrics, ``forged status``, the status page, the agent's weight and the early
refusal read these fields by name, so a misspelt statistic is a type error, not a zero.

Every field is a float and defaults to 0: an older worker's report, or one from a
daemon that knows fewer fields (``forged status`` across a pool), still decodes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

import msgspec


class Counts(msgspec.Struct, kw_only=True):
    """Gauges and counters that mean something summed over workers."""

    # The scheduler's: its queue, its running sequences and what its caches saved.
    running: float = 0.0
    prefilling: float = 0.0
    queued_interactive: float = 0.0
    queued_batch: float = 0.0
    queued_tokens: float = 0.0
    kv_cells_active: float = 0.0
    kv_cells_cached: float = 0.0
    kv_cells_reserved: float = 0.0
    session_resumes: float = 0.0
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    prefix_cache_tokens_saved: float = 0.0
    prompt_tokens_computed: float = 0.0
    early_rejections: float = 0.0
    prefix_holds: float = 0.0
    # The slot cache's (forged.engine.slotcache).
    kv_cells_total: float = 0.0
    kv_cells_used: float = 0.0
    slots_idle_cached: float = 0.0
    sessions_pinned: float = 0.0
    # The KV tiers' (forged.engine.kvtiers).
    kv_ram_entries: float = 0.0
    kv_ram_bytes: float = 0.0
    kv_ram_budget_bytes: float = 0.0
    kv_disk_entries: float = 0.0
    kv_disk_bytes: float = 0.0
    kv_disk_budget_bytes: float = 0.0
    kv_saves: float = 0.0
    kv_ram_restores: float = 0.0
    kv_disk_restores: float = 0.0
    kv_restored_tokens: float = 0.0
    kv_restore_failures: float = 0.0
    kv_demotions: float = 0.0
    kv_drops: float = 0.0
    kv_swaps: float = 0.0
    # The worker's steps (forged.engine.core, forged.engine.embedcore).
    steps: float = 0.0
    tokens_generated: float = 0.0
    # The steps that carried prompt work beside the decoders, and their share of the
    # time and of the tokens generated (StepTally). A stream's gap is a step's time, so
    # past half of the tokens, the median gap is a prompt step's (docs/engine.md).
    step_seconds: float = 0.0
    prompt_steps: float = 0.0
    prompt_step_seconds: float = 0.0
    prompt_step_tokens: float = 0.0
    # llama.cpp's passes over the weights (micro-batches) in those steps: the scheduler's
    # count (forged.engine.costmodel.micro_batches). Per step, 1 is the least.
    micro_batches: float = 0.0
    # An embedding model's workers' (forged.engine.embedcore).
    embed_queued: float = 0.0
    embed_requests: float = 0.0
    embed_inputs: float = 0.0
    embed_tokens: float = 0.0


class WorkerStats(Counts, kw_only=True):
    """One worker's report: its counts, then what describes this worker alone (a step's
    time, its cost model, its wait) and would mean nothing summed."""

    step_ms: float = 0.0
    step_plan_ms: float = 0.0
    step_prompt_room_ms: float = 0.0
    target_step_ms: float = 0.0
    # What a one-token interactive request submitted now would wait: the daemon refuses
    # at the door when even that exceeds the queue timeout (forged.engine.pool).
    wait_estimate_s: float = 0.0
    # A worker left nicer than asked (no RLIMIT_NICE) shows it (forged.engine.worker).
    nice: float = 0.0
    # The cost model's coefficients (forged.engine.costmodel.FEATURES); 0 steps
    # observed: a worker without one (an embedding model's).
    cost_fixed_ms: float = 0.0
    cost_decoder_ms: float = 0.0
    cost_prompt_token_ms: float = 0.0
    cost_chunk_ms: float = 0.0
    cost_kpair_ms: float = 0.0
    cost_tiled_kpair_ms: float = 0.0
    cost_steps_observed: float = 0.0


class Totals(Counts, kw_only=True):
    """A model's workers' counts summed, with its pool's own counters."""

    # What decided each route (forged.engine.routing.Why).
    routed_by_cache: float = 0.0
    routed_by_session: float = 0.0
    routed_by_load: float = 0.0
    # Requests submitted again because their worker was lost before admitting them.
    resubmitted: float = 0.0


class StepTally:
    """A generation worker's steps: all of them, and those that carried prompt work."""

    def __init__(self) -> None:
        self.steps = 0
        self.tokens = 0
        self.seconds = 0.0
        self.prompt_steps = 0
        self.prompt_tokens = 0
        self.prompt_seconds = 0.0

    def add(self, with_prompt: bool, seconds: float, tokens: int) -> None:
        self.steps += 1
        self.tokens += tokens
        self.seconds += seconds
        if with_prompt:
            self.prompt_steps += 1
            self.prompt_tokens += tokens
            self.prompt_seconds += seconds

    def report(self, out: Counts) -> None:
        out.steps, out.tokens_generated, out.step_seconds = self.steps, self.tokens, self.seconds
        out.prompt_steps, out.prompt_step_tokens = self.prompt_steps, self.prompt_tokens
        out.prompt_step_seconds = self.prompt_seconds


def prompt_step_shares(c: Counts) -> tuple[float, float, float] | None:
    """The steps that carried prompt work: their share of the steps, of the steps' time
    and of the tokens generated; None before any step."""
    if not (c.steps and c.step_seconds and c.tokens_generated):
        return None
    return (c.prompt_steps / c.steps, c.prompt_step_seconds / c.step_seconds,
            c.prompt_step_tokens / c.tokens_generated)


_COUNTS = tuple(f.name for f in msgspec.structs.fields(Counts))
# The counts that only grow while a worker's process lives: Prometheus reads them as
# counters (_total), which must never go down, or it sees a reset. A model's go on
# growing when a worker is lost and restarted: each worker slot keeps what its lost
# processes counted (forged.engine.supervisor). The others are gauges, what a worker
# holds now: they go with its process. Each count is one or the other
# (tests/test_stats.py checks them against the metrics' types).
COUNTERS = (
    "session_resumes", "prefix_cache_queries", "prefix_cache_hits",
    "prefix_cache_tokens_saved", "prompt_tokens_computed", "early_rejections",
    "prefix_holds", "kv_saves", "kv_ram_restores", "kv_disk_restores",
    "kv_restored_tokens", "kv_restore_failures", "kv_demotions", "kv_drops", "kv_swaps",
    "steps", "tokens_generated", "step_seconds", "prompt_steps", "prompt_step_seconds",
    "prompt_step_tokens", "micro_batches", "embed_requests", "embed_inputs",
    "embed_tokens",
)
GAUGES = tuple(name for name in _COUNTS if name not in COUNTERS)
C = TypeVar("C", bound=Counts)


def summed(into: C, parts: Iterable[Counts], names: tuple[str, ...] = _COUNTS) -> C:
    """``into`` with the counts ``names`` (default: every count) of ``parts`` added to it
    (its other fields as they are)."""
    for part in parts:
        for name in names:
            setattr(into, name, getattr(into, name) + getattr(part, name))
    return into


# Totals' own fields, the pool's counters, beside the workers' COUNTERS.
_POOL_COUNTERS = ("routed_by_cache", "routed_by_session", "routed_by_load", "resubmitted")


def counters_of(t: Totals) -> Totals:
    """``t``'s counters alone (its gauges 0): what a model leaves counted once its
    workers have stopped."""
    return Totals(**{n: getattr(t, n) for n in (*COUNTERS, *_POOL_COUNTERS)})


def added(a: Totals, b: Totals) -> Totals:
    """Two models' totals, a node's: every field of ``Totals`` added."""
    return Totals(**{f.name: getattr(a, f.name) + getattr(b, f.name)
                     for f in msgspec.structs.fields(Totals)})
