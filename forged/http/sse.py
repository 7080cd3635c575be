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


def usage(dones: list[fr.Done]) -> dict[str, Any]:
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

    def __init__(self, model: str, created: int, n: int = 1, *,
                 fingerprint: str | None = None) -> None:
        self.id = self.id_prefix + uuid.uuid4().hex
        self.model = model
        self.created = created
        self.n = n
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

    def delta(self, text: str, index: int = 0) -> bytes:
        raise NotImplementedError

    def finish(self, done: fr.Done) -> bytes:
        """One choice's last frames: the text it held back, then its finish_reason."""
        out = self.delta(done.text, done.index) if done.text else b""
        return out + self._tail(done.index) + self._final_chunk(done, self._reason(done))

    def end(self, dones: list[fr.Done], include_usage: bool) -> bytes:
        """After the last choice: the usage chunk, when asked for, and ``[DONE]``."""
        if not include_usage:
            return DONE
        u = self._envelope(self.object_chunk, [])
        u["usage"] = usage(dones)
        return event(u) + DONE

    def _tail(self, index: int) -> bytes:
        """Frames for what a subclass still holds when a choice ends."""
        return b""

    def _reason(self, done: fr.Done) -> str:
        return done.finish_reason

    def _final_chunk(self, done: fr.Done, reason: str) -> bytes:
        """A choice's last chunk: ``finish_reason`` and vLLM's ``stop_reason``."""
        raise NotImplementedError

    def whole(self, texts: list[str], dones: list[fr.Done]) -> dict[str, Any]:
        """The whole response: ``texts[i]`` is choice i's, ``dones[i]`` its end."""
        out = self._envelope(self.object_whole, [
            self._choice(text, done) for text, done in zip(texts, dones, strict=True)])
        out["usage"] = usage(dones)
        return out

    def _choice(self, text: str, done: fr.Done) -> dict[str, Any]:
        raise NotImplementedError


# A format's maker: the class, or the class with settings of this request bound.
MakeFormat = Callable[..., Format]


class CompletionFormat(Format):
    object_whole = "text_completion"
    object_chunk = "text_completion"
    id_prefix = "cmpl-"

    def delta(self, text: str, index: int = 0) -> bytes:
        return self._chunk({"index": index, "text": text, "logprobs": None,
                            "finish_reason": None})

    def _final_chunk(self, done: fr.Done, reason: str) -> bytes:
        return self._chunk({"index": done.index, "text": "", "logprobs": None,
                            "finish_reason": reason, "stop_reason": done.stop_reason})

    def _choice(self, text: str, done: fr.Done) -> dict[str, Any]:
        return {"index": done.index, "text": text, "logprobs": None,
                "finish_reason": done.finish_reason, "stop_reason": done.stop_reason}


class ChatFormat(Format):
    """Chat's shapes. With ``tools``, the answer's ``<tool_call>`` blocks are parsed
    out of the content (forged.http.tools) and sent as ``tool_calls``: each choice
    has a parser of its own, since each writes its own calls."""

    object_whole = "chat.completion"
    object_chunk = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(self, model: str, created: int, n: int = 1, *, tools: bool = False,
                 fingerprint: str | None = None) -> None:
        super().__init__(model, created, n, fingerprint=fingerprint)
        self.parsers = [ToolCallParser() for _ in range(n)] if tools else None

    def start(self) -> bytes:
        return b"".join(self._chunk({"index": i, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None})
                        for i in range(self.n))

    def delta(self, text: str, index: int = 0) -> bytes:
        if self.parsers is None:
            return self._content(text, index)
        parser = self.parsers[index]
        before = len(parser.calls)
        content, calls = parser.feed(text)
        out = self._content(content, index) if content else b""
        for i, call in enumerate(calls, before):
            out += self._chunk({"index": index, "delta": {"tool_calls": [call.openai(i)]},
                                "logprobs": None, "finish_reason": None})
        return out

    def _content(self, text: str, index: int) -> bytes:
        return self._chunk({"index": index, "delta": {"content": text}, "logprobs": None,
                            "finish_reason": None})

    def _tail(self, index: int) -> bytes:
        rest = self.parsers[index].flush() if self.parsers is not None else ""
        return self._content(rest, index) if rest else b""

    def _reason(self, done: fr.Done) -> str:
        called = self.parsers is not None and self.parsers[done.index].calls
        return "tool_calls" if called and done.finish_reason == "stop" else done.finish_reason

    def _final_chunk(self, done: fr.Done, reason: str) -> bytes:
        return self._chunk({"index": done.index, "delta": {}, "logprobs": None,
                            "finish_reason": reason, "stop_reason": done.stop_reason})

    def _choice(self, text: str, done: fr.Done) -> dict[str, Any]:
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
        return {"index": done.index, "message": message, "logprobs": None,
                "finish_reason": self._reason(done), "stop_reason": done.stop_reason}
