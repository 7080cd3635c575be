"""Where a request's KV cells are freed: the slots, what each holds, and the memory
operations that change them.

A slot is a llama.cpp sequence id. It keeps its KV after its request ends: the idle
slots are the prefix cache. :class:`SlotCache` owns the slots, the exact count of
their cells (:class:`~forged.engine.kvledger.KVLedger`), the index of saved states in
RAM and on disk (:class:`~forged.engine.kvtiers.Tiers`), and the memory operations the
worker applies before the next decode. It is the only code that makes ``SeqRm``,
``SeqCp``, ``SeqSave`` and ``SeqLoad`` (the structure test checks), so every way a
cell is freed is here: :meth:`SlotCache.evict` (a slot emptied: its request opted out
of caching, was preempted, or its cache was the least recently used when room was
needed) and :meth:`SlotCache.truncate` (a slot cut to the prefix its next request
shares).

A new request reuses the longest cached prefix of any slot, running or idle, through
``seq_cp`` (unified KV makes that free), and idle slots are evicted least recently
used when cells or slots are needed. An idle slot is taken over in place (truncated
after the shared prefix) only when that loses less than half of what is reused (a
conversation's next turn, an editor's next keystroke); a request that shares only a
header with it (another editor on the same repository) copies the prefix into a free
slot instead, so that the other's cache survives (:meth:`SlotCache.destination`).
A slot pinned to a live session is evicted only after every unpinned idle cache.

What it does not decide: which request runs, waits or is preempted. That is the
scheduler's (:mod:`forged.engine.scheduler`), which asks this cache for slots and room.

Sans-IO: plain values in, memory operations out.
"""

from __future__ import annotations

import copy

from forged.engine.kvledger import KVLedger
from forged.engine.kvtiers import MIN_SAVED_TOKENS, Entry, Tiers, common_prefix
from forged.engine.limits import SchedulerLimits
from forged.engine.plan import Chunk, MemOp, SeqCp, SeqLoad, SeqRm, SeqSave
from forged.engine.request import Request
from forged.engine.seqstate import Reuse, Slot
from forged.engine.stats import WorkerStats


def shared_prefix(req: Request, tenant: str, tokens: list[int]) -> int:
    """How much of ``req``'s prompt ``tenant``'s ``tokens`` (a slot's, or a prompt
    being computed) may serve: their common prefix, leaving one token to compute."""
    if tenant != req.tenant or req.prompt_logprobs:
        # Another tenant's prompt is never reused, never revealed; and a scored
        # prompt needs logits that the cache's positions did not keep.
        return 0
    # The last prompt token must run to give logits.
    return min(common_prefix(tokens, req.prompt), len(req.prompt) - 1)


class SlotCache:
    def __init__(self, limits: SchedulerLimits) -> None:
        self.limits = limits
        self.ledger = KVLedger()
        self.tiers = Tiers(limits.cache_ram_bytes, limits.cache_disk_bytes)
        self.slots = [Slot(sid) for sid in range(limits.slots)]
        self.ops: list[MemOp] = []
        # The scheduler's clock at its last event: a session's pin expires by it.
        self.now = 0.0

    def set_limits(self, limits: SchedulerLimits) -> None:
        self.limits = limits
        self.ops.extend(self.tiers.set_budgets(limits.cache_ram_bytes,
                                               limits.cache_disk_bytes))

    def take_ops(self) -> list[MemOp]:
        """The memory operations to apply before the next decode, in order."""
        ops, self.ops = self.ops, []
        return ops

    # --- a slot's life ------------------------------------------------------------------

    def occupy(self, sid: int, rid: int, tenant: str, now: float) -> None:
        slot = self.slots[sid]
        slot.rid, slot.last_used, slot.tenant = rid, now, tenant

    def release(self, sid: int, req: Request) -> None:
        """``req`` left slot ``sid``: what it holds stays as cache unless ``req`` opted
        out, pinned to ``req``'s session if it names one."""
        slot = self.slots[sid]
        slot.rid = None
        if not req.cache:
            self.evict(slot, keep=False)
            return
        if req.session is not None:
            # Only the latest turn is pinned; an earlier one is ordinary cache now.
            for other in self.slots:
                if other.session == req.session:
                    other.session = None
        # What the slot holds is ``req``'s now: a request that took over an expired
        # session's slot in place left it pinned to that session, for session_ttl more.
        slot.session = req.session

    def vacate(self, sid: int, req: Request) -> None:
        """``req`` was preempted: empty the slot, saving its state first unless ``req``
        opted out of caching (its state was saved, never restored, since a request
        that opts out restores nothing, and stayed for others of its tenant to reuse)."""
        slot = self.slots[sid]
        slot.rid = None
        self.evict(slot, keep=req.cache)

    def held(self, sid: int) -> list[int]:
        """The tokens whose cells slot ``sid`` holds."""
        return self.slots[sid].tokens[: self.ledger.length(sid)]

    def record(self, ch: Chunk) -> None:
        """A decode wrote ``ch``'s cells."""
        self.ledger.extend(ch.seq, len(ch.tokens))
        self.slots[ch.seq].tokens.extend(ch.tokens)

    def copy(self, src: int, dst: int, n: int) -> None:
        """Give the empty slot ``dst`` the first ``n`` positions of ``src``."""
        if self.limits.per_slot:
            self.ops.append(SeqCp(src, dst, n, whole=True))
            self.ledger.extend(dst, n)  # a copy: new cells in dst's own stream
        else:
            self.ops.append(SeqCp(src, dst, n))
            self.ledger.share(src, dst, n)
        self.slots[dst].tokens = self.slots[src].tokens[:n]
        self.slots[dst].last_used = self.slots[src].last_used

    def place(self, dst: int, forks: list[int], src: int | None, n: int) -> None:
        """Prepare the slots of a request admitted into ``dst`` (its other choices in
        ``forks``) that reuses ``n`` tokens of ``src``: in place (``dst`` is ``src``,
        cut to them) or copied into the emptied ``dst``."""
        if dst == src:
            self.truncate(self.slots[dst], n)
        else:
            self.evict(self.slots[dst])
            if src is not None and n:
                self.copy(src, dst, n)
        for sid in forks:  # after the copy: a fork may take the source's slot
            self.evict(self.slots[sid])

    def place_restored(self, dst: int, forks: list[int], entry: Entry, m: int) -> None:
        """As :meth:`place`, for a request that restores ``m`` tokens of ``entry``."""
        # A long tail the prompt does not share stays saved; otherwise the entry leaves
        # the index first, so that saving what the slots held cannot drop it.
        keep = len(entry.tokens) - m >= MIN_SAVED_TOKENS
        self.tiers.take(entry, keep)
        self.tiers.stats.restored_tokens += m
        for sid in (dst, *forks):
            self.evict(self.slots[sid])
        self._restore(dst, entry, m, keep)

    def _restore(self, dst: int, entry: Entry, m: int, keep: bool) -> None:
        """Load ``entry``'s saved state into the empty slot ``dst``, cut to the ``m``
        tokens its request shares; ``keep``: the entry stays saved."""
        slot = self.slots[dst]
        self.ops.append(SeqLoad(dst, entry, keep))
        self.ledger.extend(dst, len(entry.tokens))
        slot.tokens = list(entry.tokens)
        self.truncate(slot, m, keep=False)

    def restore_failed(self, seq: int, counted: bool = True) -> None:
        """The state restored into ``seq`` was refused: the slot is empty."""
        self.tiers.stats.restore_failures += counted
        self.ledger.clear(seq)
        self.slots[seq].tokens = []

    def save(self, slot: Slot) -> None:
        """Save ``slot``'s state to the RAM tier, if that is worth it."""
        if self.tiers.worth_saving(slot.tokens, slot.session):
            entry, ops = self.tiers.save(slot.tokens, slot.tenant, slot.session)
            self.ops.extend(ops)
            self.ops.append(SeqSave(slot.sid, entry.eid))

    def evict(self, slot: Slot, keep: bool = True) -> None:
        """Empty ``slot``; with ``keep``, its state goes to the RAM tier first."""
        if keep:
            self.save(slot)
        if slot.tokens or self.ledger.length(slot.sid):
            self.ops.append(SeqRm(slot.sid, 0))
            self.ledger.clear(slot.sid)
        slot.tokens = []
        slot.session = None

    def truncate(self, slot: Slot, n: int, keep: bool = True) -> None:
        """Cut ``slot`` to ``n`` tokens; with ``keep``, a tail worth saving is saved
        (with what precedes it) to the RAM tier first."""
        if keep and len(slot.tokens) - n >= MIN_SAVED_TOKENS:
            self.save(slot)
        if len(slot.tokens) > n:
            self.ops.append(SeqRm(slot.sid, n))
            self.ledger.truncate(slot.sid, n)
            del slot.tokens[n:]

    def unpin(self, session: str) -> None:
        """``session``'s conversation is gone: its idle slot is ordinary cache now (a
        turn of it running pins its slot again when it ends)."""
        for slot in self.slots:
            if slot.session == session and slot.rid is None:
                slot.session = None

    def save_sessions(self) -> list[MemOp]:
        """Before the worker exits: save every idle session's state (to be written to
        disk with the RAM tier's), keeping the slots as they are."""
        for slot in self.slots:
            if slot.rid is None and slot.session is not None and self.tiers.worth_saving(
                    slot.tokens, slot.session):
                entry, dropped = self.tiers.save(slot.tokens, slot.tenant, slot.session)
                self.ops.extend([*dropped, SeqSave(slot.sid, entry.eid)])
        return self.take_ops()

    # --- which slot ---------------------------------------------------------------------

    def pinned(self, slot: Slot) -> bool:
        return slot.session is not None and (
            self.now - slot.last_used < self.limits.session_ttl)

    def eviction_order(self, slot: Slot) -> tuple[bool, float]:
        """Idle caches go before pinned sessions, each least recently used first."""
        return self.pinned(slot), slot.last_used

    def evict_one_idle(self) -> bool:
        idle = [s for s in self.slots if s.rid is None and s.tokens]
        if not idle:
            return False
        self.evict(min(idle, key=self.eviction_order))
        return True

    def free_slot(self, *keep: int | None) -> int | None:
        """The slot a request takes when no cache says which (none of ``keep``): an
        unpinned one before a live session's, an empty one before a cache, and among
        those the one beside running slots, then the least recently used.

        Beside, because with per-slot streams llama.cpp computes a step in one pass
        over the weights per run of consecutive sequence ids
        (:func:`forged.engine.costmodel.micro_batches`): 8 decoders scattered over 16
        slots can take 8 passes where one would do, for every step of their lives. So
        among idle caches, one beside the running slots goes first even if it is
        more recent (its state goes to the RAM tier as any evicted cache does). The
        unified layout has no such runs."""
        idle = [s for s in self.slots if s.rid is None and s.sid not in keep]
        if not idle:
            return None
        return min(idle, key=self._placement_order).sid

    def _placement_order(self, slot: Slot) -> tuple[bool, bool, int, float]:
        if self.pinned(slot):  # live sessions: least recently used first, nothing else
            return True, True, 0, slot.last_used
        return False, bool(slot.tokens), self._new_runs(slot.sid), (
            slot.last_used if slot.tokens else 0.0)

    def _new_runs(self, sid: int) -> int:
        """How many more runs of consecutive running slots there are once ``sid``
        runs: -1 if it joins two, 0 if it extends one, 1 if it stands alone. The
        unified layout's batch is one micro-batch wherever its sequences are: 0."""
        if not self.limits.per_slot:
            return 0
        return 1 - sum(0 <= i < len(self.slots) and self.slots[i].rid is not None
                       for i in (sid - 1, sid + 1))

    def fork_slots(self, count: int, dst: int) -> list[int] | None:
        """Slots for a request's other choices (idle ones, empty first), or None."""
        out: list[int] = []
        for _ in range(count):
            sid = self.free_slot(dst, *out)
            if sid is None:
                return None
            out.append(sid)
        return out

    def reusable(self, slot: Slot, req: Request) -> bool:
        """May ``req`` take over ``slot`` in place (truncating what it does not share)?
        Not while it runs, nor while it holds another live session's conversation."""
        return slot.rid is None and (not self.pinned(slot) or slot.session == req.session)

    def destination(self, req: Request, src: int | None, n: int) -> int | None:
        """The slot ``req`` runs in. The slot holding its longest prefix, in place, when
        that keeps most of what the slot holds (the same conversation, the same editor
        a keystroke later): truncating it loses less than half of what it reuses.
        Otherwise a free slot, with the prefix copied, so that the cache of whoever
        shared only a header with ``req`` (another editor on the same repository, a
        chat with the same system prompt) survives; unless that would throw away more
        cache than truncating, or a pinned session's."""
        reusable = src is not None and self.reusable(self.slots[src], req)
        if src is None or not reusable:
            return self.free_slot(src)
        lost = len(self.slots[src].tokens) - n
        free = self.free_slot(src) if 2 * lost > n else None
        if free is None or self.pinned(self.slots[free]) or (
                lost <= len(self.slots[free].tokens)):
            return src  # a live session's cache weighs more than any tail
        return free

    # --- what a prompt finds ------------------------------------------------------------

    def best_prefix(self, req: Request) -> tuple[int | None, int]:
        """The slot of ``req``'s tenant sharing the longest prefix with its prompt,
        leaving one token to compute."""
        best, best_key = None, (0, False, False)
        for slot in self.slots:
            # On equal length the caller's own session wins, then an idle slot: it is
            # reused in place, with no copy.
            key = (shared_prefix(req, slot.tenant, slot.tokens),
                   req.session is not None and slot.session == req.session, slot.rid is None)
            if key[0] and key > best_key:
                best, best_key = slot.sid, key
        return best, best_key[0]

    def best_saved(self, req: Request) -> tuple[Entry | None, int]:
        """The saved state (RAM or disk) sharing the longest prefix with ``req``."""
        if req.prompt_logprobs or not req.cache:
            return None, 0
        return self.tiers.longest(req.tenant, req.prompt, len(req.prompt) - 1)

    def reuse(self, req: Request) -> Reuse:
        """What admission would reuse for ``req`` now: the longest prefix a slot holds,
        or a saved state's when that is longer by at least ``min_copy_tokens`` (a
        restore costs a copy). The one match that both admission and the wait
        estimate (``Scheduler._expected_cached``) make."""
        src, n = self.best_prefix(req)
        entry, m = self.best_saved(req)
        if entry is not None and m >= n + self.limits.min_copy_tokens:
            return Reuse(None, entry, m)
        return Reuse(src, None, n)

    def staging(self, req: Request) -> bool:
        """Whether ``req`` waits this step for the saved state it would restore to be
        read from disk (``Stage``, beside the decode loop): no step waits on the disk.
        With nothing on disk (the usual case), no match is made here: admission makes
        it, once."""
        if not self.tiers.on_disk:
            return False
        entry = self.reuse(req).entry
        if entry is None or self.tiers.ready(entry):
            return False
        if (op := self.tiers.stage(entry)) is not None:
            self.ops.append(op)
        return True

    # --- cells --------------------------------------------------------------------------

    def overflows(self, chunks: list[Chunk]) -> bool:
        """Whether writing ``chunks`` would pass the unified cache's cells."""
        lim = self.limits
        if lim.per_slot:
            return False  # every sequence fits its own stream, checked at submit
        growth = sum(len(c.tokens) for c in chunks)
        return self.ledger.used + growth > lim.kv_cells - lim.kv_headroom

    def make_room(self, need: int, reserved: int, src: int | None, n: int,
                  taken: tuple[int, ...]) -> bool:
        """Evict idle caches, LRU first, until ``need`` cells are free beside the
        ``reserved`` ones, once the slots ``taken`` are prepared for a request that
        takes ``n`` tokens of its prompt from ``src``. False if they cannot be yet.

        The evictions are tried on a copy of the ledger first: evicting caches (pinned
        sessions among them) that would still not admit the request would throw them
        away for nothing, and again at every step while the request waits. Unified
        layout only: in the per-slot one a slot's own stream holds its request.
        """
        if self._free_cells(self.ledger, reserved, src, taken, n) >= need:
            return True
        victims = sorted(
            (s for s in self.slots if s.rid is None and s.sid not in (src, *taken)
             and s.tokens),
            key=self.eviction_order,
        )
        trial, count = copy.deepcopy(self.ledger), 0
        while self._free_cells(trial, reserved, src, taken, n) < need:
            if count == len(victims):
                return False
            trial.clear(victims[count].sid)
            count += 1
        for victim in victims[:count]:
            self.evict(victim)
        return True

    def _free_cells(self, ledger: KVLedger, reserved: int, src: int | None,
                    slots: tuple[int, ...], n: int) -> int:
        """Cells left for a new request once ``slots`` are prepared for it, ``n`` tokens
        of its prompt coming from ``src``."""
        lim = self.limits
        released = 0
        for sid in slots:
            cells = ledger.private_cells(sid)
            # Truncating (or evicting after the copy) keeps the shared prefix; only what
            # lies beyond ``n`` goes.
            released += max(0, cells - n) if sid == src else cells
        return lim.kv_cells - lim.kv_headroom - ledger.used - reserved + released

    # --- introspection ------------------------------------------------------------------

    def cached_slots(self) -> list[tuple[str, list[int]]]:
        """What each slot holds (tenant, tokens), most recently used first: the prefix
        cache, and the running sequences' prompts so far."""
        held = sorted((s for s in self.slots if s.tokens), key=lambda s: -s.last_used)
        return [(s.tenant, s.tokens) for s in held]

    def report(self, out: WorkerStats) -> None:
        """Its fields of the worker's statistics, and its tiers'."""
        out.kv_cells_total = self.limits.kv_cells
        out.kv_cells_used = self.ledger.used
        out.slots_idle_cached = sum(1 for s in self.slots if s.rid is None and s.tokens)
        out.sessions_pinned = sum(1 for s in self.slots if s.rid is None and self.pinned(s))
        self.tiers.report(out)
