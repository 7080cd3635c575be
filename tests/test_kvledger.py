"""The ledger against a brute-force model of llama.cpp's unified KV cells."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from forged.engine.kvledger import KVLedger


class CellModel:
    """Each physical cell is a (position, set of sequence ids) pair, as in llama.cpp."""

    def __init__(self) -> None:
        self.cells: list[tuple[int, set[int]]] = []

    def length(self, seq: int) -> int:
        return max((p + 1 for p, s in self.cells if seq in s), default=0)

    def extend(self, seq: int, n: int) -> None:
        start = self.length(seq)
        self.cells += [(start + i, {seq}) for i in range(n)]

    def truncate(self, seq: int, keep: int) -> None:
        for p, s in self.cells:
            if p >= keep:
                s.discard(seq)
        self.cells = [(p, s) for p, s in self.cells if s]

    def share(self, src: int, dst: int, n: int) -> None:
        for p, s in self.cells:
            if src in s and p < n:
                s.add(dst)

    @property
    def used(self) -> int:
        return len(self.cells)


ops = st.lists(
    st.tuples(st.sampled_from(["extend", "truncate", "share", "clear"]),
              st.integers(0, 3), st.integers(0, 3), st.integers(0, 12)),
    max_size=60,
)


@settings(max_examples=400, deadline=None)
@given(ops)
def test_ledger_matches_cell_model(steps: list[tuple[str, int, int, int]]) -> None:
    ledger, model = KVLedger(), CellModel()
    for op, a, b, n in steps:
        if op == "extend":
            ledger.extend(a, n)
            model.extend(a, n)
        elif op == "truncate":
            ledger.truncate(a, n)
            model.truncate(a, n)
        elif op == "clear":
            ledger.clear(a)
            model.truncate(a, 0)
        elif a != b and ledger.length(b) == 0:
            n = min(n, ledger.length(a))
            ledger.share(a, b, n)
            model.share(a, b, n)
        assert ledger.used == model.used
        for seq in range(4):
            assert ledger.length(seq) == model.length(seq)


def test_shared_prefix_is_counted_once() -> None:
    ledger = KVLedger()
    ledger.extend(0, 100)
    ledger.share(0, 1, 80)
    ledger.extend(1, 5)
    assert ledger.used == 105
    assert ledger.private_cells(0) == 20
    assert ledger.private_cells(1) == 5
    ledger.clear(0)
    assert ledger.used == 85
    ledger.clear(1)
    assert ledger.used == 0
