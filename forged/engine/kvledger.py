"""Exact bookkeeping of llama.cpp's unified KV cells, without touching llama.cpp.

Theory of operation
-------------------
In a unified KV cache a cell holds one token's keys and values at one position, tagged
with the set of sequence ids that see it. ``llama_memory_seq_cp(src, dst, 0, n)`` does
not copy anything: it adds ``dst`` to the tags of ``src``'s cells below position ``n``.
``llama_memory_seq_rm(seq, p0, -1)`` removes ``seq`` from the tags of its cells at or
above ``p0``; a cell whose tag set becomes empty is free again.

llama.cpp exposes no count of used cells, so the scheduler keeps this ledger instead.
A sequence's cells are a list of *blocks*. A block is a run of physical cells that
one sequence wrote at consecutive positions starting at ``block.start``. Other
sequences that share a prefix reference the same block, always from its start, so a
reference is just a length: the number of the block's cells that sequence sees. The
block's live cells are then the longest reference, and the used total is the sum of
that over blocks.

A sequence may grow a block in place only while it is the block's writer and its
reference is the longest one (it sits at the block's tip). Anyone else who grows
starts a new block, because the cells they write are new physical cells even when
the positions coincide with cells another sequence sees.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class _Block:
    start: int
    writer: int
    refs: dict[int, int] = field(default_factory=dict)

    def live(self) -> int:
        return max(self.refs.values(), default=0)


class KVLedger:
    """Counts physical KV cells per the rules above. Sequence ids are small ints."""

    def __init__(self) -> None:
        self._blocks: dict[int, list[_Block]] = {}
        self._used = 0

    @property
    def used(self) -> int:
        return self._used

    def length(self, seq: int) -> int:
        """Positions ``0..length-1`` of ``seq`` are in the cache."""
        blocks = self._blocks.get(seq)
        if not blocks:
            return 0
        last = blocks[-1]
        return last.start + last.refs[seq]

    def private_cells(self, seq: int) -> int:
        """Cells that only ``seq`` keeps alive: what dropping it would free."""
        freed = 0
        for b in self._blocks.get(seq, ()):
            others = max((n for s, n in b.refs.items() if s != seq), default=0)
            freed += max(0, b.refs[seq] - others)
        return freed

    def cells_seen_by(self, seqs: set[int]) -> int:
        """Live cells that at least one of ``seqs`` sees (shared cells counted once)."""
        seen: dict[int, int] = {}
        for seq in seqs:
            for b in self._blocks.get(seq, ()):
                seen[id(b)] = max(seen.get(id(b), 0), b.refs[seq])
        return sum(seen.values())

    def extend(self, seq: int, n: int) -> None:
        """``seq`` wrote ``n`` new cells at its next positions (prefill or decode)."""
        if n <= 0:
            return
        blocks = self._blocks.setdefault(seq, [])
        last = blocks[-1] if blocks else None
        if last is not None and last.writer == seq and last.refs[seq] == last.live():
            last.refs[seq] += n
        else:
            blocks.append(_Block(start=self.length(seq), writer=seq, refs={seq: n}))
        self._used += n

    def truncate(self, seq: int, keep: int) -> None:
        """``llama_memory_seq_rm(seq, keep, -1)``: forget positions ``>= keep``."""
        blocks = self._blocks.get(seq)
        if not blocks:
            return
        while blocks and blocks[-1].start >= keep:
            self._set_ref(blocks.pop(), seq, 0)
        if blocks:
            last = blocks[-1]
            self._set_ref(last, seq, min(last.refs[seq], keep - last.start))
        if not blocks:
            del self._blocks[seq]

    def clear(self, seq: int) -> None:
        self.truncate(seq, 0)

    def share(self, src: int, dst: int, n: int) -> None:
        """``llama_memory_seq_cp(src, dst, 0, n)`` onto an empty ``dst``."""
        if self._blocks.get(dst):
            raise ValueError(f"sequence {dst} must be empty before sharing into it")
        if n > self.length(src):
            raise ValueError(f"sequence {src} holds fewer than {n} positions")
        shared: list[_Block] = []
        for b in self._blocks.get(src, ()):
            if b.start >= n:
                break
            b.refs[dst] = min(b.refs[src], n - b.start)
            shared.append(b)
        if shared:
            self._blocks[dst] = shared

    def _set_ref(self, block: _Block, seq: int, n: int) -> None:
        before = block.live()
        if n > 0:
            block.refs[seq] = n
        else:
            block.refs.pop(seq, None)
        self._used += block.live() - before
