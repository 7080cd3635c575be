"""Legacy completions' ``text_offset`` (forged.http.logprobs.CompletionLogprobs), sans-IO:
each token's offset is where its first byte's character is in the choice's text."""

from __future__ import annotations

from forged.engine.decoding import TokenLogprob
from forged.http.logprobs import CompletionLogprobs

# SmolLM2's pieces: "I", and 🙂 (F0 9F 99 82) split in two tokens.
PIECES = {57: b"I", 10813: b"\xf0\x9f", 38887: b"\x99\x82", 28: b" a"}


class Vocab:
    def token_bytes(self, token: int) -> bytes:
        return PIECES[token]


def entries(*tokens: int) -> list[TokenLogprob]:
    return [TokenLogprob(t, -1.0) for t in tokens]


def test_an_echoed_prompt_of_ids_ending_inside_a_character_starts_at_0() -> None:
    # The prompt [57, 10813] is "I" and half of 🙂: its text, as echoed, is "I\ufffd".
    lp = CompletionLogprobs(Vocab())
    echoed = lp.prompt([57, 10813], entries(10813)[:1], "I\ufffd")
    assert echoed["text_offset"] == [0, 1]
    # The other half, generated, decodes on its own: two U+FFFD after the echo's.
    assert lp.tokens(entries(38887, 28))["text_offset"] == [2, 4]


def test_an_echoed_prompt_of_whole_characters_keeps_its_offsets() -> None:
    lp = CompletionLogprobs(Vocab())
    echoed = lp.prompt([57, 10813, 38887], entries(10813, 38887), "I\U0001f642")
    assert echoed["text_offset"] == [0, 1, 1]
    assert lp.tokens(entries(28))["text_offset"] == [2]
