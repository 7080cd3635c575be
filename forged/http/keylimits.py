"""Per-key limits: what one API key may have in flight, taken before a request costs
anyone anything.

A generation takes its places (one per choice) right after its body is decoded and
its model resolved: before tokenizing, templating, retrieval or grammar conversion,
so a key at its limit gets its 429 for the price of a JSON decode. The door's other
routes (tokenize, detokenize, retrieve, telemetry events) take one place each of a
separate count, bounded by the same ``max_streams``.

Resource handling: a hold is entered into the request's resources
(:mod:`forged.http.lifetime`) as it is taken, so the places come back exactly once when
the request's ASGI call ends, however it ends.
"""

from __future__ import annotations

from dataclasses import dataclass

from forged import errors as e
from forged.auth import KeyEntry
from forged.config import PRIORITIES, Priority
from forged.http.lifetime import call


@dataclass
class KeyUsage:
    """What one API key has in flight: sequences generating or waiting (a request's
    choices each count), requests of those waiting for a slot, and door work."""

    open: int = 0
    queued: int = 0
    side: int = 0


@dataclass
class KeyHold:
    """One generation's places in its key's limits."""

    usage: KeyUsage
    places: int
    waiting: bool

    def admitted(self) -> None:
        """The engine admitted it: it no longer counts against ``max_queued``."""
        if self.waiting:
            self.usage.queued -= 1
            self.waiting = False

    def release(self) -> None:
        self.admitted()
        self.usage.open -= self.places
        self.places = 0


def hold_generation(usages: dict[str, KeyUsage], key: KeyEntry, places: int, *,
                    would_wait: bool, retry_after: int, param: str = "n") -> KeyHold:
    """Take ``places`` of ``key``'s ``max_streams`` for the rest of the request, or
    raise (a request that asks for more than the key may ever run: a 400 naming
    ``param``, the field that asked for the places). A request that would start at once
    (``would_wait`` false: its model has room) is never refused for ``max_queued``, so
    ``max_queued = 0`` means "never wait", not "never run"."""
    usage = usages.setdefault(key.name, KeyUsage())
    if places > key.max_streams:
        raise e.BadRequest(f"API key {key.name!r} may run {key.max_streams} sequences at "
                           f"once; this request asks for {places}", param=param)
    if usage.open + places > key.max_streams:
        raise e.RateLimited(f"API key {key.name!r} has {usage.open} sequences in flight; "
                            f"{places} more would pass its limit", retry_after)
    if would_wait and usage.queued >= key.max_queued:
        raise e.RateLimited(f"API key {key.name!r} has {usage.queued} requests queued, "
                            f"its limit", retry_after)
    usage.open += places
    usage.queued += 1
    hold = KeyHold(usage, places, waiting=True)
    call().held.callback(hold.release)
    return hold


def hold_side(usages: dict[str, KeyUsage], key: KeyEntry, retry_after: int) -> None:
    """One place of ``key``'s door work (tokenize, retrieve, ...) for the rest of the
    request, or a 429."""
    usage = usages.setdefault(key.name, KeyUsage())
    if usage.side >= key.max_streams:
        raise e.RateLimited(f"API key {key.name!r} has {usage.side} requests in flight on "
                            "this route kind, its limit", retry_after)
    usage.side += 1

    def release() -> None:
        usage.side -= 1

    call().held.callback(release)


def capped_priority(asked: Priority | None, key: KeyEntry | None,
                    default: Priority) -> Priority:
    """The request's priority: as asked, but never above its key's (a key's priority
    is a ceiling: a batch key cannot ask to be served as interactive)."""
    ceiling = key.priority if key is not None else None
    wanted = asked or ceiling or default
    if ceiling is not None and PRIORITIES.index(wanted) < PRIORITIES.index(ceiling):
        return ceiling
    return wanted
