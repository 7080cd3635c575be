"""Holding a step's tokens to send them with the next step's (sans-IO).

Where steps are faster than a useful write cadence (an accelerator, a small model, a
few streams), a frame a step costs the daemon a wake-up a step: the read, the frame's
decoding and its delivery cost more than the socket writes they lead to
(docs/benchmarks.md, "Tokens held in the worker"). So the worker may keep a step's
events back and send them with the next step's, within ``server.stream_coalesce_ms``
of the oldest, and the daemon wakes, reads and writes once for several steps.

Only text of choices already streaming waits: a first token is the request's time to
first token, and anything but text (an admission, an end, an error, statistics the
daemon acts on) goes at once.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from forged.engine.events import Delta, Event


class TokenHold:
    """Whether the events so far may wait for the next step's (:meth:`holds`), asked
    once a step by the worker's loop; ``sent`` and ``forget`` keep its record of the
    choices whose first text has gone out."""

    def __init__(self) -> None:
        self._since: float | None = None  # when the oldest held event was made
        self._checked = 0  # the held events already found holdable
        self._asked_at = -math.inf  # when holds() was last asked: the steps' pace
        self._step_s = math.inf  # the time between the last two asks: the last step's
        self._announced: set[tuple[int, int]] = set()  # (rid, index) streaming
        self._ended: set[tuple[int, int]] = set()  # forgotten since the last send

    def holds(self, events: Sequence[Event], now: float, hold_ms: float) -> bool:
        """True while ``events`` are only text of choices already streaming and the
        next step, predicted to take as long as the last, ends within ``hold_ms`` of
        the oldest of them (``now`` in seconds)."""
        self._step_s, self._asked_at = now - self._asked_at, now
        hold_s = hold_ms / 1000
        # Only the events that came since the last ask: the others were held already.
        if hold_s <= 0 or any(type(e) is not Delta or (e.rid, e.index) not in self._announced
                              for e in itertools.islice(events, self._checked, None)):
            return False
        since = now if self._since is None else self._since
        if now - since + self._step_s >= hold_s:
            return False
        self._since, self._checked = since, len(events)
        return True

    def due(self, now: float, priced_ms: float, last_priced_ms: float,
            hold_ms: float) -> bool:
        """Whether what is held would wait past ``hold_ms`` if the next step ran first:
        :meth:`holds` predicted it to take as long as the last, and one with more work
        (more decoders) would keep the held text too long. The next step is predicted
        as the last one's time scaled by the cost model's prices of the two plans: the
        model's ratio, not its milliseconds, which ran above the stand-in's 1 ms steps
        and flushed so early that the hold saved nothing (docs/benchmarks.md, "Tokens
        held in the worker")."""
        if self._since is None:
            return False
        scale = priced_ms / last_priced_ms if last_priced_ms > 0 else 1.0
        return (now - self._since + self._step_s * scale) * 1000 >= hold_ms

    def sent(self, events: Sequence[Event]) -> None:
        """``events`` went out (the caller sends whenever :meth:`holds` says no): their
        choices are streaming, nothing is held."""
        # Not the choices that ended since the last send: their last text goes out in
        # this frame, after forget() (each finished choice stayed here for good).
        self._announced.update((e.rid, e.index) for e in events
                               if type(e) is Delta and (e.rid, e.index) not in self._ended)
        self._ended.clear()
        self._since, self._checked = None, 0

    def forget(self, rid: int, index: int) -> None:
        """Choice ``index`` of ``rid`` ended."""
        self._announced.discard((rid, index))
        self._ended.add((rid, index))
