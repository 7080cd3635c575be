"""Turning sampled tokens into safe text deltas: UTF-8 boundaries and stop strings.

Pure and synchronous. Two things make streaming text subtle:

* A token may end in the middle of a multi-byte UTF-8 character. Bytes are held
  back until they decode, so no delta ever carries half a character.
* A stop string may be split across tokens. Text that could still be the start of
  a stop string is held back until it either completes the stop string (it and
  everything after it are dropped, unless the caller wants it included) or can no
  longer match (it is released).
"""

from __future__ import annotations

import codecs


class TextStream:
    def __init__(self, stop: list[str], *, include: bool = False) -> None:
        self._stop = [s for s in stop if s]
        self._include = include  # vLLM's include_stop_str_in_output
        self.matched: str | None = None  # the stop string that ended the stream
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._pending = ""  # decoded, not yet released (might begin a stop string)
        self.stopped = False

    def feed(self, piece: bytes, *, match: bool = True) -> str:
        """Add one token's bytes. Returns the text that is now safe to send. Without
        ``match`` (vLLM's min_tokens not yet reached) no stop string is looked for, and
        nothing is held back for one."""
        if self.stopped:
            return ""
        self._pending += self._decoder.decode(piece)
        if not match:
            return self._release(len(self._pending))
        hit = self._find_stop()
        if hit is not None:
            start, self.matched = hit
            self.stopped = True
            end = start + len(self.matched) if self._include else start
            out, self._pending = self._pending[:end], ""
            return out
        return self._release(len(self._pending) - self._partial_stop_len())

    def flush(self) -> str:
        """The stream ended without a stop string: release everything held back."""
        if self.stopped:
            return ""
        self._pending += self._decoder.decode(b"", final=True)
        out, self._pending = self._pending, ""
        return out

    def _find_stop(self) -> tuple[int, str] | None:
        """Where the first stop string in the pending text starts, and which it is."""
        found = [(i, s) for i, s in ((self._pending.find(s), s) for s in self._stop)
                 if i >= 0]
        return min(found) if found else None

    def _partial_stop_len(self) -> int:
        """Length of the longest suffix of pending text that begins some stop string."""
        text = self._pending
        for n in range(min(self._hold, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0

    def _release(self, n: int) -> str:
        out, self._pending = self._pending[:n], self._pending[n:]
        return out
