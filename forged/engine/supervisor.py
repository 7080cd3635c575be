"""Supervising one worker process: start it, hear its heartbeat, restart it with backoff.

Resource handling: :meth:`WorkerSupervisor.run` owns the process and its socket. The
process is killed whenever ``run`` leaves a process behind, for any reason (a fault,
a cancel), from a shielded scope. Each process gets its own :class:`Outbox`, so that
nothing meant for a dead process reaches its successor.

Error handling: a worker that exits, closes its socket, stops reading, or stays silent
beyond ``heartbeat_timeout`` is killed; the supervisor then reports the loss
(``on_lost``) and starts a new process after an exponential backoff, up to
``restart_backoff_max``. A fault before the first process is ready is raised (the
daemon cannot start); ``Cancelled`` and our own bugs always propagate.
"""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import suppress

import msgspec
import trio

from forged.config import EngineConfig
from forged.engine import channel
from forged.engine import frames as fr
from forged.engine.stats import COUNTERS, Counts, WorkerStats, summed
from forged.errors import Unavailable, sole_fault

log = logging.getLogger("forged.engine")

# What a dying, wedged or misbehaving worker can raise on the daemon's side.
_WORKER_FAULTS: tuple[type[Exception], ...] = (
    OSError, ValueError, msgspec.MsgspecError, trio.TooSlowError, trio.BrokenResourceError,
    trio.ClosedResourceError,
)


def worker_fault(exc: BaseException) -> Exception | None:
    """The worker fault in ``exc`` (nurseries wrap it in a group), or None if ``exc``
    holds anything else, such as ``Cancelled``, which must propagate."""
    return sole_fault(exc, _WORKER_FAULTS)


def backoff_delay(base: float, cap: float, failures: int) -> float:
    """Seconds before restart number ``failures`` (1, 2, ...) of a worker in a row."""
    # The exponent bounded first: 2.0 ** 1024 overflows (an OverflowError at the
    # 1,025th restart in a row, after hours at the cap, ended every model's workers).
    return min(cap, base * 2.0 ** min(64, max(0, failures - 1)))


class WorkerSupervisor:
    """One worker slot of the pool: whichever process currently fills it.

    ``make_init`` builds each new process's first frame (so a process started after a
    reload gets the new limits); ``on_step`` receives its every ``Step``; ``on_lost``
    hears why a process is gone, after which none of its requests will be answered;
    ``on_ready`` hears that a process is ready for requests.
    """

    def __init__(self, index: int, engine: EngineConfig, outbox_limit: int, *,
                 make_init: Callable[[], fr.Init], on_step: Callable[[fr.Step], None],
                 pass_fds: tuple[int, ...] = (),
                 on_lost: Callable[[str], None],
                 on_ready: Callable[[], None] = lambda: None) -> None:
        self.index = index
        self.engine = engine  # replaced by a reload
        self.outbox_limit = outbox_limit
        self._make_init, self._on_step, self._on_lost = make_init, on_step, on_lost
        self._on_ready = on_ready
        self._pass_fds = pass_fds  # the model file, open, for Init.model_path
        self.pid: int | None = None
        # Flash attention as the running process reported it, and why (Ready).
        self.attention: tuple[bool, str] = (False, "")
        self.ready = False
        self.restarts = 0
        self.failures = 0  # restarts in a row, for the backoff
        # The running process's frames; a new one per process (None between them).
        self.outbox: channel.Outbox | None = None
        self.stats = WorkerStats()  # the running process's last report
        # What this slot's lost processes counted, at their last reports: a new process
        # counts from 0, and a model's counters must never go down (stats.COUNTERS).
        self.lost_counts = Counts()
        self.last_heard = 0.0
        self.exit_note = ""  # how the last process ended by itself, for the log

    def routable(self, now: float) -> bool:
        """Ready, with a process to send to, and heard from recently: a worker whose
        heartbeat is late may be wedged, and a request routed to it would wait for its
        death."""
        return (self.ready and self.outbox is not None
                and now - self.last_heard <= self.engine.heartbeat_late)

    def send(self, frame: fr.ToWorker) -> None:
        """Queue ``frame`` for the running process."""
        if self.outbox is None:
            raise Unavailable(f"worker {self.index} is not running", 1)
        self.outbox.put(frame)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Keep a process running until cancelled; ``started()`` once the first is ready."""
        first = True
        while True:
            started = time.monotonic()
            try:
                await self._run_process(task_status if first else trio.TASK_STATUS_IGNORED)
                why = "the worker exited" + self.exit_note
            except BaseException as exc:
                fault = worker_fault(exc)
                if fault is None:
                    raise  # Cancelled, or a bug of ours: never swallowed
                fault_text = f"{fault}{self.exit_note}"
                if first and not self.ready:
                    raise RuntimeError(
                        f"worker {self.index} failed to start: {fault_text}") from exc
                why = f"the worker failed: {fault_text}"
            first = False
            await self._after_loss(why, time.monotonic() - started)

    async def _after_loss(self, why: str, lived: float) -> None:
        self.ready, self.pid = False, None
        # Its counters stay the slot's; its gauges (what it held) went with it.
        self.lost_counts = summed(self.lost_counts, [self.stats], COUNTERS)
        self.stats = WorkerStats()
        self._on_lost(why)
        self.restarts += 1
        # A worker that ran a while before dying starts a fresh backoff series.
        e = self.engine
        self.failures = 1 if lived > e.restart_backoff_max else self.failures + 1
        delay = backoff_delay(e.restart_backoff, e.restart_backoff_max, self.failures)
        log.warning("worker %d lost (%s); restarting in %.1f s", self.index, why, delay)
        await trio.sleep(delay)

    async def _run_process(self, task_status: trio.TaskStatus[None]) -> None:
        parent, child = socket.socketpair()
        with parent:
            try:
                proc = await trio.lowlevel.open_process(
                    [sys.executable, "-m", "forged.engine.worker", str(child.fileno())],
                    pass_fds=(child.fileno(), *self._pass_fds), stdin=subprocess.DEVNULL,
                )
            finally:
                child.close()
            stream = trio.SocketStream(trio.socket.from_stdlib_socket(parent))
            outbox = self.outbox = channel.Outbox(self.outbox_limit)
            wedged = False
            try:
                buf = await self._start(stream)
                task_status.started()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(channel.write_frames, outbox, stream)
                    await channel.read_steps(
                        stream, buf, lambda: self.engine.heartbeat_timeout, self._heard)
                    nursery.cancel_scope.cancel()
            except BaseException as exc:
                # Silent or not reading (the nursery wraps the error in a group): it
                # would not answer a polite shutdown either.
                wedged = isinstance(worker_fault(exc), trio.TooSlowError)
                raise
            finally:
                # From here on nothing is routed to this process (routable(); stopping
                # it may take seconds); frames still in its outbox die with it (their
                # requests fail with WorkerLost).
                self.outbox = None
                with trio.CancelScope(shield=True):
                    self.exit_note = _exit_note(await _stop_process(proc, stream,
                                                                    polite=not wedged))

    async def _start(self, stream: trio.SocketStream) -> fr.FrameBuffer:
        with trio.fail_after(self.engine.startup_timeout):
            ready, steps, buf = await channel.handshake(stream, self._make_init())
        self.pid, self.attention = ready.pid, (ready.flash_attn, ready.flash_attn_why)
        for step in steps:
            self._heard(step)
        self.ready = True
        log.info("worker %d ready (pid %d)", self.index, ready.pid)
        self._on_ready()
        return buf

    def _heard(self, step: fr.Step) -> None:
        self.last_heard = time.monotonic()
        if step.stats:
            self.stats = step.stats
        self._on_step(step)


def _exit_note(own_exit: int | None) -> str:
    """How a worker ended on its own, for the log: a crash in llama.cpp (a signal)
    leaves no Python traceback, so this is all an admin gets."""
    if not own_exit:
        return ""
    if own_exit < 0:
        return f" (killed by {signal.Signals(-own_exit).name})"
    return f" (exit status {own_exit})"


# Seconds a worker asked to stop may take: it writes its sessions' KV states to disk
# first (engine.cache_disk_mib). TimeoutStopSec in forged.service covers drain_timeout
# plus this.
STOP_GRACE = 10.0


async def _stop_process(proc: trio.Process, stream: trio.SocketStream, *,
                        polite: bool) -> int | None:
    """Stop the worker; its exit status if it ended by itself, None if we killed it."""
    # Ask politely first (the worker frees llama.cpp memory), then insist. A wedged
    # worker would not answer: kill it at once.
    with trio.move_on_after(STOP_GRACE if polite else 0.0):
        with suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            await stream.send_all(fr.encode(fr.Shutdown()))
        await proc.wait()
    own_exit = proc.returncode
    if own_exit is None:
        proc.kill()
        await proc.wait()
    await stream.aclose()
    return own_exit
