"""A request's accounting, the same on every path that answers it (Quart's hooks and
the hot door): its count in ``forged_requests`` and its access-log line."""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from forged.auth import KeyEntry

if TYPE_CHECKING:
    from forged.observe.metrics import Metrics

access_log = logging.getLogger("forged.access")


def request_id() -> str:
    """A request's id (``X-Request-Id``): 128 random bits in hex, as a uuid4's hex
    spells them, without building the UUID."""
    return os.urandom(16).hex()


def count_request(metrics: Metrics, rule: str, status: int, priority: str,
                  key: KeyEntry | None, model_id: str) -> None:
    count_requests(metrics, rule, status, priority, key.name if key else "-", model_id)


def count_requests(metrics: Metrics, rule: str, status: int, priority: str, key_name: str,
                   model_id: str, n: int = 1) -> None:
    """``n`` requests of one kind: a door process's answers arrive counted."""
    metrics.requests.labels(rule, str(status), priority, key_name, model_id).inc(n)


def log_access(rule: str, status: int, request_id: str, key: KeyEntry | None,
               started: float) -> None:
    """The access-log line of a request that generated nothing (a generation logs its
    own, with its tokens, when it ends)."""
    access_log.info("%s %s", rule, status, extra={"fields": {
        "request_id": request_id, "status": status, "key": key.name if key else "-",
        "duration": f"{time.monotonic() - started:.3f}"}})
