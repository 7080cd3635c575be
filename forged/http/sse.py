"""OpenAI's response objects and SSE frames, for completions and chat completions."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any, ClassVar

import msgspec

from forged.engine import frames as fr
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
        # Nothing is hidden from the answer: a thinking model's reasoning is in the
        # content, counted as completion tokens, as vLLM does without a reasoning parser.
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


class Format:
    """One response's id, model and shape; subclasses say how a choice looks."""

    object_whole: ClassVar[str]
    object_chunk: ClassVar[str]
    id_prefix: ClassVar[str]

    def __init__(self, model: str, created: int, *, fingerprint: str | None = None) -> None:
        self.id = self.id_prefix + uuid.uuid4().hex
        self.model = model
        self.created = created
        self.fingerprint = fingerprint  # OpenAI's system_fingerprint, where it has one

    def _envelope(self, obj: str, choices: list[Any]) -> dict[str, Any]:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
               "choices": choices}
        if self.fingerprint is not None:
            out["system_fingerprint"] = self.fingerprint
        return out

    def _chunk(self, choice: dict[str, Any]) -> bytes:
        return event(self._envelope(self.object_chunk, [choice]))

    def start(self) -> bytes:
        return b""

    def delta(self, text: str) -> bytes:
        raise NotImplementedError

    def finish(self, done: fr.Done, include_usage: bool) -> bytes:
        out = b""
        if done.text:
            out += self.delta(done.text)
        out += self._tail()
        out += self._final_chunk(self._reason(done), done.stop_reason)
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

    def _final_chunk(self, reason: str, stop_reason: str | int | None) -> bytes:
        """The last choice chunk: ``finish_reason`` and vLLM's ``stop_reason``."""
        raise NotImplementedError

    def whole(self, text: str, done: fr.Done) -> dict[str, Any]:
        raise NotImplementedError


# A format's maker: the class, or the class with settings of this request bound.
MakeFormat = Callable[..., Format]


class CompletionFormat(Format):
    object_whole = "text_completion"
    object_chunk = "text_completion"
    id_prefix = "cmpl-"

    def delta(self, text: str) -> bytes:
        return self._chunk({"index": 0, "text": text, "logprobs": None, "finish_reason": None})

    def _final_chunk(self, reason: str, stop_reason: str | int | None) -> bytes:
        return self._chunk({"index": 0, "text": "", "logprobs": None, "finish_reason": reason,
                            "stop_reason": stop_reason})

    def whole(self, text: str, done: fr.Done) -> dict[str, Any]:
        out = self._envelope(self.object_whole, [
            {"index": 0, "text": text, "logprobs": None, "finish_reason": done.finish_reason,
             "stop_reason": done.stop_reason}
        ])
        out["usage"] = usage(done)
        return out


class ChatFormat(Format):
    """Chat's shapes. With ``tools``, the answer's ``<tool_call>`` blocks are parsed
    out of the content (forged.http.tools) and sent as ``tool_calls``."""

    object_whole = "chat.completion"
    object_chunk = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(self, model: str, created: int, *, tools: bool = False,
                 fingerprint: str | None = None) -> None:
        super().__init__(model, created, fingerprint=fingerprint)
        self.parser = ToolCallParser() if tools else None

    def start(self) -> bytes:
        return self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None})

    def delta(self, text: str) -> bytes:
        if self.parser is None:
            return self._content(text)
        before = len(self.parser.calls)
        content, calls = self.parser.feed(text)
        out = self._content(content) if content else b""
        for i, call in enumerate(calls, before):
            out += self._chunk({"index": 0, "delta": {"tool_calls": [call.openai(i)]},
                                "logprobs": None, "finish_reason": None})
        return out

    def _content(self, text: str) -> bytes:
        return self._chunk({"index": 0, "delta": {"content": text}, "logprobs": None,
                            "finish_reason": None})

    def _tail(self) -> bytes:
        rest = self.parser.flush() if self.parser is not None else ""
        return self._content(rest) if rest else b""

    def _reason(self, done: fr.Done) -> str:
        called = self.parser is not None and self.parser.calls
        return "tool_calls" if called and done.finish_reason == "stop" else done.finish_reason

    def _final_chunk(self, reason: str, stop_reason: str | int | None) -> bytes:
        return self._chunk({"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason,
                            "stop_reason": stop_reason})

    def whole(self, text: str, done: fr.Done) -> dict[str, Any]:
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
            "index": 0, "message": message, "logprobs": None,
            "finish_reason": self._reason(done), "stop_reason": done.stop_reason,
        }])
        out["usage"] = usage(done)
        return out
