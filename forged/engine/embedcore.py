"""An embedding model's worker core, sans-IO: requests in; batches, vectors and events out.

Theory of operation
-------------------
An embedding request is a :class:`~forged.engine.request.Request` whose ``inputs``
lists the lengths of the texts its ``prompt`` holds one after another (one request per
API call, however many texts it embeds: the pool routes, admits, resubmits and cancels
it as it does a generation). A worker started with ``Init.embedding`` runs this core
instead of :class:`~forged.engine.core.WorkerCore`.

Each ``step`` packs one batch: the next input of each waiting request in turn, oldest
first, round after round, as many as fit ``limits.embed_batch`` tokens and ``slots``
sequences (a long call shares every batch with the short ones behind it), each input
its own sequence (an encoder attends within a sequence only, so inputs of different
callers share a batch without seeing each other). The backend computes the batch and
pools each sequence to one unit-length vector. A request is ``Admitted`` when its first
input enters a batch, and ``Done`` with every vector once its last one is computed.

There is no KV cache to keep, no sampler and no text: what a generation worker spends
its state on, this one does not have. A failed batch fails the requests in it, not the
worker. Queued requests expire at their ``queue_timeout``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from forged.engine import frames as fr
from forged.engine.decoding import DecodeError
from forged.engine.events import Admitted, Done, Event, Failed
from forged.engine.limits import SchedulerLimits
from forged.engine.request import Request
from forged.engine.stats import WorkerStats

# Before the first batch is measured: seconds per token of a batch (a small BERT on
# two cores computes some thousands of tokens a second).
_FIRST_TOKEN_COST_S = 0.0005


class EmbedBackend(Protocol):
    """What the core needs of llama.cpp; :class:`forged.engine.backend.Embedder` has it."""

    n_embd: int

    def embed(self, inputs: Sequence[Sequence[int]]) -> bytes:
        """Each input's pooled, unit-length vector, float32 little-endian, one after
        another; raises DecodeError if llama.cpp refuses the batch."""


@dataclass
class _Job:
    rid: int
    request: Request
    arrived: float
    offsets: list[int]  # where each input starts in the prompt
    done: int = 0  # inputs computed
    sent: int = 0  # inputs in a batch (computed or being computed)
    admitted_at: float | None = None
    vectors: list[bytes] = field(default_factory=list)


class EmbedCore:
    def __init__(self, backend: EmbedBackend, limits: SchedulerLimits) -> None:
        self.backend = backend
        self.limits = limits
        # Fixed while the worker lives: its llama.cpp context was made for this batch
        # (a reload's larger step_tokens must not pass it).
        self.batch = limits.embed_batch
        self.jobs: OrderedDict[int, _Job] = OrderedDict()
        self.events: list[Event] = []
        self._token_cost = _FIRST_TOKEN_COST_S
        self._step_ms = 0.0
        self._counts = WorkerStats()  # what it embedded, and its steps
        self._last_stats = -float("inf")

    @property
    def busy(self) -> bool:
        return bool(self.jobs)

    # --- frames in -------------------------------------------------------------------

    def handle(self, frame: fr.ToWorker, now: float) -> None:
        match frame:
            case fr.Submit(rid=rid, request=req):
                self._submit(rid, req, now)
            case fr.Cancel(rid=rid):
                self.jobs.pop(rid, None)
            case fr.SetLimits(limits=lim) if lim.geometry == self.limits.geometry:
                self.limits = lim
            case _:
                pass

    def _submit(self, rid: int, req: Request, now: float) -> None:
        why = self._refusal(req)
        if why:
            self.events.append(Failed(rid=rid, code="bad_request", message=why))
            return
        if len(self.jobs) >= self.limits.max_queued:
            self.events.append(Failed(
                rid=rid, code="overloaded", message="the embedding queue is full",
                retry_after=self.wait_estimate()))
            return
        offsets, at = [], 0
        for n in req.inputs:
            offsets.append(at)
            at += n
        self.jobs[rid] = _Job(rid, req, now, offsets)

    def _refusal(self, req: Request) -> str:
        # The daemon checks these before it sends; a worker never trusts a frame.
        if not req.inputs:
            return "not an embedding request"
        if sum(req.inputs) != len(req.prompt):
            return "the inputs' lengths do not add up to the prompt"
        longest = min(self.limits.max_context, self.batch)
        if max(req.inputs) > longest:
            return f"an input of {max(req.inputs)} tokens is over the model's {longest}"
        return ""

    # --- one step ----------------------------------------------------------------------

    def step(self, now: float, flush: Callable[[], None] | None = None) -> None:
        self._expire(now)
        batch = self._pack(now)
        if not batch:
            return
        inputs = [job.request.prompt[job.offsets[i]:job.offsets[i] + job.request.inputs[i]]
                  for job, i in batch]
        t0 = time.perf_counter()
        try:
            vectors = self.backend.embed(inputs)
        except (DecodeError, ValueError) as exc:  # ValueError: a batch refused unrun
            self._fail_batch(batch, str(exc))
            return
        self._measured(sum(len(x) for x in inputs), time.perf_counter() - t0)
        size = 4 * self.backend.n_embd
        for k, (job, _) in enumerate(batch):
            job.vectors.append(vectors[k * size:(k + 1) * size])
            job.done += 1
        self._finish(now)

    def _pack(self, now: float) -> list[tuple[_Job, int]]:
        """The next inputs, as many as one batch holds: one of each waiting request a
        turn, oldest first, so that a call of 2,048 texts shares every batch with the
        short calls behind it instead of holding the worker for minutes (a search's
        query among them). The batch ends at the first input that does not fit."""
        room, seats = self.batch, self.limits.slots
        batch: list[tuple[_Job, int]] = []
        waiting = [j for j in self.jobs.values() if j.sent < len(j.request.inputs)]
        while waiting:
            for job in waiting:
                n = job.request.inputs[job.sent]
                if n > room or not seats:
                    return batch
                self._admit(job, now)
                batch.append((job, job.sent))
                job.sent += 1
                room, seats = room - n, seats - 1
            waiting = [j for j in waiting if j.sent < len(j.request.inputs)]
        return batch

    def _admit(self, job: _Job, now: float) -> None:
        if job.admitted_at is None:
            job.admitted_at = now
            self.events.append(Admitted(rid=job.rid, cached=0,
                                           queue_time=now - job.arrived))

    def _finish(self, now: float) -> None:
        for rid, job in list(self.jobs.items()):
            if job.done < len(job.request.inputs):
                continue
            del self.jobs[rid]
            self._counts.embed_requests += 1
            self._counts.embed_inputs += len(job.request.inputs)
            self._counts.embed_tokens += len(job.request.prompt)
            self.events.append(Done(
                rid=rid, text="", stop_type="eos", prompt_tokens=len(job.request.prompt),
                completion_tokens=0, cached_tokens=0,
                prefill_s=now - (job.admitted_at or now), embeddings=b"".join(job.vectors)))

    def _fail_batch(self, batch: list[tuple[_Job, int]], why: str) -> None:
        for rid in {job.rid for job, _ in batch}:
            if self.jobs.pop(rid, None) is not None:
                self.events.append(Failed(rid=rid, code="engine_error",
                                             message=f"the embedding batch failed: {why}"))

    def _expire(self, now: float) -> None:
        for rid, job in list(self.jobs.items()):
            if job.admitted_at is None and now - job.arrived > job.request.queue_timeout:
                del self.jobs[rid]
                self.events.append(Failed(
                    rid=rid, code="queue_timeout",
                    message=f"waited {now - job.arrived:.1f} s for the embedding model"))

    def _measured(self, tokens: int, seconds: float) -> None:
        # A moving average of a batch's cost per token: what wait_estimate says.
        self._token_cost = 0.8 * self._token_cost + 0.2 * seconds / max(1, tokens)
        self._step_ms = seconds * 1000
        self._counts.steps += 1

    # --- frames out ---------------------------------------------------------------------

    def wait_estimate(self) -> float:
        """Seconds a new request would wait: the tokens queued ahead of it, computed."""
        ahead = sum(sum(j.request.inputs[j.sent:]) for j in self.jobs.values())
        return ahead * self._token_cost

    def statistics(self) -> WorkerStats:
        return msgspec.structs.replace(
            self._counts, step_ms=self._step_ms,
            embed_queued=sum(1 for j in self.jobs.values() if j.admitted_at is None),
            running=sum(1 for j in self.jobs.values() if j.admitted_at),
            wait_estimate_s=self.wait_estimate())

    def frame(self, now: float, force: bool = False, hold: bool = False) -> fr.Step | None:
        """As WorkerCore's: the events since the last frame, with statistics when due
        (nothing is held: an embedding is one event)."""
        if not self.events and not force:
            return None
        fresh = force or now - self._last_stats >= fr.STATS_INTERVAL or bool(self.events)
        if fresh:
            self._last_stats = now
        step = fr.Step(events=self.events, stats=self.statistics() if fresh else None)
        self.events = []
        return step

    def persist(self) -> None:
        """Nothing outlives an embedding worker."""

    def close(self) -> None:
        self.jobs.clear()
