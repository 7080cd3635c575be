"""Which worker a request goes to: cache locality traded against queue depth (sans-IO).

Theory of operation
-------------------
Each worker's prefix cache (its slots, and the saved states of its RAM and disk tiers)
is private to its process, so a request computes less when it lands where its prompt's
prefix already is: a conversation's next turn, a team's shared system prompt or
repository context.

**Digests.** A worker describes what it holds as *prefix digests*: for every cached
sequence, a 64-bit hash of each prefix that ends on a block boundary (every
:data:`BLOCK` tokens), chained so that one hash names the whole prefix before it,
seeded with the tenant (a cache is never shared across tenants, so neither is a
match). The worker sends the set with its statistics when it changed, at most every
:data:`DIGEST_INTERVAL` seconds, bounded to :data:`MAX_DIGESTS` hashes, most recently
used sequences first (:class:`DigestBuilder`). The daemon hashes a request's prompt the
same way (:func:`block_hashes`); the longest block prefix that a worker's set holds is
that worker's *match*.

**Between reports.** A report is up to a few hundred milliseconds old, and a request
that was just routed is not in any slot yet. So the :class:`Router` also remembers,
for :data:`RECENT_SECONDS`, the prompts it sent to each worker, and, while the worker
lives, which worker served each session's last turn: a session's next turn counts as
a match of its whole prompt there (its disk state is in that worker's own folder too).

**The choice** (:func:`choose`), SGLang's cache-aware policy with forged's loads: the
worker with the longest match wins when the match is at least ``min_match`` of the
prompt, unless it is overloaded against the least loaded worker (more than
``imbalance`` open requests beyond it, and more than :data:`IMBALANCE_RATIO` times
as many); otherwise the least loaded worker wins. SGLang compares the busiest worker
with the idlest; forged compares the one the cache would pick, so that a busy worker
elsewhere does not send a conversation away from its cache. The load is the pool's
count of a worker's open requests, which is never stale.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field

# Tokens per digest block: a prefix shorter than this is not worth routing for.
BLOCK = 64
# Hashes one worker reports (8 bytes each on the wire): 64 full 2,048-token contexts.
MAX_DIGESTS = 2048
# Seconds between a worker's digest reports, at most.
DIGEST_INTERVAL = 0.25
# How long the router trusts its own memory of where it sent a prompt.
RECENT_SECONDS = 5.0
_RECENT_KEPT = 4096  # per worker
_SESSIONS_KEPT = 16384
# The cache holder must also carry this many times the least loaded worker's load to
# count as overloaded (SGLang's balance_rel_threshold).
IMBALANCE_RATIO = 1.5


def block_hashes(tenant: str, tokens: Sequence[int]) -> list[int]:
    """The hash of each of ``tokens``' prefixes that ends on a block boundary, shortest
    first; each hash keys the next, so equal hashes mean equal prefixes (and tenant)."""
    data = memoryview(array("q", tokens).tobytes())
    key = hashlib.blake2b(tenant.encode(), digest_size=16).digest()
    out: list[int] = []
    step = BLOCK * 8
    for end in range(step, len(data) + 1, step):
        key = hashlib.blake2b(data[end - step:end], key=key, digest_size=16).digest()
        out.append(int.from_bytes(key[:8], "little"))
    return out


def matched_tokens(hashes: Sequence[int], *held: Container[int]) -> int:
    """Tokens of the prompt whose ``hashes`` these are that a worker holding ``held``
    (what it reported, what was sent there since) has cached: its longest block
    prefix in any of them."""
    for n in range(len(hashes), 0, -1):
        if any(hashes[n - 1] in h for h in held):
            return n * BLOCK
    return 0


@dataclass(frozen=True)
class Candidate:
    index: int  # the worker
    load: int  # its open requests
    matched: int  # prompt tokens it holds


@dataclass(frozen=True)
class Policy:
    cache_aware: bool = True
    min_match: float = 0.3  # of the prompt's tokens
    imbalance: int = 8  # open requests


def choose(candidates: Sequence[Candidate], prompt_tokens: int, policy: Policy) -> int:
    """The worker for a request of ``prompt_tokens`` (see the module's docstring)."""
    least = min(candidates, key=lambda c: (c.load, c.index))
    if not policy.cache_aware:
        return least.index
    best = max(candidates, key=lambda c: (c.matched, -c.load, -c.index))
    if best.matched == 0 or best.matched < policy.min_match * prompt_tokens:
        return least.index
    overloaded = (best.load - least.load > policy.imbalance
                  and best.load > IMBALANCE_RATIO * least.load)
    return least.index if overloaded else best.index


Why = str  # "cache", "session" or "load": what decided a route, for the statistics


@dataclass
class Router:
    """The pool's routing state: what each worker reported, what was sent where."""

    workers: int
    policy: Policy = field(default_factory=Policy)
    _held: list[frozenset[int]] = field(default_factory=list)
    # Per worker: prompt hashes routed there, with when they stop counting.
    _recent: list[OrderedDict[int, float]] = field(default_factory=list)
    # (tenant, session) -> the worker that served its last turn.
    _sessions: OrderedDict[tuple[str, str], int] = field(default_factory=OrderedDict)
    routed: dict[Why, int] = field(
        default_factory=lambda: {"cache": 0, "session": 0, "load": 0})

    def __post_init__(self) -> None:
        self._held = [frozenset() for _ in range(self.workers)]
        self._recent = [OrderedDict() for _ in range(self.workers)]

    def reported(self, index: int, digests: Iterable[int]) -> None:
        self._held[index] = frozenset(digests)

    def held(self, index: int) -> int:
        return len(self._held[index])

    def lost(self, index: int) -> None:
        """Worker ``index``'s process is gone, and its slots and RAM with it (its
        successor reports its disk tier)."""
        self._held[index] = frozenset()
        self._recent[index].clear()
        for key in [k for k, i in self._sessions.items() if i == index]:
            del self._sessions[key]

    def route(self, tenant: str, prompt: Sequence[int], session: str | None,
              loads: dict[int, int], now: float) -> int:
        """The worker, of those in ``loads`` (index -> open requests), for a prompt;
        remembered as sent there."""
        # The scheduler reuses at most all but the last prompt token.
        aware = self.policy.cache_aware
        hashes = block_hashes(tenant, prompt[:-1]) if aware else []
        sticky = (self._sessions.get((tenant, session))
                  if aware and session is not None else None)
        cands = [Candidate(i, load, len(prompt) if i == sticky
                           else matched_tokens(hashes, *self._holds(i, now)))
                 for i, load in loads.items()]
        index = choose(cands, len(prompt), self.policy)
        self._remember(index, hashes, tenant, session, now)
        self.routed[self._why(next(c for c in cands if c.index == index), sticky,
                              len(prompt))] += 1
        return index

    def _why(self, chosen: Candidate, sticky: int | None, prompt_tokens: int) -> Why:
        """What the chosen worker has for the request: its session, enough of its
        prompt for the cache to decide, or neither (load decided)."""
        if chosen.index == sticky:
            return "session"
        enough = chosen.matched and chosen.matched >= self.policy.min_match * prompt_tokens
        return "cache" if enough else "load"

    def _holds(self, index: int, now: float) -> tuple[Container[int], Container[int]]:
        """What worker ``index`` reported, and the prompts sent there lately: looked
        up apart, since their union (6,000 hashes when both are full) cost about a
        quarter of a millisecond a request."""
        recent = self._recent[index]
        while recent and next(iter(recent.values())) < now:
            recent.popitem(last=False)
        return self._held[index], recent.keys()

    def _remember(self, index: int, hashes: list[int], tenant: str, session: str | None,
                  now: float) -> None:
        recent = self._recent[index]
        for h in hashes:
            recent[h] = now + RECENT_SECONDS
            recent.move_to_end(h)
        while len(recent) > _RECENT_KEPT:
            recent.popitem(last=False)
        if session is not None:
            self._sessions[(tenant, session)] = index
            self._sessions.move_to_end((tenant, session))
            while len(self._sessions) > _SESSIONS_KEPT:
                self._sessions.popitem(last=False)


class DigestBuilder:
    """The worker's side: the digests of the sequences it holds, and whether they
    changed since the last report. A tier entry's tokens never change, so its hashes
    are kept by entry id; a slot's are computed again (a few hundred, in microseconds)."""

    def __init__(self) -> None:
        self._entries: dict[int, list[int]] = {}
        self._last: frozenset[int] | None = None

    def build(self, slots: Iterable[tuple[str, list[int]]],
              entries: Iterable[tuple[int, str, list[int]]]) -> list[int] | None:
        """The digests of ``slots`` (tenant, tokens) and tier ``entries`` (id, tenant,
        tokens), most recently used first, up to MAX_DIGESTS; None when unchanged.
        The entries past the bound are never looked at: a full RAM tier holds
        thousands, and the worker builds this every DIGEST_INTERVAL between steps."""
        out: dict[int, None] = {}  # ordered, without duplicates
        seen: dict[int, list[int]] = {}
        for tenant, tokens in slots:
            out.update(dict.fromkeys(block_hashes(tenant, tokens)))
        for eid, tenant, tokens in entries:
            if len(out) >= MAX_DIGESTS:
                break
            hashes = seen[eid] = self._entries.get(eid) or block_hashes(tenant, tokens)
            out.update(dict.fromkeys(hashes))
        self._entries = seen  # entries that left the tiers (or the bound) are forgotten
        digests = list(out)[:MAX_DIGESTS]
        now = frozenset(digests)
        if now == self._last:
            return None
        self._last = now
        return digests
