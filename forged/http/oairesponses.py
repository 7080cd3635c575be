"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}``, as a thin translation to forged's one chat request and back.

Theory of operation. A body is decoded strictly (an unknown field is a 400 naming
it, unlike chat's lenient body: the Responses API is new and its clients send what
they mean). Its ``input`` items become chat messages: ``message`` items by role
(``developer`` as ``system``), a ``function_call`` item as an assistant's tool call
(consecutive calls, and the text just before them, one assistant turn), a
``function_call_output`` item as a tool message; ``instructions`` is a system message
in front. ``tools`` (functions), ``tool_choice``, ``text.format`` (structured output)
and the sampling fields map to chat's, and :func:`forged.http.api.run_chat` runs it,
answering in :mod:`forged.http.oaioutput`'s shapes. Fields the API defines that
forged cannot honour (reasoning effort, built-in tools, background runs, truncation,
logprobs, ...) are refused by name; their values that ask for nothing are accepted.

Stored responses (:mod:`forged.http.oaistore`). With ``store`` (the default), a
finished response is kept with its conversation: the previous response's, this
request's input items, and its output. A request with ``previous_response_id`` is
that conversation followed by its own input (``instructions`` are not carried over,
as OpenAI does). A conversation's turns share one engine ``session`` (forged.http.api's
``session``: its KV stays pinned between turns, and is unpinned once no stored response
holds it), so a follow-up computes only its new tokens, which
``usage.input_tokens_details.cached_tokens`` shows. Without ``store``
nothing is kept, and with ``prompt_cache_key`` that key names the session instead.
"""

from __future__ import annotations

import functools
import re
import time
import uuid
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta, Struct
from quart import Response, request
from quart_trio import QuartTrio

from forged import errors as e
from forged.http.api import decoded_body, engine_session, run_chat
from forged.http.lifetime import call
from forged.http.oaioutput import Turn, bound
from forged.http.oaistore import ResponseStore, Stored
from forged.http.refused import Refused, refuse, unsupported
from forged.http.responses import json_response
from forged.http.schemas import ChatMessage, ChatRequest, error_path
from forged.http.state import AppState

T = TypeVar("T")


class _Strict(Struct, forbid_unknown_fields=True, kw_only=True):
    pass


# --- the body --------------------------------------------------------------------------


class JsonSchemaFormat(_Strict, tag="json_schema", tag_field="type"):
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    schema: dict[str, Any]
    # Echoed by a stored response, never in a prompt: bounded as the schema is.
    description: Annotated[str, Meta(max_length=65536)] | None = None
    strict: bool | None = None  # the schema is always enforced (a grammar)


class JsonObjectFormat(_Strict, tag="json_object", tag_field="type"):
    pass


class TextFormat(_Strict, tag="text", tag_field="type"):
    pass


class TextConfig(_Strict):
    format: TextFormat | JsonObjectFormat | JsonSchemaFormat | None = None
    verbosity: Any = None  # refused unless medium (the default)


class FunctionTool(_Strict, tag="function", tag_field="type"):
    name: str
    parameters: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None  # a call is always constrained by its schema


class StreamOptions(_Strict):
    include_obfuscation: Any = None  # refused if true: no obfuscation padding is sent


Metadata = Annotated[dict[Annotated[str, Meta(max_length=64)],
                          Annotated[str, Meta(max_length=512)]], Meta(max_length=16)]
# What a stored response echoes and its prompt never holds: bounded, so that the store
# holds its conversations' text, not megabytes of an identifier per response.
Identifier = Annotated[str, Meta(max_length=256)]


class ResponsesBody(_Strict):
    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    tools: Annotated[list[dict[str, Any]], Meta(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    metadata: Metadata | None = None
    text: TextConfig | None = None
    store: bool = True
    previous_response_id: str | None = None
    # Only to name the engine session: forged's prefix cache needs no key.
    prompt_cache_key: Annotated[str, Meta(min_length=1, max_length=200)] | None = None
    # Identifiers of the end user: recorded by OpenAI, and changing no output.
    user: Identifier | None = None
    safety_identifier: Identifier | None = None
    # Codex sends its session's, thread's and window's ids, and its turn's metadata, on
    # every request (codex-rs/core/src/responses_metadata.rs): read by OpenAI's servers,
    # changing no output, neither kept nor echoed.
    client_metadata: dict[str, str] | None = None
    # Refused unless they ask for nothing (_REFUSED).
    reasoning: Any = None
    include: list[str] | None = None
    background: Any = None
    truncation: Any = None
    service_tier: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None
    prompt: Any = None
    conversation: Any = None
    prompt_cache_retention: Any = None


_REFUSED: dict[str, Refused] = {
    "background": Refused("background responses are not supported", (None, False)),
    "truncation": Refused("an input that does not fit the context is refused, never "
                          "truncated", (None, "disabled")),
    "service_tier": Refused("service tiers are not supported: use forged's priority "
                            "classes (an API key's priority)", (None, "auto", "default")),
    "top_logprobs": Refused("logprobs are not supported on /v1/responses (they are on "
                            "/v1/chat/completions)", (None, 0)),
    "max_tool_calls": Refused("a bound on tool calls is not supported"),
    "prompt": Refused("stored prompt templates are not supported"),
    "conversation": Refused("conversations are not supported: use previous_response_id"),
    "prompt_cache_retention": Refused("a cached prompt is kept as long as memory allows",
                                      (None, "in_memory")),
}
_REASONING_OFF: dict[str, tuple[Any, ...]] = {
    "effort": (None, "none"), "summary": (None,), "generate_summary": (None,)}
# What `include` may ask for: forged writes no reasoning items, so there is no
# reasoning content to withhold from a response that is not stored.
_INCLUDABLE = ("reasoning.encrypted_content",)

_object_decoder = msgspec.json.Decoder(dict[str, Any])
_UNKNOWN = re.compile(r"^Object contains unknown field `([^`]*)`")
_MISSING = re.compile(r"^Object missing required field `([^`]*)`")


def _convert(value: Any, kind: type[T], where: str = "") -> T:
    """``value`` as ``kind``; a mismatch is a 400 naming the field (its path under
    ``where``), an unknown field too."""
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        text, at = error_path(str(exc))
        path = _joined(where, at)
        if unknown := _UNKNOWN.match(text):
            path = _joined(path, unknown.group(1))
            raise e.BadRequest(f"unknown field `{path}`: the Responses API has no such "
                               "field, or forged does not support it", param=path,
                               code="unsupported_field") from exc
        if missing := _MISSING.match(text):
            path = _joined(path, missing.group(1))
        raise e.BadRequest(f"{text} (at {path})" if path else text, param=path or None) from exc


def _joined(where: str, path: str) -> str:
    if not where or not path:
        return where or path
    return where + path if path.startswith("[") else f"{where}.{path}"


def _refuse(body: ResponsesBody) -> None:
    """A 400 naming the first field that asks for what forged cannot do."""
    refuse(body, _REFUSED)
    reasoning = body.reasoning
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise unsupported("reasoning must be an object", "reasoning")
        for name, value in reasoning.items():
            if value not in _REASONING_OFF.get(name, ()):
                raise unsupported("reasoning effort and summaries are not supported: a "
                                  "model thinks as its chat template says",
                                  f"reasoning.{name}")
    for i, item in enumerate(body.include or ()):
        if item not in _INCLUDABLE:
            raise unsupported(f"{item!r} cannot be included", f"include[{i}]")
    if body.text is not None and body.text.verbosity not in (None, "medium"):
        raise unsupported("verbosity is not supported", "text.verbosity")
    if body.stream_options is not None and body.stream_options.include_obfuscation:
        raise unsupported("streams carry no obfuscation padding",
                          "stream_options.include_obfuscation")


# --- input items -----------------------------------------------------------------------


class TextPart(_Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # an earlier output's, sent back
    logprobs: list[Any] | None = None


class MessageItem(_Strict):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]
    type: Literal["message"] = "message"
    # An earlier response's output item, sent back as it came.
    id: str | None = None
    status: str | None = None
    phase: str | None = None


# Kept in a stored conversation, though a chat template may not write it in the prompt:
# bounded as OpenAI bounds it (a 2 MiB call_id was stored for a prompt of 200 tokens).
CallId = Annotated[str, Meta(max_length=64)]


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: CallId
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: CallId
    output: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None


# A conversation's items, normalised: what is stored and what becomes chat messages.
class Said(Struct, frozen=True):
    role: str
    text: str


class Called(Struct, frozen=True):
    call_id: str
    name: str
    arguments: str


class Answered(Struct, frozen=True):
    call_id: str
    output: str


Item = Said | Called | Answered

_MEDIA = {"input_image": "images", "input_file": "files", "input_audio": "audio"}


def input_items(given: str | list[dict[str, Any]]) -> list[Item]:
    if isinstance(given, str):
        return [Said("user", given)]
    return [_item(item, f"input[{i}]") for i, item in enumerate(given)]


def _item(item: dict[str, Any], where: str) -> Item:
    kind = item.get("type", "message")
    match kind:
        case "message":
            m = _convert(item, MessageItem, where)
            return Said(m.role, _text(m.content, f"{where}.content"))
        case "function_call":
            c = _convert(item, FunctionCallItem, where)
            return Called(c.call_id, c.name, c.arguments)
        case "function_call_output":
            o = _convert(item, FunctionCallOutputItem, where)
            return Answered(o.call_id, _text(o.output, f"{where}.output"))
    raise unsupported(f"input items of type {kind!r} are not supported: forged takes "
                      "message, function_call and function_call_output items",
                      f"{where}.type")


def _text(content: str | list[dict[str, Any]], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind not in ("input_text", "output_text"):
            what = _MEDIA.get(str(kind))
            raise unsupported(f"{what} in input are not supported: this model reads text "
                              "only" if what else f"content parts of type {kind!r} are not "
                              "supported", f"{where}[{j}].type")
        texts.append(_convert(part, TextPart, f"{where}[{j}]").text)
    return "\n".join(texts)  # as a chat message's text parts are joined


def output_items(output: list[dict[str, Any]]) -> list[Item]:
    """A response's own output, as the conversation's next items."""
    out: list[Item] = []
    for item in output:
        if item["type"] == "message":
            out.append(Said("assistant", "".join(p["text"] for p in item["content"])))
        else:
            out.append(Called(item["call_id"], item["name"], item["arguments"]))
    return out


def messages(instructions: str | None, items: list[Item]) -> list[ChatMessage]:
    """The chat: ``instructions`` first, then the items; a call joins the assistant
    turn before it (its text, or the calls made with it)."""
    out = [ChatMessage(role="system", content=instructions)] if instructions else []
    for item in items:
        match item:
            case Said(role=role, text=text):
                out.append(ChatMessage(role=role, content=text))  # type: ignore[arg-type]
            case Called(call_id=call_id, name=name, arguments=arguments):
                call = {"id": call_id, "type": "function",
                        "function": {"name": name, "arguments": arguments}}
                if out and out[-1].role == "assistant":
                    out[-1].tool_calls = [*(out[-1].tool_calls or []), call]
                else:
                    out.append(ChatMessage(role="assistant", tool_calls=[call]))
            case Answered(call_id=call_id, output=output):
                out.append(ChatMessage(role="tool", content=output, tool_call_id=call_id))
    return out


# --- the chat request ------------------------------------------------------------------


class NamedFunction(_Strict, tag="function", tag_field="type"):
    name: str


def chat_request(body: ResponsesBody, items: list[Item], session: str | None) -> ChatRequest:
    return ChatRequest(
        model=body.model, messages=messages(body.instructions, items),
        max_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p,
        stream=body.stream, user=body.user, session=session, tools=_tools(body.tools),
        tool_choice=_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=_response_format(body.text))


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools, as chat's; forged.http.tools checks them further."""
    out = []
    for i, tool in enumerate(tools or []):
        if (kind := tool.get("type")) != "function":
            raise unsupported(f"tools of type {kind!r} are not supported: forged runs "
                              "function tools only", f"tools[{i}].type")
        t = _convert(tool, FunctionTool, f"tools[{i}]")
        fn: dict[str, Any] = {"name": t.name}
        if t.parameters is not None:
            fn["parameters"] = t.parameters
        if t.description is not None:
            fn["description"] = t.description
        out.append({"type": "function", "function": fn})
    return out or None


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not isinstance(choice, dict):
        return choice  # none, auto or required
    if (kind := choice.get("type")) != "function":
        raise unsupported(f"tool_choice of type {kind!r} is not supported: name a "
                          "function, or use none, auto or required", "tool_choice.type")
    named = _convert(choice, NamedFunction, "tool_choice")
    return {"type": "function", "function": {"name": named.name}}


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    match text.format if text is not None else None:
        case JsonObjectFormat():
            return {"type": "json_object"}
        case JsonSchemaFormat(name=name, schema=schema):
            return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
    return None


# chat's names of fields in errors, as the Responses API names them
_RENAMED = [(re.compile(p), r) for p, r in (
    (r"^messages(\[\d+\])?", "input"),
    (r"^max_tokens$", "max_output_tokens"),
    (r"^response_format\.json_schema\.schema", "text.format.schema"),
    (r"^response_format", "text.format"),
    (r"^(tools\[\d+\])\.function", r"\1"),
    (r"^tool_choice\.function", "tool_choice"),
)]


def _renamed(param: str | None) -> str | None:
    for pattern, name in _RENAMED:
        if param is not None and pattern.match(param):
            return pattern.sub(name, param, count=1)
    return param


def _echo(body: ResponsesBody) -> dict[str, Any]:
    """The fields of the response object that repeat the request."""
    fmt = body.text.format if body.text is not None else None
    return {
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls
        is not False, "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": None, "summary": None}, "store": body.store,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": msgspec.to_builtins(fmt) if fmt else {"type": "text"}},
        "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
        "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled",
        "prompt_cache_key": body.prompt_cache_key, "user": body.user,
        "safety_identifier": body.safety_identifier, "background": False,
        "service_tier": "default"}


# --- routes ----------------------------------------------------------------------------


def add_routes(app: QuartTrio, state: AppState) -> None:
    store = ResponseStore(released=functools.partial(_unpin, state))

    @app.post("/v1/responses")
    async def create() -> Response:
        # Checked into its Struct in one of the door's threads: it grows with the body.
        raw = await decoded_body(state, _object_decoder)
        body = await state.off_loop(_convert, raw, ResponsesBody)
        return await _create(state, store, body)

    @app.get("/v1/responses/<response_id>")
    async def retrieve(response_id: str) -> Response:
        _retrieve_args(request.args)
        found = store.get(response_id, _key(), state.cfg.responses, time.monotonic())
        if found is None:
            raise _not_found(response_id)
        return json_response(found.response)

    @app.get("/v1/responses/<response_id>/input_items")
    async def listed_inputs(response_id: str) -> Response:
        found = store.get(response_id, _key(), state.cfg.responses, time.monotonic())
        if found is None:
            raise _not_found(response_id)
        return json_response(input_page(found, _page_args(request.args)))

    @app.delete("/v1/responses/<response_id>")
    async def delete(response_id: str) -> Response:
        if not store.delete(response_id, _key(), state.cfg.responses, time.monotonic()):
            raise _not_found(response_id)
        return json_response({"id": response_id, "object": "response", "deleted": True})


def _retrieve_args(args: Any) -> None:
    """``GET /v1/responses/{id}``'s query: a 400 naming what asks for more than the
    stored response, whole (its events streamed again, from a point; what it never
    held)."""
    if args.get("stream", "false").lower() not in ("false", "0"):
        raise unsupported("a stored response is retrieved whole: its events are not "
                          "streamed again", "stream")
    if "starting_after" in args:
        raise unsupported("a stored response is retrieved whole, not from an event on",
                          "starting_after")
    included = [v for k in args if k.partition("[")[0] == "include" for v in args.getlist(k)]
    for i, item in enumerate(included):
        if item not in _INCLUDABLE:
            raise unsupported(f"{item!r} cannot be included", f"include[{i}]")


class PageArgs(_Strict):
    """``GET /v1/responses/{id}/input_items``'s query, as OpenAI's list endpoints take it."""

    limit: Annotated[int, Meta(ge=1, le=100)] = 20
    order: Literal["asc", "desc"] = "desc"
    after: str | None = None


def _page_args(args: Any) -> PageArgs:
    if any(k.partition("[")[0] == "include" for k in args):  # the SDK sends include[]
        raise unsupported("include is not supported: input items hold their text only",
                          "include")
    raw = dict(args.items())
    try:
        return msgspec.convert(raw, PageArgs, strict=False)
    except msgspec.ValidationError as exc:
        raise e.BadRequest(str(exc), param=_path_param(str(exc))) from exc


def _path_param(message: str) -> str | None:
    """The query parameter msgspec names in ``... - at `$.limit```, if any."""
    _, at, where = message.rpartition("at `$.")
    return where.rstrip("`") or None if at else None


def input_page(stored: Stored, args: PageArgs) -> dict[str, Any]:
    """One page of a stored response's input items: what its prompt was made of (its
    predecessors' conversation included), each with a stable id."""
    prefix = stored.id.removeprefix("resp_")
    items = [item_json(item, f"{prefix}_{i}")
             for i, item in enumerate(stored.conversation[:stored.inputs])]
    if args.order == "desc":
        items.reverse()
    if args.after is not None:
        ids = [item["id"] for item in items]
        if args.after not in ids:
            raise e.BadRequest(f"after: no input item {args.after!r} in this response",
                               param="after")
        items = items[ids.index(args.after) + 1:]
    page = items[:args.limit]
    return {"object": "list", "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > len(page)}


def item_json(item: Item, suffix: str) -> dict[str, Any]:
    """A normalised item in the Responses API's shape, as OpenAI lists input items."""
    match item:
        case Said(role=role, text=text):
            part = "output_text" if role == "assistant" else "input_text"
            return {"id": f"msg_{suffix}", "type": "message", "role": role,
                    "status": "completed", "content": [{"type": part, "text": text}]}
        case Called(call_id=call_id, name=name, arguments=arguments):
            return {"id": f"fc_{suffix}", "type": "function_call", "status": "completed",
                    "call_id": call_id, "name": name, "arguments": arguments}
        case Answered(call_id=call_id, output=output):
            return {"id": f"fco_{suffix}", "type": "function_call_output",
                    "status": "completed", "call_id": call_id, "output": output}
    raise AssertionError(item)


def _key() -> str:
    """The caller's API key's name: stored responses are its own."""
    key = call().key
    return key.name if key is not None else ""


def _not_found(response_id: str) -> e.NotFound:
    return e.NotFound(f"Response with id '{response_id}' not found.")


async def _create(state: AppState, store: ResponseStore, body: ResponsesBody) -> Response:
    _refuse(body)
    key, previous = _key(), None
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id, key, state.cfg.responses,
                             time.monotonic())
        if previous is None:
            raise e.NotFound(f"Previous response with id '{body.previous_response_id}' "
                             "not found.", param="previous_response_id",
                             code="previous_response_not_found")
    history = [*(previous.conversation if previous else ()), *input_items(body.input)]
    if not history:
        raise e.BadRequest("input is empty", param="input")
    session = _session(body, previous)

    def keep(response: dict[str, Any], output: list[dict[str, Any]]) -> None:
        if body.store:
            store.put(Stored(response["id"], key, time.monotonic(), response,
                             (*history, *output_items(output)), session, len(history)),
                      state.cfg.responses)

    try:
        return await run_chat(state, chat_request(body, history, session),
                              bound(Turn(_echo(body), keep)))
    except e.BadRequest as exc:
        exc.param = _renamed(exc.param)
        raise


def _session(body: ResponsesBody, previous: Stored | None) -> str | None:
    """The engine session of this turn's KV: the conversation's (a new one when this
    response is stored), or the one ``prompt_cache_key`` names."""
    if body.prompt_cache_key is not None:
        return "cache/" + body.prompt_cache_key
    if previous is not None:
        return previous.session
    return _STORED_SESSION + uuid.uuid4().hex if body.store else None


_STORED_SESSION = "responses/"


def _unpin(state: AppState, key: str, session: str) -> None:
    """The store holds no response of ``session`` any more: its KV is unpinned on every
    model's workers. Not a ``prompt_cache_key``'s: the caller's requests that are not
    stored share it."""
    if session.startswith(_STORED_SESSION):
        for group in state.models.all():
            group.pool.unpin(engine_session(key, session))
