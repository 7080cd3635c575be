"""Anthropic's Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

A thin translation to forged's one chat request and back; everything behind it (API
keys, per-key limits, priorities, the prefix cache, metrics) is :func:`api.run_chat`'s.

* **The body** is a strict struct: a field forged does not know is a 400 that names
  it, and so is a field Anthropic defines that forged cannot honour (``thinking``,
  ``container``, image and document blocks, server tools, ...), unless its value asks
  for nothing (``thinking: {"type": "disabled"}``, ``mcp_servers: []``).
* **Into a chat request:** ``system`` becomes the system message; a message's ``text``
  blocks its text parts; an assistant's ``tool_use`` blocks its ``tool_calls``; a
  user's ``tool_result`` blocks ``tool`` messages, in their place; ``tools`` become
  function tools and ``tool_choice`` OpenAI's (``any`` is ``required``);
  ``output_config.format`` is a JSON schema for the answer.
* **The answer** (:class:`MessageFormat`) is a ChatFormat, so the same parser finds
  the model's tool calls: text goes into a ``text`` block, each call into a
  ``tool_use`` block of its own, whole or as Anthropic's event stream.
* **Errors** on these paths carry Anthropic's body, with the status forged would use.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta
from quart import Response, request
from quart_trio import QuartTrio

from forged import errors as e
from forged.engine.decoding import TokenLogprob
from forged.engine.events import Done
from forged.http import api, sse
from forged.http.logprobs import Vocabulary
from forged.http.refused import Refused, refuse
from forged.http.responses import HTTPError, json_response
from forged.http.schemas import ChatMessage, ChatRequest, ContentPart, body_error
from forged.http.state import AppState
from forged.http.tools import ToolCall

PREFIX = "/v1/messages"


def add_routes(app: QuartTrio, state: AppState) -> None:
    api.add_error_shape(app, PREFIX, error_response)
    api.add_shared_routes(app, api.SharedRoutes("anthropic-version", model_page, model_info,
                                                error_response))

    @app.post(PREFIX)
    async def messages() -> Response:
        body = await api.decoded_body(state, _messages_decoder)
        try:
            req = await state.off_loop(chat_request, body)
            return await api.run_chat(state, req, MessageFormat)
        except e.ContextTooLong as exc:
            if exc.asked is None:
                raise
            # Anthropic's words: Claude Code reads the numbers to retry with less.
            raise e.BadRequest(
                "input length and `max_tokens` exceed context limit: {} + {} > {}, decrease "
                "input length or `max_tokens` and try again".format(*exc.asked),
                param="max_tokens", code=exc.code) from exc
        except e.BadRequest as exc:
            exc.param = anthropic_param(exc.param)
            raise

    @app.post(PREFIX + "/count_tokens")
    async def count_tokens() -> Response:
        body = await api.decoded_body(state, _count_decoder, engine=False)
        try:
            req = await state.off_loop(chat_request, body)
            n = await api.chat_prompt_tokens(state, req)
        except e.BadRequest as exc:
            exc.param = anthropic_param(exc.param)
            raise
        return json_response({"input_tokens": n})


# --- the body ----------------------------------------------------------------------------


class _Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class _Typed(_Strict, tag_field="type"):
    """A member of a union told apart by its ``type``."""


# A cache_control marker is accepted wherever Anthropic takes one: forged's prefix cache
# keeps every prompt's KV without being asked.
CacheControl = dict[str, Any] | None


class TextBlock(_Typed, tag="text"):
    text: str
    cache_control: CacheControl = None
    citations: Annotated[list[Any], Meta(max_length=0)] | None = None


class ToolUseBlock(_Typed, tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl = None


class ToolResultBlock(_Typed, tag="tool_result"):
    tool_use_id: str
    content: str | list[dict[str, Any]] = ""  # text blocks (read by _block)
    # Accepted: the result's text, which says what went wrong, goes to the model as in
    # any chat template (they have no error flag).
    is_error: bool = False
    cache_control: CacheControl = None


Block = TextBlock | ToolUseBlock | ToolResultBlock
# Blocks Anthropic defines that forged cannot read, by type: what they would carry.
REFUSED_BLOCKS = {
    "image": "images", "document": "documents", "search_result": "search results",
    "thinking": "thinking blocks", "redacted_thinking": "thinking blocks",
    "server_tool_use": "server tool calls", "web_search_tool_result": "web search results",
    "web_fetch_tool_result": "web fetch results",
    "code_execution_tool_result": "code execution results",
    "bash_code_execution_tool_result": "code execution results",
    "text_editor_code_execution_tool_result": "code execution results",
    "tool_search_tool_result": "tool search results", "container_upload": "container uploads",
    "mcp_tool_use": "MCP tool calls", "mcp_tool_result": "MCP tool results",
}


class Message(_Strict):
    role: Literal["user", "assistant"]
    # Blocks are read one by one (_block), so that one forged cannot read is refused
    # by what it is.
    content: str | list[dict[str, Any]]


class ToolChoiceAuto(_Typed, tag="auto"):
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(_Typed, tag="any"):
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(_Typed, tag="tool"):
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(_Typed, tag="none"):
    pass


ToolChoice = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone


class Tool(_Strict):
    """A client tool; server tools (their ``type`` names them) are refused."""

    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: CacheControl = None
    # forged's calls always match the schema (a grammar), and a call is sent whole
    # once written: both settings are what forged does anyway.
    strict: bool | None = None
    eager_input_streaming: bool | None = None
    defer_loading: bool | None = None
    input_examples: list[dict[str, Any]] | None = None
    allowed_callers: list[str] | None = None


class JsonFormat(_Strict):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(_Strict):
    format: JsonFormat | None = None
    effort: str | None = None


class Metadata(_Strict):
    user_id: str | None = None  # accepted: forged attributes requests by API key


class CountTokensRequest(_Strict):
    """What count_tokens takes: the conversation, without the generation's settings."""

    model: str
    messages: Annotated[list[Message], Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl = None
    # Refused unless they ask for nothing (REFUSED).
    thinking: dict[str, Any] | None = None
    speed: str | None = None
    mcp_servers: list[Any] | None = None
    context_management: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    max_tokens: Annotated[int, Meta(ge=1)]  # Anthropic's range, as OpenAI chat's
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    metadata: Metadata | None = None
    # Both tiers are the one forged has.
    service_tier: Literal["auto", "standard_only"] | None = None
    container: Any = None
    diagnostics: Any = None
    inference_geo: str | None = None


# Fields forged cannot honour, with the values that ask for nothing.
REFUSED = {
    "thinking": Refused("extended thinking is not supported: a model thinks as its chat "
                        "template says, in the text", (None, {"type": "disabled"})),
    "speed": Refused("only the standard speed is served", (None, "standard")),
    "mcp_servers": Refused("MCP servers are not supported: run them as client tools",
                           (None, [])),
    "context_management": Refused("context management is not supported"),
    "container": Refused("containers are not supported"),
    "diagnostics": Refused("diagnostics are not supported"),
    "inference_geo": Refused("the request runs where this server is"),
}
OUTPUT_REFUSED = {"effort": Refused("the model's effort is not adjustable")}
TOOL_REFUSED = {
    "defer_loading": Refused("tool search is not supported", (None, False)),
    "input_examples": Refused("tool input examples are not supported", (None, [])),
    "allowed_callers": Refused("programmatic tool calling is not supported",
                               (None, ["direct"])),
}

_messages_decoder = msgspec.json.Decoder(MessagesRequest)
_count_decoder = msgspec.json.Decoder(CountTokensRequest)


# --- into forged's chat request ------------------------------------------------------------


def chat_request(body: CountTokensRequest) -> ChatRequest:
    """The chat request ``body`` asks for (count_tokens' body: only its prompt). Run in
    one of the door's threads, as the body's decoding may be: it reads every block."""
    refuse(body, REFUSED)
    if body.output_config is not None:
        refuse(body.output_config, OUTPUT_REFUSED, "output_config.")
    fmt = body.output_config.format if body.output_config else None
    choice, parallel = _tool_choice(body.tool_choice)
    fields: dict[str, Any] = {}
    if isinstance(body, MessagesRequest):
        fields = {"max_tokens": body.max_tokens, "stop": body.stop_sequences,
                  "stream": body.stream, "temperature": body.temperature,
                  "top_p": body.top_p, "top_k": body.top_k}
    return ChatRequest(
        model=body.model, messages=_messages(body), json_schema=fmt.schema if fmt else None,
        tools=[_tool(i, t) for i, t in enumerate(body.tools or [])] or None,
        tool_choice=choice, parallel_tool_calls=parallel, **fields)


def _messages(body: CountTokensRequest) -> list[ChatMessage]:
    if body.messages[-1].role == "assistant":
        raise e.BadRequest("a last assistant message (a prefill to continue) is not "
                           "supported: end with a user message",
                           param=f"messages[{len(body.messages) - 1}]")
    out = []
    system = body.system
    if isinstance(system, list):  # blocks run on, as llama-server joins them
        system = "".join(stable_system(b.text) for b in system)
    elif system:
        system = stable_system(system)
    if system:  # a system prompt of nothing is no system message
        out.append(ChatMessage("system", system))
    for i, m in enumerate(body.messages):
        out += _turn(m, f"messages[{i}]")
    return out


# Claude Code opens its system prompt with a billing line whose ``cch=`` stamp changes
# on every request ("x-anthropic-billing-header: cc_version=...; cch=a5145;You are
# ..."): left as sent, no request could reuse a cached prefix past its first line, and
# every turn of an agent recomputed its whole system prompt. The stamp means nothing to
# the model; llama-server writes it as fffff too.
_BILLING_STAMP = re.compile(r"(x-anthropic-billing-header:[^\n]*?\bcch=)[^;\n]{5};")


def stable_system(text: str) -> str:
    """``text`` with a leading billing line's per-request stamp made constant."""
    if not text.startswith("x-anthropic-billing-header:"):
        return text
    return _BILLING_STAMP.sub(r"\1fffff;", text, count=1)


def _turn(m: Message, where: str) -> list[ChatMessage]:
    """One Anthropic message as chat messages: an assistant's tool_use blocks are its
    tool_calls; a user's tool results are tool messages, in their place among its text."""
    if not m.content:  # Anthropic's rule (only a last assistant's may be, refused above)
        raise e.BadRequest("all messages must have non-empty content",
                           param=f"{where}.content")
    if isinstance(m.content, str):
        return [ChatMessage(m.role, m.content)]
    allowed = (TextBlock, ToolUseBlock if m.role == "assistant" else ToolResultBlock)
    blocks = [_block(raw, allowed, f"{where}.content[{j}]")
              for j, raw in enumerate(m.content)]
    for j, b in enumerate(blocks):
        if isinstance(b, TextBlock) and not b.text:
            raise e.BadRequest("text content blocks must be non-empty",
                               param=f"{where}.content[{j}].text")
    if m.role == "assistant":
        calls = [{"id": b.id, "type": "function",
                  "function": {"name": b.name, "arguments": b.input}}
                 for b in blocks if isinstance(b, ToolUseBlock)]
        return [ChatMessage("assistant", _texts(blocks), tool_calls=calls or None)]
    out: list[ChatMessage] = []
    for j, block in enumerate(blocks):
        if isinstance(block, ToolResultBlock):
            out.append(ChatMessage("tool", _result(block, f"{where}.content[{j}]"),
                                   tool_call_id=block.tool_use_id))
        elif out and out[-1].role == "user" and isinstance(out[-1].content, list):
            out[-1].content += _texts([block])
        else:
            out.append(ChatMessage("user", _texts([block])))
    return out


def _texts(blocks: list[Block]) -> list[ContentPart]:
    """The text blocks, as text parts: the chat joins them as it joins OpenAI's."""
    return [ContentPart("text", b.text) for b in blocks if isinstance(b, TextBlock)]


def _result(block: ToolResultBlock, where: str) -> str | list[ContentPart]:
    if isinstance(block.content, str):
        return block.content
    return _texts([_block(raw, (TextBlock,), f"{where}.content[{k}]")
                   for k, raw in enumerate(block.content)])


def _block(raw: dict[str, Any], allowed: tuple[type, ...], where: str) -> Block:
    """One content block, of the types ``allowed`` where it is: one forged cannot read
    is refused by what it is."""
    kind = raw.get("type")
    if isinstance(kind, str) and kind in REFUSED_BLOCKS:
        raise e.BadRequest(f"{REFUSED_BLOCKS[kind]} are not supported: this server reads "
                           "text, tool calls and tool results", param=f"{where}.type",
                           code="unsupported_field")
    block: Block = _convert(raw, Block, where)
    if not isinstance(block, allowed):
        raise e.BadRequest(f"a {kind} block is not allowed here", param=f"{where}.type")
    if isinstance(block, TextBlock) and block.citations:
        raise e.BadRequest("citations are not supported", param=f"{where}.citations",
                           code="unsupported_field")
    return block


def _convert(raw: Any, type_: Any, where: str) -> Any:
    """``raw`` as ``type_``; a mismatch is a 400 naming its path within the body."""
    try:
        return msgspec.convert(raw, type_)
    except msgspec.ValidationError as exc:
        text = str(exc)  # "... - at `$.field`", or no path for the object itself
        text = text.replace(" - at `$", f" - at `$.{where}", 1) if " - at `$" in text \
            else f"{text} - at `$.{where}`"
        raise body_error(msgspec.ValidationError(text)) from exc


def _tool(i: int, raw: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic tool as OpenAI's function tool."""
    where = f"tools[{i}]"
    if raw.get("type") not in (None, "custom"):
        raise e.BadRequest(f"the server tool {raw['type']!r} is not supported: only client "
                           "tools (name, description, input_schema)", param=f"{where}.type",
                           code="unsupported_field")
    tool = _convert(raw, Tool, where)
    refuse(tool, TOOL_REFUSED, f"{where}.")
    fn = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        fn["description"] = tool.description
    return {"type": "function", "function": fn}


def _tool_choice(choice: ToolChoice | None) -> tuple[str | dict[str, Any] | None,
                                                      bool | None]:
    """OpenAI's ``tool_choice`` and ``parallel_tool_calls``."""
    match choice:
        case None:
            return None, None
        case ToolChoiceNone():
            return "none", None
        case ToolChoiceAuto():
            return "auto", not choice.disable_parallel_tool_use
        case ToolChoiceAny():
            return "required", not choice.disable_parallel_tool_use
    return ({"type": "function", "function": {"name": choice.name}},
            not choice.disable_parallel_tool_use)


# How the chat request's fields are named in Anthropic's body, for an error's param.
_PARAMS = [
    (re.compile(r"^tools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema"),
    (re.compile(r"^tools\[(\d+)\]\.function\."), r"tools[\1]."),
    (re.compile(r"^tool_choice\.function\."), "tool_choice."),
    (re.compile(r"^json_schema"), "output_config.format.schema"),
    (re.compile(r"^response_format$"), "output_config.format"),
    (re.compile(r"^stop$"), "stop_sequences"),
    (re.compile(r"^max_completion_tokens$"), "max_tokens"),
]


def anthropic_param(param: str | None) -> str | None:
    """The name in Anthropic's body of ``param``, a field of the chat request."""
    for pattern, name in _PARAMS:
        if param is not None and pattern.match(param):
            return pattern.sub(name, param, count=1)
    return param


# --- the answer ----------------------------------------------------------------------------


def event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: ".encode() + msgspec.json.encode({"type": name, **data}) \
        + b"\n\n"


class MessageFormat(sse.ChatFormat):
    """Anthropic's message, whole or as its events. Its blocks are numbered as they
    open: a text block until the first tool call, then a tool_use block per call."""

    id_prefix = "msg_"

    def __init__(self, model: str, created: int, n: int = 1, *, tools: bool = False,
                 fingerprint: str | None = None, vocab: Vocabulary | None = None
                 ) -> None:
        super().__init__(model, created, n, tools=tools, fingerprint=fingerprint,
                         vocab=vocab)
        self._blocks = 0  # blocks opened so far
        self._text_open = False

    def start(self) -> bytes:
        message = self._message([], None, None,
                                usage(self.prompt_tokens, self.cached_tokens, 0))
        return event("message_start", {"message": message}) + event("ping", {})

    def delta(self, text: str, index: int = 0,
              logprobs: list[TokenLogprob] | None = None) -> bytes:
        if self.parsers is None:
            return self._text(text)
        content, calls = self.parsers[index].feed(text)
        return self._text(content) + b"".join(self._tool_use(c) for c in calls)

    def _text(self, text: str) -> bytes:
        if not text:
            return b""
        out = b""
        if not self._text_open:
            out = event("content_block_start", {"index": self._blocks,
                                                "content_block": {"type": "text", "text": ""}})
            self._text_open = True
        return out + event("content_block_delta", {"index": self._blocks, "delta": {
            "type": "text_delta", "text": text}})

    def _close_text(self) -> bytes:
        if not self._text_open:
            return b""
        self._text_open = False
        self._blocks += 1
        return event("content_block_stop", {"index": self._blocks - 1})

    def _tool_use(self, call: ToolCall) -> bytes:
        """A call, written whole by the time the parser releases it: its input in one
        delta."""
        out = self._close_text()
        block = {"type": "tool_use", "id": tool_use_id(call), "name": call.name, "input": {}}
        index, self._blocks = self._blocks, self._blocks + 1
        return out + event("content_block_start", {"index": index, "content_block": block}) \
            + event("content_block_delta", {"index": index, "delta": {
                "type": "input_json_delta", "partial_json": call.arguments}}) \
            + event("content_block_stop", {"index": index})

    def finish(self, done: Done) -> bytes:
        out = self.delta(done.text, done.index) if done.text else b""
        if self.parsers is not None:
            out += self._text(self.parsers[done.index].flush())
        reason, sequence = self._stop(done)
        data: dict[str, Any] = {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                "usage": _done_usage(done)}
        if self.retrieved is not None:
            data["retrieved"] = self.retrieved
        return out + self._close_text() + event("message_delta", data)

    def end(self, dones: list[Done], include_usage: bool) -> bytes:
        return event("message_stop", {})

    def error(self, err: HTTPError) -> bytes:
        return event("error", {"error": error_detail(err)})

    def _stop(self, done: Done) -> tuple[str, str | None]:
        """Anthropic's stop_reason, and the stop sequence that ended the answer."""
        if done.stop_type == "limit":
            return "max_tokens", None
        if isinstance(done.stop_reason, str):
            return "stop_sequence", done.stop_reason
        if self.parsers is not None and self.parsers[done.index].calls:
            return "tool_use", None
        return "end_turn", None

    def whole(self, texts: list[str], dones: list[Done],
              scores: list[sse.Scores] | None = None) -> dict[str, Any]:
        text, done = texts[0], dones[0]
        calls: list[ToolCall] = []
        if self.parsers is not None:
            text, calls = self.parsers[0].feed(text)
            text += self.parsers[0].flush()
        content = [{"type": "text", "text": text}] if text else []
        content += [{"type": "tool_use", "id": tool_use_id(c), "name": c.name,
                     "input": json.loads(c.arguments)} for c in calls]
        out = self._message(content, *self._stop(done), _done_usage(done))
        if self.retrieved is not None:
            out["retrieved"] = self.retrieved
        return out

    def _message(self, content: list[dict[str, Any]], reason: str | None,
                 sequence: str | None, used: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": reason, "stop_sequence": sequence,
                "usage": used}


def tool_use_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def usage(prompt: int, cached: int, output: int) -> dict[str, int]:
    """Anthropic counts the prompt's tokens read from the cache apart from the rest
    (forged writes every prompt into its cache: nothing to count as a cache write)."""
    return {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": output}


def _done_usage(done: Done) -> dict[str, int]:
    return usage(done.prompt_tokens, done.cached_tokens, done.completion_tokens)


# --- errors ------------------------------------------------------------------------------

# Anthropic's error types by status; a 503 is overloaded_error when the queue is full.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error"}


def error_detail(err: HTTPError) -> dict[str, str]:
    detail = err.body.error
    if err.status in _ERROR_TYPES:
        kind = _ERROR_TYPES[err.status]
    elif err.status >= 500:
        overloaded = detail.code in ("overloaded", "queue_timeout")
        kind = "overloaded_error" if overloaded else "api_error"
    else:
        kind = "invalid_request_error"
    message = detail.message
    # Anthropic's body has no param: the message names the field, as Anthropic's do.
    if detail.param and detail.param not in message:
        message = f"{detail.param}: {message}"
    return {"type": kind, "message": message}


def model_info(model: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI model object as Anthropic's Models API shows one."""
    created = dt.datetime.fromtimestamp(model["created"], dt.UTC)
    return {"type": "model", "id": model["id"], "display_name": model["id"],
            "created_at": created.isoformat().replace("+00:00", "Z")}


def model_page(models: list[dict[str, Any]]) -> dict[str, Any]:
    """``GET /v1/models`` for Anthropic's clients: one page, in its list's shape, cut
    by its ``limit``, ``after_id`` and ``before_id``."""
    data = [model_info(m) for m in models]
    args = request.args
    before = False
    for name, after in (("after_id", True), ("before_id", False)):
        if (given := args.get(name)) is not None:
            ids = [m["id"] for m in data]
            if given not in ids:
                raise e.BadRequest(f"{name}: no model {given!r}", param=name)
            at = ids.index(given)
            data = data[at + 1:] if after else data[:at]
            before = not after
    try:
        limit = int(args.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 1000:
        raise e.BadRequest("limit: expected an integer from 1 to 1000", param="limit")
    page = data[-limit:] if before else data[:limit]  # the page just before the id
    return {"data": page, "has_more": len(data) > len(page),
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None}


def error_response(err: HTTPError) -> Response:
    body = msgspec.json.encode({"type": "error", "error": error_detail(err)})
    return Response(body, status=err.status, headers=err.headers())
