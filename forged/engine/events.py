"""What a worker tells of a request: admitted, text, a scored prompt, a choice's end,
or a failure. A ``Step`` frame (:mod:`forged.engine.frames`) carries them from the
worker; the pool (:class:`forged.engine.pool.RequestStream`) hands them to http, having
turned a ``Failed`` into the domain error it stands for. http reads these, never the
frames.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from forged.engine.decoding import TokenLogprob


class Admitted(msgspec.Struct, tag="admitted", tag_field="e", forbid_unknown_fields=True):
    rid: int
    cached: int
    queue_time: float


# Text and logprob events leave out fields at their defaults: a request that asked for
# no logprobs pays nothing for them on the wire.
class Delta(msgspec.Struct, tag="delta", tag_field="e", forbid_unknown_fields=True,
            omit_defaults=True):
    rid: int
    text: str
    index: int = 0  # the choice (OpenAI's ``n``)
    # With logprobs: the entries of the tokens whose text this delta completes.
    logprobs: list[TokenLogprob] | None = None


class Scored(msgspec.Struct, tag="scored", tag_field="e", forbid_unknown_fields=True):
    """A request's prompt, scored (``Request.prompt_logprobs``): the entry of each prompt
    token after the first, sent once the whole prompt is computed."""

    rid: int
    logprobs: list[TokenLogprob]


FinishReason = Literal["stop", "length"]
# Why a sequence stopped, in llama.cpp's words: an end-of-generation token, a stop
# string, or a limit (max_tokens, the time limit, a dedent past n_indent).
StopType = Literal["eos", "word", "limit"]


class Done(msgspec.Struct, tag="done", tag_field="e", forbid_unknown_fields=True,
           omit_defaults=True):
    """One choice ended; a request with ``n`` choices ends with its ``n``-th Done."""

    rid: int
    text: str  # the last delta's text, released at the end
    stop_type: StopType
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # From admission to the first token, on the worker: where a request's TTFT went.
    prefill_s: float = 0.0
    prefill_steps: int = 0
    decode_s: float = 0.0  # from the first token to the end
    # vLLM's stop_reason: the stop string or the stop token (of ``stop_tokens``) that
    # ended the answer; None for a model's own end, or a limit.
    stop_reason: str | int | None = None
    index: int = 0  # the choice
    logprobs: list[TokenLogprob] | None = None  # as Delta's, for ``text``
    # An embedding request's answer: one unit-length vector per input, float32
    # little-endian, one after another (the model's embedding length each).
    embeddings: bytes = b""

    @property
    def finish_reason(self) -> FinishReason:
        """OpenAI's name for it."""
        return "length" if self.stop_type == "limit" else "stop"


ErrorCode = Literal["overloaded", "queue_timeout", "engine_error", "bad_request"]


class Failed(msgspec.Struct, tag="failed", tag_field="e", forbid_unknown_fields=True):
    rid: int
    code: ErrorCode
    message: str
    retry_after: float | None = None  # seconds, for "overloaded": the worker's estimate


Event = Admitted | Delta | Scored | Done | Failed
