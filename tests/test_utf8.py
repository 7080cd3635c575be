"""The UTF-8 guard that keeps grammar-constrained output valid text."""

import codecs
import random

import numpy as np

from forged.engine.utf8 import Utf8Guard, Utf8Table

PIECES = [b"a", b"\xe4", b"\xbd", b"\xa0b", b"\xe4\xbd", b"", b"\xff", b"\xa0\xa0",
          b"x\xc3", b"\xa9", b"\xf0\x9f", b"\x98\x80", b"\xe4A", b"\xbd\xbd\xbd",
          b"\xf4", b"\x8f", b"\x90", b"\xed", b"\xe0"]


def _allowed(table: Utf8Table, pending: bytes) -> set[bytes]:
    banned = set(table.banned(pending).tolist())
    return {p for i, p in enumerate(PIECES) if i not in banned}


def test_what_may_follow_each_unfinished_character() -> None:
    table = Utf8Table.build(PIECES)
    assert _allowed(table, b"") == {b"a", b"\xe4", b"\xe4\xbd", b"", b"x\xc3", b"\xf0\x9f",
                                    b"\xf4", b"\xed", b"\xe0"}
    assert _allowed(table, b"\xe4\xbd") == {b"\xbd", b"\xa0b", b"", b"\xa9", b"\x8f",
                                             b"\x90"}
    assert _allowed(table, b"\xe4") == {b"\xbd", b"", b"\xa9", b"\xa0\xa0", b"\x98\x80",
                                        b"\x8f", b"\x90"}
    # Past U+10FFFF, a surrogate, an overlong form: what Python's decoder refuses.
    assert _allowed(table, b"\xf4") == {b"", b"\x8f"}
    assert _allowed(table, b"\xed") == {b"", b"\x98\x80", b"\x8f", b"\x90"}
    assert b"\x8f" not in _allowed(table, b"\xe0")


def test_any_walk_of_allowed_tokens_is_valid_utf8() -> None:
    """Before the guard, a temperature-1 sample could join b'\\xe4' and b'A' (llama.cpp's
    grammar counted one code point; the client got replacement characters)."""
    table, rng = Utf8Table.build(PIECES), random.Random(7)
    for _ in range(300):
        guard, out = Utf8Guard(table), b""
        for _ in range(rng.randrange(1, 12)):
            logits = np.zeros(len(PIECES), dtype=np.float32)
            guard.ban(logits)
            token = rng.choice([i for i in range(len(PIECES)) if logits[i] == 0.0])
            guard.accept(token)
            out += PIECES[token]
        # Valid up to an unfinished last character (a stream may stop there); raises if not.
        codecs.getincrementaldecoder("utf-8")("strict").decode(out, final=False)
