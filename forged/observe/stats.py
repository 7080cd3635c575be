"""The one percentile definition: metrics, ``forged status``, ``forged bench`` and the
benchmark harness (``bench/``) all use it, so they agree on the same data."""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile by nearest rank: the smallest value with at least ``q``
    percent of the data at or below it, ``sorted(values)[ceil(q / 100 * n) - 1]``
    (p0 is the smallest value); None when there is no data.

    Always one of the values, never an interpolation between two: a p99 of steps
    is a step that happened."""
    if not 0 <= q <= 100:
        raise ValueError(f"a percentile is in [0, 100], not {q}")
    data = sorted(values)
    if not data:
        return None
    # q * n before the division keeps whole ranks exact (0.07 * 100 is 7.000000000000001).
    rank = math.ceil(q * len(data) / 100)
    return data[max(rank, 1) - 1]
