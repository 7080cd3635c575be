"""OpenAI's response objects and SSE frames, for completions and chat completions."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec

from forged.engine import frames as fr
from forged.http.logprobs import ChatLogprobs, CompletionLogprobs, Vocabulary, joined
from forged.http.responses import HTTPError
from forged.http.tools import ToolCallParser

_json = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"


def event(obj: Any) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


def error_event(err: HTTPError) -> bytes:
    return event(err.body) + DONE


def usage(done: fr.Done) -> dict[str, Any]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    }


@dataclass
class Scores:
    """A collected answer's logprob entries: its tokens', and its prompt's when scored."""

    tokens: list[fr.TokenLogprob] = field(default_factory=list)
    prompt: list[fr.TokenLogprob] | None = None


class Format:
    """One response's id, model and shape; subclasses say how a choice looks."""

    object_whole: ClassVar[str]
    object_chunk: ClassVar[str]
    id_prefix: ClassVar[str]

    def __init__(self, model: str, created: int) -> None:
        self.id = self.id_prefix + uuid.uuid4().hex
        self.model = model
        self.created = created

    def _envelope(self, obj: str, choices: list[Any]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def _chunk(self, choice: dict[str, Any]) -> bytes:
        return event(self._envelope(self.object_chunk, [choice]))

    def start(self) -> bytes:
        return b""

    def delta(self, text: str, logprobs: list[fr.TokenLogprob] | None = None) -> bytes:
        """A chunk of text, with the logprob entries of the tokens it completes."""
        raise NotImplementedError

    def scored(self, prompt: list[fr.TokenLogprob]) -> bytes:
        """The prompt's entries (after its first token), when it was scored."""
        return b""

    def finish(self, done: fr.Done, include_usage: bool) -> bytes:
        out = b""
        if done.text or done.logprobs:
            out += self.delta(done.text, done.logprobs)
        out += self._tail()
        out += self._final_chunk(self._reason(done))
        if include_usage:
            u = self._envelope(self.object_chunk, [])
            u["usage"] = usage(done)
            out += event(u)
        return out + DONE

    def _tail(self) -> bytes:
        """Frames for what a subclass still holds when the answer ends."""
        return b""

    def _reason(self, done: fr.Done) -> str:
        return done.finish_reason

    def _final_chunk(self, reason: str) -> bytes:
        raise NotImplementedError

    def whole(self, text: str, done: fr.Done, scores: Scores | None = None
              ) -> dict[str, Any]:
        raise NotImplementedError


# A format's maker: the class, or the class with settings of this request bound.
MakeFormat = Callable[..., Format]


@dataclass(frozen=True)
class Echo:
    """The prompt a completion returns before its text (``echo``)."""

    text: str
    tokens: list[int]
    scored: bool  # its logprobs come (in a Scored event) before any text


class CompletionFormat(Format):
    """Completions' shapes; with ``vocab``, the legacy logprobs; with ``echo``, the
    prompt first."""

    object_whole = "text_completion"
    object_chunk = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, model: str, created: int, *, vocab: Vocabulary | None = None,
                 echo: Echo | None = None) -> None:
        super().__init__(model, created)
        self.logprobs = CompletionLogprobs(vocab) if vocab is not None else None
        self.echo = echo

    def start(self) -> bytes:
        if self.echo is None or self.echo.scored:
            return b""
        return self._text(self.echo.text, None)

    def scored(self, prompt: list[fr.TokenLogprob]) -> bytes:
        assert self.echo is not None and self.logprobs is not None
        return self._text(self.echo.text, self.logprobs.prompt(self.echo.tokens, prompt,
                                                               self.echo.text))

    def delta(self, text: str, logprobs: list[fr.TokenLogprob] | None = None) -> bytes:
        return self._text(text, None if self.logprobs is None
                          else self.logprobs.tokens(logprobs or []))

    def _text(self, text: str, logprobs: dict[str, Any] | None) -> bytes:
        return self._chunk({"index": 0, "text": text, "logprobs": logprobs,
                            "finish_reason": None})

    def _final_chunk(self, reason: str) -> bytes:
        return self._chunk({"index": 0, "text": "", "logprobs": None, "finish_reason": reason})

    def whole(self, text: str, done: fr.Done, scores: Scores | None = None
              ) -> dict[str, Any]:
        scores = scores or Scores()
        logprobs = None
        if self.logprobs is not None:
            parts = []  # the prompt's first: the offsets run on
            if self.echo is not None and scores.prompt is not None:
                parts.append(self.logprobs.prompt(self.echo.tokens, scores.prompt,
                                                  self.echo.text))
            logprobs = joined([*parts, self.logprobs.tokens(scores.tokens)])
        if self.echo is not None:
            text = self.echo.text + text
        out = self._envelope(self.object_whole, [
            {"index": 0, "text": text, "logprobs": logprobs,
             "finish_reason": done.finish_reason}
        ])
        out["usage"] = usage(done)
        return out


class ChatFormat(Format):
    """Chat's shapes. With ``tools``, the answer's ``<tool_call>`` blocks are parsed
    out of the content (forged.http.tools) and sent as ``tool_calls``. With ``vocab``,
    logprobs: with tools they cover every generated token, the calls' text included,
    each chunk carrying those of the text it was made from (text the parser holds back
    keeps its entries for the next chunk)."""

    object_whole = "chat.completion"
    object_chunk = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(self, model: str, created: int, *, tools: bool = False,
                 vocab: Vocabulary | None = None) -> None:
        super().__init__(model, created)
        self.parser = ToolCallParser() if tools else None
        self.logprobs = ChatLogprobs(vocab) if vocab is not None else None
        self._pending: list[fr.TokenLogprob] = []  # entries for the next chunk

    def start(self) -> bytes:
        return self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None})

    def delta(self, text: str, logprobs: list[fr.TokenLogprob] | None = None) -> bytes:
        self._pending += logprobs or []
        choices = self._choices(text)
        if choices:
            choices[-1]["logprobs"] = self._take_logprobs()
        return b"".join(self._chunk(c) for c in choices)

    def _choices(self, text: str) -> list[dict[str, Any]]:
        if self.parser is None:
            return [self._content(text)]
        before = len(self.parser.calls)
        content, calls = self.parser.feed(text)
        out = [self._content(content)] if content else []
        out += [{"index": 0, "delta": {"tool_calls": [call.openai(i)]}, "logprobs": None,
                 "finish_reason": None} for i, call in enumerate(calls, before)]
        return out

    def _take_logprobs(self) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        entries, self._pending = self._pending, []
        return self.logprobs.content(entries)

    @staticmethod
    def _content(text: str) -> dict[str, Any]:
        return {"index": 0, "delta": {"content": text}, "logprobs": None,
                "finish_reason": None}

    def _tail(self) -> bytes:
        rest = self.parser.flush() if self.parser is not None else ""
        if not rest:
            return b""
        return self._chunk({**self._content(rest), "logprobs": self._take_logprobs()})

    def _reason(self, done: fr.Done) -> str:
        called = self.parser is not None and self.parser.calls
        return "tool_calls" if called and done.finish_reason == "stop" else done.finish_reason

    def _final_chunk(self, reason: str) -> bytes:
        # Entries still held (text the tool-call parser consumed) go with the last chunk.
        logprobs = self._take_logprobs() if self._pending else None
        return self._chunk({"index": 0, "delta": {}, "logprobs": logprobs,
                            "finish_reason": reason})

    def whole(self, text: str, done: fr.Done, scores: Scores | None = None
              ) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.parser is not None:
            content, calls = self.parser.feed(text)
            content += self.parser.flush()
            message["content"] = content or None
            if calls:
                message["tool_calls"] = [call.openai(i) for i, call in enumerate(calls)]
                for c in message["tool_calls"]:
                    del c["index"]  # a whole message's calls have no index
        out = self._envelope(self.object_whole, [{
            "index": 0, "message": message, "finish_reason": self._reason(done),
            "logprobs": None if self.logprobs is None
            else self.logprobs.content((scores or Scores()).tokens),
        }])
        out["usage"] = usage(done)
        return out
