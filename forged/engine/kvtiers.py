"""What the worker keeps of evicted KV beyond its slots: a host-RAM tier and a disk tier.

Sans-IO. :class:`Tiers` is the index the scheduler consults: for each saved sequence
state, whose it is (tenant, session), which tokens it holds, how many bytes it takes
and where it lives. The bytes themselves are the worker core's (RAM) and its disk
store's (files); the index tells them what to keep, move or drop, as :data:`TierOp`
decisions, and it never holds a blob.

- A slot's cache that is evicted is *saved* to RAM first (``SeqSave``), unless it is
  too short to be worth it. Entries that the new one extends (an earlier turn of the
  same conversation, the same file a keystroke ago) are dropped: the longer one
  serves every prompt they served.
- A request whose prompt starts with a saved entry's tokens *restores* it into a slot
  (``SeqLoad``) instead of recomputing it, when that beats what the slots hold. The
  entry leaves the index: the slot now holds it, and saves it again when evicted.
- RAM is bounded by ``ram_bytes``. What leaves first is the least recently used entry
  of the tenant that holds the most bytes in the tier: tenants share each tier fairly,
  and one tenant's flood of sessions evicts its own entries before anyone else's. A
  session's entry that leaves RAM goes to disk (``Demote``) when there is a disk tier;
  anything else is dropped. Disk is bounded by ``disk_bytes`` the same way.
- A disk entry is *staged* before it is restored: its file is read (and its hash
  checked) beside the decode loop (``Stage``), and the request waits in the queue
  meanwhile, so that no step waits on the disk. At most ``MAX_STAGED`` are staged at
  once: each is a state held in memory.
- Entries are matched only within a tenant: a cache is never used across tenants.
  Across models, the disk store refuses files of another model when it indexes them.
"""

from __future__ import annotations

import bisect
import enum
import itertools
import math
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from forged.engine.stats import WorkerStats

# A state shorter than this is not saved: recomputing it costs about as much as the
# copy, and every entry is one more prefix to compare at admission.
MIN_SAVED_TOKENS = 32


class Tier(enum.Enum):
    RAM = "ram"
    DISK = "disk"


@dataclass
class Entry:
    eid: int
    tokens: list[int]
    tenant: str
    session: str | None
    tier: Tier = Tier.RAM
    nbytes: int = 0  # known once saved (RAM) or from the file (disk)
    key: str = ""  # the disk store's name for it, once written


@dataclass(frozen=True)
class Drop:
    """Forget ``entry``'s bytes in ``tier``."""

    entry: Entry
    tier: Tier


@dataclass(frozen=True)
class Demote:
    """Write ``entry``'s RAM bytes to disk, then free them."""

    entry: Entry


@dataclass(frozen=True)
class Stage:
    """Read ``entry``'s file into memory ahead of its restore, beside the decode loop."""

    entry: Entry


TierOp = Drop | Demote | Stage
# Disk entries staged (read into memory, or being read) at most at once.
MAX_STAGED = 4


@dataclass(frozen=True)
class Written:
    """A disk write handed to a writer beside the decode loop has ended: as file
    ``key`` of ``nbytes`` bytes, or failed (``key`` empty)."""

    entry: Entry
    key: str
    nbytes: int


@dataclass(frozen=True)
class Read:
    """A staging read has ended: ``state`` is the entry's checked bytes, or None (the
    file was missing, damaged or stale, and is gone)."""

    entry: Entry
    state: bytearray | None


class DiskTier(Protocol):
    """Where sessions' saved states go when they leave RAM (forged.engine.kvdisk)."""

    def write(self, entry: Entry, state: bytearray) -> tuple[str, int] | None:
        """Store ``state`` now: the file's key and size; None if it failed."""

    def write_later(self, entry: Entry, state: bytearray) -> bool:
        """Hand ``state`` to a writer beside the decode loop; False if it is busy."""

    def read_later(self, entry: Entry) -> bool:
        """Read ``entry`` beside the decode loop (as ``read``); False if it is busy."""

    def finished(self) -> list[Written | Read]:
        """The writes and reads handed over that have ended since the last call."""

    def wait_done(self, timeout: float) -> None:
        """Until one handed over has ended, or ``timeout`` seconds."""

    def wait_writes(self) -> None: ...

    def remove_key(self, key: str) -> None: ...

    def read(self, entry: Entry) -> bytearray | None:
        """``entry``'s state, checked against its model and tokens; None (the file
        dropped, with a log line) when it is missing, corrupt or stale."""

    def remove(self, entry: Entry) -> None: ...

    def order(self, entries: Iterable[Entry]) -> None:
        """Give the files of ``entries`` (least recently used first) times in that
        order, so that the next start's index has the same order."""


@dataclass
class TierStats:
    saves: int = 0
    restores_ram: int = 0
    restores_disk: int = 0
    restored_tokens: int = 0
    restore_failures: int = 0
    demotions: int = 0
    drops: int = 0
    swaps: int = 0


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix, comparing slices in C: 256 tokens, then twice as
    many each time they match, then halving the slice that differs. The scheduler
    matches every request it queues against the slots, the saved states and the queue
    (``Scheduler._expected_cached``), so a pair costs a few slice compares, whether
    they share a long context or only a header (a chat template, a repository's
    name), which token by token cost a Python loop over the header."""
    n = min(len(a), len(b))
    lo, step = 0, 256
    while lo < n:
        hi = min(n, lo + step)
        if a[lo:hi] != b[lo:hi]:
            while hi - lo > 1:  # a[:lo] == b[:lo] and a[lo:hi] != b[lo:hi]
                mid = (lo + hi) // 2
                if a[lo:mid] == b[lo:mid]:
                    lo = mid
                else:
                    hi = mid
            return lo
        lo, step = hi, 2 * step
    return n


class PrefixIndex:
    """Each tenant's entries in the lexicographic order of their tokens, so that a
    match costs a few binary searches and slice compares, not one compare per entry.
    The default RAM tier holds about 1,800 states of SmolLM2; scanning them all cost
    about 4 ms a match (the scheduler makes two a request, plus one a save) while the
    worker decoded nothing (docs/benchmarks.md: "A match beside thousands of saved
    states").

    Two facts of that order carry it. The entry sharing the longest prefix with a
    prompt is one of the prompt's two neighbours, and those sharing as much lie
    around them. Every entry between a prefix of the prompt and the prompt itself
    extends that prefix, so the prefixes are found by jumping, not by walking."""

    def __init__(self) -> None:
        # (tokens, eid, entry): the eid makes equal token lists distinct and ordered.
        self._sorted: dict[str, list[tuple[list[int], int, Entry]]] = {}
        self._sessions: dict[tuple[str, str], dict[int, Entry]] = {}

    def add(self, e: Entry) -> None:
        bisect.insort(self._sorted.setdefault(e.tenant, []), (e.tokens, e.eid, e))
        if e.session is not None:
            self._sessions.setdefault((e.tenant, e.session), {})[e.eid] = e

    def remove(self, e: Entry) -> None:
        keys = self._sorted[e.tenant]
        at = bisect.bisect_left(keys, (e.tokens, e.eid))
        if at == len(keys) or keys[at][1] != e.eid:
            raise KeyError(e.eid)  # never: every entry of the tiers is indexed once
        del keys[at]
        if not keys:
            del self._sorted[e.tenant]
        if e.session is not None:
            same = self._sessions[(e.tenant, e.session)]
            del same[e.eid]
            if not same:
                del self._sessions[(e.tenant, e.session)]

    def of_session(self, tenant: str, session: str) -> list[Entry]:
        return list(self._sessions.get((tenant, session), {}).values())

    def longest(self, tenant: str, prompt: list[int], limit: int) -> tuple[Entry | None, int]:
        """An entry sharing the most of ``prompt``'s first ``limit`` tokens, and how
        many; of those, one in RAM if any is."""
        keys = self._sorted.get(tenant, [])
        at = bisect.bisect_left(keys, (prompt,))

        def shared(j: int) -> int:
            return min(common_prefix(keys[j][0], prompt), limit)

        best = max((shared(j) for j in (at - 1, at) if 0 <= j < len(keys)), default=0)
        if best <= 0:
            return None, 0
        found: Entry | None = None
        for side in (range(at - 1, -1, -1), range(at, len(keys))):
            for j in side:
                if shared(j) < best:
                    break
                entry = keys[j][2]
                if entry.tier is Tier.RAM:
                    return entry, best
                if found is None:
                    found = entry
        return found, best

    def prefixes(self, tenant: str, tokens: list[int]) -> list[Entry]:
        """The entries whose tokens begin ``tokens`` (equal ones included)."""
        keys = self._sorted.get(tenant, [])
        at = bisect.bisect_left(keys, (tokens,))
        out = [k[2] for k in itertools.takewhile(lambda k: k[0] == tokens,
                                                 itertools.islice(keys, at, None))]
        j = at - 1
        while j >= 0:
            have = keys[j][0]
            n = common_prefix(have, tokens)
            if n == len(have):
                out.append(keys[j][2])
                j -= 1
            elif n == 0:
                break
            else:  # keys[j] extends tokens[:n]: the next prefix is at most that long
                j = bisect.bisect_right(keys, (tokens[:n], math.inf), 0, j) - 1
        return out


@dataclass
class Tiers:
    ram_bytes: int = 0
    disk_bytes: int = 0
    # Least recently used first, per tier; and per tier and tenant, with the bytes
    # each tenant holds there, so that the fit and the statistics never sum or scan
    # every entry (at 3,000 RAM entries a save that evicted cost 0.9 ms, and the
    # statistics 0.2 ms: docs/benchmarks.md). Only _put, _pop, _touch and resized
    # change them.
    _lru: dict[Tier, OrderedDict[int, Entry]] = field(
        default_factory=lambda: {t: OrderedDict() for t in Tier})
    _held: dict[Tier, dict[str, OrderedDict[int, Entry]]] = field(
        default_factory=lambda: {t: {} for t in Tier})
    _bytes: dict[Tier, dict[str, int]] = field(default_factory=lambda: {t: {} for t in Tier})
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    stats: TierStats = field(default_factory=TierStats)
    # Disk entries being read for a restore, and those read (their bytes in memory).
    staging: set[int] = field(default_factory=set)
    staged: dict[int, None] = field(default_factory=dict)  # oldest first
    _index: PrefixIndex = field(default_factory=PrefixIndex)


    def entries(self, tier: Tier) -> list[Entry]:
        return list(self._lru[tier].values())

    def recent_first(self) -> Iterator[Entry]:
        """Every entry, most recently used first, RAM before disk, as they are read
        (the digests stop at their bound)."""
        return itertools.chain.from_iterable(reversed(self._lru[t].values()) for t in Tier)

    @property
    def on_disk(self) -> bool:
        return bool(self._lru[Tier.DISK])

    def used(self, tier: Tier) -> int:
        return sum(self._bytes[tier].values())  # one term a tenant

    def _put(self, tier: Tier, e: Entry) -> None:
        """``e`` joins ``tier`` as its most recently used entry."""
        e.tier = tier
        self._lru[tier][e.eid] = e
        self._held[tier].setdefault(e.tenant, OrderedDict())[e.eid] = e
        self._bytes[tier][e.tenant] = self._bytes[tier].get(e.tenant, 0) + e.nbytes

    def _pop(self, e: Entry) -> bool:
        """``e`` leaves its tier; False if it was not there."""
        if self._lru[e.tier].pop(e.eid, None) is None:
            return False
        held = self._held[e.tier]
        del held[e.tenant][e.eid]
        if held[e.tenant]:
            self._bytes[e.tier][e.tenant] -= e.nbytes
        else:  # the tenant's last entry here: no zero (or rounding) left behind
            del held[e.tenant], self._bytes[e.tier][e.tenant]
        return True

    def _touch(self, e: Entry) -> None:
        self._lru[e.tier].move_to_end(e.eid)
        self._held[e.tier][e.tenant].move_to_end(e.eid)

    def resized(self, e: Entry, nbytes: int, key: str | None = None) -> list[TierOp]:
        """``e`` takes ``nbytes`` now (its state was saved, or its file written, as
        ``key``): what must go for its tier to fit its budget."""
        if key is not None:
            e.key = key
        if e.eid not in self._lru[e.tier]:
            e.nbytes = nbytes  # restored or dropped meanwhile: nothing to account
            return []
        self._bytes[e.tier][e.tenant] += nbytes - e.nbytes
        e.nbytes = nbytes
        return self._fit(e.tier)

    # --- saving ------------------------------------------------------------------------

    def worth_saving(self, tokens: list[int], session: str | None) -> bool:
        """Saved states go to RAM; with no RAM, a session's passes through to disk."""
        kept = self.ram_bytes > 0 or (session is not None and self.disk_bytes > 0)
        return kept and len(tokens) >= MIN_SAVED_TOKENS

    def save(self, tokens: list[int], tenant: str,
             session: str | None) -> tuple[Entry, list[TierOp]]:
        """Index a state about to be saved to RAM; what it makes redundant goes."""
        entry = Entry(next(self._ids), list(tokens), tenant, session)
        extended = self._index.prefixes(tenant, entry.tokens)
        same = self._index.of_session(tenant, session) if session is not None else []
        ops: list[TierOp] = [self._remove(e) for e in
                             {e.eid: e for e in extended + same}.values()]
        self._put(Tier.RAM, entry)
        self._index.add(entry)
        self.stats.saves += 1
        return entry, ops

    def holds(self, eid: int, tier: Tier) -> bool:
        """Whether entry ``eid`` is still indexed in ``tier``: a save's entry may have
        gone before its bytes came (a fit in the same plan chose it), a stop's demoted
        entry before its write (each write refits the disk budget)."""
        return eid in self._lru[tier]

    def sized(self, eid: int, nbytes: int) -> list[TierOp]:
        """The saved state of ``eid`` takes ``nbytes``: make RAM fit its budget."""
        entry = self._lru[Tier.RAM].get(eid)
        return [] if entry is None else self.resized(entry, nbytes)

    def adopt(self, found: Iterable[Entry]) -> list[TierOp]:
        """Disk entries found at start (oldest first): index them within the budget."""
        for e in found:
            e.eid = next(self._ids)
            self._put(Tier.DISK, e)
            self._index.add(e)
        return self._fit(Tier.DISK)

    def _fit(self, tier: Tier) -> list[TierOp]:
        budget = self.ram_bytes if tier is Tier.RAM else self.disk_bytes
        ops: list[TierOp] = []
        while self._lru[tier] and self.used(tier) > budget:
            victim = self._victim(tier)
            if tier is Tier.RAM and victim.session is not None and self.disk_bytes > 0:
                self._demote(victim)
                ops.append(Demote(victim))
                ops.extend(self._fit(Tier.DISK))
            else:
                ops.append(self._remove(victim))
        return ops

    def _demote(self, e: Entry) -> None:
        self._pop(e)
        self._put(Tier.DISK, e)
        self.stats.demotions += 1

    def _victim(self, tier: Tier) -> Entry:
        """The least recently used entry of the tenant holding the most bytes in
        ``tier`` (with one tenant, as by default: the least recently used of all)."""
        held = self._bytes[tier]
        most = max(held, key=held.__getitem__)
        return next(iter(self._held[tier][most].values()))

    def stage(self, e: Entry) -> Stage | None:
        """Whether ``e`` may be restored now: a RAM entry may, and a staged disk entry;
        otherwise the read to ask for (None when it is under way or too many are)."""
        if e.tier is Tier.RAM or e.eid in self.staged or e.eid in self.staging:
            return None
        if len(self.staging) + len(self.staged) >= MAX_STAGED:
            if not self.staged:
                return None  # all are being read: the next step asks again
            # The oldest staged state's request went away, or waits longer for room:
            # its bytes go (the core frees what is no longer staged), and it is read
            # again if asked for.
            del self.staged[next(iter(self.staged))]
        self.staging.add(e.eid)
        return Stage(e)

    def ready(self, e: Entry) -> bool:
        return e.tier is Tier.RAM or e.eid in self.staged

    def read(self, e: Entry, ok: bool) -> None:
        """The staging read of ``e`` ended: its bytes are in memory, or it is gone."""
        self.staging.discard(e.eid)
        if ok and e.eid in self._lru[Tier.DISK]:
            self.staged[e.eid] = None
        elif not ok:  # its request computes its prompt instead
            self.stats.restore_failures += 1
            self.lost(e)

    def unstage(self, eid: int) -> None:
        self.staging.discard(eid)
        self.staged.pop(eid, None)

    def _remove(self, e: Entry) -> Drop:
        self.unstage(e.eid)
        self._pop(e)
        self._index.remove(e)
        self.stats.drops += 1
        return Drop(e, e.tier)

    def lost(self, e: Entry) -> None:
        """``e``'s bytes are gone (a disk write or read failed): forget it."""
        self.unstage(e.eid)
        if self._pop(e):
            self._index.remove(e)

    def set_budgets(self, ram_bytes: int, disk_bytes: int) -> list[TierOp]:
        self.ram_bytes, self.disk_bytes = ram_bytes, disk_bytes
        return self._fit(Tier.RAM) + self._fit(Tier.DISK)

    # --- restoring ---------------------------------------------------------------------

    def longest(self, tenant: str, prompt: list[int], limit: int) -> tuple[Entry | None, int]:
        """The entry of ``tenant`` sharing the longest prefix with ``prompt`` (at most
        ``limit`` tokens of it), RAM before disk on a tie."""
        return self._index.longest(tenant, prompt, limit)  # never across tenants

    def take(self, entry: Entry, keep: bool = False) -> None:
        """``entry`` is being restored into a slot: it leaves the index, unless
        ``keep`` (then it only counts as used now)."""
        self.unstage(entry.eid)  # the core takes the staged bytes, if any
        if keep:
            self._touch(entry)
        else:
            self._pop(entry)
            self._index.remove(entry)
        if entry.tier is Tier.RAM:
            self.stats.restores_ram += 1
        else:
            self.stats.restores_disk += 1

    def demote_sessions(self) -> list[TierOp]:
        """Before the worker exits: every session's RAM entry goes to disk, as far as
        the disk budget holds them (the most recently used are kept), written newest
        first: a stop has a grace (supervisor.STOP_GRACE), and what it cuts short is
        then the oldest conversations. The disk store orders the files' times after
        (``DiskTier.order``): its next start reads them least recently used first."""
        if not self.disk_bytes:
            return []
        moved = [e for e in self._lru[Tier.RAM].values() if e.session is not None]
        for e in moved:  # in their order of use: the disk's LRU order stays true
            self._demote(e)
        dropped = self._fit(Tier.DISK)
        gone, ids = {op.entry.eid for op in dropped}, {e.eid for e in moved}
        return [*(op for op in dropped if op.entry.eid not in ids),  # files there before
                *(Demote(e) for e in reversed(moved) if e.eid not in gone),
                *(Drop(e, Tier.RAM) for e in moved if e.eid in gone)]  # never written

    def report(self, out: WorkerStats) -> None:
        """Its fields of the worker's statistics: use against budget, and what moved."""
        s = self.stats
        out.kv_ram_entries = len(self._lru[Tier.RAM])
        out.kv_ram_bytes = self.used(Tier.RAM)
        out.kv_ram_budget_bytes = self.ram_bytes
        out.kv_disk_entries = len(self._lru[Tier.DISK])
        out.kv_disk_bytes = self.used(Tier.DISK)
        out.kv_disk_budget_bytes = self.disk_bytes
        out.kv_saves = s.saves
        out.kv_ram_restores = s.restores_ram
        out.kv_disk_restores = s.restores_disk
        out.kv_restored_tokens = s.restored_tokens
        out.kv_restore_failures = s.restore_failures
        out.kv_demotions = s.demotions
        out.kv_drops = s.drops
        out.kv_swaps = s.swaps
