"""The worker process: one llama.cpp context driven by the sans-IO scheduler.

``python -m forged.engine.worker FD`` talks frames over the inherited socket ``FD``.
It is a plain synchronous loop, so the GIL and llama.cpp never touch the daemon's
event loop, and a llama.cpp ``abort()`` only costs this process.

Each turn: read whatever frames arrived (block only when idle), expire queued
requests, ask the scheduler for a plan, apply its memory operations, decode, sample,
turn tokens into text, and send one ``Step`` frame with all the events.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from forged.engine import frames as fr
from forged.engine.backend import (
    Context,
    ContextParams,
    DecodeError,
    Model,
    NoKVSpace,
    Sampler,
    SamplingParams,
)
from forged.engine.costmodel import CostModel, chunk_shape, decode_shape
from forged.engine.scheduler import (
    Admitted,
    Chunk,
    Expired,
    QueueFull,
    Scheduler,
    SchedulerLimits,
    SeqCp,
    SeqRequest,
    SeqRm,
    StepPlan,
)
from forged.engine.textstream import TextStream

_EOG_BIAS = -float("inf")


@dataclass
class _Req:
    sub: fr.Submit
    sampler: Sampler
    text: TextStream
    generated: int = 0
    cached: int = 0
    admitted: bool = False
    eog: set[int] = field(default_factory=set)
    # Admission, then the first token: when, and at which step count.
    admitted_at: tuple[float, int] = (0.0, 0)
    first_at: tuple[float, int] = (0.0, 0)


class Worker:
    def __init__(self, sock: socket.socket, init: fr.Init) -> None:
        self.sock = sock
        self.init = init
        self.model = Model(init.model_path)
        self.ctx = Context(self.model, ContextParams(
            n_ctx=init.kv_cells, n_seq_max=init.slots,
            n_batch=max(init.step_tokens, init.prefill_step_tokens),
            threads=init.threads, flash_attn=init.flash_attn,
            kv_unified=init.per_slot_cells == 0,
        ))
        self.sched = Scheduler(self._limits(init), calibrate(self.ctx, init.slots))
        self.reqs: dict[int, _Req] = {}
        self.events: list[fr.Event] = []
        self.inbuf = fr.FrameBuffer()
        self.running = True
        self._last_send = 0.0
        self._last_stats = 0.0
        self._step_delay = 0.0
        self._crash_token: int | None = None
        self._step_ms = 0.0
        self._steps = 0
        self._tokens_out = 0

    def _limits(self, live: fr.Init | fr.SetLimits) -> SchedulerLimits:
        """The scheduler's limits: geometry from Init, the reloadable rest from ``live``."""
        i = self.init
        return SchedulerLimits(
            kv_cells=i.kv_cells, slots=i.slots, max_running=i.max_running,
            step_tokens=i.step_tokens, prefill_step_tokens=i.prefill_step_tokens,
            target_step_ms=live.target_step_ms, kv_headroom=i.kv_headroom,
            decode_reservation=live.decode_reservation, max_queued=live.max_queued,
            max_queued_tokens=live.max_queued_tokens, per_slot_cells=i.per_slot_cells,
            max_context=i.max_context,
            overtake_window=live.overtake_window, session_ttl=live.session_ttl,
        )

    # --- input ------------------------------------------------------------------------

    def _read_frames(self, timeout: float) -> list[fr.ToWorker]:
        ready, _, _ = select.select([self.sock], [], [], timeout)
        if not ready:
            return []
        data = self.sock.recv(1 << 20)
        if not data:  # the daemon went away: nothing left to serve
            self.running = False
            return []
        return [fr.to_worker_decoder.decode(b) for b in self.inbuf.feed(data)]

    def _handle(self, frame: fr.ToWorker, now: float) -> None:
        match frame:
            case fr.Submit():
                self._submit(frame, now)
            case fr.Cancel(rid=rid):
                self.sched.cancel(rid)
                self._drop(rid)
            case fr.SetLimits():
                self.sched.set_limits(self._limits(frame))
            case fr.Shutdown():
                self.running = False
            case fr.Hang(seconds=s) if self.init.test_hooks:
                time.sleep(s)
            case fr.SlowSteps(seconds=s) if self.init.test_hooks:
                self._step_delay = s
            case fr.CrashOn(token=t) if self.init.test_hooks:
                self._crash_token = t
            case _:
                pass

    def _submit(self, sub: fr.Submit, now: float) -> None:
        s = sub.sampling
        bias = list(s.logit_bias)
        if sub.ignore_eos:
            bias += [(t, _EOG_BIAS) for t in self.model.eog_tokens]
        params = SamplingParams(
            temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
            repeat_penalty=s.repeat_penalty, presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            seed=s.seed if s.seed is not None else int.from_bytes(os.urandom(4)),
            logit_bias=tuple(bias),
        )
        req = SeqRequest(sub.rid, sub.prompt, sub.max_tokens, sub.priority,
                         queue_timeout=sub.queue_timeout, cache=sub.cache,
                         session=sub.session, tenant=sub.tenant)
        try:
            self.sched.submit(req, now)
        except QueueFull as exc:
            self.events.append(fr.Failed(rid=sub.rid, code="overloaded", message=str(exc),
                                         retry_after=exc.retry_after))
            return
        except ValueError as exc:
            self.events.append(fr.Failed(rid=sub.rid, code="bad_request", message=str(exc)))
            return
        sampler = Sampler(self.model, params)
        if params.repeat_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
            sampler.accept(sub.prompt)
        eog = set() if sub.ignore_eos else set(self.model.eog_tokens)
        self.reqs[sub.rid] = _Req(sub, sampler, TextStream(sub.stop), eog=eog)

    def _drop(self, rid: int) -> None:
        req = self.reqs.pop(rid, None)
        if req is not None:
            req.sampler.close()

    # --- one step ---------------------------------------------------------------------

    def step(self) -> None:
        now = time.monotonic()
        self.sched.expire(now)
        plan = self.sched.plan(now)
        self._scheduler_events()
        if plan is None:
            return
        for op in plan.ops:
            match op:
                case SeqRm(seq=seq, p0=p0):
                    self.ctx.seq_rm(seq, p0)
                case SeqCp(src=src, dst=dst, n=n, whole=True):
                    self.ctx.seq_cp_stream(src, dst, n)
                case SeqCp(src=src, dst=dst, n=n):
                    self.ctx.seq_cp(src, dst, n)
        if not plan.chunks:
            return
        if self._crash_token is not None:
            self._crash_if_poisoned(plan)
        t0 = time.perf_counter()
        try:
            sampled, failed = run_isolating(plan.chunks, self._decode_and_sample)
        except NoKVSpace:
            self._relieve(plan)
            return
        ran = plan if not failed else StepPlan(
            [], [c for c in plan.chunks if c.rid not in failed], plan.shape)
        self.sched.commit(ran, sampled, time.monotonic())
        for rid, exc in failed.items():
            self._fail(rid, "engine_error", f"decode failed: {exc}")
        for rid, tok in sampled.items():
            self._on_token(rid, tok)
        if self._step_delay:
            time.sleep(self._step_delay)
        self._step_ms = (time.perf_counter() - t0) * 1000
        if not failed:  # a retried step's time says nothing about its shape
            self.sched.observe(plan, self._step_ms)
        self._steps += 1
        self._tokens_out += len(sampled)

    def _crash_if_poisoned(self, plan: StepPlan) -> None:
        for c in plan.chunks:
            if c.pos >= len(self.reqs[c.rid].sub.prompt) and \
                    self._crash_token in self.reqs[c.rid].sub.prompt:
                os.abort()  # as llama.cpp does on a failed assertion

    def _decode_and_sample(self, chunks: list[Chunk]) -> dict[int, int]:
        idx = self.ctx.decode([(c.seq, c.pos, c.tokens, c.sample) for c in chunks])
        return {c.rid: self.reqs[c.rid].sampler.sample(self.ctx, i)
                for c, i in zip(chunks, idx, strict=True) if c.sample}

    def _relieve(self, plan: StepPlan) -> None:
        # The ledger said the batch fits, but llama.cpp found no cells: give some back.
        if not self.sched.preempt_one():
            self._fail_plan(plan, "the KV cache is full")

    def _fail_plan(self, plan: StepPlan, message: str) -> None:
        for c in plan.chunks:
            self._fail(c.rid, "engine_error", message)

    def _fail(self, rid: int, code: fr.ErrorCode, message: str) -> None:
        if self.sched.is_running(rid):
            self.sched.cancel(rid)
        self._drop(rid)
        self.events.append(fr.Failed(rid=rid, code=code, message=message))

    def _scheduler_events(self) -> None:
        for ev in self.sched.drain_events():
            match ev:
                case Admitted(rid=rid, cached=cached, queue_time=qt):
                    req = self.reqs[rid]
                    if not req.admitted:  # a preempted request is admitted again, silently
                        req.admitted, req.cached = True, cached
                        req.admitted_at = (time.monotonic(), self._steps)
                        self.events.append(fr.Admitted(rid=rid, cached=cached, queue_time=qt))
                case Expired(rid=rid):
                    self._drop(rid)
                    self.events.append(fr.Failed(rid=rid, code="queue_timeout",
                                                 message="timed out waiting for a free slot"))

    def _on_token(self, rid: int, tok: int) -> None:
        req = self.reqs[rid]
        if tok in req.eog:
            # What was held back for a possible stop string or a split character is
            # the end of the answer after all.
            self._finish(rid, "stop", req.text.flush())
            return
        req.generated += 1
        if req.generated == 1:
            req.first_at = (time.monotonic(), self._steps + 1)  # this step counts
        text = req.text.feed(self.model.piece(tok))
        if req.text.stopped:
            self._finish(rid, "stop", text)
        elif req.generated >= req.sub.max_tokens:
            self._finish(rid, "length", text + req.text.flush())
        elif text:
            self.events.append(fr.Delta(rid=rid, text=text))

    def _finish(self, rid: int, reason: fr.FinishReason, text: str) -> None:
        req = self.reqs[rid]
        self.sched.finish(rid)
        self._drop(rid)
        self.events.append(fr.Done(
            rid=rid, text=text, finish_reason=reason, prompt_tokens=len(req.sub.prompt),
            completion_tokens=req.generated, cached_tokens=req.cached,
            prefill_s=max(0.0, req.first_at[0] - req.admitted_at[0]),
            prefill_steps=max(0, req.first_at[1] - req.admitted_at[1]),
        ))

    # --- output -------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = dict(self.sched.statistics())
        out.update(step_ms=self._step_ms, steps=self._steps, tokens_generated=self._tokens_out)
        return out

    def flush(self, now: float, force: bool = False) -> None:
        if not self.events and not force:
            return
        # Statistics cost a walk over the KV ledger: send them at most every 50 ms,
        # or at once when something other than tokens changed (force).
        fresh = (force or now - self._last_stats >= 0.05
                 or any(not isinstance(e, fr.Delta) for e in self.events))
        frame = fr.Step(events=self.events, stats=self.stats() if fresh else {})
        self.events = []
        self.sock.sendall(fr.encode(frame))
        self._last_send = now
        if fresh:
            self._last_stats = now

    def run(self) -> None:
        hb = self.init.heartbeat_interval
        while self.running:
            busy = self.sched.n_running > 0 or self.sched.n_queued > 0
            now = time.monotonic()
            wait = 0.0 if busy else max(0.0, hb - (now - self._last_send))
            frames = self._read_frames(wait)
            for frame in frames:
                self._handle(frame, time.monotonic())
            self.step()
            now = time.monotonic()
            # After a cancel the statistics change with no event: send them at once.
            self.flush(now, force=bool(frames) or now - self._last_send >= hb)

    def close(self) -> None:
        for rid in list(self.reqs):
            self._drop(rid)
        self.ctx.close()
        self.model.close()


def run_isolating(chunks: list[Chunk], run: Callable[[list[Chunk]], dict[int, int]]
                  ) -> tuple[dict[int, int], dict[int, DecodeError]]:
    """Run ``chunks`` as one step. If llama.cpp fails it (rolling it back), run the
    halves apart, recursively, so that only the requests whose chunks fail alone fail
    and every other stream in the step goes on. ``NoKVSpace`` on the whole step is not
    a failure of any chunk: it propagates, for the caller to make room.

    Returns the tokens sampled and the errors of the requests that failed, by rid.
    """
    try:
        return run(chunks), {}
    except NoKVSpace:
        raise
    except DecodeError as exc:
        if len(chunks) == 1:
            return {}, {chunks[0].rid: exc}
    return _bisect(chunks, run)


def _bisect(chunks: list[Chunk], run: Callable[[list[Chunk]], dict[int, int]]
            ) -> tuple[dict[int, int], dict[int, DecodeError]]:
    sampled: dict[int, int] = {}
    failed: dict[int, DecodeError] = {}
    half = len(chunks) // 2
    for part in (chunks[:half], chunks[half:]):
        try:
            sampled |= run(part)
        except DecodeError as exc:  # NoKVSpace too: in a retry it fails its chunks
            if len(part) == 1:
                failed[part[0].rid] = exc
            else:
                more_sampled, more_failed = _bisect(part, run)
                sampled |= more_sampled
                failed |= more_failed
    return sampled, failed


def calibrate(ctx: Context, slots: int) -> CostModel:
    """A cost model seeded from a few steps of typical shapes run now, on empty
    sequences that are removed afterwards, so that the first real steps are already
    bounded by this machine's and this model's speed rather than by the built-in seed."""
    model = CostModel()
    n_batch = ctx.params.n_batch
    # (decoders, prompt tokens in place of one of them), each within one batch
    shapes = [(d, min(p, n_batch - d + 1)) for d, p in
              ((1, 0), (min(slots, 8), 0), (1, 32), (1, 128), (min(slots, 4), 64))]
    ctx.decode([(0, 0, [0], True)])  # the first decode allocates; do not time it
    ctx.seq_rm(0, 0)
    for _ in range(2):
        for decoders, prompt in shapes:
            items: list[tuple[int, int, list[int], bool]] = [
                (s, 0, [0], True) for s in range(decoders)]
            shape = decode_shape([0] * decoders)
            if prompt:
                items[0] = (0, 0, [0] * prompt, True)
                shape = decode_shape([0] * (decoders - 1)).plus(chunk_shape(0, prompt))
            t0 = time.perf_counter()
            ctx.decode(items)
            model.observe(shape, (time.perf_counter() - t0) * 1000)
            for s in range(decoders):
                ctx.seq_rm(s, 0)
    return model


def _read_init(sock: socket.socket) -> fr.Init:
    buf = fr.FrameBuffer()
    while True:
        data = sock.recv(1 << 16)
        if not data:
            raise SystemExit(0)
        bodies = buf.feed(data)
        if bodies:
            frame = fr.to_worker_decoder.decode(bodies[0])
            if not isinstance(frame, fr.Init):
                raise SystemExit("worker: the first frame must be init")
            return frame


def main(argv: list[str]) -> int:
    # The daemon owns signals: a terminal's Ctrl-C must not kill the worker first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=int(argv[1]))
    init = _read_init(sock)
    try:
        worker = Worker(sock, init)
    except Exception as exc:
        print(f"forged worker: cannot start: {exc}", file=sys.stderr)
        return 1
    sock.sendall(fr.encode(fr.Ready(pid=os.getpid(), n_ctx_train=worker.model.n_ctx_train,
                                    kv_cells=init.kv_cells)))
    worker.flush(time.monotonic(), force=True)  # statistics before the first request
    try:
        worker.run()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the daemon is gone; exit quietly
    except msgspec.DecodeError as exc:
        print(f"forged worker: bad frame from the daemon: {exc}", file=sys.stderr)
        return 1
    finally:
        worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
