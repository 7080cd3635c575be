from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from forged.engine.textstream import TextStream


def run(pieces: list[bytes], stop: list[str]) -> tuple[list[str], bool]:
    ts = TextStream(stop)
    out = [ts.feed(p) for p in pieces]
    if not ts.stopped:
        out.append(ts.flush())
    return out, ts.stopped


def test_multibyte_character_split_across_tokens_is_never_emitted_half_done() -> None:
    euro = "€".encode()  # three bytes
    out, _ = run([b"a", euro[:1], euro[1:2], euro[2:], b"b"], [])
    assert out[:4] == ["a", "", "", "€"]
    assert "".join(out) == "a€b"


def test_stop_string_split_across_tokens() -> None:
    out, stopped = run([b"hello ", b"EN", b"D", b" more"], ["END"])
    assert stopped
    assert "".join(out) == "hello "
    # the partial "EN" was held back, never sent
    assert out[1] == ""


def test_partial_stop_that_does_not_complete_is_released() -> None:
    out, stopped = run([b"ab", b"E", b"x"], ["END"])
    assert not stopped
    assert out == ["ab", "", "Ex", ""]


def test_earliest_stop_wins() -> None:
    out, stopped = run([b"one two three"], ["three", "two"])
    assert stopped and "".join(out) == "one "


@given(st.text(max_size=40), st.integers(1, 7))
def test_any_split_reassembles_the_text(text: str, size: int) -> None:
    data = text.encode()
    pieces = [data[i : i + size] for i in range(0, len(data), size)]
    out, _ = run(pieces, [])
    assert "".join(out) == text
    for part in out:
        part.encode()  # never half a character (no lone surrogates, no U+FFFD)
        assert "\ufffd" not in part or "\ufffd" in text


BLOCKS = ("<tool_call>", "</tool_call>")
CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'


def blocks(pieces: list[str], stop: list[str] | None = None) -> tuple[list[str], bool]:
    ts = TextStream(stop or [], blocks=BLOCKS)
    out = [ts.feed(p.encode()) for p in pieces]
    if not ts.stopped:
        out.append(ts.flush())
    return out, ts.stopped


def test_a_block_is_held_until_it_closes() -> None:
    text = "Sure. " + CALL + " done"
    out, stopped = blocks(list(text))  # one character at a time
    assert not stopped and "".join(out) == text
    # the text as it comes, the whole block at its close, then the rest
    assert [o for o in out if o] == [*"Sure. ", CALL, *" done"]


def test_a_block_written_again_verbatim_ends_the_stream_before_it() -> None:
    other = CALL.replace('"x": 1', '"x": 2')
    for pieces in ([CALL + "\n" + other + "\n" + CALL + "\n" + CALL],
                   list(CALL + "\n" + other + "\n" + CALL + "\n" + CALL)):
        out, stopped = blocks(pieces)
        assert stopped
        assert "".join(out) == CALL + "\n" + other + "\n"


def test_a_repeat_differing_only_in_layout_is_a_repeat() -> None:
    again = CALL.replace("\n", "\n  ")
    out, stopped = blocks([CALL, "\n", again])
    assert stopped and "".join(out) == CALL + "\n"


def test_an_unclosed_block_is_released_by_flush_and_stops_still_work() -> None:
    out, stopped = blocks([CALL, "\n<tool_call>{\"na"])
    assert not stopped and out[-1] == '<tool_call>{"na'  # the limit: all of it
    out, stopped = blocks(["one END two"], ["END"])
    assert stopped and "".join(out) == "one "
    out, stopped = blocks(["a <tool_", "x"])
    assert not stopped and out == ["a ", "<tool_x", ""]  # a partial marker, held


def test_blocks_are_held_and_remembered_before_min_tokens_too() -> None:
    """vLLM's min_tokens (``match=False``): a call is still sent whole, and its repeat
    once min_tokens is past still ends the stream."""
    ts = TextStream([], blocks=BLOCKS)
    out = [ts.feed(c.encode(), match=False) for c in CALL + "\n"]
    assert [o for o in out if o] == [CALL, "\n"]
    assert ts.feed(CALL.encode()) == "" and ts.stopped


def test_a_repeat_held_for_a_stop_strings_start_is_caught_at_the_end() -> None:
    """The repeat's closing '>' may begin the stop string '>>': it is held, and the
    stream ends (flush) before the next token could release it."""
    out, _ = blocks([CALL + "\n", CALL], [">>"])
    assert "".join(out) == CALL + "\n"
    ts = TextStream([">>"], blocks=BLOCKS)
    text = ts.feed((CALL + "\n").encode()) + ts.feed(CALL.encode()) + ts.flush()
    assert text == CALL + "\n" and ts.stopped
