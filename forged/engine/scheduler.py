"""The sans-IO continuous-batching scheduler.

Theory of operation
-------------------
The scheduler owns no thread, socket or model. The worker feeds it events and runs
what it decides:

* ``submit(rid, req, now)`` queues a request (or refuses it when the queue is full);
* ``drop(rid)`` forgets a queued or running request (its caller left, or it failed);
* ``expire(now)`` drops queued requests whose queue timeout passed;
* ``plan(now)`` admits what fits and returns one :class:`StepPlan`: KV memory
  operations to apply first, then the tokens of one ``llama_decode`` call;
* ``commit(plan, sampled)`` records what that decode wrote and sampled;
* ``complete(rid, index)`` ends one running choice that finished by itself (EOS, stop
  string, length).

Each step's batch is laid out by :mod:`forged.engine.layout`, where a request is
batched: every decoder's next token first, then prompt chunks within the step's time
target, shortest remaining prompt first with aging. There is no batching window: a
request that arrives on an idle worker is planned in the very next step.

Admission knows capacity: a request waits in :mod:`forged.engine.waitqueue` (where a
request waits: its class's queue, shortest first with aging, held while another
computes the prefix it shares). ``submit`` estimates how long it would wait for its
first token (the prompt work ahead of it, at the rate steps leave for prompts, plus
the wait for a slot at the rate slots have been freed) and refuses it at once, with
that estimate, when the estimate is beyond its queue timeout.

Memory: the slots, their cells and the saved states are the slot cache's
(:mod:`forged.engine.slotcache`, where cells are freed), which counts cells exactly. A
request is admitted only when its prompt (less any cached prefix) plus ``max_tokens``
fits beside what the running sequences have reserved (``_make_room``, which asks the
cache to evict idle slots); otherwise it waits, in its class, in the same
shortest-first-with-aging order.

Choices: a request with ``n`` > 1 is admitted as a group, with a slot for each choice
(and, in the unified layout, each choice's decode cells reserved). Only its first
choice, the leader, computes the prompt; the others wait (``Phase.FORK``). The chunk
that ends the prompt samples every choice's first token from the leader's logits, and
``commit`` then copies the prompt's KV into each other choice's sequence (``seq_cp``: a
tag in the unified cache, a stream copy per slot), after which each decodes on its own.
A running sequence is keyed by ``(rid, choice index)``.

Tiers: a slot's cache that is evicted (or cut by more than a few tokens) is saved to
a host-RAM tier first, and a request whose prompt starts with a saved state longer
than any slot's prefix restores it into a free slot (``_admit_restored``). Sessions'
states also go to disk. :mod:`forged.engine.kvtiers` keeps the index (the slot cache
holds it); the worker core moves the bytes. Interactive work that waits for a slot
held by batch work swaps the batch request out to RAM (``_swap_for``).

Sessions: a request may name its conversation (``session``). When it ends, its slot is
pinned to that session for ``session_ttl`` seconds, so the next turn finds its whole
history cached and computes only the new tokens. Pinned slots are evicted only after
every unpinned idle cache, least recently used first; losing one costs the next turn a
recompute, never a wrong answer, because the prompt always carries the full history.
"""

from __future__ import annotations

import msgspec

from forged.engine.costmodel import CostModel
from forged.engine.kvtiers import Entry
from forged.engine.layout import (
    decode_chunks,
    lay_out,
    prompt_room_ms,
    step_shape,
    virtual_start,
)
from forged.engine.limits import SchedulerLimits
from forged.engine.plan import (
    Admission,
    Chunk,
    Expired,
    Key,
    Preempted,
    QueueFull,
    SchedEvent,
    StepPlan,
)
from forged.engine.request import Request
from forged.engine.seqstate import Phase, Queued, Running
from forged.engine.slotcache import SlotCache
from forged.engine.stats import WorkerStats
from forged.engine.waitqueue import WaitQueue


class Scheduler:
    def __init__(self, limits: SchedulerLimits, cost: CostModel | None = None) -> None:
        self.limits = limits
        self.cost = cost or CostModel()
        self.cache = SlotCache(limits)
        self.queue = WaitQueue(limits)
        self._running: dict[Key, Running] = {}
        self._events: list[SchedEvent] = []
        self.cache_queries = 0
        self.cache_hits = 0
        self.cache_tokens_saved = 0
        self.prompt_tokens_computed = 0
        self.micro_batches = 0  # llama.cpp's passes over the weights, all steps
        self.session_resumes = 0
        self.early_rejections = 0
        self.last_plan_ms = 0.0
        self._now = 0.0

    # --- events in ---------------------------------------------------------------

    def submit(self, rid: int, req: Request, now: float) -> None:
        """Queue ``req`` as ``rid``. Raises :class:`QueueFull` when a bound would be passed, or when
        it would wait beyond its queue timeout before its prompt is computed."""
        lim = self.limits
        self.queue.check_room(req)
        self._tick(now)
        if not req.prompt or len(req.prompt) + req.max_tokens > lim.max_context:
            raise ValueError(f"the request is longer than the largest a slot takes "
                             f"({lim.max_context} tokens)")
        most = lim.max_choices(len(req.prompt), req.max_tokens)
        if req.n > most:  # it would wait for room that never comes
            raise ValueError(f"n: at most {most} choices of this request can run at once")
        # Shortest first means least work first: a long prompt the caches serve is short.
        reused = self.cache.reuse(req).cached
        cached, after = self.queue.expected_cached(req, reused, self._prefilling())
        vstart = max(virtual_start(self.limits, now, len(req.prompt) - cached), after)
        wait = self.wait_estimate(req.rank, vstart, req.n)
        if wait > req.queue_timeout:
            self.early_rejections += 1
            raise QueueFull(f"the server is at capacity: this request would wait about "
                            f"{wait:.0f} s before its prompt is computed",
                            wait - req.queue_timeout)
        self.queue.add(Queued(rid, req, now, vstart, now + req.queue_timeout, cached=cached,
                              reused=reused))

    def drop(self, rid: int) -> bool:
        """Forget ``rid`` wherever it is, queued or running, every choice of it: its
        caller left, or it failed. Returns whether it was known."""
        found = self.queue.drop(rid)
        for key in [key for key in self._running if key[0] == rid]:
            self._release(key)
            found = True
        return found

    def complete(self, rid: int, index: int = 0) -> None:
        """Choice ``index`` of ``rid`` finished by itself (EOS, stop string, length). Its
        KV stays as prefix cache unless opted out, and its slot counts towards the pace
        at which slots free up."""
        self.queue.slot_freed()
        self._release((rid, index))

    def _tick(self, now: float) -> None:
        self.queue.tick(now)
        self._now = self.cache.now = now

    def _release(self, key: Key) -> None:
        run = self._running.pop(key)
        self.cache.release(run.slot, run.req)

    def expire(self, now: float) -> list[int]:
        """Drop queued requests whose deadline passed; they are also reported as events."""
        gone: list[int] = []
        for item in self.queue.due(now):
            if item.rid in gone:
                continue  # another of its choices expired already: all are gone
            self.drop(item.rid)
            gone.append(item.rid)
            self._events.append(Expired(item.rid))
        return gone

    def set_limits(self, limits: SchedulerLimits) -> None:
        """Apply reloadable limits; the KV and slot geometry cannot change live."""
        if limits.geometry != self.limits.geometry:
            raise ValueError("kv_cells, slots and kv_layout need a restart")
        self.limits = self.queue.limits = limits
        self.cache.set_limits(limits)

    # --- decisions out -------------------------------------------------------------

    def drain_events(self) -> list[SchedEvent]:
        events, self._events = self._events, []
        return events

    def plan(self, now: float) -> StepPlan | None:
        """Admit what fits, then lay out one decode step. ``None`` when idle."""
        self._tick(now)
        self._admit(now)
        chunks = self._layout()
        while self.cache.overflows(chunks):
            if not self.cache.evict_one_idle() and not self.preempt_one():
                break  # nothing left to give back; llama_decode will say if it fits
            chunks = self._layout()
        ops = self.cache.take_ops()
        if not chunks and not ops:
            return None
        # In slot order: with per-slot streams llama.cpp makes one micro-batch, one pass
        # over the weights, of each run of consecutive sequence ids in batch order
        # (llama_batch_allocr::split_equal, "sequential"). In admission order 16
        # decoders took about 15 passes: 135 ms a step where 83 ms suffice (docs/engine.md).
        chunks.sort(key=lambda c: c.seq)
        shape = step_shape(self.limits, self.cost, chunks, self._running)
        self.last_plan_ms = self.cost.predict(shape) if chunks else 0.0
        if chunks:  # the unified layout's batch is one micro-batch (n_ubatch = n_batch)
            self.micro_batches += shape.chunks + 1 if self.limits.per_slot else 1
        return StepPlan(ops, chunks, shape)

    def observe(self, plan: StepPlan, ms: float) -> None:
        """The worker measured ``plan``'s step: refit the cost model."""
        if plan.chunks:
            self.cost.observe(plan.shape, ms)

    def _layout(self) -> list[Chunk]:
        return lay_out(self.limits, self.cost,
                       decode_chunks(self._running.values(), self.cache.ledger),
                       self._prefilling(), len(self._running), len(self.queue))

    def _swap_for(self, item: Queued) -> bool:
        """Interactive work waits for a slot that batch work holds: swap the batch
        request with the most work left out to the RAM tier. It is queued again and
        resumes from its saved state (its client sees a pause), instead of the
        interactive request waiting for it to end."""
        if item.req.rank != 0 or not self.cache.tiers.ram_bytes or (
                len(self._running) + item.req.n <= self.limits.max_running
                and self.cache.free_slot() is not None):
            return False  # not a shortage of slots (cells: see _make_room, preempt_one)
        batch = [r for r in self._running.values()
                 if r.req.rank > 0 and r.phase is not Phase.FORK]
        if not batch:
            return False
        self._preempt(max(batch, key=lambda r: r.req.max_tokens - r.generated + r.prompt_left))
        self.cache.tiers.stats.swaps += 1
        return True

    def preempt_one(self) -> bool:
        """Give back the cells of the least urgent running request (batch, newest first).

        It is queued again, with everything it has produced so far as its prompt, so it
        resumes exactly where it stopped: vLLM's preemption, by swapping when there is
        a RAM tier (its state is saved on the way out and restored), else by
        recomputing. The caller's stream only pauses. It keeps its place in the aging
        order, and it may wait for a slot again for at most its queue timeout.
        """
        # Choices waiting for their prompt go with their leader, never alone.
        candidates = [r for r in self._running.values() if r.phase is not Phase.FORK]
        if len(candidates) <= 1:
            return False  # alone it must fit: admission checked prompt + max_tokens
        self._preempt(max(candidates, key=lambda r: (r.req.rank, r.admitted_at, r.index)))
        return True

    def _preempt(self, run: Running) -> None:
        """Queue ``run`` again with what it has so far; its slot's state is saved to the
        RAM tier on the way out, when there is one, so it resumes without recomputing."""
        done = self.cache.held(run.slot)
        if run.phase is Phase.DECODE:  # one choice resumes on its own
            again = msgspec.structs.replace(run.req, prompt=[*done, run.last_token], n=1,
                                            max_tokens=max(1, run.req.max_tokens - run.generated))
        else:  # a leader, with the choices that wait for its prompt
            again = msgspec.structs.replace(run.req, n=1 + len(run.forks))
        for index in (run.index, *run.forks):
            self.cache.vacate(self._running.pop((run.rid, index)).slot, run.req)
        # Matched after its state was saved: a swap's resume is a restore, not a prefill.
        reused = self.cache.reuse(again).cached
        cached = self.queue.expected_cached(again, reused, self._prefilling())[0]
        self.queue.add(Queued(run.rid, again, run.submitted_at, run.vstart,
                              self._now + run.req.queue_timeout, run.index, cached=cached,
                              reused=reused))
        self._events.append(Preempted(run.rid))

    def commit(self, plan: StepPlan, sampled: dict[Key, int], now: float) -> None:
        """Record a decode that ran ``plan``: cells written and tokens sampled, by
        sequence; at the end of a shared prompt, the fork into its other choices."""
        for ch in plan.chunks:
            self.cache.record(ch)
            run = self._running[ch.key]
            if run.phase is Phase.PREFILL:
                run.next_prompt += len(ch.tokens)
                self.prompt_tokens_computed += len(ch.tokens)
            if ch.sample:
                run.phase = Phase.DECODE
                run.last_token = sampled[ch.key]
                run.generated += 1
                for index in ch.forks:
                    self._fork(run, self._running[(ch.rid, index)], sampled[(ch.rid, index)])
                run.forks = ()
            self.cache.slots[run.slot].last_used = now

    def _fork(self, leader: Running, run: Running, token: int) -> None:
        """``run`` takes the prompt its leader has just computed (a copy of its KV, made
        before the next decode) and the first token its own sampler drew from the
        leader's logits."""
        self.cache.copy(leader.slot, run.slot, self.cache.ledger.length(leader.slot))
        run.phase, run.next_prompt = Phase.DECODE, len(run.req.prompt)
        run.last_token, run.generated = token, 1

    # --- admission ------------------------------------------------------------------

    def _admit(self, now: float) -> None:
        for items in self.queue.in_order():
            for item in items:
                if (self.queue.hold(item, self._prefilling(), now)
                        or self.cache.staging(item.req)):
                    continue  # it needs no room yet, so it blocks nobody behind it
                while (len(self._running) + item.req.n > self.limits.max_running
                        or not self._try_admit(item, now)):
                    if not self._swap_for(item):
                        return  # it waits for room; nothing behind it may pass meanwhile
                self.queue.remove(item)
                self._events.append(Admission(item.rid,
                                             self._running[(item.rid, item.index)].cached,
                                             now - item.submitted_at))

    def _try_admit(self, item: Queued, now: float) -> bool:
        req = item.req
        reuse = self.cache.reuse(req)
        if reuse.entry is not None:
            return self._admit_restored(item, reuse.entry, reuse.cached, now)
        src, n = reuse.src, reuse.cached
        dst = self.cache.destination(req, src, n)
        if dst is None and src is not None:
            # The prefix is another live session's, in the one idle slot: take a slot
            # as a request sharing nothing would (it waited out the pin: session_ttl).
            src, n, dst = None, 0, self.cache.free_slot()
        if dst is None:
            return False
        forks = self.cache.fork_slots(req.n - 1, dst)
        if forks is None:
            return False
        if dst != src and self.limits.per_slot and n < self.limits.min_copy_tokens:
            src, n = None, 0  # copying a whole stream costs more than a short prefill
        if not self._make_room(req, n, src, dst, forks):
            return False
        own = src is not None and self.cache.slots[src].session == req.session
        self._count_reuse(req, n, own)
        self.cache.place(dst, forks, src, n)
        self._start(item, [dst, *forks], n, now)
        return True

    def _admit_restored(self, item: Queued, entry: Entry, m: int, now: float) -> bool:
        """Admit ``item`` into a free slot that gets ``entry``'s saved state, truncated
        to the ``m`` tokens its prompt shares: a restore instead of a recompute."""
        req = item.req
        dst = self.cache.free_slot()
        forks = None if dst is None else self.cache.fork_slots(req.n - 1, dst)
        # The restored cells are new ones (not shared with a slot): count them all.
        if dst is None or forks is None or not self._make_room(req, 0, None, dst, forks):
            return False
        self._count_reuse(req, m, req.session is not None and entry.session == req.session)
        self.cache.place_restored(dst, forks, entry, m)
        self._start(item, [dst, *forks], m, now)
        return True

    def restore_failed(self, seq: int, counted: bool = True) -> Key | None:
        """The state restored into ``seq`` was refused (a corrupt or stale file), or
        copied from a slot whose was (not ``counted`` again): the request there computes
        its whole prompt instead. Returns its key."""
        self.cache.restore_failed(seq, counted)
        run = next((r for r in self._running.values() if r.slot == seq), None)
        if run is None:
            return None
        self.cache_tokens_saved -= run.cached
        run.next_prompt = run.cached = 0
        self._events = [Admission(ev.rid, 0, ev.queue_time)
                        if isinstance(ev, Admission) and ev.rid == run.rid else ev
                        for ev in self._events]
        return run.key

    def _count_reuse(self, req: Request, n: int, own_session: bool) -> None:
        self.cache_queries += 1
        if n:
            self.cache_hits += 1
            self.cache_tokens_saved += n
            if req.session is not None and own_session:
                self.session_resumes += 1

    def _start(self, item: Queued, slots: list[int], cached: int, now: float) -> None:
        """Run ``item``'s choices in ``slots``: the first computes the prompt, the others
        wait for it."""
        forks = tuple(item.index + j for j in range(1, len(slots)))
        for j, sid in enumerate(slots):
            self.cache.occupy(sid, item.rid, item.req.tenant, now)
            run = Running(item.rid, item.req, sid, now, item.submitted_at, item.vstart,
                           next_prompt=cached, cached=cached, index=item.index + j)
            if j:
                run.phase = Phase.FORK
            else:
                run.forks = forks
            self._running[run.key] = run

    def _reserved(self) -> int:
        """Cells promised to running sequences but not written yet."""
        cap = self.limits.decode_reservation
        return sum(
            max(0, r.reserved_length(cap) - self.cache.ledger.length(r.slot))
            for r in self._running.values()
        )

    def _make_room(self, req: Request, n: int, src: int | None, dst: int,
                   forks: list[int]) -> bool:
        """Evict idle caches, LRU first, until ``req`` fits. False if it cannot yet."""
        if self.limits.per_slot:
            return True  # the slot's own stream holds the request, checked at submit
        # One prompt, and decode cells for each choice.
        need = len(req.prompt) - n + req.n * min(req.max_tokens, self.limits.decode_reservation)
        return self.cache.make_room(need, self._reserved(), src, n, (dst, *forks))

    # --- capacity ---------------------------------------------------------------------

    def wait_estimate(self, rank: int, vstart: float, wanted: int = 1) -> float:
        """Seconds a request of this class and place in the order would wait in the
        queue, which is all its queue timeout bounds: until ``wanted`` slots (its
        choices) are free for it, at the pace slots were freed lately while requests
        waited (``WaitQueue.slot_wait``). An estimate, used only to refuse at once what
        would wait past its queue timeout anyway.

        The prompt work ahead of it is not added, nor taken as a second bound: once
        admitted a request never times out, and the pace of slots already includes
        the prefills of those ahead. Added (until issue 34), a closed loop of twice
        the slots (each caller waiting ~30 s for one request to end) was estimated
        past 60 s and refused thousands of times a minute; as a bound, the door's
        estimate for a short question counted the long prompts prefilling, which a
        short prompt passes (``layout.prefill_sequence``), and refused half of a
        closed loop of 64 requests."""
        short = sum(q.req.n for q in self.queue.ahead(rank, vstart)) + wanted - (
            self.limits.max_running - len(self._running))
        return self.queue.slot_wait(short)

    # --- step layout ---------------------------------------------------------------------

    def _prefilling(self) -> list[Running]:
        return [r for r in self._running.values() if r.phase is Phase.PREFILL]

    # --- introspection ------------------------------------------------------------------

    @property
    def n_queued(self) -> int:
        return len(self.queue)

    @property
    def n_running(self) -> int:
        return len(self._running)

    def is_running(self, rid: int) -> bool:
        return any(key[0] == rid for key in self._running)

    def sequence(self, key: Key) -> Running | None:
        """The running sequence of ``key`` (request id, choice), if it runs: its phase,
        its position, what it has generated."""
        return self._running.get(key)

    def statistics(self) -> WorkerStats:
        active = self._active_cells()
        interactive, batch = (len(q) for q in self.queue.classes)
        out = WorkerStats(
            running=len(self._running), prefilling=len(self._prefilling()),
            queued_interactive=interactive, queued_batch=batch,
            queued_tokens=self.queue.tokens, kv_cells_active=active,
            kv_cells_cached=self.cache.ledger.used - active,
            kv_cells_reserved=self._reserved(), session_resumes=self.session_resumes,
            prefix_cache_queries=self.cache_queries, prefix_cache_hits=self.cache_hits,
            prefix_cache_tokens_saved=self.cache_tokens_saved,
            prompt_tokens_computed=self.prompt_tokens_computed,
            early_rejections=self.early_rejections, prefix_holds=self.queue.prefix_holds,
            wait_estimate_s=self.wait_estimate(0, self._now), step_plan_ms=self.last_plan_ms,
            target_step_ms=min(self.limits.target_step_ms, 1e9),
            step_prompt_room_ms=min(self._prompt_room_ms(), 1e9),
            micro_batches=self.micro_batches,
        )
        self.cost.report(out)
        self.cache.report(out)
        return out

    def _prompt_room_ms(self) -> float:
        return prompt_room_ms(self.limits, self.cost,
                              decode_chunks(self._running.values(), self.cache.ledger),
                              self._prefilling(), len(self.queue))

    def _active_cells(self) -> int:
        """Cells that some running sequence sees (the rest is evictable cache)."""
        return self.cache.ledger.cells_seen_by({r.slot for r in self._running.values()})
