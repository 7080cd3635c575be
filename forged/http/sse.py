"""OpenAI's response objects and SSE frames, for completions and chat completions."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec

from forged.engine.decoding import TokenLogprob
from forged.engine.events import Done
from forged.http.logprobs import ChatLogprobs, CompletionLogprobs, Vocabulary, joined
from forged.http.responses import HTTPError
from forged.http.tools import ToolCallParser

_json = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"
# A text no token makes (a private-use character, which JSON does not escape), and its
# JSON: where a chunk's text goes in its pre-encoded bytes (Format._text_chunk).
_MARK = "\ue000forged\ue000"
_MARK_JSON = _json.encode(_MARK)


def event(obj: Any) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


def error_event(err: HTTPError) -> bytes:
    return event(err.body) + DONE


def usage(dones: list[Done]) -> dict[str, Any]:
    """A response's usage: its prompt once, the completions of all its choices."""
    prompt, completion = dones[0].prompt_tokens, sum(d.completion_tokens for d in dones)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": dones[0].cached_tokens},
        # Nothing is hidden from the answer: a thinking model's reasoning is in the
        # content, counted as completion tokens, as vLLM does without a reasoning parser.
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


class Format:
    """One response's id, model and shape, for its ``n`` choices; subclasses say how a
    choice looks. A stream is ``start()``, then each choice's ``delta``s and its
    ``finish``, in any interleaving, then ``end`` once every choice has finished."""

    object_whole: ClassVar[str]
    object_chunk: ClassVar[str]
    id_prefix: ClassVar[str]
    # A dialect whose stream is not SSE (Ollama's NDJSON) says so here.
    content_type: ClassVar[str] = "text/event-stream"
    # The repository chunks the prompt drew on (forged.http.retrieve), when it did:
    # named in the whole response, and in a chunk of their own before [DONE].
    retrieved: list[dict[str, Any]] | None = None
    # The prompt's length and the part of it the prefix cache served, known once the
    # request is admitted (set before start()): for a dialect whose first frame
    # announces them (Anthropic's message_start).
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def __init__(self, model: str, created: int, n: int = 1, *,
                 fingerprint: str | None = None) -> None:
        self.id = self.id_prefix + uuid.uuid4().hex
        self.model = model
        self.created = created
        self.n = n
        self.fingerprint = fingerprint  # OpenAI's system_fingerprint, where it has one
        self._around: dict[int, tuple[bytes, bytes]] = {}  # _text_chunk's, per choice

    def _envelope(self, obj: str, choices: list[Any]) -> dict[str, Any]:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
               "choices": choices}
        if self.fingerprint is not None:
            out["system_fingerprint"] = self.fingerprint
        return out

    def _chunk(self, choice: dict[str, Any]) -> bytes:
        return event(self._envelope(self.object_chunk, [choice]))

    def _text_chunk(self, text: str, index: int, choice: Callable[[str, int], dict[str, Any]]
                    ) -> bytes:
        """``self._chunk(choice(text, index))``, byte for byte, from that chunk's bytes
        around its text, encoded once per choice: a stream's every token is such a
        chunk, and building and encoding its envelope was most of a token's frame."""
        parts = self._around.get(index)
        if parts is None:
            whole = self._chunk(choice(_MARK, index))
            head, _, tail = whole.partition(_MARK_JSON)
            parts = self._around[index] = (head, tail)
        return parts[0] + _json.encode(text) + parts[1]

    def start(self) -> bytes:
        return b""

    def error(self, err: HTTPError) -> bytes:
        """The stream's last frame when it fails after it began, in the dialect's shape."""
        return error_event(err)

    def delta(self, text: str, index: int = 0,
              logprobs: list[TokenLogprob] | None = None) -> bytes:
        """A chunk of choice ``index``'s text, with the logprob entries of the tokens
        it completes."""
        raise NotImplementedError

    def scored(self, prompt: list[TokenLogprob]) -> bytes:
        """The prompt's entries (after its first token), when it was scored."""
        return b""

    def finish(self, done: Done) -> bytes:
        """One choice's last frames: the text it held back, then its finish_reason."""
        out = b""
        if done.text or done.logprobs:
            out += self.delta(done.text, done.index, done.logprobs)
        return out + self._tail(done.index) + self._final_chunk(done, self._reason(done))

    def end(self, dones: list[Done], include_usage: bool) -> bytes:
        """After the last choice: the usage chunk, when asked for, and ``[DONE]``."""
        named = b""
        if self.retrieved is not None:
            r = self._envelope(self.object_chunk, [])
            r["retrieved"] = self.retrieved
            named = event(r)
        if not include_usage:
            return named + DONE
        u = self._envelope(self.object_chunk, [])
        u["usage"] = usage(dones)
        return named + event(u) + DONE

    def _tail(self, index: int) -> bytes:
        """Frames for what a subclass still holds when a choice ends."""
        return b""

    def _reason(self, done: Done) -> str:
        return done.finish_reason

    def _final_chunk(self, done: Done, reason: str) -> bytes:
        """A choice's last chunk: ``finish_reason`` and vLLM's ``stop_reason``."""
        raise NotImplementedError

    def whole(self, texts: list[str], dones: list[Done],
              scores: list[Scores] | None = None) -> dict[str, Any]:
        """The whole response: ``texts[i]`` is choice i's, ``dones[i]`` its end."""
        scores = scores or [Scores() for _ in dones]
        out = self._envelope(self.object_whole, [
            self._choice(text, done, score)
            for text, done, score in zip(texts, dones, scores, strict=True)])
        out["usage"] = usage(dones)
        if self.retrieved is not None:
            out["retrieved"] = self.retrieved
        return out

    def _choice(self, text: str, done: Done, scores: Scores) -> dict[str, Any]:
        raise NotImplementedError


@dataclass
class Scores:
    """A collected choice's logprob entries: its tokens', and its prompt's when scored."""

    tokens: list[TokenLogprob] = field(default_factory=list)
    prompt: list[TokenLogprob] | None = None


# A format's maker: the class, or the class with settings of this request bound.
MakeFormat = Callable[..., Format]


@dataclass(frozen=True)
class Echo:
    """The prompt a completion returns before its text (``echo``)."""

    text: str
    tokens: list[int]
    scored: bool  # its logprobs come (in a Scored event) before any text


class CompletionFormat(Format):
    """Completions' shapes; with ``vocab``, the legacy logprobs (each choice's offsets
    its own); with ``echo``, the prompt first, in every choice."""

    object_whole = "text_completion"
    object_chunk = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, model: str, created: int, n: int = 1, *,
                 fingerprint: str | None = None, vocab: Vocabulary | None = None,
                 echo: Echo | None = None) -> None:
        super().__init__(model, created, n, fingerprint=fingerprint)
        self.logprobs = ([CompletionLogprobs(vocab) for _ in range(n)]
                         if vocab is not None else None)
        self.echo = echo

    def start(self) -> bytes:
        if self.echo is None or self.echo.scored:
            return b""
        return b"".join(self._text(self.echo.text, i, None) for i in range(self.n))

    def scored(self, prompt: list[TokenLogprob]) -> bytes:
        echo, logprobs = self.echo, self.logprobs
        assert echo is not None and logprobs is not None
        return b"".join(self._text(echo.text, i, lp.prompt(echo.tokens, prompt, echo.text))
                        for i, lp in enumerate(logprobs))

    def delta(self, text: str, index: int = 0,
              logprobs: list[TokenLogprob] | None = None) -> bytes:
        if self.logprobs is None:
            return self._text_chunk(text, index, self._text_choice)
        return self._text(text, index, self.logprobs[index].tokens(logprobs or []))

    def _text(self, text: str, index: int, logprobs: dict[str, Any] | None) -> bytes:
        return self._chunk(self._text_choice(text, index, logprobs))

    @staticmethod
    def _text_choice(text: str, index: int, logprobs: dict[str, Any] | None = None
                     ) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}

    def _final_chunk(self, done: Done, reason: str) -> bytes:
        return self._chunk({"index": done.index, "text": "", "logprobs": None,
                            "finish_reason": reason, "stop_reason": done.stop_reason})

    def _choice(self, text: str, done: Done, scores: Scores) -> dict[str, Any]:
        logprobs = None
        if self.logprobs is not None:
            lp = self.logprobs[done.index]
            parts = []  # the prompt's first: the offsets run on
            if self.echo is not None and scores.prompt is not None:
                parts.append(lp.prompt(self.echo.tokens, scores.prompt, self.echo.text))
            logprobs = joined([*parts, lp.tokens(scores.tokens)])
        if self.echo is not None:
            text = self.echo.text + text
        return {"index": done.index, "text": text, "logprobs": logprobs,
                "finish_reason": done.finish_reason, "stop_reason": done.stop_reason}


class ChatFormat(Format):
    """Chat's shapes. With ``tools``, the answer's ``<tool_call>`` blocks are parsed
    out of the content (forged.http.tools) and sent as ``tool_calls``: each choice
    has a parser of its own, since each writes its own calls. With ``vocab``,
    logprobs: with tools they cover every generated token, the calls' text included,
    each chunk carrying those of the text it was made from (text the parser holds back
    keeps its entries for the next chunk)."""

    object_whole = "chat.completion"
    object_chunk = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(self, model: str, created: int, n: int = 1, *, tools: bool = False,
                 fingerprint: str | None = None, vocab: Vocabulary | None = None) -> None:
        super().__init__(model, created, n, fingerprint=fingerprint)
        self.parsers = [ToolCallParser() for _ in range(n)] if tools else None
        self.logprobs = ChatLogprobs(vocab) if vocab is not None else None
        # Each choice's entries for its next chunk.
        self._pending: list[list[TokenLogprob]] = [[] for _ in range(n)]

    def start(self) -> bytes:
        return b"".join(self._chunk({"index": i, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None})
                        for i in range(self.n))

    def delta(self, text: str, index: int = 0,
              logprobs: list[TokenLogprob] | None = None) -> bytes:
        if self.parsers is None and self.logprobs is None:
            return self._text_chunk(text, index, self._content)
        self._pending[index] += logprobs or []
        choices = self._choices(text, index)
        if choices:
            choices[-1]["logprobs"] = self._take_logprobs(index)
        return b"".join(self._chunk(c) for c in choices)

    def _choices(self, text: str, index: int) -> list[dict[str, Any]]:
        if self.parsers is None:
            return [self._content(text, index)]
        parser = self.parsers[index]
        before = len(parser.calls)
        content, calls = parser.feed(text)
        out = [self._content(content, index)] if content else []
        out += [{"index": index, "delta": {"tool_calls": [call.openai(i)]}, "logprobs": None,
                 "finish_reason": None} for i, call in enumerate(calls, before)]
        return out

    def _take_logprobs(self, index: int) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        entries, self._pending[index] = self._pending[index], []
        return self.logprobs.content(entries)

    @staticmethod
    def _content(text: str, index: int) -> dict[str, Any]:
        return {"index": index, "delta": {"content": text}, "logprobs": None,
                "finish_reason": None}

    def _tail(self, index: int) -> bytes:
        rest = self.parsers[index].flush() if self.parsers is not None else ""
        if not rest:
            return b""
        return self._chunk({**self._content(rest, index),
                            "logprobs": self._take_logprobs(index)})

    def _reason(self, done: Done) -> str:
        called = self.parsers is not None and self.parsers[done.index].calls
        return "tool_calls" if called and done.finish_reason == "stop" else done.finish_reason

    def _final_chunk(self, done: Done, reason: str) -> bytes:
        # Entries still held (text the tool-call parser consumed) go with the last chunk.
        logprobs = self._take_logprobs(done.index) if self._pending[done.index] else None
        return self._chunk({"index": done.index, "delta": {}, "logprobs": logprobs,
                            "finish_reason": reason, "stop_reason": done.stop_reason})

    def _choice(self, text: str, done: Done, scores: Scores) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.parsers is not None:
            parser = self.parsers[done.index]
            content, calls = parser.feed(text)
            content += parser.flush()
            message["content"] = content or None
            if calls:
                message["tool_calls"] = [call.openai(i) for i, call in enumerate(calls)]
                for c in message["tool_calls"]:
                    del c["index"]  # a whole message's calls have no index
        return {"index": done.index, "message": message, "finish_reason": self._reason(done),
                "stop_reason": done.stop_reason,
                "logprobs": None if self.logprobs is None
                else self.logprobs.content(scores.tokens)}
