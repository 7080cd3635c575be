"""The request path into the engine: routing, capacity, and each request's events.

The pool fills ``engine.workers`` worker slots, each a
:class:`~forged.engine.supervisor.WorkerSupervisor` (which starts, watches and restarts
the process), and routes every request to one of them: to the worker whose caches hold
the longest prefix of its prompt, traded against load (the sans-IO
:class:`~forged.engine.routing.Router` decides; the pool feeds it the workers'
prefix digests and their open requests).

Resource handling: :meth:`EnginePool.run` owns every supervisor from its nursery. A
request is open only inside :meth:`EnginePool.open_request`; leaving that block early
(the client went away, a timeout, a drain) cancels the request in the worker without
awaiting anything, so it is safe even in a cancelled scope.

Error handling: when a worker process is lost, each of its admitted requests raises
:class:`~forged.errors.WorkerLost` from ``receive()`` (its stream has begun). A request
it had not admitted is submitted again, to another ready worker or, when there is none,
to the next one that becomes ready (the restarted process), at most
:data:`RESUBMITS` times and within the request's queue timeout; never a prompt that was
running in a crash before. No new request is routed to a worker whose heartbeat is
late. A prompt that was running when a worker died twice is refused (400) instead of
taking its co-batched streams down a third time.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Protocol

import trio

from forged.config import Config, ModelConfig, worker_cpus
from forged.engine import frames as fr
from forged.engine.channel import Outbox
from forged.engine.events import Admitted, Delta, Done, Event, Failed
from forged.engine.limits import scheduler_limits
from forged.engine.request import Request
from forged.engine.routing import Policy, Router
from forged.engine.stats import COUNTERS, GAUGES, Totals, summed
from forged.engine.supervisor import WorkerSupervisor
from forged.errors import (
    BadRequest,
    EngineError,
    ForgedError,
    Overloaded,
    QueueTimeout,
    Unavailable,
    WorkerLost,
)

# A prompt that was running in two worker crashes is refused from then on.
CRASHES_TO_REFUSE = 2
_SUSPECTS_KEPT = 1024
# Times a request a lost worker had not admitted is submitted again: a second crash
# before its admission is bad luck, a third says something is wrong with the node.
RESUBMITS = 2
# Frames an outbox holds beyond two per open request before its worker counts as not
# reading (control frames: limits, test hooks).
_OUTBOX_SPARE = 64


def routing_policy(cfg: Config) -> Policy:
    e = cfg.engine
    return Policy(cache_aware=e.routing == "cache_aware", min_match=e.route_min_match,
                  imbalance=e.route_imbalance)


def retry_after_seconds(seconds: float) -> int:
    """A Retry-After header value: whole seconds, at least 1."""
    return max(1, math.ceil(seconds))


def failure(ev: Failed, retry_after: int) -> ForgedError:
    """The domain error a worker's ``Failed`` event stands for; ``retry_after``: the
    configured hint, unless the worker estimated the wait itself."""
    match ev.code:
        case "overloaded":
            return Overloaded(ev.message, retry_after if ev.retry_after is None
                              else retry_after_seconds(ev.retry_after))
        case "queue_timeout":
            return QueueTimeout(ev.message, retry_after)
        case "bad_request":
            return BadRequest(ev.message)
        case _:
            return EngineError(ev.message)


class Sink(Protocol):
    """The door's writer of a stream (forged.http.direct.StepSink)."""

    def __call__(self, ev: Event) -> bool:
        """Take ``ev`` to write (True), or leave it to the stream's task (False)."""

    def delivered(self) -> None:
        """Write what was taken from the frame just delivered."""


class RequestStream:
    """Events of one request, coalesced: ``receive()`` returns all that arrived. A
    ``Failed`` event never comes out: once the events before it are taken,
    ``receive()`` raises the error it stands for (:func:`failure`)."""

    def __init__(self, rid: int, request: Request, fingerprint: int = 0,
                 retry_after: int = 1, clock: Callable[[], float] = time.monotonic) -> None:
        self.rid = rid
        self.clock = clock  # of arrivals (a test's may be trio's autojump clock)
        self.request = request  # kept to submit it again if its worker is lost
        self.fingerprint = fingerprint  # of the prompt, to recognise one that kills
        # Where it was submitted: the worker and that process's outbox (None: parked,
        # waiting for a worker after a loss).
        self.worker: int | None = None
        self.outbox: Outbox | None = None
        self.resubmits = 0
        self.admitted = False
        self.finished = False
        self._open = request.n  # choices not yet Done: the request ends with the last
        # When each piece of the first choice's text reached the daemon: TTFT and
        # inter-token latency (other choices' pieces would show as gaps of ~0).
        self.delta_times: list[float] = []
        self.retry_after = retry_after
        self._events: list[Event] = []
        self._error: ForgedError | None = None
        self._wake = trio.Event()
        # When the first of the pending events arrived, and how long after the event
        # before it: the door's coalescing reads them (forged.http.generate.Pace).
        self.arrived = 0.0
        self.gap = math.inf
        self._last = -math.inf
        self._delivery = 0  # the pool's delivery the last event came in
        # The door's writer for this stream, which may take an event as it arrives and
        # write it with the others its frame brings (forged.http.direct): True when it
        # did, and then the event is not queued. It takes none while events are
        # queued, so order holds.
        self.sink: Sink | None = None
        self._nudged = False

    def push(self, ev: Event, delivery: int = 0) -> None:
        """One event of the worker's frame number ``delivery`` (0: of none). A worker
        may send several steps' tokens in one frame (forged.engine.hold): they
        arrive together, so the gap that paces the door's writes (``gap``) is the one
        before their frame, not the nothing between them."""
        if (isinstance(ev, Delta) or (isinstance(ev, Done) and ev.text)) \
                and ev.index == 0:
            self.delta_times.append(self.clock())
        if isinstance(ev, Admitted):
            self.admitted = True
        elif isinstance(ev, Done):
            self._open -= 1
            self.finished = self._open == 0
        elif isinstance(ev, Failed):
            self.fail(failure(ev, self.retry_after))
            return
        if not delivery or delivery != self._delivery:
            now = self.clock()
            if not self._events:
                self.arrived, self.gap = now, now - self._last
            self._last, self._delivery = now, delivery
        if self.sink is not None and not self._events and self.sink(ev):
            if not delivery:
                self.sink.delivered()
            return
        self._events.append(ev)
        self._wake.set()

    def delivered(self) -> None:
        """The worker's frame has been pushed whole: what the sink took goes out."""
        if self.sink is not None:
            self.sink.delivered()

    def nudge(self) -> None:
        """Wake the receiver without an event: its sink needs it (a write to finish).
        ``receive()`` then returns what is queued, perhaps nothing."""
        self._nudged = True
        self._wake.set()

    def fail(self, error: ForgedError) -> None:
        self.finished = True
        self._error = self._error or error  # the first cause is the one to report
        self._wake.set()

    def raise_failure(self) -> None:
        """Raise the stream's error, if it failed (events before it may be pending)."""
        if self._error is not None:
            raise self._error

    async def receive(self) -> list[Event]:
        """Wait for at least one event, or a ``nudge``. Raises the stream's error once
        events run out."""
        while not self._events and not self._nudged:
            if self._error is not None:
                raise self._error
            await self._wake.wait()
            self._wake = trio.Event()
        self._nudged = False
        return self.take()

    def take(self) -> list[Event]:
        """The events that arrived, without waiting; an error stays for receive()."""
        out, self._events = self._events, []
        return out


class EnginePool:
    """The workers of one model (its :class:`~forged.engine.groups.ModelGroup`).
    ``cache_dir``: the folder of its workers' saved KV states (a folder per worker);
    ``model_fd``: the model file, open, that workers inherit and load (-1: they open
    ``model.path``)."""

    def __init__(self, cfg: Config, model: ModelConfig, n_ctx_train: int, *,
                 cache_dir: Path, model_fd: int = -1, test_hooks: bool = False,
                 embedding: bool = False, threads_why: str = "") -> None:
        self.cfg = cfg
        self.threads_why = threads_why  # for forged status (Config.threads_why)
        self.model = model
        self.cache_dir = cache_dir
        self.model_fd = model_fd
        self.nice = 0  # what new processes load at (a swap's new model: nicer)
        self.ended = ""  # why fail_all ended it (a swap's old model): said to latecomers
        self.n_ctx_train = n_ctx_train
        self.embedding = embedding  # its workers embed (forged.engine.embedcore)
        self.limits = scheduler_limits(cfg, n_ctx_train, encoder=embedding)
        self.test_hooks = test_hooks
        self.draining = False
        # Each worker's open requests, by routing id.
        self.pending: list[dict[int, RequestStream]] = [{} for _ in range(cfg.engine.workers)]
        self.workers = [self._supervisor(i) for i in range(cfg.engine.workers)]
        self.router = Router(cfg.engine.workers, routing_policy(cfg))
        self._rids = itertools.count(1)
        self._deliveries = itertools.count(1)  # the frames delivered (RequestStream.push)
        self._started_at = time.monotonic()
        # Prompt fingerprint -> worker crashes it was running in (bounded, LRU).
        self.suspects: OrderedDict[int, int] = OrderedDict()
        # Requests whose worker was lost before admitting them, while no other worker
        # is ready: routing id -> (stream, why it was lost, until when it may wait, on
        # trio's clock).
        # Bounded by the admission limits, as the requests are.
        self._parked: dict[int, tuple[RequestStream, str, float]] = {}
        self._parked_changed = trio.Event()
        self._heard = trio.Event()  # set (and renewed) at each Step from any worker
        self.resubmitted = 0

    def _supervisor(self, index: int) -> WorkerSupervisor:
        return WorkerSupervisor(
            index, self.cfg.engine, self._outbox_limit(),
            pass_fds=(self.model_fd,) if self.model_fd >= 0 else (),
            make_init=functools.partial(self._init, index),
            on_step=lambda step: self._deliver(index, step),
            on_lost=lambda why: self.lose_worker(index, why),
            on_ready=self.unpark)

    def _outbox_limit(self) -> int:
        return 2 * (self.limits.max_queued + self.limits.max_running) + _OUTBOX_SPARE

    def disk_folders(self) -> set[Path]:
        """The folders its workers keep saved KV states in (none without a disk tier):
        what else is under its ``cache_dir`` is no worker's (forged.daemon.lifespan)."""
        return {f for i in range(len(self.workers)) if (f := self._disk_folder(i))}

    def _disk_folder(self, index: int) -> Path | None:
        # Each worker its own folder: a session's state is restored where it was saved.
        return self.cache_dir / f"worker-{index}" if self.cfg.engine.cache_disk_mib else None

    def _init(self, index: int) -> fr.Init:
        e = self.cfg.engine
        cache_dir = str(folder) if (folder := self._disk_folder(index)) else ""
        path = f"/proc/self/fd/{self.model_fd}" if self.model_fd >= 0 else self.model.path
        return fr.Init(model_path=path, threads=e.threads,
                       flash_attn=None if e.flash_attn == "auto" else e.flash_attn,
                       heartbeat_interval=e.heartbeat_interval,
                       limits=self.limits, test_hooks=self.test_hooks, cache_dir=cache_dir,
                       nice=self.nice, embedding=self.embedding,
                       cpus=worker_cpus(e.cpus, self.cfg.door_cpus))

    def supervisor(self, index: int) -> WorkerSupervisor:
        return self.workers[index]

    # --- lifecycle -------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run every worker until cancelled; ``started()`` once all have loaded the model."""
        async with trio.open_nursery() as nursery:
            for w in self.workers:
                await nursery.start(w.run)
            nursery.start_soon(self.expire_parked)
            task_status.started()

    def set_limits(self, cfg: Config) -> None:
        """Apply the live-reloadable settings of a new config to every worker."""
        self.cfg = cfg
        self.limits = scheduler_limits(cfg, self.n_ctx_train, encoder=self.embedding)
        self.router.policy = routing_policy(cfg)
        frame = fr.SetLimits(limits=self.limits)
        for w in self.workers:
            w.engine, w.outbox_limit = cfg.engine, self._outbox_limit()
            if w.outbox is not None:  # the running process's too, not only the next's
                w.outbox.limit = w.outbox_limit
                w.outbox.put(frame)

    # --- what workers say ----------------------------------------------------------------

    def _deliver(self, index: int, step: fr.Step) -> None:
        # A worker was heard: requests waiting for a late one may go (_late_workers),
        # and so may those a lost worker left, not only at a restarted one's start.
        self._heard.set()
        self._heard = trio.Event()
        if self._parked:
            self.unpark()
        if step.digests is not None:
            self.router.reported(index, step.digests)
        pending = self.pending[index]
        delivery = next(self._deliveries)
        # A stream's events of one frame (several steps' tokens, when the worker held
        # them) go to its socket in one write, once the frame is pushed whole.
        streams: dict[int, RequestStream] = {}
        for ev in step.events:
            rs = pending.get(ev.rid)
            if rs is None:
                continue  # the caller left already
            rs.push(ev, delivery)
            streams[ev.rid] = rs
            if rs.finished:
                del pending[ev.rid]
        for rs in streams.values():
            rs.delivered()

    def lose_worker(self, index: int, why: str) -> None:
        """Worker ``index``'s process is gone: count the crash against every prompt it
        was running and fail those requests; submit the others again."""
        self.router.lost(index)
        lost = list(self.pending[index].values())
        self.pending[index].clear()
        for rs in lost:
            if rs.admitted:
                self._suspect(rs.fingerprint, 1)
                rs.fail(WorkerLost(why))
        # After the count: a prompt beside which one ran is a suspect too.
        for rs in lost:
            if not rs.admitted:
                self._resubmit(rs, why)

    def _suspect(self, fingerprint: int, crashes: int) -> None:
        self.suspects[fingerprint] = self.suspects.get(fingerprint, 0) + crashes
        self.suspects.move_to_end(fingerprint)
        while len(self.suspects) > _SUSPECTS_KEPT:
            self.suspects.popitem(last=False)

    # --- resubmission --------------------------------------------------------------------

    def _resubmit(self, rs: RequestStream, why: str) -> None:
        """Submit again a request whose worker was lost before admitting it; with no
        worker ready, park it until one is (or its wait runs out)."""
        if rs.resubmits >= RESUBMITS or rs.fingerprint in self.suspects:
            if rs.resubmits >= RESUBMITS:
                # In every crash of its RESUBMITS + 1 workers before one admitted it: a
                # frame that kills a worker as it is read does that. It is a suspect.
                self._suspect(rs.fingerprint, CRASHES_TO_REFUSE)
            rs.fail(WorkerLost(why))
            return
        rs.resubmits += 1
        self.resubmitted += 1
        routable = self.routable_workers()
        if routable:
            self._submit(rs, self._route(rs.request, routable))
            return
        rs.worker = rs.outbox = None
        wait = min(rs.request.queue_timeout, self.cfg.limits.queue_timeout)
        self._parked[rs.rid] = (rs, why, trio.current_time() + wait)
        self._parked_changed.set()

    def unpark(self) -> None:
        """A worker is ready: the parked requests go to it (or to another ready one)."""
        routable = self.routable_workers()
        if not routable:
            return  # it stopped answering already; the next one will do
        parked, self._parked = self._parked, {}
        for rs, _, _ in parked.values():
            self._submit(rs, self._route(rs.request, routable))

    async def expire_parked(self) -> None:
        """Fail parked requests whose wait for a worker ran out."""
        while True:
            deadline = min((d for _, _, d in self._parked.values()), default=math.inf)
            with trio.move_on_at(deadline):
                await self._parked_changed.wait()
                self._parked_changed = trio.Event()
            now = trio.current_time()
            for rid, (rs, why, until) in list(self._parked.items()):
                if until <= now:
                    del self._parked[rid]
                    rs.fail(WorkerLost(f"{why}; no worker was ready in time to run it"))

    # --- requests --------------------------------------------------------------------

    def check_capacity(self) -> list[WorkerSupervisor]:
        """Raise what a new request would get if there is no room for it now: called
        before the request is tokenized too, so a full queue answers at once. Returns
        the workers it may go to (computed once: a heartbeat may turn late meanwhile)."""
        lim = self.cfg.limits
        if self.draining:
            raise Unavailable(self.ended or "the server is shutting down", lim.retry_after)
        routable = self.routable_workers()
        if not routable and not any(w.ready for w in self.workers):
            raise Unavailable("no model worker is ready; retry shortly", lim.retry_after)
        queued = len(self._parked) + sum(
            1 for p in self.pending for r in p.values() if not r.admitted)
        if queued >= lim.max_queued:
            raise Overloaded("the server is at capacity; retry later", lim.retry_after)
        # Each worker estimates how long even the shortest new request would wait before
        # its prompt is computed; past the queue timeout everywhere, waiting is futile.
        wait = min((w.stats.wait_estimate_s for w in routable), default=0.0)
        if wait > lim.queue_timeout:
            raise Overloaded(f"the server is at capacity: a request would wait about "
                             f"{wait:.0f} s for a slot",
                             retry_after_seconds(wait - lim.queue_timeout))
        return routable  # empty: every ready worker is late (open_request waits)

    async def _late_workers(self) -> list[WorkerSupervisor]:
        """Every ready worker's heartbeat is late. A worker is far likelier to be busy
        (a long step, a moment without CPU) than wedged, and refusing everything then
        turned a hiccup of a few seconds into a burst of 503s: wait up to
        ``heartbeat_late`` more for one to be heard. A wedged worker is killed at
        ``heartbeat_timeout``; what it had not admitted goes elsewhere."""
        with trio.move_on_after(self.cfg.engine.heartbeat_late):
            while not (routable := self.routable_workers()):
                await self._heard.wait()
            return routable
        raise Unavailable("no model worker answered in time; retry shortly",
                          self.cfg.limits.retry_after)

    def would_wait(self, places: int) -> bool:
        """Whether a request of ``places`` sequences would wait for a slot now: no
        ready worker has that many running places free. (An estimate: the KV cells and
        the queue ahead are the scheduler's to judge.)"""
        if self._parked:
            return True
        return all(sum(rs.request.n for rs in self.pending[w.index].values()) + places
                   > self.limits.max_running for w in self.routable_workers())

    def routable_workers(self) -> list[WorkerSupervisor]:
        now = time.monotonic()
        return [w for w in self.workers if w.routable(now)]

    def _route(self, request: Request, routable: list[WorkerSupervisor]) -> WorkerSupervisor:
        loads = {w.index: len(self.pending[w.index]) for w in routable}
        index = self.router.route(request.tenant, request.prompt, request.session, loads,
                                  time.monotonic())
        return self.workers[index]

    def _submit(self, rs: RequestStream, w: WorkerSupervisor) -> None:
        assert w.outbox is not None  # routable workers have a process
        rs.worker, rs.outbox = w.index, w.outbox
        self.pending[w.index][rs.rid] = rs
        w.outbox.put(fr.Submit(rid=rs.rid, request=rs.request))

    @asynccontextmanager
    async def open_request(self, request: Request) -> AsyncIterator[RequestStream]:
        """Submit ``request`` and yield its stream; leaving the block cancels it if
        unfinished."""
        # Per tenant: one tenant's crashes never get another tenant's prompt refused.
        fingerprint = hash((request.tenant, tuple(request.prompt)))
        if self.suspects.get(fingerprint, 0) >= CRASHES_TO_REFUSE:
            raise BadRequest("this prompt was running when the model worker crashed, "
                             f"{CRASHES_TO_REFUSE} times; it is refused rather than run "
                             "again", code="prompt_crashed_worker")
        routable = self.check_capacity() or await self._late_workers()
        rs = RequestStream(next(self._rids), request, fingerprint,
                           self.cfg.limits.retry_after)
        if (size := fr.encoded_size(fr.Submit(rid=rs.rid, request=request))) > fr.MAX_FRAME:
            # A worker would refuse the frame, and die of it.
            raise BadRequest(f"the request is {size} bytes on the wire to the model "
                             f"worker, more than its {fr.MAX_FRAME} limit")
        self._submit(rs, self._route(request, routable))
        try:
            yield rs
        finally:
            self._close(rs)

    def renice(self, nice: int) -> None:
        """Every worker process (and those started later) to ``nice``."""
        self.nice = nice
        for w in self.workers:
            if w.outbox is not None:
                w.outbox.put(fr.Renice(nice=nice))

    def unpin(self, session: str) -> None:
        """No conversation holds ``session`` any more: every worker unpins its slot.
        Advisory: a worker whose outbox is half full is not sent it (the pin ends with
        limits.session_ttl, as it did), so a flood of deletions cannot fill an outbox
        that requests' submits and cancels need."""
        for w in self.workers:
            if w.outbox is not None and len(w.outbox.unsent) < w.outbox.limit // 2:
                w.outbox.put(fr.Unpin(session=session))

    def fail_all(self, error: ForgedError) -> None:
        """End every open request with ``error``: the pool is being stopped (a swap's
        old model past its drain deadline)."""
        self.draining = True
        self.ended = str(error)
        for pending in self.pending:
            for rs in pending.values():
                rs.fail(error)
            pending.clear()
        for rs, _, _ in self._parked.values():
            rs.fail(error)
        self._parked.clear()

    def _close(self, rs: RequestStream) -> None:
        # Synchronous on purpose: this runs when the caller is being cancelled. Only
        # the process that got the submit hears of the cancel.
        self._parked.pop(rs.rid, None)
        if rs.worker is None:
            return
        outbox = rs.outbox
        if self.pending[rs.worker].pop(rs.rid, None) is not None and outbox is not None \
                and self.workers[rs.worker].outbox is outbox:
            outbox.put(fr.Cancel(rid=rs.rid))

    # --- introspection ---------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return any(w.ready for w in self.workers)

    def in_flight(self) -> int:
        return sum(len(p) for p in self.pending) + len(self._parked)

    def totals(self) -> Totals:
        """The workers' counts summed, and the pool's own: how requests were routed, and
        saved from a crash. Gauges are what the ready workers hold now; counters are
        every worker's, with what its lost processes counted, so that none goes down
        when a worker is lost or restarted (Prometheus would read a reset)."""
        routed = self.router.routed
        out = Totals(routed_by_cache=routed["cache"], routed_by_session=routed["session"],
                     routed_by_load=routed["load"], resubmitted=self.resubmitted)
        summed(out, (w.stats for w in self.workers if w.ready), GAUGES)
        return summed(out, (c for w in self.workers for c in (w.lost_counts, w.stats)),
                      COUNTERS)

    def restarts(self) -> int:
        return sum(w.restarts for w in self.workers)

    def statistics(self) -> dict[str, object]:
        now = time.monotonic()
        return {
            "workers": [
                {"index": w.index, "pid": w.pid, "ready": w.ready, "restarts": w.restarts,
                 "pending": len(self.pending[w.index]), "digests": self.router.held(w.index),
                 "heard_ago": now - w.last_heard if w.ready else None, "stats": w.stats,
                 "flash_attn": w.attention[0], "flash_attn_why": w.attention[1],
                 "threads": self.cfg.engine.threads, "threads_why": self.threads_why}
                for w in self.workers
            ],
            "totals": self.totals(),
            "in_flight": self.in_flight(),
            "parked": len(self._parked),
            "draining": self.draining,
            "uptime": now - self._started_at,
            "pid": os.getpid(),
        }
