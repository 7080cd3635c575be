"""The request path into the engine: routing, capacity, and each request's events.

The pool fills ``engine.workers`` worker slots, each a
:class:`~forged.engine.supervisor.WorkerSupervisor` (which starts, watches and restarts
the process), and routes every request to one of them.

Resource handling: :meth:`EnginePool.run` owns every supervisor from its nursery. A
request is open only inside :meth:`EnginePool.open_request`; leaving that block early
(the client went away, a timeout, a drain) cancels the request in the worker without
awaiting anything, so it is safe even in a cancelled scope.

Error handling: when a worker process is lost, each of its requests raises
:class:`~forged.errors.WorkerLost` from ``receive()``. No new request is routed to a
worker whose heartbeat is late. A prompt that was running when a worker died twice is
refused (400) instead of taking its co-batched streams down a third time.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from forged.config import Config
from forged.engine import frames as fr
from forged.engine.limits import scheduler_limits
from forged.engine.request import Request
from forged.engine.supervisor import WorkerSupervisor
from forged.errors import BadRequest, ForgedError, Overloaded, Unavailable, WorkerLost

# Statistics that describe one worker (a step's time, its cost model, its wait) and
# would mean nothing summed over workers.
_PER_WORKER = ("step_ms", "step_plan_ms", "step_prompt_room_ms", "wait_estimate_s",
               "target_step_ms")

# A prompt that was running in two worker crashes is refused from then on.
CRASHES_TO_REFUSE = 2
_SUSPECTS_KEPT = 1024
# Frames an outbox holds beyond two per open request before its worker counts as not
# reading (control frames: limits, test hooks).
_OUTBOX_SPARE = 64


def retry_after_seconds(seconds: float) -> int:
    """A Retry-After header value: whole seconds, at least 1."""
    return max(1, math.ceil(seconds))


class RequestStream:
    """Events of one request, coalesced: ``receive()`` returns all that arrived."""

    def __init__(self, rid: int, fingerprint: int = 0, choices: int = 1) -> None:
        self.rid = rid
        self.fingerprint = fingerprint  # of the prompt, to recognise one that kills
        self.admitted = False
        self.finished = False
        self._open = choices  # choices not yet Done: the request ends with the last
        # When each piece of the first choice's text reached the daemon: TTFT and
        # inter-token latency (other choices' pieces would show as gaps of ~0).
        self.delta_times: list[float] = []
        self._events: list[fr.Event] = []
        self._error: ForgedError | None = None
        self._wake = trio.Event()

    def push(self, ev: fr.Event) -> None:
        if (isinstance(ev, fr.Delta) or (isinstance(ev, fr.Done) and ev.text)) \
                and ev.index == 0:
            self.delta_times.append(time.monotonic())
        if isinstance(ev, fr.Admitted):
            self.admitted = True
        elif isinstance(ev, fr.Done):
            self._open -= 1
            self.finished = self._open == 0
        elif isinstance(ev, fr.Failed):
            self.finished = True
        self._events.append(ev)
        self._wake.set()

    def fail(self, error: ForgedError) -> None:
        self.finished = True
        self._error = error
        self._wake.set()

    async def receive(self) -> list[fr.Event]:
        """Wait for at least one event. Raises the stream's error once events run out."""
        while not self._events:
            if self._error is not None:
                raise self._error
            await self._wake.wait()
            self._wake = trio.Event()
        out, self._events = self._events, []
        return out


class EnginePool:
    def __init__(self, cfg: Config, n_ctx_train: int, *, test_hooks: bool = False) -> None:
        self.cfg = cfg
        self.n_ctx_train = n_ctx_train
        self.limits = scheduler_limits(cfg, n_ctx_train)
        self.test_hooks = test_hooks
        self.draining = False
        # Each worker's open requests, by routing id.
        self.pending: list[dict[int, RequestStream]] = [{} for _ in range(cfg.engine.workers)]
        self.workers = [self._supervisor(i) for i in range(cfg.engine.workers)]
        self._rids = itertools.count(1)
        self._started_at = time.monotonic()
        # Prompt fingerprint -> worker crashes it was running in (bounded, LRU).
        self._suspects: OrderedDict[int, int] = OrderedDict()

    def _supervisor(self, index: int) -> WorkerSupervisor:
        return WorkerSupervisor(
            index, self.cfg.engine, self._outbox_limit(),
            make_init=functools.partial(self._init, index),
            on_step=lambda step: self._deliver(index, step),
            on_lost=lambda why: self._lose(index, why))

    def _outbox_limit(self) -> int:
        return 2 * (self.limits.max_queued + self.limits.max_running) + _OUTBOX_SPARE

    def _init(self, index: int) -> fr.Init:
        e = self.cfg.engine
        # Each worker its own folder: a session's state is restored where it was saved.
        cache_dir = (str(Path(self.cfg.server.state_dir) / "kvcache" / f"worker-{index}")
                     if e.cache_disk_mib else "")
        return fr.Init(model_path=self.cfg.model.path, threads=e.threads,
                       flash_attn=e.flash_attn, heartbeat_interval=e.heartbeat_interval,
                       limits=self.limits, test_hooks=self.test_hooks, cache_dir=cache_dir)

    def supervisor(self, index: int) -> WorkerSupervisor:
        return self.workers[index]

    # --- lifecycle -------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run every worker until cancelled; ``started()`` once all have loaded the model."""
        async with trio.open_nursery() as nursery:
            for w in self.workers:
                await nursery.start(w.run)
            task_status.started()

    def set_limits(self, cfg: Config) -> None:
        """Apply the live-reloadable settings of a new config to every worker."""
        self.cfg = cfg
        self.limits = scheduler_limits(cfg, self.n_ctx_train)
        frame = fr.SetLimits(limits=self.limits)
        for w in self.workers:
            w.engine, w.outbox_limit = cfg.engine, self._outbox_limit()
            if w.outbox is not None:
                w.outbox.put(frame)

    # --- what workers say ----------------------------------------------------------------

    def _deliver(self, index: int, step: fr.Step) -> None:
        pending = self.pending[index]
        for ev in step.events:
            rs = pending.get(ev.rid)
            if rs is None:
                continue  # the caller left already
            rs.push(ev)
            if rs.finished:
                del pending[ev.rid]

    def _lose(self, index: int, why: str) -> None:
        """Worker ``index``'s process is gone: count the crash against every prompt it
        was running, and fail all its requests."""
        pending = self.pending[index]
        for rs in pending.values():
            if rs.admitted:
                self._suspects[rs.fingerprint] = self._suspects.get(rs.fingerprint, 0) + 1
                self._suspects.move_to_end(rs.fingerprint)
            rs.fail(WorkerLost(why))
        pending.clear()
        while len(self._suspects) > _SUSPECTS_KEPT:
            self._suspects.popitem(last=False)

    # --- requests --------------------------------------------------------------------

    def check_capacity(self) -> None:
        """Raise what a new request would get if there is no room for it now: called
        before the request is tokenized too, so a full queue answers at once."""
        lim = self.cfg.limits
        if self.draining:
            raise Unavailable("the server is shutting down", lim.retry_after)
        routable = self._routable()
        if not routable:
            raise Unavailable("no model worker is ready; retry shortly", lim.retry_after)
        queued = sum(1 for p in self.pending for r in p.values() if not r.admitted)
        if queued >= lim.max_queued:
            raise Overloaded("the server is at capacity; retry later", lim.retry_after)
        # Each worker estimates how long even the shortest new request would wait before
        # its prompt is computed; past the queue timeout everywhere, waiting is futile.
        wait = min(w.stats.get("wait_estimate_s", 0.0) for w in routable)
        if wait > lim.queue_timeout:
            raise Overloaded(f"the server is at capacity: a request would wait about "
                             f"{wait:.0f} s for a slot and the prompts ahead",
                             retry_after_seconds(wait - lim.queue_timeout))

    def _routable(self) -> list[WorkerSupervisor]:
        now = time.monotonic()
        return [w for w in self.workers if w.routable(now)]

    def _pick(self) -> WorkerSupervisor:
        self.check_capacity()
        return min(self._routable(), key=lambda w: len(self.pending[w.index]))

    @asynccontextmanager
    async def open_request(self, request: Request) -> AsyncIterator[RequestStream]:
        """Submit ``request`` and yield its stream; leaving the block cancels it if
        unfinished."""
        fingerprint = hash(tuple(request.prompt))
        if self._suspects.get(fingerprint, 0) >= CRASHES_TO_REFUSE:
            raise BadRequest("this prompt was running when the model worker crashed, "
                             f"{CRASHES_TO_REFUSE} times; it is refused rather than run "
                             "again", code="prompt_crashed_worker")
        w = self._pick()
        outbox, pending = w.outbox, self.pending[w.index]
        assert outbox is not None  # routable workers have a process
        rs = RequestStream(next(self._rids), fingerprint, request.n)
        pending[rs.rid] = rs
        outbox.put(fr.Submit(rid=rs.rid, request=request))
        try:
            yield rs
        finally:
            # Synchronous on purpose: this runs when the caller is being cancelled. Only
            # the process that got the submit hears of the cancel.
            if pending.pop(rs.rid, None) is not None and w.outbox is outbox:
                outbox.put(fr.Cancel(rid=rs.rid))

    # --- introspection ---------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return any(w.ready for w in self.workers)

    def in_flight(self) -> int:
        return sum(len(p) for p in self.pending)

    def totals(self) -> dict[str, float]:
        """Worker statistics summed over the ready workers."""
        keys: set[str] = set()
        for w in self.workers:
            keys.update(w.stats)
        keys = {k for k in keys if k not in _PER_WORKER and not k.startswith("cost_")}
        return {k: sum(w.stats.get(k, 0.0) for w in self.workers if w.ready) for k in keys}

    def restarts(self) -> int:
        return sum(w.restarts for w in self.workers)

    def statistics(self) -> dict[str, object]:
        now = time.monotonic()
        return {
            "workers": [
                {"index": w.index, "pid": w.pid, "ready": w.ready, "restarts": w.restarts,
                 "pending": len(self.pending[w.index]),
                 "heard_ago": now - w.last_heard if w.ready else None, "stats": w.stats}
                for w in self.workers
            ],
            "totals": self.totals(),
            "in_flight": self.in_flight(),
            "draining": self.draining,
            "uptime": now - self._started_at,
            "pid": os.getpid(),
        }
