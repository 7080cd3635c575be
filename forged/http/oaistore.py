"""Stored responses of OpenAI's Responses API (``store``, ``previous_response_id``,
``GET``/``DELETE /v1/responses/{id}``): in memory, per API key, bounded.

Sans-IO: the caller passes the time and the limits (``responses.max_stored``,
``responses.retention``, read at each call so that a reload applies at once). When the
count is full, the oldest response of the key that holds the most goes first, so that
one key's many responses never push out another's; one older than the retention is
gone for every purpose. A response is found only by the key that made it: another
key's lookup is the same miss as an unknown id, so ids do not leak between keys.

Sessions: the responses of one conversation share an engine session, whose KV stays
pinned between turns. When the last stored response holding a session goes (deleted,
evicted or expired), the store calls ``released(key, session)``, so the caller unpins
it: the pin ended only with ``limits.session_ttl``, a deleted conversation's KV held
in a slot that other work's caches were evicted before.

Memory: each stored response holds its conversation's items (a follow-up shares its
predecessors' items: the tuples are copied, the items are not). A response is stored
only once it was generated, so its conversation fit the model's context; what it keeps
beside its prompt is bounded (a ``call_id`` at 64 characters, ``user`` and
``safety_identifier`` at 256, ``metadata``, a schema and its description at 64 KiB):
the store holds at most ``max_stored`` contexts' worth of text, and little more.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from forged.config import ResponsesConfig


@dataclass(frozen=True)
class Stored:
    id: str
    key: str  # the API key's name that made it ("" with no keys)
    at: float  # when it was stored (a monotonic clock)
    response: dict[str, Any]  # as GET returns it
    # The conversation up to and including its output, for a follow-up's prompt: the
    # Responses API's input items (forged.http.oairesponses), normalised.
    conversation: tuple[Any, ...]
    session: str | None  # the engine session its conversation's KV stays pinned to
    inputs: int = 0  # how many of the conversation's first items were its input


class ResponseStore:
    def __init__(self, released: Callable[[str, str], None] = lambda key, session: None
                 ) -> None:
        self._kept: OrderedDict[str, Stored] = OrderedDict()  # oldest first
        self._ids: dict[str, OrderedDict[str, None]] = {}  # each key's ids, oldest first
        self._holders: Counter[tuple[str, str]] = Counter()  # responses per (key, session)
        self._released = released

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, stored: Stored, cfg: ResponsesConfig) -> None:
        self._expire(cfg, stored.at)
        self._kept[stored.id] = stored
        self._ids.setdefault(stored.key, OrderedDict())[stored.id] = None
        if stored.session is not None:
            self._holders[stored.key, stored.session] += 1
        while len(self._kept) > cfg.max_stored:
            self._evict()

    def _evict(self) -> None:
        """The oldest response of the key that holds the most goes: a key storing many
        evicts its own, not another key's conversation mid-way (with the oldest of all
        going, one key's batch of max_stored ended every other key's follow-ups); of keys
        holding as many, the oldest response goes."""
        oldest = max(self._ids.values(),
                     key=lambda ids: (len(ids), -self._kept[next(iter(ids))].at))
        self._remove(next(iter(oldest)))

    def _remove(self, response_id: str) -> None:
        stored = self._kept.pop(response_id)
        ids = self._ids[stored.key]
        del ids[response_id]
        if not ids:
            del self._ids[stored.key]
        if stored.session is not None:
            held = (stored.key, stored.session)
            self._holders[held] -= 1
            if not self._holders[held]:
                del self._holders[held]
                self._released(*held)

    def get(self, response_id: str, key: str, cfg: ResponsesConfig, now: float
            ) -> Stored | None:
        self._expire(cfg, now)
        stored = self._kept.get(response_id)
        return stored if stored is not None and stored.key == key else None

    def delete(self, response_id: str, key: str, cfg: ResponsesConfig, now: float) -> bool:
        found = self.get(response_id, key, cfg, now) is not None
        if found:
            self._remove(response_id)
        return found

    def _expire(self, cfg: ResponsesConfig, now: float) -> None:
        while self._kept:
            oldest = next(iter(self._kept.values()))
            if now - oldest.at <= cfg.retention:
                return
            self._remove(oldest.id)
