"""``POST /v1/events``: an editor says a completion was shown, taken or dismissed.

Tabby's event shape (``{"type": "view", "completion_id": "..."}``, other fields ignored
and never stored): the id and type are recorded under the caller's API key name
(:mod:`forged.observe.telemetry`), for ``forged report`` and the Prometheus counters.
"""

from __future__ import annotations

import time
from typing import Annotated

import msgspec
from msgspec import Meta

from forged.auth import KeyEntry
from forged.http.state import AppState
from forged.observe.telemetry import Event, EventType


class EventRequest(msgspec.Struct, kw_only=True):
    type: EventType
    # An id as forged gives them ("infill-…", "cmpl-…", "chatcmpl-…"): nothing a prompt
    # could be smuggled into the telemetry file through.
    completion_id: Annotated[str, Meta(min_length=1, max_length=128,
                                       pattern=r"^[A-Za-z0-9_.:-]+$")]


event_decoder = msgspec.json.Decoder(EventRequest)


def record_event(state: AppState, req: EventRequest, key: KeyEntry | None) -> None:
    state.telemetry.record(Event(req.completion_id, key.name if key else "-", req.type,
                                 time.time()))
