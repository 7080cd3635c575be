"""What the scheduler tells the worker: a step's plan (memory operations, then the
batch's chunks) and the events of requests' lives. Plain values, sans-IO; the
scheduler (:mod:`forged.engine.scheduler`) makes them and re-exports them, the worker
core (:mod:`forged.engine.core`) carries them out."""

from __future__ import annotations

from dataclasses import dataclass, field

from forged.engine.costmodel import StepShape
from forged.engine.kvtiers import Entry, TierOp

# A running sequence: (request id, choice index).
Key = tuple[int, int]


@dataclass(frozen=True)
class SeqRm:
    """``llama_memory_seq_rm(seq, p0, -1)``."""

    seq: int
    p0: int


@dataclass(frozen=True)
class SeqCp:
    """``llama_memory_seq_cp(src, dst, 0, n)``; with ``whole``, a per-slot copy: the
    entire stream of ``src`` (llama.cpp copies streams only whole), then
    ``seq_rm(dst, n, -1)``."""

    src: int
    dst: int
    n: int
    whole: bool = False


@dataclass(frozen=True)
class SeqSave:
    """Copy ``seq``'s state (``llama_state_seq_get_data``) to RAM as entry ``eid``."""

    seq: int
    eid: int


@dataclass(frozen=True)
class SeqLoad:
    """Write ``entry``'s saved state into the empty ``seq`` (``llama_state_seq_set_data``);
    with ``keep``, the entry stays in its tier too (the slot uses only part of it)."""

    seq: int
    entry: Entry
    keep: bool = False


MemOp = SeqRm | SeqCp | SeqSave | SeqLoad | TierOp


@dataclass(frozen=True)
class Chunk:
    """Consecutive tokens of one sequence in the batch; logits for the last if ``sample``."""

    rid: int
    seq: int
    pos: int
    tokens: list[int]
    sample: bool
    index: int = 0  # the choice whose sequence this is
    # The end of a prompt shared by several choices: the others, which sample their
    # first token from the same logits, each with its own sampler.
    forks: tuple[int, ...] = ()

    @property
    def key(self) -> Key:
        return self.rid, self.index

    @property
    def choices(self) -> tuple[int, ...]:
        """The choices that sample from this chunk's last logits."""
        return (self.index, *self.forks) if self.sample else ()


@dataclass(frozen=True)
class StepPlan:
    ops: list[MemOp]
    chunks: list[Chunk]
    shape: StepShape = field(default_factory=StepShape)  # what the cost model learns from

    @property
    def n_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.chunks)


@dataclass(frozen=True)
class Admission:
    """The scheduler admitted ``rid`` (``cached`` prompt tokens reused); the worker's
    core tells the daemon with a ``frames.Admitted``."""

    rid: int
    cached: int
    queue_time: float


@dataclass(frozen=True)
class Expired:
    rid: int


@dataclass(frozen=True)
class Preempted:
    """``rid`` lost its cells to memory pressure; it is re-queued to be recomputed."""

    rid: int


SchedEvent = Admission | Expired | Preempted


class QueueFull(Exception):
    """A queue bound would be passed, or the request would wait past its deadline;
    ``retry_after`` is when the work ahead should have drained enough (seconds)."""

    def __init__(self, message: str = "the request queue is full",
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after
