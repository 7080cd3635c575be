"""The scheduler's records (sans-IO): a running sequence, a slot, a queued request,
and where a prompt would start if admitted now. Only :mod:`forged.engine.scheduler`
makes and changes them."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from forged.engine.kvtiers import Entry
from forged.engine.plan import Key
from forged.engine.request import Request


class Phase(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    FORK = "fork"  # a choice waiting for its leader to compute the shared prompt


# A running sequence: its request's routing id and its choice's index (OpenAI's ``n``).


@dataclass
class Running:
    rid: int
    # After a preemption: what it produced so far is its prompt, and less is left.
    req: Request
    slot: int
    admitted_at: float
    submitted_at: float  # when its caller's request first queued: the age that counts
    vstart: float  # its place in the aging order (see Queued)
    next_prompt: int  # index of the first prompt token not yet in the KV cache
    cached: int  # prompt tokens reused from the prefix cache
    phase: Phase = Phase.PREFILL
    last_token: int = -1  # sampled but not yet fed back
    generated: int = 0
    index: int = 0  # its choice
    # A leader's choices waiting for its prompt (in Phase.FORK), until it forks them.
    forks: tuple[int, ...] = ()

    @property
    def key(self) -> Key:
        return self.rid, self.index

    @property
    def prompt_left(self) -> int:
        """Prompt tokens not yet computed."""
        return len(self.req.prompt) - self.next_prompt

    def reserved_length(self, decode_reservation: int) -> int:
        decode = min(self.req.max_tokens, decode_reservation)
        # A choice waiting for its prompt gets the prompt's cells by a copy: in the
        # unified cache those are the leader's, shared, so only its decode cells count.
        return decode if self.phase is Phase.FORK else len(self.req.prompt) + decode


@dataclass
class Slot:
    sid: int
    tokens: list[int] = field(default_factory=list)
    rid: int | None = None
    last_used: float = 0.0
    session: str | None = None  # the session whose latest turn this KV holds
    tenant: str = ""  # whose prompt this KV holds


@dataclass
class Queued:
    rid: int
    req: Request
    submitted_at: float  # when its caller's request first queued
    # Its place in the shortest-first-with-aging order, fixed at submission so that a
    # preempted request, queued again with a longer prompt, keeps it.
    vstart: float
    deadline: float
    index: int = 0  # the first of its req.n choices (a preempted choice keeps its own)
    # Prompt tokens it is expected not to compute (``Scheduler._expected_cached``), and
    # of those what the slots and saved states held for it (``_reuse``): matched once,
    # when it is queued, and not refreshed (see there why).
    cached: int = 0
    reused: int = 0
    held: bool = False  # it has waited for a prefix being computed (_holder)

    @property
    def to_compute(self) -> int:
        """The prompt work it brings: what the caches will not serve."""
        return len(self.req.prompt) - self.cached


@dataclass(frozen=True)
class Reuse:
    """Where a prompt would start if admitted now: ``cached`` tokens restored from the
    saved ``entry``, or else shared with slot ``src`` (none when ``src`` is None)."""

    src: int | None
    entry: Entry | None
    cached: int
