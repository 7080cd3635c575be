"""OpenAI's Responses API, the answer's side: the ``response`` object, its output items
and the stream's events, as a :class:`~forged.http.sse.ChatFormat` that
:func:`forged.http.api.run_chat` drives like any other.

A response's ``output`` is a list of items: a ``message`` (role assistant, one
``output_text`` part) for text, a ``function_call`` for each tool call (forged's
:class:`~forged.http.tools.ToolCallParser` splits the model's ``<tool_call>`` blocks
out of its text, as on chat). Text after a call opens a new message. :class:`Output`
builds the items and, for a stream, the events that make them; the whole response
is made by the same code, its events dropped, so both paths give the same items.

A stream is ``event: NAME\\ndata: JSON\\n\\n`` frames, each with its
``sequence_number``::

    response.created, response.in_progress
    per message:   response.output_item.added, response.content_part.added,
                   response.output_text.delta..., response.output_text.done,
                   response.content_part.done, response.output_item.done
    per call:      response.output_item.added, response.function_call_arguments.delta,
                   response.function_call_arguments.done, response.output_item.done
    response.completed (response.incomplete when max_output_tokens cut it short)

A failure after the stream began is a last ``response.failed``, whose response
carries the error. Nothing ends the stream but the last event (no ``[DONE]``).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec

from forged.engine.decoding import TokenLogprob
from forged.engine.events import Done
from forged.http.responses import HTTPError
from forged.http.sse import ChatFormat, Scores
from forged.http.tools import ToolCall

_json = msgspec.json.Encoder()
Event = dict[str, Any]


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class Output:
    """A response's output items as the answer is made, and the events that make them.
    At most one message is open (taking text) at a time."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._text: list[str] | None = None  # the open message's text so far

    def text(self, piece: str) -> list[Event]:
        if not piece:
            return []
        events = self._open() if self._text is None else []
        assert self._text is not None
        self._text.append(piece)
        return [*events, self._at({"type": "response.output_text.delta", "content_index": 0,
                                   "delta": piece, "logprobs": []})]

    def _open(self) -> list[Event]:
        self._text = []
        item = {"id": "msg_" + uuid.uuid4().hex, "type": "message", "status": "in_progress",
                "role": "assistant", "content": []}
        self.items.append(item)
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1,
                 "item": dict(item)},
                self._at({"type": "response.content_part.added", "content_index": 0,
                          "part": _part("")})]

    def call(self, call: ToolCall) -> list[Event]:
        """A call the model made, whole: its events come at once."""
        events = self.close("completed")
        item = {"id": "fc_" + uuid.uuid4().hex, "type": "function_call",
                "status": "completed", "call_id": call.id, "name": call.name,
                "arguments": call.arguments}
        self.items.append(item)
        return [*events,
                {"type": "response.output_item.added", "output_index": len(self.items) - 1,
                 "item": {**item, "status": "in_progress", "arguments": ""}},
                self._at({"type": "response.function_call_arguments.delta",
                          "delta": call.arguments}),
                self._at({"type": "response.function_call_arguments.done", "name": call.name,
                          "arguments": call.arguments}),
                self._done()]

    def close(self, status: str) -> list[Event]:
        """End the open message, if any; ``status``: completed, or incomplete when the
        answer was cut short."""
        if self._text is None:
            return []
        text, self._text = "".join(self._text), None
        part = _part(text)
        self.items[-1].update(status=status, content=[part])
        return [self._at({"type": "response.output_text.done", "content_index": 0,
                          "text": text, "logprobs": []}),
                self._at({"type": "response.content_part.done", "content_index": 0,
                          "part": part}),
                self._done()]

    def _at(self, event: Event) -> Event:
        """``event`` about the last item."""
        return {**event, "item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _done(self) -> Event:
        return {"type": "response.output_item.done", "output_index": len(self.items) - 1,
                "item": dict(self.items[-1])}


def usage(done: Done) -> dict[str, Any]:
    return {"input_tokens": done.prompt_tokens,
            "input_tokens_details": {"cached_tokens": done.cached_tokens},
            "output_tokens": done.completion_tokens,
            # A thinking model's reasoning is part of its text (as on chat).
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": done.prompt_tokens + done.completion_tokens}


@dataclass(frozen=True)
class Turn:
    """What one request's response repeats of its request (``echo``: the fields of the
    response object that say how it was asked for), and what is done with the
    finished response (``keep``: stored, or nothing)."""

    echo: dict[str, Any]
    keep: Callable[[dict[str, Any], list[dict[str, Any]]], None]


class ResponsesFormat(ChatFormat):
    """The Responses API's shapes for one request (``n`` is always 1). A subclass bound
    to the request's :class:`Turn` is made by :func:`bound`, since ``run_chat`` takes
    a class."""

    id_prefix = "resp_"
    turn: ClassVar[Turn]

    def __init__(self, model: str, created: int, n: int = 1, **kwargs: Any) -> None:
        super().__init__(model, created, n, **kwargs)
        self.output = Output()
        self._seq = 0

    def _frames(self, events: list[Event]) -> bytes:
        out = []
        for ev in events:
            ev["sequence_number"] = self._seq
            self._seq += 1
            out.append(b"event: " + ev["type"].encode() + b"\ndata: " + _json.encode(ev)
                       + b"\n\n")
        return b"".join(out)

    def response(self, status: str, done: Done | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The response object as it stands."""
        out = {"id": self.id, "object": "response", "created_at": self.created,
               "status": status, "error": error,
               "incomplete_details": {"reason": "max_output_tokens"}
               if status == "incomplete" else None,
               "model": self.model, "output": self.output.items,
               "usage": None if done is None else usage(done), **self.turn.echo}
        if self.retrieved is not None:
            out["retrieved"] = self.retrieved
        return out

    def start(self) -> bytes:
        return self._frames([{"type": "response.created",
                              "response": self.response("in_progress")},
                             {"type": "response.in_progress",
                              "response": self.response("in_progress")}])

    def delta(self, text: str, index: int = 0,
              logprobs: list[TokenLogprob] | None = None) -> bytes:
        return self._frames(self._feed(text))

    def _feed(self, text: str) -> list[Event]:
        if self.parsers is None:
            return self.output.text(text)
        content, calls = self.parsers[0].feed(text)
        return self.output.text(content) + [ev for c in calls for ev in self.output.call(c)]

    def _tail(self, index: int) -> bytes:
        rest = self.parsers[0].flush() if self.parsers is not None else ""
        return self._frames(self.output.text(rest))

    def _final_chunk(self, done: Done, reason: str) -> bytes:
        return self._frames(self.output.close(_status(done)))

    def finish(self, done: Done) -> bytes:
        """The answer's last frames, then the last event: the whole response (usage is
        always in it). Here, not in ``end``: forged.http.generate makes ``end``'s frames
        before ``finish``'s, and the one choice's end is the response's."""
        frames = super().finish(done)
        status = _status(done)
        whole = self._finished(status, done)
        return frames + self._frames([{"type": f"response.{status}", "response": whole}])

    def end(self, dones: list[Done], include_usage: bool) -> bytes:
        return b""

    def whole(self, texts: list[str], dones: list[Done],
              scores: list[Scores] | None = None) -> dict[str, Any]:
        self._feed(texts[0])
        self._tail(0)
        status = _status(dones[0])
        self.output.close(status)
        return self._finished(status, dones[0])

    def _finished(self, status: str, done: Done) -> dict[str, Any]:
        whole = self.response(status, done)
        self.turn.keep(whole, self.output.items)
        return whole

    def error(self, err: HTTPError) -> bytes:
        detail = err.body.error
        failed = self.response("failed", error={
            "code": _ERROR_CODES.get(err.status, "server_error"), "message": detail.message,
            "param": detail.param, "type": detail.type})
        return self._frames([{"type": "response.failed", "response": failed}])


# A failed response's error code (the Responses API's vocabulary), by HTTP status.
_ERROR_CODES = {400: "invalid_prompt", 429: "rate_limit_exceeded"}


def _status(done: Done) -> str:
    return "incomplete" if done.finish_reason == "length" else "completed"


def bound(turn: Turn) -> type[ResponsesFormat]:
    """:class:`ResponsesFormat` for one request."""

    class Bound(ResponsesFormat):
        pass

    Bound.turn = turn
    return Bound
