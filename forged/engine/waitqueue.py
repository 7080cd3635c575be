"""Where a request waits: the admission queue, one per class, and what it knows of the
wait.

A queued request waits in its class (interactive before batch), in shortest-first
order with aging (its virtual start, :func:`forged.engine.layout.virtual_start`). A
queued prompt's work is only what the caches will not serve (``Queued.to_compute``):
the prefix that admission would take from a slot or a saved state, or that a request
running or queued before it computes, is matched once, when it is queued
(:meth:`WaitQueue.expected_cached`), and the same figure places it in the order.

A prefix is computed once: a queued request whose prompt shares a long prefix (at
least ``min_copy_tokens`` more than the caches hold) with a request of its class or a
more urgent one that is still prefilling that prefix is held in the queue, without
blocking those behind it, until that prefix is computed (:meth:`WaitQueue.holder`).

The queue also keeps the pace at which slots free up while requests wait, which the
scheduler's wait estimate uses to refuse at once what would wait past its timeout.

Sans-IO: the scheduler (:mod:`forged.engine.scheduler`) adds, admits, drops and
expires; nothing here runs a request.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator

from forged.config import PRIORITIES
from forged.engine.limits import SchedulerLimits
from forged.engine.plan import QueueFull
from forged.engine.request import Request
from forged.engine.seqstate import Queued, Running
from forged.engine.slotcache import shared_prefix

# Slot frees remembered to estimate how fast slots turn over while requests wait.
_FINISH_WINDOW = 16


class WaitQueue:
    def __init__(self, limits: SchedulerLimits) -> None:
        self.limits = limits
        self.classes: tuple[list[Queued], ...] = tuple([] for _ in PRIORITIES)
        self.tokens = 0  # prompt tokens queued
        # The pace of slot turnover, measured only while requests wait for one: when
        # nobody waits, slots free up at the pace requests arrive, which says nothing
        # about capacity. ``waiting_clock`` counts seconds spent with a queue.
        self.waiting_clock = 0.0
        self.finished_at: deque[float] = deque(maxlen=_FINISH_WINDOW)
        self._now = 0.0
        self.prefix_holds = 0

    def __len__(self) -> int:
        return sum(len(q) for q in self.classes)

    def check_room(self, req: Request) -> None:
        """Raise :class:`QueueFull` if queuing ``req`` would pass a bound."""
        if len(self) >= self.limits.max_queued or (
                len(self) and self.tokens + len(req.prompt) > self.limits.max_queued_tokens):
            raise QueueFull

    def add(self, item: Queued) -> None:
        self.classes[item.req.rank].append(item)
        self.tokens += len(item.req.prompt)

    def remove(self, item: Queued) -> None:
        self.classes[item.req.rank].remove(item)
        self.tokens -= len(item.req.prompt)

    def drop(self, rid: int) -> bool:
        """Forget every queued choice of ``rid``; whether there was one."""
        gone = [item for q in self.classes for item in q if item.rid == rid]
        for item in gone:
            self.remove(item)
        return bool(gone)

    def due(self, now: float) -> list[Queued]:
        """The queued requests whose deadline passed."""
        return [item for q in self.classes for item in q if item.deadline <= now]

    def in_order(self) -> Iterator[list[Queued]]:
        """Each class's requests in admission order, the most urgent class first."""
        for q in self.classes:
            yield sorted(q, key=lambda it: (it.vstart, it.submitted_at))

    # --- the pace of slots --------------------------------------------------------------

    def tick(self, now: float) -> None:
        if len(self) and now > self._now:
            self.waiting_clock += now - self._now
        self._now = now

    def slot_freed(self) -> None:
        """A running request ended by itself: its slot counts towards the pace at which
        slots free up, if someone waits for one."""
        if len(self):
            self.finished_at.append(self.waiting_clock)

    def slot_wait(self, short: int) -> float:
        """Seconds until ``short`` more slots are free, at the pace slots were freed
        lately while requests waited (0 while that pace is unknown: no evidence is no
        reason to refuse). The pace slows by itself while waiting requests see no slot
        free."""
        if short <= 0 or len(self.finished_at) < 2:
            return 0.0
        span = self.waiting_clock - self.finished_at[0]
        return short * span / len(self.finished_at) if span > 0 else 0.0

    def ahead(self, rank: int, vstart: float) -> list[Queued]:
        """The queued requests a request of class ``rank`` at ``vstart`` waits behind."""
        return [q for cls, queue in enumerate(self.classes) for q in queue
                if cls < rank or (cls == rank and q.vstart <= vstart)]

    # --- prefixes computed once ---------------------------------------------------------

    def expected_cached(self, req: Request, reused: int, prefilling: list[Running]
                        ) -> tuple[int, float]:
        """Prompt tokens ``req`` should not compute itself, and the place in the aging
        order it must not pass: the prefix the caches would serve it now (``reused``,
        from ``SlotCache.reuse``), or a longer one (by ``min_copy_tokens``) that a
        request of its class or a more urgent one is computing (``prefilling``) or is
        queued to compute. ``hold`` makes it wait for that one and copy; so it is
        ordered after that one too, or it could jump ahead as a short prompt and then
        compute the long prefix.

        Matched once, when it is queued, and not refreshed: the estimate sums every
        queued request at each submit and each ``statistics()`` (up to max_queued of
        them), and a match is a pass over the slots, the saved states and the queue.
        Slots change at every step, so a cached match would be invalid at every step
        anyway. Staleness errs both ways (a cache evicted after it was queued, one
        computed since) and is bounded: the queue timeout still expires what waits
        too long, and admission matches afresh. In the per-slot layout a slot prefix
        under ``min_copy_tokens`` may be recomputed after all (``_try_admit``); the
        estimate is then off by less than that.
        """
        best, after = reused, -math.inf
        pending = [(r.req, r.vstart) for r in prefilling]
        # A queued request that computes less than a copy's worth itself can give no
        # more: what the caches serve it, they serve ``req`` too, and what it copies
        # from another, ``req`` finds in that other. Skipping those keeps a queue of
        # requests on cached contexts from costing a full match each.
        pending += [(q.req, q.vstart) for queue in self.classes for q in queue
                    if q.to_compute >= self.limits.min_copy_tokens]
        for other, vstart in pending:
            n = computed_for(req, other)
            if n > best and n >= reused + self.limits.min_copy_tokens:
                # Strictly after: on a tie the queue's order would not say who computes.
                best, after = n, math.nextafter(vstart, math.inf)
        return best, after

    def hold(self, item: Queued, prefilling: list[Running], now: float) -> bool:
        """Whether ``item`` waits in the queue, this step, for ``holder`` to compute
        the prefix it shares. Such a wait is for work done on its behalf, not for
        capacity: its queue timeout starts again (as a preempted request's does), so
        it cannot expire for having been held."""
        if self.holder(item, prefilling) is None:
            return False
        if not item.held:
            item.held = True
            self.prefix_holds += 1
        item.deadline = max(item.deadline, now + item.req.queue_timeout)
        return True

    def holder(self, item: Queued, prefilling: list[Running]) -> Running | None:
        """The running request computing a prefix of ``item``'s prompt that ``item``
        should wait for, to copy it once computed, rather than compute it a second
        time in parallel (what vLLM and SGLang do for in-flight prefixes).

        Only while that request has not yet passed the shared part (it then holds it
        in its slot, and admission copies it from there), only when the prefix gives
        at least ``min_copy_tokens`` more than the caches give now, and only behind a
        request of the same class or a more urgent one. Batch prefill yields every
        step to interactive prompts, so an interactive request held behind it could
        wait as long as the interactive load lasts: it computes the prefix itself
        instead. Behind its own class the wait is bounded: the holder runs, and the
        aging order gives it each step's room once it is the oldest. A holder that is
        cancelled or preempted stops prefilling, which ends the hold: the request is
        then admitted on whatever the caches hold.

        What the caches give is the match made when ``item`` was queued (``reused``)
        or what the running requests have computed of its prefix so far, not a fresh
        ``SlotCache.reuse``: that is a pass over every slot and saved state, for every
        held request at every step. A cache that appeared since can only make it wait
        for what it would have had at once (then admission matches afresh and takes
        the best); one that went since can only make it compute a prefix itself, as
        it did before holds existed.
        """
        best, best_n, done = None, 0, item.reused
        for run in prefilling:
            n = computed_for(item.req, run.req) if run.rid != item.rid else 0
            done = max(done, min(n, run.next_prompt))  # in that run's slot already
            if n > max(run.next_prompt, best_n):
                best, best_n = run, n
        if best is None or best_n < done + self.limits.min_copy_tokens:
            return None
        return best


def computed_for(req: Request, other: Request) -> int:
    """How much of ``req``'s prompt ``other`` computes that ``req`` may wait for: not
    behind a less urgent class (``WaitQueue.holder`` says why), nor behind a request
    that keeps no cache (it may drop its cells in the step it passes the prefix)."""
    if other.rank > req.rank or not other.cache:
        return 0
    return shared_prefix(req, other.tenant, other.prompt)
