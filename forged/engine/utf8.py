"""Which tokens keep a constrained output valid UTF-8 (sans-IO).

llama.cpp's grammar sampler decodes a token's bytes into code points without checking
continuation bytes: a lead byte followed by ASCII, or a byte token that continues
nothing, passes as one code point. The text stream then decodes the same bytes into
several replacement characters, so a schema's ``maxLength`` (or a ``pattern``) that
the grammar enforced no longer holds for the text the client gets. Seen with a tiny
byte-fallback vocabulary at temperature 1, possible with any vocabulary that has
partial-UTF-8 tokens.

The guard bans, before each draw, the tokens whose bytes would make the output so far
invalid UTF-8. Its state is the output's unfinished last character (0-3 bytes): what
may follow depends only on how many bytes it still owes and the range the next byte
must fall in (after E0, ED, F0 and F4 that range is narrower than 80-BF).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt


def _is_continuation(b: int) -> bool:
    return 0x80 <= b <= 0xBF


def _leading_continuations(piece: bytes) -> int:
    n = 0
    while n < len(piece) and _is_continuation(piece[n]):
        n += 1
    return n


def _valid_after(pending: bytes, piece: bytes) -> bool:
    """Whether ``pending + piece`` is valid UTF-8 up to an unfinished last character."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    try:
        decoder.decode(pending + piece, final=False)
    except UnicodeDecodeError:
        return False
    # Python holds back an unfinished character without checking its second byte.
    tail = decoder.getstate()[0]
    if len(tail) < 2:
        return True
    lo, hi = _SECOND_BYTE.get(tail[0], (0x80, 0xBF))
    return lo <= tail[1] <= hi


# The range of the byte after a lead byte that narrows it (no overlong forms, no
# surrogates, nothing past U+10FFFF); any other lead takes 80-BF.
_SECOND_BYTE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF),
                0xF4: (0x80, 0x8F)}
_SEQUENCE_LENGTH = [(0xC2, 0xDF, 2), (0xE0, 0xEF, 3), (0xF0, 0xF4, 4)]


def _constraint(pending: bytes) -> tuple[int, int, int]:
    """(bytes owed, lowest and highest next byte): all that decides what may follow."""
    if not pending:
        return (0, 0, 0)
    length = next(n for lo, hi, n in _SEQUENCE_LENGTH if lo <= pending[0] <= hi)
    lo, hi = _SECOND_BYTE.get(pending[0], (0x80, 0xBF)) if len(pending) == 1 else (0x80, 0xBF)
    return (length - len(pending), lo, hi)


@dataclass
class Utf8Table:
    """A vocabulary's pieces, and which tokens may follow each kind of unfinished
    character (computed on first need: at most a dozen kinds)."""

    pieces: Sequence[bytes]
    _clean: npt.NDArray[np.bool_]  # starts a character and is valid on its own
    _continuing: list[int]  # starts with a continuation byte, or is empty
    _banned: dict[tuple[int, int, int], npt.NDArray[np.int64]] = field(default_factory=dict)

    @classmethod
    def build(cls, pieces: Sequence[bytes]) -> Utf8Table:
        lead = [_leading_continuations(p) for p in pieces]
        clean = np.array([n == 0 and _valid_after(b"", p) for p, n in zip(pieces, lead,
                                                                            strict=True)])
        continuing = [t for t, (p, n) in enumerate(zip(pieces, lead, strict=True))
                      if n > 0 or not p]
        return cls(pieces, clean, continuing)

    def banned(self, pending: bytes) -> npt.NDArray[np.int64]:
        """The tokens that cannot follow an output ending in ``pending``, the bytes of
        an unfinished character."""
        key = _constraint(pending)
        if key not in self._banned:
            self._banned[key] = np.flatnonzero(~self._allowed(pending))
        return self._banned[key]

    def _allowed(self, pending: bytes) -> npt.NDArray[np.bool_]:
        if not pending:
            return self._clean
        allowed = np.zeros(len(self.pieces), dtype=np.bool_)
        allowed[[t for t in self._continuing if _valid_after(pending, self.pieces[t])]] = True
        return allowed


class Utf8Guard:
    """One output's state: bans before a draw, advances after it."""

    def __init__(self, table: Utf8Table) -> None:
        self._table = table
        self._decoder = codecs.getincrementaldecoder("utf-8")("strict")

    @property
    def pending(self) -> bytes:
        return bytes(self._decoder.getstate()[0])

    def ban(self, logits: npt.NDArray[np.float32]) -> None:
        logits[self._table.banned(self.pending)] = -np.inf

    def accept(self, token: int) -> None:
        try:
            self._decoder.decode(self._table.pieces[token], final=False)
        except UnicodeDecodeError:  # only if every token was banned: start afresh
            self._decoder.reset()
