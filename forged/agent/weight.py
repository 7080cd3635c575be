"""The agent's answer: a weight from the node's free capacity and queue, or its state.

Theory of operation
-------------------
HAProxy connects to ``server.agent_listen`` every ``agent-inter`` and reads one line
(its configuration manual, "agent-check"). forged answers:

* ``drain`` from the moment a stop begins (SIGTERM), through the grace and the drain:
  the balancer sends the node no new request, and requests in flight finish;
* ``down #...`` while no model worker is ready (starting, or restarting after a crash);
* otherwise ``up ready W%``: ``up`` and ``ready`` undo an earlier ``down`` or
  ``drain`` (only the agent may undo what the agent did), and ``W`` scales the weight
  the server line gives the node.

The weight (:func:`weight_percent`) is the product of two factors:

* **room**: ``0.5 + 0.5 * min(free KV cells, free running places)``, both as fractions
  of the node's total. An idle node scores 1, a node whose every running place (or
  every KV cell) is taken 0.5: it still takes work, which queues behind the running;
* **queue**: ``H / (H + q)``, where ``q`` is the queued prompt work in seconds (queued
  prompt tokens times each worker's measured milliseconds per prompt token, averaged
  over the workers) and ``H`` is ``server.agent_queue_half``: a queue of ``H`` seconds
  halves the weight, of ``3H`` quarters it.

It is rounded to a multiple of 10 (small changes would move keys around a consistent
hash ring for nothing) and never goes below 1% while the node serves (0% is what
``drain`` means). A node that is slow because it has fewer cores measures more
milliseconds per prompt token, so the same queue weighs it down more.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

# Weights move in steps of this many percent.
STEP = 10


class WorkerLoad(Protocol):
    """What the weight reads of a worker's statistics (forged.engine.stats.WorkerStats:
    the agent does not reach into the engine)."""

    @property
    def kv_cells_active(self) -> float: ...
    @property
    def kv_cells_reserved(self) -> float: ...
    @property
    def kv_cells_total(self) -> float: ...
    @property
    def running(self) -> float: ...
    @property
    def queued_tokens(self) -> float: ...
    @property
    def cost_prompt_token_ms(self) -> float: ...


@dataclass(frozen=True)
class NodeLoad:
    """What the weight is computed from; fractions are of the whole node."""

    kv_free: float  # KV cells neither held nor promised by running sequences
    running_free: float  # running places (engine.max_running per worker) free
    queue_seconds: float  # queued prompt work, by the workers' cost model


def node_load(ready: Sequence[WorkerLoad], *, workers: int, kv_cells: int,
              max_running: int) -> NodeLoad | None:
    """The load of a node from its ready workers' statistics (``EnginePool`` workers'
    ``stats``), out of ``workers`` configured; None when none is ready. A worker that is
    not ready adds capacity to the total but none to what is free."""
    if not ready:
        return None
    busy_cells = sum(s.kv_cells_active + s.kv_cells_reserved for s in ready)
    # A worker ready but not yet heard from has reported no cells: all of them are free.
    free_cells = sum(s.kv_cells_total or kv_cells for s in ready) - busy_cells
    free_places = len(ready) * max_running - sum(s.running for s in ready)
    queue_ms = sum(s.queued_tokens * s.cost_prompt_token_ms for s in ready) / len(ready)
    return NodeLoad(kv_free=_fraction(free_cells, workers * kv_cells),
                    running_free=_fraction(free_places, workers * max_running),
                    queue_seconds=max(0.0, queue_ms / 1000))


def _fraction(part: float, whole: float) -> float:
    return min(1.0, max(0.0, part / whole)) if whole > 0 else 0.0


def weight_percent(load: NodeLoad, queue_half: float) -> int:
    """The weight to report, 1-100 (the formula is in this module's docstring)."""
    room = 0.5 + 0.5 * min(load.kv_free, load.running_free)
    queue = queue_half / (queue_half + load.queue_seconds)
    return max(1, STEP * round(100 * room * queue / STEP))


def agent_reply(*, leaving: bool, load: NodeLoad | None, queue_half: float) -> str:
    """The line the agent sends, newline included."""
    if leaving:
        return "drain\n"
    if load is None:
        return "down #no model worker ready\n"
    return f"up ready {weight_percent(load, queue_half)}%\n"
