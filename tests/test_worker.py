"""The worker's and the pool's decisions that need no process: isolating a failed
decode, restart backoff, and refusing a prompt that keeps killing workers."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import msgspec
import pytest
import trio

from forged import config as fc
from forged.engine import frames as fr
from forged.engine import testhooks
from forged.engine.channel import Outbox, read_steps
from forged.engine.decoding import DecodeError, NoKVSpace, run_isolating
from forged.engine.events import Delta
from forged.engine.limits import scheduler_limits
from forged.engine.plan import Chunk
from forged.engine.pool import EnginePool, retry_after_seconds
from forged.engine.scheduler import Scheduler
from forged.engine.stats import WorkerStats
from forged.engine.supervisor import backoff_delay
from forged.engine.worker import WorkerShell
from forged.errors import Overloaded
from tests.conftest import DaemonFactory
from tests.test_models import as_toml


def chunks(*rids: int) -> list[Chunk]:
    return [Chunk(rid, rid, 0, [1, 2], sample=True) for rid in rids]


class FakeDecode:
    """Fails any batch that contains a poisoned request, as llama.cpp fails a step."""

    def __init__(self, *poisoned: int, status: int = -1) -> None:
        self.poisoned = set(poisoned)
        self.status = status
        self.calls: list[list[int]] = []

    def __call__(self, batch: list[Chunk]) -> dict[int, int]:
        self.calls.append([c.rid for c in batch])
        if self.poisoned & {c.rid for c in batch}:
            raise DecodeError(self.status)
        return {c.rid: 100 + c.rid for c in batch}


def test_a_step_that_decodes_runs_once() -> None:
    run = FakeDecode()
    sampled, failed = run_isolating(chunks(1, 2, 3), run)
    assert sampled == {1: 101, 2: 102, 3: 103} and not failed
    assert run.calls == [[1, 2, 3]]


@pytest.mark.parametrize("poisoned", [(1,), (4,), (2, 7), (1, 2, 3, 4, 5, 6, 7, 8)])
def test_a_failed_step_fails_only_the_requests_that_fail_alone(poisoned: tuple[int, ...]
                                                               ) -> None:
    run = FakeDecode(*poisoned)
    sampled, failed = run_isolating(chunks(*range(1, 9)), run)
    assert set(failed) == set(poisoned)
    assert sampled == {rid: 100 + rid for rid in range(1, 9) if rid not in poisoned}
    # every healthy request was decoded exactly once
    decoded = [rid for call in run.calls for rid in call if not set(call) & set(poisoned)]
    assert sorted(decoded) == sorted(sampled)


def test_no_kv_space_on_the_whole_step_is_for_the_caller() -> None:
    def full(batch: list[Chunk]) -> dict[int, int]:
        raise NoKVSpace(1)

    with pytest.raises(NoKVSpace):
        run_isolating(chunks(1, 2), full)


def test_restarts_back_off_exponentially_up_to_a_cap() -> None:
    delays = [backoff_delay(0.5, 30.0, n) for n in range(1, 10)]
    assert delays[:4] == [0.5, 1.0, 2.0, 4.0]
    assert delays[-1] == 30.0 and max(delays) == 30.0
    assert delays == sorted(delays)
    # Hours of a worker dying at once: 2.0 ** 1024 overflowed (an OverflowError ended
    # every model's workers).
    assert backoff_delay(0.5, 30.0, 1025) == backoff_delay(0.5, 30.0, 10**6) == 30.0


def test_retry_after_is_whole_seconds_at_least_one() -> None:
    assert retry_after_seconds(0.01) == 1
    assert retry_after_seconds(12.2) == 13


def test_the_door_refuses_when_every_worker_estimates_a_wait_past_the_timeout() -> None:
    cfg = msgspec.structs.replace(fc.Config(), engine=msgspec.structs.replace(
        fc.Config().engine, workers=2))
    pool = EnginePool(cfg, cfg.model, 8192, cache_dir=Path("/nonexistent"))
    for w, wait in zip(pool.workers, (100.0, 75.5), strict=True):
        w.ready, w.last_heard, w.stats = True, time.monotonic(), WorkerStats(wait_estimate_s=wait)
        w.outbox = Outbox(limit=64)  # a running process
    with pytest.raises(Overloaded) as refused:
        pool.check_capacity()
    # the least loaded worker's estimate, less the 60 s queue timeout, in whole seconds
    assert refused.value.retry_after == 16
    pool.workers[1].stats = WorkerStats(wait_estimate_s=59.0)
    pool.check_capacity()  # one worker would take it in time


async def test_an_outbox_past_its_limit_means_the_worker_stopped_reading() -> None:
    outbox = Outbox(limit=3)
    for rid in range(3):
        outbox.put(fr.Cancel(rid=rid))
    assert len(await outbox.take()) == 3
    for rid in range(4):
        outbox.put(fr.Cancel(rid=rid))
    with pytest.raises(trio.TooSlowError):
        await outbox.take()


@pytest.mark.parametrize(("layout", "max_context", "n_ctx_train", "expected"), [
    ("per_slot", 0, 8192, 2048),    # a slot's stream: 32768 / 16
    ("per_slot", 0, 1024, 1024),    # the model's training context is smaller
    ("unified", 0, 65536, 32768 - 64),  # the whole cache less the headroom
    ("per_slot", 1000, 8192, 1000),  # as configured
])
def test_the_largest_request_is_derived_once_from_the_config_and_the_model(
        layout: str, max_context: int, n_ctx_train: int, expected: int) -> None:
    engine = msgspec.structs.replace(fc.Config().engine, kv_layout=layout,
                                     max_context=max_context)
    lim = scheduler_limits(msgspec.structs.replace(fc.Config(), engine=engine), n_ctx_train)
    assert lim.max_context == expected <= lim.room


def test_a_reload_sends_the_whole_new_limits_and_a_worker_refuses_a_new_geometry() -> None:
    cfg = fc.Config()
    pool = EnginePool(cfg, cfg.model, 8192, cache_dir=Path("/nonexistent"))
    pool.workers[0].outbox = outbox = Outbox(limit=8)
    new = msgspec.structs.replace(cfg, limits=msgspec.structs.replace(
        cfg.limits, max_queued=7))
    pool.set_limits(new)
    frame = outbox.unsent[0]
    assert isinstance(frame, fr.SetLimits) and frame.limits == scheduler_limits(new, 8192)
    sched = Scheduler(pool.limits)
    sched.set_limits(frame.limits)
    assert sched.limits.max_queued == 7
    with pytest.raises(ValueError, match="restart"):
        sched.set_limits(msgspec.structs.replace(frame.limits, slots=4))


async def test_a_step_longer_than_a_read_reaches_the_pool_whole() -> None:
    """The reader asks the socket for READ_SIZE bytes at a time (below glibc's mmap
    threshold, so that no read maps and unmaps a buffer): a frame several times that
    long, beside short ones, arrives whole and in order."""
    ours, theirs = trio.socket.socketpair()
    texts = ["a", "b" * (3 * fr.READ_SIZE + 7), "c"]
    frames = [fr.Step(events=[Delta(rid=i, text=t)], stats=None) for i, t in enumerate(texts)]
    got: list[str] = []

    def on_step(step: fr.Step) -> None:
        got.extend(e.text for e in step.events if isinstance(e, Delta))

    async with trio.SocketStream(ours) as reader, trio.open_nursery() as nursery:
        nursery.start_soon(read_steps, reader, fr.FrameBuffer(), lambda: 10.0, on_step)
        async with trio.SocketStream(theirs) as writer:  # then its end closes: EOF
            for frame in frames:
                await writer.send_all(fr.encode(frame))
    assert got == texts


async def test_a_worker_heard_in_time_is_kept_and_a_silent_one_is_not(
        autojump_clock: trio.testing.MockClock) -> None:
    """The reader's one scope moves its deadline on with each read: five frames 0.6 s
    apart pass a 1 s silence limit, and the limit trips 1 s after the last one (the
    limit read at each frame: a reload's new one holds from the next)."""
    ours, theirs = trio.socket.socketpair()
    heard: list[float] = []

    async def speak(writer: trio.SocketStream) -> None:
        for _ in range(5):
            await writer.send_all(fr.encode(fr.Step(events=[], stats=None)))
            await trio.sleep(0.6)

    async with (trio.SocketStream(ours) as reader, trio.SocketStream(theirs) as writer,
                trio.open_nursery() as nursery):
        nursery.start_soon(speak, writer)
        t0 = trio.current_time()
        with pytest.raises(trio.TooSlowError):
            await read_steps(reader, fr.FrameBuffer(), lambda: 1.0,
                             lambda _: heard.append(trio.current_time() - t0))
        gave_up = trio.current_time() - t0
    assert heard == pytest.approx([0.0, 0.6, 1.2, 1.8, 2.4], abs=0.01)
    assert gave_up == pytest.approx(3.4, abs=0.01)


def test_a_step_past_the_frame_limit_goes_as_several_frames(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Several requests' embeddings finished in one step can pass MAX_FRAME together,
    each within it alone: the worker sends the step as several frames, its events in
    order, the statistics and digests with the first. (Encoding it raised, and the
    worker died with every request it held.)"""
    monkeypatch.setattr(fr, "MAX_FRAME", 4096)
    events = [Delta(rid=i, text="x" * 1500) for i in range(6)]
    shell = object.__new__(WorkerShell)
    ours, theirs = socket.socketpair()
    shell.sock, shell._last_send = ours, 0.0
    shell.core = cast(Any, SimpleNamespace(frame=lambda now, force, hold: fr.Step(
        events=events, stats=WorkerStats(), digests=[7])))
    shell.send(force=True)
    ours.close()
    data = b""
    while chunk := theirs.recv(65536):
        data += chunk
    theirs.close()
    frames = [fr.from_worker_decoder.decode(b) for b in fr.FrameBuffer().feed(data)]
    steps = [f for f in frames if isinstance(f, fr.Step)]
    assert len(steps) == len(frames) > 1
    assert [e for f in steps for e in f.events] == events
    assert steps[0].stats is not None and steps[0].digests == [7]
    assert all(f.stats is None and f.digests is None for f in steps[1:])


def test_held_tokens_go_before_the_worker_handles_what_arrived() -> None:
    """server.stream_coalesce_ms: a stream's text may wait in the worker for the next
    step's. A frame that arrives meanwhile may take long to handle (a submit's grammar
    built, a test hook's hang): what is held goes out first, so no token waits past its
    budget for it. (It waited for the handling.)"""
    from tests.test_core import core_with, submit

    core, _ = core_with({5: [1] * 40}, hold_ms=60_000.0)  # holds while steps are fast
    submit(core, 1, [5], max_tokens=30)
    shell = object.__new__(WorkerShell)
    ours, theirs = socket.socketpair()
    shell.sock, shell.core, shell.inbuf = ours, core, fr.FrameBuffer()
    shell.init = cast(Any, SimpleNamespace(heartbeat_interval=3600.0))
    shell.running, shell._last_send = True, time.monotonic()
    held_when_handled: list[int] = []

    def handle(frame: fr.ToWorker) -> None:
        held_when_handled.append(len(core.events))

    shell._handle = handle  # type: ignore[method-assign]
    with ours, theirs:
        for _ in range(5):
            shell.turn()
        assert core.events  # tokens held after the first one went
        theirs.sendall(fr.encode(fr.Hang(seconds=0.0)))
        shell.turn()
    assert held_when_handled == [0]


async def test_a_reloaded_heartbeat_timeout_holds_for_the_running_worker(
        tiny_model: Path, start_daemon: DaemonFactory) -> None:
    """A reload reported engine.heartbeat_timeout as applied, but the running worker's
    reader kept the old limit until its next restart: raised from 1.5 to 8 s, a worker
    silent for 3 s was still killed (with every request it held)."""
    engine = {"heartbeat_interval": 0.1, "heartbeat_timeout": 1.5, "target_step_ms": 100.0}
    with trio.fail_after(60):
        async with start_daemon(tiny_model, engine=engine) as d:
            cfg = d.daemon.cfg
            d.daemon.config_path.write_text(as_toml(msgspec.structs.replace(
                cfg, engine=msgspec.structs.replace(cfg.engine, heartbeat_timeout=8.0))))
            d.daemon.reload()
            await trio.sleep(0.5)  # the new limit holds from the worker's next frame
            pool = d.daemon.models.default.pool
            testhooks.hang_worker(pool, 0, 3.0)
            await trio.sleep(4.0)
            assert pool.workers[0].restarts == 0


async def test_a_reload_whose_mix_with_the_running_restart_keys_is_invalid_is_refused(
        tiny_model: Path, start_daemon: DaemonFactory,
        caplog: pytest.LogCaptureFixture) -> None:
    """A reload keeps the running values of the keys that need a restart: the file was
    valid alone (interval 1 s, timeout 5 s), but with the running interval (2 s) the
    timeout is shorter than three heartbeats, and a worker would be killed between
    two. It was applied all the same."""
    with trio.fail_after(60):
        async with start_daemon(tiny_model, engine={"heartbeat_interval": 2.0}) as d:
            cfg = d.daemon.cfg
            d.daemon.config_path.write_text(as_toml(msgspec.structs.replace(
                cfg, engine=msgspec.structs.replace(cfg.engine, heartbeat_interval=1.0,
                                                    heartbeat_timeout=5.0))))
            d.daemon.reload()
            assert d.daemon.cfg.engine.heartbeat_timeout == cfg.engine.heartbeat_timeout
    assert "reload refused" in caplog.text and "need a restart" in caplog.text
