"""``POST /v1/events``: an editor says a completion was shown, taken or dismissed.

Editor telemetry, not the engine's events. Tabby's event shape (``{"type": "view",
"completion_id": "..."}``, other fields ignored and never stored): the id and type are
recorded under the caller's API key name (:mod:`forged.observe.telemetry`), for
``forged report`` and the Prometheus counters.

An event is accepted only for a completion this daemon served to the same key (404
otherwise: one key cannot skew another's acceptance rate, nor fill the file with ids
of its own making), and at most ``telemetry.event_rate`` a second per key, in bursts of
``telemetry.event_burst`` (429 beyond, with Retry-After): a token bucket per key.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Annotated

import msgspec
import trio
from msgspec import Meta

from forged import errors as e
from forged.auth import KeyEntry
from forged.config import TelemetryConfig
from forged.http.state import AppState
from forged.observe.telemetry import Event, EventType


class EventRequest(msgspec.Struct, kw_only=True):
    type: EventType
    # An id as forged gives them ("infill-…", "cmpl-…", "chatcmpl-…"): nothing a prompt
    # could be smuggled into the telemetry file through.
    completion_id: Annotated[str, Meta(min_length=1, max_length=128,
                                       pattern=r"^[A-Za-z0-9_.:-]+$")]


event_decoder = msgspec.json.Decoder(EventRequest)


@dataclass
class TokenBucket:
    """``rate`` tokens a second, held up to ``burst``; sans-IO: the caller says when."""

    tokens: float
    at: float

    def take(self, now: float, rate: float, burst: int) -> float:
        """Take a token: 0.0, or the seconds until there will be one (none taken)."""
        self.tokens = min(float(burst), self.tokens + (now - self.at) * rate)
        self.at = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / rate


def record_event(state: AppState, req: EventRequest, key: KeyEntry | None) -> None:
    name = key.name if key else "-"
    _take_token(state.event_buckets, name, state.cfg.telemetry)
    # Unknown and another key's alike: whether an id is another key's is not said.
    if state.telemetry.served.key_of(req.completion_id) != name:
        raise e.NotFound(f"no completion {req.completion_id!r} was served to this API key "
                         "recently", param="completion_id", code="completion_not_found")
    state.telemetry.record(Event(req.completion_id, name, req.type, time.time()))


def _take_token(buckets: dict[str, TokenBucket], name: str, cfg: TelemetryConfig) -> None:
    """Per key: over its rate this key gets 429, every other key is unaffected. The
    buckets are one per key name, so they are bounded by the keys file."""
    now = trio.current_time()
    bucket = buckets.setdefault(name, TokenBucket(cfg.event_burst, now))
    wait = bucket.take(now, cfg.event_rate, cfg.event_burst)
    if wait:
        raise e.RateLimited(f"API key {name!r} sends more than {cfg.event_rate:g} editor "
                            "events a second (telemetry.event_rate)", math.ceil(wait))
