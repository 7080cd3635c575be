"""The daemon's side of the engine: worker processes, their frames, and request streams.

Resource handling: :meth:`EnginePool.run` owns every worker process from its nursery.
A supervisor task per worker starts the process, reads its frames, and restarts it
after it dies; the process is killed whenever its supervisor exits, for any reason.
A request is open only inside :meth:`EnginePool.open_request`; leaving that block
early (the client went away, a timeout, a drain) cancels the request in the worker
without awaiting anything, so it is safe even in a cancelled scope.

Error handling: a worker that exits, closes its socket or stays silent beyond
``heartbeat_timeout`` is killed; each of its requests then raises
:class:`~forged.errors.WorkerLost` from ``receive()``. No new request is routed to a
worker whose heartbeat is late, and every worker process has its own outbox, so that
nothing meant for a dead process reaches its successor. A prompt that was running when
a worker died twice is refused (400) instead of taking its co-batched streams down a
third time. Restarts back off exponentially, up to ``restart_backoff_max``.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import socket
import subprocess
import sys
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field

import msgspec
import trio

from forged.config import Config
from forged.engine import frames as fr
from forged.errors import BadRequest, ForgedError, Overloaded, Unavailable, WorkerLost

log = logging.getLogger("forged.engine")

# What a dying, wedged or misbehaving worker can raise on the daemon's side.
_WORKER_FAULTS: tuple[type[Exception], ...] = (
    OSError, ValueError, msgspec.MsgspecError, trio.TooSlowError, trio.BrokenResourceError,
    trio.ClosedResourceError,
)


def _worker_fault(exc: BaseException) -> Exception | None:
    """The worker fault in ``exc`` (nurseries wrap it in a group), or None if ``exc``
    holds anything else, such as ``Cancelled``, which must propagate."""
    if isinstance(exc, _WORKER_FAULTS):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        match, rest = exc.split(_WORKER_FAULTS)
        if match is not None and rest is None:
            leaf: BaseException = match
            while isinstance(leaf, BaseExceptionGroup):
                leaf = leaf.exceptions[0]
            assert isinstance(leaf, Exception)
            return leaf
    return None


@dataclass(frozen=True)
class Job:
    prompt: list[int]
    max_tokens: int
    priority: int
    sampling: fr.Sampling
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    cache: bool = True
    session: str | None = None
    tenant: str = ""


_PER_WORKER = ("step_ms", "step_plan_ms", "step_prompt_room_ms", "wait_estimate_s",
               "target_step_ms")

# A prompt that was running in two worker crashes is refused from then on.
CRASHES_TO_REFUSE = 2
_SUSPECTS_KEPT = 1024


def backoff_delay(base: float, cap: float, failures: int) -> float:
    """Seconds before restart number ``failures`` (1, 2, ...) of a worker in a row."""
    return min(cap, base * 2.0 ** max(0, failures - 1))


class RequestStream:
    """Events of one request, coalesced: ``receive()`` returns all that arrived."""

    def __init__(self, rid: int, fingerprint: int = 0) -> None:
        self.rid = rid
        self.fingerprint = fingerprint  # of the prompt, to recognise one that kills
        self.admitted = False
        self.finished = False
        # When each piece of text reached the daemon: TTFT and inter-token latency.
        self.delta_times: list[float] = []
        self._events: list[fr.Event] = []
        self._error: ForgedError | None = None
        self._wake = trio.Event()

    def push(self, ev: fr.Event) -> None:
        if isinstance(ev, fr.Delta) or (isinstance(ev, fr.Done) and ev.text):
            self.delta_times.append(time.monotonic())
        if isinstance(ev, fr.Admitted):
            self.admitted = True
        elif isinstance(ev, fr.Done | fr.Failed):
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


class _Outbox:
    """Frames for one worker. Bounded by construction: each open request adds at most a
    submit and a cancel, and open requests are bounded by the admission limits."""

    def __init__(self) -> None:
        self._q: deque[fr.ToWorker] = deque()
        self._wake = trio.Event()

    def put(self, frame: fr.ToWorker) -> None:
        self._q.append(frame)
        self._wake.set()

    async def take(self) -> list[fr.ToWorker]:
        while not self._q:
            await self._wake.wait()
            self._wake = trio.Event()
        out = list(self._q)
        self._q.clear()
        return out


class _Worker:
    def __init__(self, index: int) -> None:
        self.index = index
        self.pid: int | None = None
        self.ready = False
        self.restarts = 0
        self.failures = 0  # restarts in a row, for the backoff
        self.pending: dict[int, RequestStream] = {}
        # The running process's frames; a new one per process (None between them).
        self.outbox: _Outbox | None = None
        self.stats: dict[str, float] = {}
        self.last_heard = 0.0
        self.wedged = False

    def routable(self, now: float, late: float) -> bool:
        """Ready, and heard from recently: a worker whose heartbeat is late may be
        wedged, and a request routed to it would wait for its death."""
        return self.ready and now - self.last_heard <= late

    @property
    def queued(self) -> int:
        return sum(1 for r in self.pending.values() if not r.admitted)

    def lose_all(self, why: str) -> None:
        for rs in self.pending.values():
            rs.fail(WorkerLost(why))
        self.pending.clear()


class EnginePool:
    def __init__(self, cfg: Config, *, test_hooks: bool = False) -> None:
        self.cfg = cfg
        self.test_hooks = test_hooks
        self.workers = [_Worker(i) for i in range(cfg.engine.workers)]
        self.draining = False
        self._rids = itertools.count(1)
        self._started_at = time.monotonic()
        # Prompt fingerprint -> worker crashes it was running in (bounded, LRU).
        self._suspects: OrderedDict[int, int] = OrderedDict()

    # --- lifecycle -------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run every worker until cancelled; ``started()`` once all have loaded the model."""
        async with trio.open_nursery() as nursery:
            for w in self.workers:
                await nursery.start(self._supervise, w)
            task_status.started()

    async def _supervise(
        self, w: _Worker, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        first = True
        while True:
            started = time.monotonic()
            try:
                await self._run_worker(w, task_status if first else trio.TASK_STATUS_IGNORED)
                why = "the worker exited"
            except BaseException as exc:
                fault = _worker_fault(exc)
                if fault is None:
                    raise  # Cancelled, or a bug of ours: never swallowed
                if first and not w.ready:
                    raise RuntimeError(f"worker {w.index} failed to start: {fault}") from exc
                why = f"the worker failed: {fault}"
            first = False
            w.ready, w.pid = False, None
            self._suspect(w)
            w.lose_all(why)
            w.restarts += 1
            # A worker that ran a while before dying starts a fresh backoff series.
            e = self.cfg.engine
            w.failures = 1 if time.monotonic() - started > e.restart_backoff_max else (
                w.failures + 1)
            delay = backoff_delay(e.restart_backoff, e.restart_backoff_max, w.failures)
            log.warning("worker %d lost (%s); restarting in %.1f s", w.index, why, delay)
            await trio.sleep(delay)

    def _suspect(self, w: _Worker) -> None:
        """Count the crash against every prompt the worker was running."""
        for rs in w.pending.values():
            if rs.admitted:
                self._suspects[rs.fingerprint] = self._suspects.get(rs.fingerprint, 0) + 1
                self._suspects.move_to_end(rs.fingerprint)
        while len(self._suspects) > _SUSPECTS_KEPT:
            self._suspects.popitem(last=False)

    async def _run_worker(self, w: _Worker, task_status: trio.TaskStatus[None]) -> None:
        parent, child = socket.socketpair()
        with parent:
            try:
                proc = await trio.lowlevel.open_process(
                    [sys.executable, "-m", "forged.engine.worker", str(child.fileno())],
                    pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL,
                )
            finally:
                child.close()
            stream = trio.SocketStream(trio.socket.from_stdlib_socket(parent))
            outbox = w.outbox = _Outbox()
            try:
                buf = await self._handshake(w, stream, proc.pid)
                w.ready = True
                task_status.started()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._writer, outbox, stream)
                    await self._reader(w, stream, buf)
                    nursery.cancel_scope.cancel()
            finally:
                # From here on nothing is routed to this process; frames still in its
                # outbox die with it (their requests fail with WorkerLost).
                w.outbox = None
                with trio.CancelScope(shield=True):
                    await self._stop_process(proc, stream, polite=not w.wedged)
                w.wedged = False

    async def _handshake(self, w: _Worker, stream: trio.SocketStream, pid: int
                         ) -> fr.FrameBuffer:
        e, lim = self.cfg.engine, self.cfg.limits
        init = fr.Init(
            model_path=self.cfg.model.path, kv_cells=e.kv_cells, slots=e.slots,
            max_running=e.max_running, step_tokens=e.step_tokens,
            prefill_step_tokens=e.prefill_step_tokens, threads=e.threads,
            flash_attn=e.flash_attn, kv_headroom=e.kv_headroom,
            decode_reservation=e.decode_reservation, max_queued=lim.max_queued,
            max_queued_tokens=lim.max_queued_tokens, heartbeat_interval=e.heartbeat_interval,
            per_slot_cells=e.per_slot_cells, max_context=e.max_context,
            overtake_window=lim.overtake_window, session_ttl=lim.session_ttl,
            target_step_ms=e.target_step_ms, test_hooks=self.test_hooks,
        )
        await stream.send_all(fr.encode(init))
        buf = fr.FrameBuffer()
        frames: list[fr.FromWorker] = []
        # Ready, then a first Step with statistics: only then is the worker "ready", so
        # /health, /stats and /metrics never show a worker without numbers.
        with trio.fail_after(e.startup_timeout):
            while len(frames) < 2:
                data = await stream.receive_some(1 << 16)
                if not data:
                    raise ValueError("the worker exited while loading the model")
                frames += [fr.from_worker_decoder.decode(b) for b in buf.feed(data)]
        ready, first = frames[0], frames[1]
        if not isinstance(ready, fr.Ready) or not isinstance(first, fr.Step):
            raise ValueError("the worker did not start with ready and statistics")
        w.pid, w.last_heard = ready.pid, time.monotonic()
        for step in frames[1:]:
            if isinstance(step, fr.Step):
                self._dispatch(w, step)
        log.info("worker %d ready (pid %d)", w.index, ready.pid)
        return buf  # it may hold the start of the next frame: the reader goes on with it

    async def _writer(self, outbox: _Outbox, stream: trio.SocketStream) -> None:
        while True:
            frames = await outbox.take()
            await stream.send_all(b"".join(fr.encode(f) for f in frames))

    async def _reader(self, w: _Worker, stream: trio.SocketStream, buf: fr.FrameBuffer
                      ) -> None:
        while True:
            with trio.move_on_after(self.cfg.engine.heartbeat_timeout) as silent:
                data = await stream.receive_some(1 << 20)
            if silent.cancelled_caught:
                w.wedged = True
                raise trio.TooSlowError("no heartbeat from the worker")
            if not data:
                return
            w.last_heard = time.monotonic()
            for body in buf.feed(data):
                frame = fr.from_worker_decoder.decode(body)
                if isinstance(frame, fr.Step):
                    self._dispatch(w, frame)

    def _dispatch(self, w: _Worker, step: fr.Step) -> None:
        if step.stats:
            w.stats = step.stats
        for ev in step.events:
            rs = w.pending.get(ev.rid)
            if rs is None:
                continue  # the caller left already
            rs.push(ev)
            if rs.finished:
                del w.pending[ev.rid]

    async def _stop_process(self, proc: trio.Process, stream: trio.SocketStream, *,
                            polite: bool) -> None:
        # Ask politely first (the worker frees llama.cpp memory), then insist. A wedged
        # worker would not answer: kill it at once.
        with trio.move_on_after(2.0 if polite else 0.0):
            with suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                await stream.send_all(fr.encode(fr.Shutdown()))
            await proc.wait()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await stream.aclose()

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
        queued = sum(w.queued for w in self.workers)
        if queued >= lim.max_queued:
            raise Overloaded("the server is at capacity; retry later", lim.retry_after)
        # Each worker estimates how long even the shortest new request would wait before
        # its prompt is computed; past the queue timeout everywhere, waiting is futile.
        wait = min(w.stats.get("wait_estimate_s", 0.0) for w in routable)
        if wait > lim.queue_timeout:
            raise Overloaded(f"the server is at capacity: a request would wait about "
                             f"{wait:.0f} s for a slot and the prompts ahead",
                             retry_after_seconds(wait - lim.queue_timeout))

    def _routable(self) -> list[_Worker]:
        now, late = time.monotonic(), self.cfg.engine.heartbeat_late
        return [w for w in self.workers if w.routable(now, late)]

    def _pick(self) -> _Worker:
        self.check_capacity()
        return min(self._routable(), key=lambda w: len(w.pending))

    @asynccontextmanager
    async def open_request(self, job: Job) -> AsyncIterator[RequestStream]:
        """Submit ``job`` and yield its stream; leaving the block cancels it if unfinished."""
        fingerprint = hash(tuple(job.prompt))
        if self._suspects.get(fingerprint, 0) >= CRASHES_TO_REFUSE:
            raise BadRequest("this prompt was running when the model worker crashed, "
                             f"{CRASHES_TO_REFUSE} times; it is refused rather than run "
                             "again", code="prompt_crashed_worker")
        w = self._pick()
        outbox = w.outbox
        assert outbox is not None  # routable workers have a process
        rs = RequestStream(next(self._rids), fingerprint)
        w.pending[rs.rid] = rs
        outbox.put(fr.Submit(
            rid=rs.rid, prompt=job.prompt, max_tokens=job.max_tokens, priority=job.priority,
            sampling=job.sampling, stop=job.stop, ignore_eos=job.ignore_eos, cache=job.cache,
            session=job.session, tenant=job.tenant, queue_timeout=self.cfg.limits.queue_timeout,
        ))
        try:
            yield rs
        finally:
            # Synchronous on purpose: this runs when the caller is being cancelled. Only
            # the process that got the submit hears of the cancel.
            if w.pending.pop(rs.rid, None) is not None and w.outbox is outbox:
                outbox.put(fr.Cancel(rid=rs.rid))

    def set_limits(self, cfg: Config) -> None:
        """Apply the live-reloadable limits of a new config to every worker."""
        self.cfg = cfg
        frame = fr.SetLimits(max_queued=cfg.limits.max_queued,
                             max_queued_tokens=cfg.limits.max_queued_tokens,
                             decode_reservation=cfg.engine.decode_reservation,
                             overtake_window=cfg.limits.overtake_window,
                             session_ttl=cfg.limits.session_ttl,
                             target_step_ms=cfg.engine.target_step_ms)
        for w in self.workers:
            if w.outbox is not None:
                w.outbox.put(frame)

    def hang_worker(self, index: int, seconds: float) -> None:
        """Test hook: make a worker's loop block (it must be started with test hooks)."""
        self._outbox(index).put(fr.Hang(seconds=seconds))

    def slow_steps(self, index: int, seconds: float) -> None:
        """Test hook: make every step of a worker take at least ``seconds`` longer."""
        self._outbox(index).put(fr.SlowSteps(seconds=seconds))

    def crash_on_token(self, index: int, token: int) -> None:
        """Test hook: make a worker abort once a running request's prompt holds ``token``."""
        self._outbox(index).put(fr.CrashOn(token=token))

    def _outbox(self, index: int) -> _Outbox:
        outbox = self.workers[index].outbox
        if outbox is None:
            raise Unavailable(f"worker {index} is not running", 1)
        return outbox

    # --- introspection ---------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return any(w.ready for w in self.workers)

    def in_flight(self) -> int:
        return sum(len(w.pending) for w in self.workers)

    def totals(self) -> dict[str, float]:
        """Worker statistics summed over the ready workers."""
        keys: set[str] = set()
        for w in self.workers:
            keys.update(w.stats)
        # Per-worker figures (a step's time, the cost model, the wait) do not add up.
        keys = {k for k in keys if k not in _PER_WORKER and not k.startswith("cost_")}
        return {k: sum(w.stats.get(k, 0.0) for w in self.workers if w.ready) for k in keys}

    def restarts(self) -> int:
        return sum(w.restarts for w in self.workers)

    def statistics(self) -> dict[str, object]:
        totals = self.totals()
        return {
            "workers": [
                {"index": w.index, "pid": w.pid, "ready": w.ready, "restarts": w.restarts,
                 "pending": len(w.pending), "heard_ago": (time.monotonic() - w.last_heard)
                 if w.ready else None, "stats": w.stats}
                for w in self.workers
            ],
            "totals": totals,
            "in_flight": self.in_flight(),
            "draining": self.draining,
            "uptime": time.monotonic() - self._started_at,
            "pid": os.getpid(),
        }


def retry_after_seconds(seconds: float) -> int:
    """A Retry-After header value: whole seconds, at least 1."""
    return max(1, math.ceil(seconds))
