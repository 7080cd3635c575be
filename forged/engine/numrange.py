"""A JSON schema's numeric bounds as GBNF (``minimum``, ``maximum``, ``exclusiveMinimum``,
``exclusiveMaximum`` on an ``integer`` or a ``number``), which llama-cpp-python's
converter ignores.

Theory of operation: the bounds become the smallest and the largest integer they
admit, and the grammar writes the decimal integers between them, digit by digit, with
no leading zero: for each length of number, the range of that length is split where
its ends' digits part (``[1, 213]`` is ``[1-9]``, ``[1-9] [0-9]``, ``"1" [0-9]{2}``,
``"2" "0" [0-9]``, ``"2" "1" [0-3]``). A ``number`` may also have a fraction after an
integer part ``I`` when all of ``[I, I + 1]`` is within the bounds (a negative one is
written without a fraction); as in the converter's own rules, at most 16 digits.
Everything the grammar writes is within the bounds; the model cannot write an
exponent, nor a fraction at the edges of the range. Claude Code's own tools have such
bounds (``"type": "integer", "exclusiveMinimum": 0``, ``"type": "number", "minimum":
0, "maximum": 600000``).
"""

from __future__ import annotations

import math
from typing import Any

BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# The most digits written for an integer part without an upper bound, and for a
# fraction, as the converter's own number rules have it: a small model at temperature 1
# otherwise wrote digits until its token limit.
DIGITS = 16
_PAST = 10 ** DIGITS  # the least integer of more digits


def integer_bounds(schema: dict[str, Any]) -> tuple[int | None, int | None]:
    """The smallest and the largest integer ``schema``'s bounds admit (None: no bound)."""
    lows, highs = [], []
    if (v := schema.get("minimum")) is not None:
        lows.append(math.ceil(v))
    if (v := schema.get("exclusiveMinimum")) is not None:
        lows.append(math.floor(v) + 1)
    if (v := schema.get("maximum")) is not None:
        highs.append(math.floor(v))
    if (v := schema.get("exclusiveMaximum")) is not None:
        highs.append(math.ceil(v) - 1)
    lo, hi = (max(lows) if lows else None), (min(highs) if highs else None)
    # A bound past DIGITS digits bounds nothing the grammar writes (a JavaScript
    # number's 1.7e308): the digit ranges up to it were over 256 KiB of grammar, a 400.
    return (None if lo is not None and lo <= -_PAST else lo,
            None if hi is not None and hi >= _PAST else hi)


def bounded_rule(schema: dict[str, Any]) -> str | None:
    """A GBNF expression for ``schema``'s numbers within its bounds; None when the schema
    has no bounds or admits no integer."""
    if not any(k in schema for k in BOUNDS):
        return None
    lo, hi = integer_bounds(schema)
    alts = integers(lo, hi)
    if not alts:
        return None
    if schema.get("type") == "number":
        # I.F is within [I, I + 1): the integer parts whose whole interval fits.
        whole = naturals(max(lo or 0, 0), None if hi is None else hi - 1)
        if whole:
            alts.append("(" + " | ".join(whole) + f') "." [0-9]{{1,{DIGITS}}}')
    return "(" + " | ".join(alts) + ")"


def integers(lo: int | None, hi: int | None) -> list[str]:
    """Alternatives that write each integer of ``[lo, hi]`` once (None: unbounded)."""
    if lo is not None and hi is not None and lo > hi:
        return []
    alts = []
    if lo is None or lo < 0:  # -k for k in [max(1, -hi), -lo]
        negative = naturals(1 if hi is None or hi >= 0 else -hi, None if lo is None else -lo)
        alts.append('"-" (' + " | ".join(negative) + ")")
    if hi is None or hi >= 0:
        alts += naturals(max(lo, 0) if lo is not None else 0, hi)
    return alts


def naturals(lo: int, hi: int | None) -> list[str]:
    """Alternatives for the integers of ``[lo, hi]``, ``lo`` at least 0."""
    if hi is not None and hi < lo:
        return []
    alts = ['"0"'] if lo == 0 else []
    lo = max(lo, 1)
    if hi is not None and lo > hi:
        return alts
    last = len(str(lo)) if hi is None else len(str(hi))
    for n in range(len(str(lo)), last + 1):
        top = 10 ** n - 1 if hi is None else min(hi, 10 ** n - 1)
        alts += _same_length(str(max(lo, 10 ** (n - 1))), str(top))
    if hi is None and last < DIGITS:  # any longer number, up to the converter's length
        alts.append(f"[1-9] [0-9]{{{last},{DIGITS - 1}}}")
    return alts


def _same_length(a: str, b: str) -> list[str]:
    """Alternatives for the digit strings from ``a`` to ``b``, of the same length."""
    if not a:
        return [""]
    n = len(a) - 1
    if a[0] == b[0]:
        return [f'"{a[0]}" {rest}'.rstrip() for rest in _same_length(a[1:], b[1:])]
    low_whole, high_whole = a[1:] == "0" * n, b[1:] == "9" * n
    first, last = int(a[0]) + (not low_whole), int(b[0]) - (not high_whole)
    out = []
    if not low_whole:
        out += [f'"{a[0]}" {rest}'.rstrip() for rest in _same_length(a[1:], "9" * n)]
    if first <= last:
        out.append(f"[{first}-{last}]" + (f" [0-9]{{{n}}}" if n else ""))
    if not high_whole:
        out += [f'"{b[0]}" {rest}'.rstrip() for rest in _same_length("0" * n, b[1:])]
    return out
