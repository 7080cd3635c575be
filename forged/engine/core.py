"""The worker's core, sans-IO: frames in; backend calls, events and statistics out.

Theory of operation
-------------------
A worker process (:mod:`forged.engine.worker`) owns one socket and one llama.cpp
context. Everything it decides lives here, in :class:`WorkerCore`, which imports no
socket, no event loop and no llama.cpp: it drives a :class:`Backend` (the real one is
:class:`forged.engine.backend.Llama`; tests pass a fake) and the sans-IO
:class:`~forged.engine.scheduler.Scheduler`.

* ``handle(frame, now)`` takes a ``Submit``, ``Cancel``, ``SetLimits`` or ``Unpin`` frame;
* ``step(now)`` runs one step: expire queued requests, plan, apply the plan's KV memory
  operations, decode (isolating failing requests: ``decoding.run_isolating``), sample;
* ``frame(now, force)`` returns the ``Step`` frame: new events, and statistics when due.

Per request the core keeps what the scheduler does not, for each of its ``n`` choices:
the sampler (its own seed, penalty history and grammar state), the text stream (UTF-8
boundaries and stop strings) and the counters its ``Done`` event reports. Every path
out of a request (each choice's end of sequence, stop string or length; cancel,
expiry, a failed step) closes its samplers and, if it ran, tells the scheduler, so no
sequence leaks. The request ends when its last choice does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from forged.engine import frames as fr
from forged.engine.costmodel import CostModel
from forged.engine.decoding import (
    NEVER,
    Backend,
    NoKVSpace,
    TokenLogprob,
    TokenSampler,
    answer_ends,
    run_isolating,
)
from forged.engine.events import Admitted, Delta, Done, ErrorCode, Event, Failed, Scored, StopType
from forged.engine.hold import TokenHold
from forged.engine.kvtiers import (
    Demote,
    DiskTier,
    Drop,
    Entry,
    Read,
    Stage,
    Tier,
    TierOp,
    Written,
)
from forged.engine.limits import SchedulerLimits
from forged.engine.logprobs import Scores
from forged.engine.plan import (
    Admission,
    Chunk,
    Expired,
    Key,
    MemOp,
    QueueFull,
    SeqCp,
    SeqLoad,
    SeqRm,
    SeqSave,
    StepPlan,
)
from forged.engine.request import Request
from forged.engine.routing import DIGEST_INTERVAL, DigestBuilder
from forged.engine.scheduler import Scheduler
from forged.engine.stats import StepTally, WorkerStats
from forged.engine.textstream import TextStream

# How long a step with nothing to compute waits for a restore's read from disk (then
# the next step looks again).
_STAGE_WAIT_S = 1.0


@dataclass
class _Choice:
    """One of a request's ``n`` answers: its own sampler and text."""

    sampler: TokenSampler
    text: TextStream
    generated: int = 0
    first_at: tuple[float, int] = (0.0, 0)  # its first token: when, and at which step
    # For n_indent: the indentation of the line being generated, while it is only
    # whitespace (None once the line has other text, and on the cursor's own line).
    indent: int | None = None
    done: bool = False
    scores: Scores | None = None  # only when the request asked for logprobs

    def close(self) -> None:
        if not self.done:
            self.done = True
            self.sampler.close()


@dataclass
class _Stream:
    """What the core keeps of one request beside the scheduler's bookkeeping."""

    request: Request
    eog: frozenset[int]
    choices: list[_Choice] = field(default_factory=list)
    cached: int = 0
    admitted: bool = False
    admitted_at: tuple[float, int] = (0.0, 0)  # when, and at which step count


class WorkerCore:
    def __init__(self, backend: Backend, limits: SchedulerLimits, cost: CostModel, *,
                 clock: Callable[[], float] = time.monotonic,
                 disk: DiskTier | None = None, saved: Sequence[Entry] = ()) -> None:
        self.backend = backend
        self.sched = Scheduler(limits, cost)
        # The RAM tier's bytes, by entry id; the scheduler's Tiers says what they hold.
        self.ram: dict[int, bytearray] = {}
        # Disk entries whose write has not ended yet: their bytes, by entry id (a
        # restore meanwhile is served from here).
        self.writing: dict[int, bytearray] = {}
        # Disk entries staged for a restore: their bytes, read and checked.
        self.staged: dict[int, bytearray] = {}
        self.disk = disk
        if disk is None:
            self.sched.cache.tiers.disk_bytes = 0
        else:
            self._tier_ops(self.sched.cache.tiers.adopt(saved))
        # Seconds, on the clock of the ``now`` the caller passes: it times the steps
        # and the first tokens.
        self.clock = clock
        self.streams: dict[int, _Stream] = {}
        self.events: list[Event] = []
        # Requests whose draw this step found no token to take (a grammar left none):
        # the step ran, but they end here, by rid, with why.
        self._undrawn: dict[int, str] = {}
        self._last_stats = NEVER
        self._hold = TokenHold()  # a step's tokens sent with the next step's
        self._digests = DigestBuilder()
        self._last_digests = NEVER
        self._step_ms = 0.0
        self._tally = StepTally()

    @property
    def busy(self) -> bool:
        return self.sched.n_running > 0 or self.sched.n_queued > 0

    # --- frames in ----------------------------------------------------------------------

    def handle(self, frame: fr.ToCore, now: float) -> None:
        match frame:
            case fr.Submit(rid=rid, request=req):
                self._submit(rid, req, now)
            case fr.Cancel(rid=rid):
                self.sched.drop(rid)
                self._close(rid)
            case fr.SetLimits(limits=limits):
                self.sched.set_limits(limits)
            case fr.Unpin(session=session):
                self.sched.cache.unpin(session)

    def _submit(self, rid: int, req: Request, now: float) -> None:
        try:
            self.sched.submit(rid, req, now)
        except QueueFull as exc:
            self.events.append(Failed(rid=rid, code="overloaded", message=str(exc),
                                         retry_after=exc.retry_after))
            return
        except ValueError as exc:
            self.events.append(Failed(rid=rid, code="bad_request", message=str(exc)))
            return
        sampling, eog = answer_ends(req, frozenset(self.backend.eog_tokens))
        stream = self.streams[rid] = _Stream(req, eog)
        try:
            for i in range(req.n):
                sampler = self.backend.sampler(sampling.for_choice(i), req.prompt)
                text = TextStream(req.stop, include=req.include_stop,
                                  blocks=req.unique_blocks)
                stream.choices.append(_Choice(sampler, text, scores=_scores(req, i)))
        except ValueError as exc:  # a grammar llama.cpp refused (the daemon checks first)
            self.sched.drop(rid)
            self._close(rid)
            self.events.append(Failed(rid=rid, code="bad_request", message=str(exc)))

    def _close(self, rid: int) -> None:
        stream = self.streams.pop(rid, None)
        for index, choice in enumerate(stream.choices if stream is not None else ()):
            choice.close()
            self._hold.forget(rid, index)

    # --- one step -------------------------------------------------------------------------

    def step(self, now: float, flush: Callable[[], None] = lambda: None) -> None:
        """One step. ``flush`` sends the events so far: it is called before a decode
        that computes a newly admitted prompt, so that the daemon knows the request
        was admitted even if that decode kills the process (llama.cpp aborts). A
        request the daemon never saw admitted is resubmitted elsewhere after a crash;
        one that may have caused it must not be."""
        self.account_disk()
        self.sched.expire(now)
        priced_ms = self.sched.last_plan_ms  # the last plan's, for the hold's due()
        plan = self.sched.plan(now)
        if self.sched.cache.tiers.staging and (plan is None or not plan.chunks):
            # Nothing to compute but a restore's read: wait for it here, not spin.
            assert self.disk is not None
            self.disk.wait_done(_STAGE_WAIT_S)
        if plan is not None:
            if plan.ops and self.events:
                flush()  # held tokens go before a state's copy out of or into a slot
            # Before the admissions are reported: a refused restore changes them.
            recompute = self.apply_memory_ops(plan.ops)
            if recompute:
                plan = StepPlan([], [c for c in plan.chunks if c.key not in recompute],
                                plan.shape)
        admitted = self._scheduler_events()
        if plan is not None and plan.chunks:
            # Held tokens go before a prompt's decode too (it may take the step target),
            # and before any decode the cost model prices past their budget.
            if admitted or (self.events and (plan.shape.prompt_tokens or self._hold.due(
                    now, self.sched.last_plan_ms, priced_ms, self.sched.limits.hold_ms))):
                flush()
            self._decode(plan)

    def apply_memory_ops(self, ops: list[MemOp]) -> set[Key]:
        """Run the scheduler's memory operations; the requests whose saved state was
        refused, which compute their prompt from the start instead (next step)."""
        recompute: set[Key] = set()
        emptied: set[int] = set()  # slots whose restore failed: nothing to copy from
        # An entry restored in the plan that saved it left the index at planning (its
        # save was skipped, and every such restore failed): saved for that load alone.
        loading = {op.entry.eid for op in ops if isinstance(op, SeqLoad)}
        for op in ops:
            match op:
                case SeqRm(seq=seq, p0=p0):
                    self.backend.seq_rm(seq, p0)
                case SeqCp(dst=dst) if op.src in emptied:
                    recompute |= self._refused(dst, emptied, counted=False)
                case SeqCp(src=src, dst=dst, n=n, whole=True):
                    self.backend.seq_cp_stream(src, dst, n)
                case SeqCp(src=src, dst=dst, n=n):
                    self.backend.seq_cp(src, dst, n)
                case SeqSave(seq=seq, eid=eid) if self.sched.cache.tiers.holds(eid, Tier.RAM):
                    state = self.ram[eid] = self.backend.seq_save(seq)
                    self._tier_ops(self.sched.cache.tiers.sized(eid, len(state)))
                case SeqSave(seq=seq, eid=eid) if eid in loading:
                    self.ram[eid] = self.backend.seq_save(seq)
                case SeqLoad(seq=seq, entry=entry, keep=keep):
                    if not self._restore(seq, entry, keep):
                        recompute |= self._refused(seq, emptied)
                case Drop() | Demote() | Stage():
                    self._tier_ops([op])
        return recompute

    def _refused(self, seq: int, emptied: set[int], counted: bool = True) -> set[Key]:
        """Slot ``seq`` holds nothing it was to hold (its restore was refused, or it
        was to copy from a slot whose restore was): its request computes its whole
        prompt. (A copy from an emptied slot gave a silently wrong answer: the request
        decoded after a prefix llama.cpp did not hold, and its slot then served that
        hole to later requests as a cached prefix.)"""
        self.backend.seq_rm(seq, 0)
        emptied.add(seq)
        key = self.sched.restore_failed(seq, counted)
        return {key} if key is not None else set()

    def _restore(self, seq: int, entry: Entry, keep: bool) -> bool:
        if entry.tier is Tier.RAM:
            state = self.ram.get(entry.eid) if keep else self.ram.pop(entry.eid, None)
        elif entry.eid in self.writing:  # its write has not ended: the bytes are here
            state = self.writing[entry.eid] if keep else self.writing.pop(entry.eid)
        elif entry.eid in self.staged:  # read beside the decode loop, for this restore
            state = self.staged.pop(entry.eid)
            if self.disk is not None and not keep:
                self.disk.remove(entry)
        else:
            state = self.disk.read(entry) if self.disk is not None else None
            if self.disk is not None and not keep:
                self.disk.remove(entry)  # the slot holds it now; saved again on eviction
        if state is not None and self.backend.seq_load(seq, state, len(entry.tokens)):
            return True
        if keep:  # a kept entry llama.cpp refuses goes: each match would try it again
            self.sched.cache.tiers.lost(entry)
            self._tier_ops([Drop(entry, entry.tier)])
        return False

    def _tier_ops(self, ops: list[TierOp], later: bool = True) -> None:
        """Move or free the tiers' bytes as the scheduler's Tiers decided; ``later``:
        disk writes go to the writer beside the decode loop."""
        for op in ops:
            match op:
                case Drop(entry=e, tier=Tier.RAM):
                    self.ram.pop(e.eid, None)
                case Drop(entry=e):
                    self.writing.pop(e.eid, None)  # its file, if written, goes then
                    if self.disk is not None:
                        self.disk.remove(e)
                case Demote(entry=e):
                    self._demote(e, later)
                case Stage(entry=e):
                    if e.eid in self.writing:  # not on disk yet: its bytes are here
                        self.sched.cache.tiers.read(e, ok=True)
                    elif self.disk is None:
                        self.sched.cache.tiers.read(e, ok=False)
                    elif not self.disk.read_later(e):
                        self.sched.cache.tiers.unstage(e.eid)  # busy: asked again next step

    def _demote(self, e: Entry, later: bool) -> None:
        """``e``'s RAM bytes go to disk: written beside the decode loop when ``later``
        (a step never waits on the disk), else now."""
        state = self.ram.pop(e.eid, None)
        if not later and not self.sched.cache.tiers.holds(e.eid, e.tier):
            return  # a stop's: dropped since (each write refits the budget), never read
        if self.disk is None or state is None:
            self.sched.cache.tiers.lost(e)
        elif later and self.disk.write_later(e, state):
            self.writing[e.eid] = state
        elif (written := self.disk.write(e, state)) is None:
            self.sched.cache.tiers.lost(e)
        else:  # the file's size is known now (its header adds to the state)
            self._tier_ops(self.sched.cache.tiers.resized(e, written[1], written[0]))

    def account_disk(self) -> None:
        """Account for the disk writes and reads that ended (each step does, first),
        and free the staged bytes the scheduler no longer wants."""
        for done in self.disk.finished() if self.disk is not None else ():
            match done:
                case Written():
                    self._written(done)
                case Read(entry=e, state=state):
                    self.sched.cache.tiers.read(e, ok=state is not None)
                    if state is not None and self.sched.cache.tiers.ready(e):
                        self.staged[e.eid] = state
        for eid in [eid for eid in self.staged if eid not in self.sched.cache.tiers.staged]:
            del self.staged[eid]

    def _written(self, w: Written) -> None:
        """A written file is the entry's now (or is removed, if the entry was restored
        or dropped meanwhile); a failed write loses the entry."""
        if self.writing.pop(w.entry.eid, None) is None:
            if w.key and self.disk is not None:
                self.disk.remove_key(w.key)  # nobody wants it any more
        elif not w.key:
            self.sched.cache.tiers.lost(w.entry)
        else:
            self._tier_ops(self.sched.cache.tiers.resized(w.entry, w.nbytes, w.key))

    def persist(self) -> None:
        """Before the worker exits (a drain, a restart): sessions' states go to disk."""
        if self.disk is None:
            return
        self.disk.wait_writes()
        self.account_disk()
        self.apply_memory_ops(self.sched.cache.save_sessions())
        self._tier_ops(self.sched.cache.tiers.demote_sessions(), later=False)
        self.disk.wait_writes()  # those the saves above evicted from RAM
        self.account_disk()
        self.disk.order(self.sched.cache.tiers.entries(Tier.DISK))

    def _decode(self, plan: StepPlan) -> None:
        t0 = self.clock()
        self._undrawn = {}
        try:
            sampled, failed = run_isolating(plan.chunks, self._decode_and_sample)
        except NoKVSpace:
            self._relieve(plan)
            return
        undrawn = self._undrawn
        # A request whose draw or decode failed ends whole: its other choices' tokens
        # (an n > 1 request's choices may sit in a half that decoded) go too, and every
        # chunk of it is unwritten: decoded, but not recorded, the slot keeps what it was.
        dropped = failed.keys() | undrawn.keys()
        sampled = {key: tok for key, tok in sampled.items() if key[0] not in dropped}
        for c in plan.chunks if dropped else ():  # the decode loop: nothing, as a rule
            if c.rid in dropped:
                self.backend.seq_rm(c.seq, c.pos)
        ran = plan if not dropped else StepPlan(
            [], [c for c in plan.chunks if c.rid not in dropped], plan.shape)
        self.sched.commit(ran, sampled, self.clock())
        for rid, exc in failed.items():
            self._fail(rid, "engine_error", f"decode failed: {exc}")
        for rid, why in undrawn.items():
            self._fail(rid, "bad_request", why)
        for (rid, index), tok in sampled.items():
            self._on_token(rid, index, tok)
        self._step_ms = (self.clock() - t0) * 1000
        if not failed:  # a retried step's time says nothing about its shape
            self.sched.observe(plan, self._step_ms)
        self._tally.add(plan.shape.prompt_tokens > 0, self._step_ms / 1000, len(sampled))

    def _decode_and_sample(self, chunks: list[Chunk]) -> dict[Key, int]:
        # Logits live only until the next decode (a retried half's, in run_isolating):
        # whatever is scored is scored here.
        idx = self.backend.decode([(c.seq, c.pos, c.tokens, self._logits_wanted(c))
                                   for c in chunks])
        sampled: dict[Key, int] = {}
        for c, i in zip(chunks, idx, strict=True):
            stream = self.streams[c.rid]
            scores = stream.choices[c.index].scores
            if scores is not None and scores.scoring:
                self._score_prompt(stream, scores, c, i)
            try:
                sampled |= self._draw(stream, c, i)
            except ValueError as exc:  # no token to take: this request ends, not the step
                self._undrawn[c.rid] = str(exc)
        return sampled

    def _draw(self, stream: _Stream, c: Chunk, i: int) -> dict[Key, int]:
        """At the end of a shared prompt, every choice samples from the same logits."""
        out = {}
        for index in c.choices:
            choice = stream.choices[index]
            out[(c.rid, index)] = tok = choice.sampler.sample(i)
            if choice.scores is not None:
                choice.scores.scoring = False
                choice.scores.sampled = self.backend.logprobs(i, tok, choice.scores.top)
        return out

    def _logits_wanted(self, c: Chunk) -> int:
        scores = self.streams[c.rid].choices[c.index].scores
        return len(c.tokens) if scores is not None and scores.scoring else int(c.sample)

    def _score_prompt(self, stream: _Stream, scores: Scores, c: Chunk, last: int) -> None:
        """Score the prompt tokens that follow the positions of chunk ``c``, whose last
        token's logits are at batch index ``last`` (the others' just before it). A
        scored prompt is never taken from the cache, so its positions are indices into
        it (the scheduler sees to that)."""
        prompt, into = stream.request.prompt, scores.prompt
        assert into is not None
        first = last - len(c.tokens) + 1
        for j in range(len(c.tokens)):
            after = c.pos + j + 1
            if after < len(prompt):  # the last position's token is the one sampled
                into[after] = self.backend.logprobs(first + j, prompt[after], scores.top)

    def _relieve(self, plan: StepPlan) -> None:
        # The ledger said the batch fits, but llama.cpp found no cells: give some back.
        if not self.sched.preempt_one():
            for rid in dict.fromkeys(c.rid for c in plan.chunks):  # once per request
                self._fail(rid, "engine_error", "the KV cache is full")

    def _fail(self, rid: int, code: ErrorCode, message: str) -> None:
        self.sched.drop(rid)
        self._close(rid)
        self.events.append(Failed(rid=rid, code=code, message=message))

    def _scheduler_events(self) -> bool:
        """Turn the scheduler's events into the daemon's; whether one was an admission."""
        admitted = False
        for ev in self.sched.drain_events():
            match ev:
                case Admission(rid=rid, cached=cached, queue_time=qt):
                    stream = self.streams[rid]
                    if not stream.admitted:  # a preempted request is admitted again, silently
                        stream.admitted, stream.cached = True, cached
                        stream.admitted_at = (self.clock(), self._tally.steps)
                        self.events.append(Admitted(rid=rid, cached=cached, queue_time=qt))
                        admitted = True
                case Expired(rid=rid):
                    self.sched.drop(rid)  # its other choices may be running
                    self._close(rid)
                    self.events.append(Failed(rid=rid, code="queue_timeout",
                                                 message="timed out waiting for a free slot"))
        return admitted

    def _on_token(self, rid: int, index: int, tok: int) -> None:
        stream = self.streams[rid]
        req, choice = stream.request, stream.choices[index]
        scores = choice.scores
        if scores is not None and (prompt := scores.take_prompt()) is not None:
            self.events.append(Scored(rid=rid, logprobs=prompt))
        if req.max_tokens == 0:  # a warm-up: the prompt is in the cache now; say nothing
            self._finish(rid, index, "limit", "")
            return
        if tok in stream.eog:
            self._end_on_token(rid, index, tok)
            return
        choice.generated += 1
        if choice.generated == 1:
            choice.first_at = (self.clock(), self._tally.steps + 1)  # this step counts
        piece = self.backend.piece(tok, tok in req.preserve)
        if scores is not None:
            scores.add(piece)
        # vLLM's min_tokens: a stop string counts only in a token after the first
        # min_tokens, as the end of sequence does (their draws cannot take it).
        text = choice.text.feed(piece, match=choice.generated > req.sampling.min_tokens)
        stop: StopType | None = "word" if choice.text.stopped else None
        if stop is None and (choice.generated >= req.max_tokens
                             or self._out_of_time(req, choice, piece)):
            text, stop = text + choice.text.flush(), "limit"
        text, dedented = _within_indent(req, choice, text)
        if dedented or stop is not None:
            self._finish(rid, index, stop or "limit", text, choice.text.matched)
        elif text:
            self.events.append(Delta(rid=rid, text=text, index=index,
                                        logprobs=_released(choice, text)))

    def _end_on_token(self, rid: int, index: int, tok: int) -> None:
        """An end-of-generation token, or one of the request's stop tokens (whose text
        ends the answer when the caller wants the stop included)."""
        req = self.streams[rid].request
        choice = self.streams[rid].choices[index]
        reason = tok if tok in req.stop_tokens else None
        text = ""
        if reason is not None and req.include_stop:
            text = choice.text.feed(self.backend.piece(tok, tok in req.preserve))
        # What was held back for a possible stop string or a split character is the
        # end of the answer after all.
        text, _ = _within_indent(req, choice, text + choice.text.flush())
        self._finish(rid, index, "eos", text, reason)

    def _out_of_time(self, req: Request, choice: _Choice, piece: bytes) -> bool:
        """llama.cpp's t_max_predict_ms: a newline made after the time limit ends it."""
        limit = req.max_predict_ms
        return bool(limit) and b"\n" in piece and (
            self.clock() - choice.first_at[0]) * 1000 > limit

    def _finish(self, rid: int, index: int, stop: StopType, text: str,
                reason: str | int | None = None) -> None:
        """Choice ``index`` ended; the request ends with its last choice."""
        stream = self.streams[rid]
        choice = stream.choices[index]
        self.sched.complete(rid, index)
        choice.close()
        self._hold.forget(rid, index)
        if all(c.done for c in stream.choices):
            del self.streams[rid]
        self.events.append(Done(
            rid=rid, index=index, text=text, stop_type=stop,
            prompt_tokens=len(stream.request.prompt), completion_tokens=choice.generated,
            cached_tokens=stream.cached,
            prefill_s=max(0.0, choice.first_at[0] - stream.admitted_at[0]),
            prefill_steps=max(0, choice.first_at[1] - stream.admitted_at[1]),
            decode_s=self.clock() - choice.first_at[0] if choice.generated else 0.0,
            stop_reason=reason, logprobs=_released(choice, text),
        ))

    # --- frames out -----------------------------------------------------------------------

    def statistics(self) -> WorkerStats:
        out = self.sched.statistics()
        out.step_ms = self._step_ms
        self._tally.report(out)
        return out

    def frame(self, now: float, force: bool = False, hold: bool = False) -> fr.Step | None:
        """The ``Step`` frame to send now, if any: the events since the last one, with
        statistics when ``force``d, when something other than tokens happened, or at
        most every fr.STATS_INTERVAL while only tokens flow; with ``hold``, text of
        streams already streaming may wait for the next step's (forged.engine.hold)."""
        if not self.events and not force:
            return None
        if not force and self._hold.holds(self.events, now, hold * self.sched.limits.hold_ms):
            return None
        fresh = (force or now - self._last_stats >= fr.STATS_INTERVAL
                 or any(not isinstance(e, Delta) for e in self.events))
        if fresh:
            self._last_stats = now
        step = fr.Step(events=self.events, stats=self.statistics() if fresh else None,
                       digests=self._due_digests(now))
        self._hold.sent(self.events)
        self.events = []
        return step

    def _due_digests(self, now: float) -> list[int] | None:
        """What the caches hold, for the daemon's routing, when it changed and the last
        report is DIGEST_INTERVAL old."""
        if now - self._last_digests < DIGEST_INTERVAL:
            return None
        self._last_digests = now
        return self._digests.build(
            self.sched.cache.cached_slots(),
            ((e.eid, e.tenant, e.tokens) for e in self.sched.cache.tiers.recent_first()))

    def close(self) -> None:
        for rid in list(self.streams):
            self._close(rid)


def _scores(req: Request, index: int) -> Scores | None:
    """A choice's logprob state, when asked for; the first choice computes the prompt,
    so it scores the prompt."""
    if req.logprobs is None and not req.prompt_logprobs:
        return None
    scored = len(req.prompt) if req.prompt_logprobs and index == 0 else None
    return Scores(req.logprobs or 0, scored)


def _released(choice: _Choice, text: str) -> list[TokenLogprob] | None:
    """The logprob entries that go out with ``text``; None when none were asked for."""
    return None if choice.scores is None else choice.scores.release(text)


def _within_indent(req: Request, choice: _Choice, text: str) -> tuple[str, bool]:
    """``text`` up to where a line starts with less indentation than ``n_indent``
    (spaces and tabs count one each), and whether it was cut there. Like llama.cpp,
    the line of the cursor is never cut; unlike it, the dedented text is never sent."""
    n = req.n_indent
    if not n:
        return text, False
    for i, ch in enumerate(text):
        if ch == "\n":
            choice.indent = 0
        elif choice.indent is not None:
            if ch in " \t":
                choice.indent += 1
            elif choice.indent < n:
                return text[:i], True
            else:
                choice.indent = None
    return text, False
