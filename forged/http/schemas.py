"""Request bodies of the OpenAI-compatible API.

Deliberately *not* ``forbid_unknown_fields``: clients add new fields all the time,
and OpenAI-compatible servers ignore the ones they do not know. A known field with
a wrong type or a value out of range is an error that names the field.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import Meta, Struct

from forged import errors as e

Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
Fraction = Annotated[float, Meta(ge=0.0, le=1.0)]
# A token budget or window where llama.cpp's -1 means "the whole context".
Window = Annotated[int, Meta(ge=-1, le=2**31 - 1)]
# The most choices one request may ask for: each is a sequence of its own in the batch.
MAX_N = 16


class StreamOptions(Struct):
    include_usage: bool = False


class GenerationFields(Struct, kw_only=True):
    """What every generation route takes (completions, chat, infill)."""

    model: str | None = None
    # -1 (llama.cpp's): until the context is full.
    max_tokens: Window | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=-1, le=1_000_000)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    repeat_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)] | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]] | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    # OpenAI's best_of (n to 16, checked against n in forged.http.api): each choice
    # generated takes a sequence, as n's do, so it has n's bound.
    best_of: Annotated[int, Meta(ge=1, le=MAX_N)] | None = None
    user: str | None = None
    # Extensions that llama.cpp's server and vLLM accept.
    ignore_eos: bool = False
    cache_prompt: bool = True
    # forged's scheduling class: interactive (default) or batch (agentic fan-out, jobs).
    priority: Literal["interactive", "batch"] | None = None
    # A conversation's name: its KV stays cached between turns (docs/engine.md).
    session: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    # llama.cpp's sampler chain, in order: names ("top_k", "dry", ...) or its letters
    # ("edkypmxt"); llama.cpp's default chain when absent (forged.http.sampling).
    samplers: Annotated[list[str], Meta(max_length=16)] | Annotated[
        str, Meta(max_length=16)] | None = None
    # llama.cpp's other samplers; absent or at their "off" value, each is left out.
    typical_p: Fraction | None = None
    top_n_sigma: Annotated[float, Meta(ge=-1e6, le=1e6)] | None = None
    dynatemp_range: Annotated[float, Meta(ge=0.0, le=10.0)] | None = None
    dynatemp_exponent: Annotated[float, Meta(ge=0.0, le=100.0)] | None = None
    xtc_probability: Fraction | None = None
    xtc_threshold: Fraction | None = None
    repeat_last_n: Window | None = None
    dry_multiplier: Annotated[float, Meta(ge=0.0, le=1000.0)] | None = None
    dry_base: Annotated[float, Meta(ge=0.0, le=100.0)] | None = None
    dry_allowed_length: Annotated[int, Meta(ge=0, le=2**31 - 1)] | None = None
    dry_penalty_last_n: Window | None = None
    # llama.cpp cuts a breaker at 40 characters and tokenizes each against the whole
    # vocabulary: a few short ones.
    dry_sequence_breakers: Annotated[list[Annotated[str, Meta(min_length=1, max_length=40)]],
                                     Meta(min_length=1, max_length=8)] | None = None
    mirostat: Literal[0, 1, 2] | None = None
    mirostat_tau: Annotated[float, Meta(ge=0.0, le=100.0)] | None = None
    mirostat_eta: Annotated[float, Meta(ge=0.0, le=10.0)] | None = None
    min_keep: Annotated[int, Meta(ge=0, le=2**31 - 1)] | None = None
    # Structured output (forged.http.structured): OpenAI's, llama.cpp's and vLLM's words.
    response_format: dict[str, Any] | None = None
    json_schema: dict[str, Any] | None = None
    grammar: Annotated[str, Meta(max_length=65536)] | None = None
    guided_json: dict[str, Any] | None = None
    guided_choice: Annotated[list[str], Meta(max_length=256)] | None = None
    # vLLM's: no end-of-generation or stop token (nor stop string) before this many
    # tokens; repeat_penalty's other name; the stop string kept at the end of the text;
    # token ids that end the answer as end-of-generation does.
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] | None = None
    include_stop_str_in_output: bool = False
    stop_token_ids: Annotated[list[int], Meta(max_length=256)] | None = None
    # A repository index the prompt draws on (forged.http.retrieve); absent: the API
    # key's default_repo, if it has one.
    repo: str | None = None

    def content(self) -> object:
        """What the caller asked, as the access log shows it with log.log_content: a
        chat's messages, the prompt of a completion or an infill."""
        raise NotImplementedError

    def editor_bounds(self) -> tuple[float, int]:
        """llama.cpp's ``t_max_predict_ms`` and ``n_indent``: taken by its native
        routes (/infill, /completion), none elsewhere."""
        return 0.0, 0


# OpenAI's bound on the alternatives per token (vLLM's default max_logprobs too).
MAX_TOP_LOGPROBS = 20
TopLogprobs = Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)]


class CompletionRequest(GenerationFields, kw_only=True):
    # Whether max_tokens 0 without echo warms the cache up (llama.cpp's n_predict 0), or
    # asks for nothing at all (OpenAI's, a 400).
    warms_up: ClassVar[bool] = False
    # A string, token ids, or a one-element list of either (as evaluation harnesses
    # send a batch of one).
    prompt: str | list[int | str | list[int]]
    # 0 (only with echo): nothing generated; with logprobs, the prompt scored
    # (forged.http.logprobs). -1: until the context is full.
    max_tokens: Window | None = None
    # Fill-in-the-middle: the code after the completion (the prompt is the code before).
    suffix: str | None = None
    logprobs: TopLogprobs | None = None
    echo: bool = False

    def content(self) -> object:
        return self.prompt


class ContentPart(Struct):
    type: str
    text: str | None = None


Role = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(Struct):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # An assistant's earlier calls, and a tool's answer to one (forged.http.tools).
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatRequest(GenerationFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: Window | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Extra variables for the chat template (vLLM's), e.g. {"enable_thinking": false}.
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None

    def content(self) -> object:
        return self.messages


completion_decoder = msgspec.json.Decoder(CompletionRequest)
chat_decoder = msgspec.json.Decoder(ChatRequest)


# Where msgspec says the error is: a path, or a key of the map at a path.
_AT = re.compile(r" - at `(?:key` in `)?\$\.?([^`]*)`$")
# An error about a field of the object at the path: one missing, or one a strict body
# does not know. The field is the param, under the object's path.
_FIELD = re.compile(r"^Object (?:missing required|contains unknown) field `([^`]*)`")


def error_path(text: str) -> tuple[str, str]:
    """A validation error's message, and the path it names as a param ("" for the body
    itself): a map's entry, which msgspec writes as ``[...]``, is the map."""
    m = _AT.search(text)
    return _AT.sub("", text), m.group(1).partition("[...]")[0] if m else ""


def body_error(exc: msgspec.MsgspecError) -> e.BadRequest:
    """A body that is not JSON, or JSON of the wrong shape, as a BadRequest naming the
    field."""
    text = str(exc)
    if isinstance(exc, msgspec.ValidationError):
        message, where = error_path(text)
        param = where
        if field := _FIELD.match(message):
            param = f"{where}.{field.group(1)}" if where else field.group(1)
        return e.BadRequest(f"{message} (at {where})" if where else message, param or None)
    return e.BadRequest(f"We could not parse the JSON body of your request: {text}")


_JSON_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def json_depth(body: bytes) -> int:
    """Deepest nesting of arrays and objects, skipping brackets inside strings."""
    depth = deepest = 0
    for m in _JSON_TOKENS.finditer(body):
        tok = m.group()
        if tok in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        elif tok in (b"]", b"}"):
            depth -= 1
    return deepest
