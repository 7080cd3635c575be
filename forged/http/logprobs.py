"""``logprobs`` and ``echo``: what a request asks for, and OpenAI's shapes for them.

The engine sends token ids and raw log-probabilities (:mod:`forged.engine.logprobs`:
the log-softmax of the model's logits before penalties, logit bias, grammar,
temperature or truncation, vLLM's default "raw logprobs"). This module writes them
out as OpenAI does:

* **chat**: ``choices[].logprobs = {"content": [{token, logprob, bytes, top_logprobs:
  [{token, logprob, bytes}]}], "refusal": null}``, ``top_logprobs`` (0 to 20) entries
  per token, most likely first.
* **completions** (the legacy shape): ``logprobs = {tokens, token_logprobs,
  top_logprobs, text_offset}``; each ``top_logprobs`` entry is a dict of the
  ``logprobs`` (0 to 20) most likely tokens plus the chosen one (so up to
  ``logprobs`` + 1 entries, as OpenAI documents). With ``echo`` the prompt's tokens
  come first, the first of them with ``null`` (nothing precedes it).

A token's ``token`` is its text with special tokens written out; a token that is not
whole UTF-8 by itself (a character split across tokens) is written ``bytes:\\xe2\\x80``
as OpenAI's legacy completions write it, and ``bytes`` always has its raw bytes.
``text_offset`` is each token's offset, in characters, into the choice's ``text``
(the echoed prompt included): the character its first byte belongs to.

One :class:`ChatLogprobs` or :class:`CompletionLogprobs` serves one choice: the
offsets run on from chunk to chunk, so each choice keeps its own.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from typing import Any, Protocol

from forged import errors as e
from forged.engine.decoding import TokenLogprob
from forged.http.schemas import ChatRequest, CompletionRequest


@dataclass(frozen=True)
class Asked:
    """What a request asks for: ``top`` alternatives per token (None: no logprobs), and
    whether its prompt is scored (echo with logprobs)."""

    top: int | None = None
    prompt: bool = False


def chat_asked(req: ChatRequest) -> Asked:
    if req.top_logprobs is not None and not req.logprobs:
        raise e.BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    return Asked(req.top_logprobs or 0) if req.logprobs else Asked()


def completion_asked(req: CompletionRequest) -> Asked:
    if req.echo and req.suffix is not None:
        raise e.BadRequest("echo cannot be combined with suffix", param="echo")
    if req.max_tokens == 0 and not (req.echo or req.warms_up):  # nothing asked for at all
        raise e.BadRequest("max_tokens must be at least 1 (0 only with echo)",
                           param="max_tokens")
    return Asked(req.logprobs, req.echo and req.logprobs is not None)


class Vocabulary(Protocol):
    def token_bytes(self, token: int) -> bytes: ...


def token_string(piece: bytes) -> str:
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


class ChatLogprobs:
    """One chat choice's logprobs."""

    def __init__(self, vocab: Vocabulary) -> None:
        self.vocab = vocab

    def content(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        return {"content": [{**self._token(e.token, e.logprob),
                             "top_logprobs": [self._token(t, lp) for t, lp in e.top]}
                            for e in entries],
                "refusal": None}

    def _token(self, token: int, logprob: float) -> dict[str, Any]:
        piece = self.vocab.token_bytes(token)
        return {"token": token_string(piece), "logprob": logprob, "bytes": list(piece)}


class CompletionLogprobs:
    """One completion choice's logprobs, with the text offsets that run on from chunk to
    chunk."""

    def __init__(self, vocab: Vocabulary) -> None:
        self.vocab = vocab
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._chars = 0  # characters of the choice's text before the next token

    def prompt(self, tokens: list[int], entries: list[TokenLogprob], text: str
               ) -> dict[str, list[Any]]:
        """The echoed prompt: ``tokens`` (the first is not scored, the rest are
        ``entries``), whose text the choice returns as ``text``."""
        out = self.tokens([TokenLogprob(tokens[0], 0.0), *entries])
        out["token_logprobs"][0] = out["top_logprobs"][0] = None
        # A prompt of ids may end inside a character, whose bytes ``text`` ends with as
        # one U+FFFD: counted here too, or the shift below would move every offset on.
        self._chars += len(self._decoder.decode(b"", final=True))
        # Offsets are into ``text``: where the tokens' own text is longer (a BOS the
        # tokenizer added), the first tokens share offset 0.
        shift = len(text) - self._chars
        out["text_offset"] = [max(0, o + shift) for o in out["text_offset"]]
        self._decoder.reset()
        self._chars = len(text)
        return out

    def tokens(self, entries: list[TokenLogprob]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                     "text_offset": []}
        for entry in entries:
            piece = self.vocab.token_bytes(entry.token)
            out["tokens"].append(token_string(piece))
            out["token_logprobs"].append(entry.logprob)
            out["top_logprobs"].append(self._top(entry))
            out["text_offset"].append(self._offset(piece))
            self._chars += len(self._decoder.decode(piece))
        return out

    def _offset(self, piece: bytes) -> int:
        """Where the character of ``piece``'s first byte is in the text: after the
        characters so far, unless bytes of an unfinished character wait that ``piece``
        does not continue (they become one U+FFFD before it)."""
        waiting = self._decoder.getstate()[0]
        if not waiting or not piece:
            return self._chars
        try:
            codecs.getincrementaldecoder("utf-8")().decode(waiting + piece[:1])
        except UnicodeDecodeError:
            return self._chars + 1
        return self._chars

    def _top(self, entry: TokenLogprob) -> dict[str, float]:
        top: dict[str, float] = {}
        for token, logprob in [*entry.top, (entry.token, entry.logprob)]:
            top.setdefault(token_string(self.vocab.token_bytes(token)), logprob)
        return top


def joined(parts: list[dict[str, list[Any]]]) -> dict[str, list[Any]]:
    """Legacy logprobs of consecutive stretches of one choice, as one."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                 "text_offset": []}
    for part in parts:
        for key, values in part.items():
            out[key] += values
    return out
