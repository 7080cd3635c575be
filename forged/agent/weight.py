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
  of the node's total, each worker counted at its own model's ``kv_cells`` and
  ``max_running``. An idle node scores 1, a node whose every running place (or every KV
  cell) is taken 0.5: it still takes work, which queues behind the running;
* **queue**: ``H / (H + q)``, where ``q`` is the queued prompt work in seconds (queued
  prompt tokens times each worker's measured milliseconds per prompt token, averaged
  over the workers ready) and ``H`` is ``server.agent_queue_half``: a queue of ``H``
  seconds halves the weight, of ``3H`` quarters it.

Both are the generation workers' alone when the node has any: an embedding worker keeps
no KV cells and its batches are short, so beside a chat worker its idle places would
hide a full one (a full chat worker beside an idle embedding worker weighed 80%, not
50%). A node that serves only embedding models is weighed by their running places.

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
class Worker:
    """One worker of the node, as the weight counts it."""

    stats: WorkerLoad | None  # its last report; None while it is not ready
    kv_cells: int  # its model's engine.kv_cells
    max_running: int  # its model's engine.max_running
    generates: bool = True  # False: an embedding model's (no KV cache, short batches)


@dataclass(frozen=True)
class NodeLoad:
    """What the weight is computed from; fractions are of the whole node."""

    kv_free: float  # KV cells neither held nor promised by running sequences
    running_free: float  # running places (engine.max_running per worker) free
    queue_seconds: float  # queued prompt work, by the workers' cost model


def node_load(workers: Sequence[Worker]) -> NodeLoad | None:
    """The load of a node from its workers (every model's); None when none is ready. A
    worker that is not ready adds capacity to the total but none to what is free."""
    if all(w.stats is None for w in workers):
        return None
    # The generation workers, or else (a node of embedding models only) all of them.
    measured = [w for w in workers if w.generates] or list(workers)
    ready = [(w, w.stats) for w in measured if w.stats is not None]
    cells = sum(w.kv_cells for w in measured if w.generates)
    busy_cells = sum(s.kv_cells_active + s.kv_cells_reserved for _, s in ready)
    # A worker ready but not yet heard from has reported no cells: all of them are free.
    free_cells = sum(s.kv_cells_total or w.kv_cells for w, s in ready if w.generates)
    free_places = sum(w.max_running - s.running for w, s in ready)
    queue_ms = sum(s.queued_tokens * s.cost_prompt_token_ms for _, s in ready)
    return NodeLoad(kv_free=_fraction(free_cells - busy_cells, cells) if cells else 1.0,
                    running_free=_fraction(free_places, sum(w.max_running for w in measured)),
                    queue_seconds=max(0.0, queue_ms / max(1, len(ready)) / 1000))


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
