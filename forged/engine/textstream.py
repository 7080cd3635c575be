"""Turning sampled tokens into safe text deltas: UTF-8 boundaries and stop strings.

Pure and synchronous. Two things make streaming text subtle:

* A token may end in the middle of a multi-byte UTF-8 character. Bytes are held
  back until they decode, so no delta ever carries half a character.
* A stop string may be split across tokens. Text that could still be the start of
  a stop string is held back until it either completes the stop string (it and
  everything after it are dropped, unless the caller wants it included) or can no
  longer match (it is released).

With ``blocks`` (an opening and a closing marker: tool calls' ``<tool_call>`` and
``</tool_call>``), a block is held back whole until it closes, and a block written
again verbatim ends the stream before it, as a stop string would. A model given tools
and a grammar that allows another call after each may repeat its call until the
limit; the repeat is never sent, and the choice ends where it began.
"""

from __future__ import annotations

import codecs


class TextStream:
    def __init__(self, stop: list[str], *, include: bool = False,
                 blocks: tuple[str, str] | None = None) -> None:
        self._stop = [s for s in stop if s]
        self._include = include  # vLLM's include_stop_str_in_output
        self.matched: str | None = None  # the stop string that ended the stream
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._pending = ""  # decoded, not yet released (might begin a stop string)
        self.stopped = False
        self._blocks = blocks
        self._seen: set[str] = set()  # the blocks released, as their stripped text

    def feed(self, piece: bytes, *, match: bool = True) -> str:
        """Add one token's bytes. Returns the text that is now safe to send. Without
        ``match`` (vLLM's min_tokens not yet reached) no stop string is looked for, and
        nothing is held back for one."""
        if self.stopped:
            return ""
        self._pending += self._decoder.decode(piece)
        if not match:
            # Blocks are held and recorded still: a call made before min_tokens must
            # be whole when sent, and its repeat after min_tokens caught.
            n = len(self._pending)
            return self._release_blocks(n) if self._blocks else self._release(n)
        hit = self._find_stop()
        if hit is not None:
            start, self.matched = hit
            self.stopped = True
            end = start + len(self.matched) if self._include else start
            out, self._pending = self._pending[:end], ""
            return out
        safe = len(self._pending) - self._partial_stop_len()
        return self._release_blocks(safe) if self._blocks else self._release(safe)

    def _release_blocks(self, safe: int) -> str:
        """Release up to ``safe``, but never part of an open block nor of its opening
        marker; a closed block seen before ends the stream where it begins."""
        assert self._blocks is not None
        opening, closing = self._blocks
        out = ""
        while True:
            start = self._pending.find(opening)
            if start < 0:
                partial = _partial_len(self._pending, opening)
                return out + self._release(min(safe, len(self._pending) - partial))
            end = self._pending.find(closing, start + len(opening))
            if end < 0 or end + len(closing) > safe:
                return out + self._release(min(start, safe))
            end += len(closing)
            block = " ".join(self._pending[start:end].split())  # layout aside
            if block in self._seen:
                self.stopped = True
                out += self._pending[:start]
                self._pending = ""
                return out
            self._seen.add(block)
            out += self._release(end)
            safe -= end

    def flush(self) -> str:
        """The stream ended without a stop string: release everything held back."""
        if self.stopped:
            return ""
        self._pending += self._decoder.decode(b"", final=True)
        # A block held only because a stop string's possible start overlapped its
        # closing marker is whole now: a repeat must still end the stream.
        out = self._release_blocks(len(self._pending)) if self._blocks else ""
        if self.stopped:
            return out
        out, self._pending = out + self._pending, ""
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


def _partial_len(text: str, word: str) -> int:
    """The length of the longest end of ``text`` that begins ``word``."""
    for n in range(min(len(text), len(word) - 1), 0, -1):
        if word.startswith(text[-n:]):
            return n
    return 0
