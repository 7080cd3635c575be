"""Tool calls on chat: the request's ``tools`` into the prompt and a grammar, and the
model's ``<tool_call>`` blocks back out as OpenAI's ``tool_calls``.

forged speaks one tool-call syntax, the Hermes format most open chat models are
trained on (Qwen2.5, Hermes, SmolLM3, ...)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Oslo"}}
    </tool_call>

* **The prompt.** A chat template that takes ``tools`` and writes ``<tool_call>``
  renders them itself. Any other template gets them in a system message of forged's
  (:data:`SYSTEM_PROMPT`, placed before the caller's own system message), with earlier
  calls written as ``<tool_call>`` blocks in the assistant's turns and tool results
  as ``<tool_response>`` blocks in user turns, as Qwen2.5's template does.
* **The grammar.** ``tool_choice`` ``required`` or a named function: the answer is
  one call (several with ``parallel_tool_calls``) that matches the functions' schemas,
  from its first token. ``auto``: the model writes what it likes until it writes
  ``<tool_call>`` (llama.cpp's lazy grammar triggers), and from there the call is
  constrained. ``none``: the tools stay in the prompt, with no grammar and no parsing.
* **The answer.** :class:`ToolCallParser` takes the text as it streams and splits it
  into content and calls; text that could still become ``<tool_call>`` is held back.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from forged import errors as e
from forged.engine.callgrammar import call_grammar
from forged.engine.grammar import MAX_SCHEMA_BYTES, check_schema
from forged.engine.grammar import TOOL_CLOSE as CLOSE
from forged.engine.grammar import TOOL_OPEN as OPEN
from forged.engine.request import Grammar
from forged.http.schemas import json_depth

MAX_ARGUMENTS_DEPTH = 64

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 128

SYSTEM_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools do to its prompt, its sampling and its answer."""

    tools: list[dict[str, Any]]  # as the template sees them: OpenAI's tool objects
    grammar: Grammar | None
    parse: bool  # whether the answer is searched for calls


def plan_tools(tools: list[Any] | None, choice: Any, parallel: bool | None) -> ToolPlan | None:
    """Check ``tools`` and ``tool_choice``; None when the request has no tools."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise e.BadRequest("tool_choice needs tools", param="tool_choice")
        return None
    if len(tools) > MAX_TOOLS:
        raise e.BadRequest(f"at most {MAX_TOOLS} tools are allowed", param="tools")
    functions = [_function(i, t) for i, t in enumerate(tools)]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise e.BadRequest("tool names must be unique", param="tools")
    wanted = _choice(choice, names)
    listed = [{"type": "function", "function": f} for f in functions]
    if wanted == "none":
        # Still in the prompt, as llama-server and vLLM render them: the turn after a
        # tool result then shares its whole prefix with the turn that called the tool.
        return ToolPlan(listed, None, False)
    allowed = [f for f in functions if wanted in ("auto", "required") or f["name"] == wanted]
    grammar = call_grammar(allowed, many=parallel is not False, lazy=wanted == "auto")
    return ToolPlan(listed, grammar, True)


def _function(i: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise e.BadRequest("only tools of type 'function' are supported", param=f"{where}.type")
    fn = tool.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise e.BadRequest("a tool needs function.name", param=f"{where}.function")
    if not _NAME.match(fn["name"]):
        raise e.BadRequest("a function name has 1 to 64 letters, digits, _ or -",
                           param=f"{where}.function.name")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    # A call's arguments are an object (OpenAI's and Anthropic's rule): another root
    # would let the model write "arguments": "abc", which no dialect can return.
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise e.BadRequest("a function's parameters must be a JSON schema of type "
                           "object", param=f"{where}.function.parameters.type")
    if len(json.dumps(params)) > MAX_SCHEMA_BYTES:
        raise e.BadRequest(f"a function's parameters are larger than {MAX_SCHEMA_BYTES} "
                           "bytes", param=f"{where}.function.parameters")
    check_schema(params, f"{where}.function.parameters")
    out = {"name": fn["name"], "parameters": params}
    if isinstance(fn.get("description"), str):
        out["description"] = fn["description"]
    return out


def _choice(choice: Any, names: list[str]) -> str:
    """``none``, ``auto``, ``required`` or the one function's name."""
    if choice is None:
        return "auto"
    if choice in ("none", "auto", "required"):
        return str(choice)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(
            choice.get("function"), dict):
        name = choice["function"].get("name")
        if name in names:
            return str(name)
        raise e.BadRequest(f"tool_choice names {name!r}, which is not among the tools",
                           param="tool_choice.function.name")
    raise e.BadRequest("tool_choice must be none, auto, required or "
                       '{"type": "function", "function": {"name": ...}}', param="tool_choice")


# --- the prompt ------------------------------------------------------------------------


def system_prompt(tools: list[dict[str, Any]]) -> str:
    return SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))


def fold_into_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
                       ) -> list[dict[str, Any]]:
    """For a template that knows nothing of tools: the tools as a system message, and
    earlier calls and results written in the Hermes format as plain turns."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user",
                        "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m.get("tool_calls"):
            blocks = "\n".join(f"{OPEN}\n{_call_text(c)}\n{CLOSE}" for c in m["tool_calls"])
            out.append({"role": "assistant", "content": _before_calls(m["content"]) + blocks})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools:
        text = system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _before_calls(content: str) -> str:
    """The text before an assistant's calls, a line of its own. The parser's content
    keeps the line break the model wrote before ``<tool_call>`` ("Let me look.\\n"): a
    second one made the next turn's prompt leave the model's tokens there."""
    if not content or content[-1].isspace():
        return content
    return content + "\n"


def _call_text(call: dict[str, Any]) -> str:
    """A call's JSON in its block. Arguments the client sent as JSON text (OpenAI's,
    the Responses API's) are written as they are: the text the model wrote, sent back
    unchanged, is then the tokens it generated, and the next turn's prompt reuses the
    KV of this turn's answer past the call (re-serialized, ``{ "city": "Paris" }``
    became ``{"city": "Paris"}`` and the turn's cache ended there)."""
    fn = call["function"]
    args = fn["arguments"]
    # A value (Anthropic's input, Ollama's arguments) as the parser writes one: its
    # UTF-8 as the model wrote it, not escaped ("Z\\u00fcrich" is 4 tokens more for SmolLM2).
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return f'{{"name": {json.dumps(fn["name"])}, "arguments": {text}}}'


_arguments_json = msgspec.json.Decoder()


def parse_arguments(raw: Any, where: str) -> Any:
    """An assistant message's ``function.arguments`` (a JSON string, as OpenAI sends
    it) as a value, for templates that write it out as JSON."""
    if not isinstance(raw, str):
        return raw
    # As deep as a request body may be: deeper, json's recursion (and the template's
    # after it) would end in a RecursionError.
    if (depth := json_depth(raw.encode())) > MAX_ARGUMENTS_DEPTH:
        raise e.BadRequest(f"function.arguments is nested {depth} levels deep, more "
                           f"than {MAX_ARGUMENTS_DEPTH}", param=where)
    # msgspec, not json: json.loads takes what the prompt cannot carry. An integer of
    # over 4,300 digits raised ValueError, and "\ud800" made a lone surrogate that
    # failed once the template's text was encoded: both were 500s.
    try:
        return _arguments_json.decode(raw)
    except msgspec.DecodeError as exc:
        raise e.BadRequest(f"function.arguments must be a JSON string ({exc})",
                           param=where) from exc


# --- the answer ------------------------------------------------------------------------


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self, index: int) -> dict[str, Any]:
        return {"index": index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallParser:
    """Splits streamed text into content and tool calls.

    ``feed`` returns the content that is certain and the calls completed so far; text
    that may be the start of ``<tool_call>``, and a call still being written, wait.
    A block that does not hold a call (``{"name", "arguments"}`` JSON) is content.
    """

    calls: list[ToolCall] = field(default_factory=list)
    cut: bool = False  # the answer ended inside a call, which was dropped
    _buf: str = ""

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        content, new = "", []
        while True:
            start = self._buf.find(OPEN)
            if start < 0:
                keep = _partial_suffix(self._buf, OPEN)
                content += self._text(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                break
            content += self._text(self._buf[:start])
            self._buf = self._buf[start:]
            end, call = _block_end(self._buf)
            if end < 0:
                break
            block, self._buf = self._buf[:end], self._buf[end:]
            if call is None:
                content += block
            else:
                new.append(call)
                self.calls.append(call)
        return content, new

    def _text(self, segment: str) -> str:
        # Between and after calls, whitespace is layout, not content.
        return "" if self.calls and segment.isspace() else segment

    def flush(self) -> str:
        """What is left at the end, as content; but a call the limit cut short is
        dropped (``self.cut``): neither a half-sent call nor its markup in the content."""
        rest, self._buf = self._buf, ""
        # "<tool" and longer: the marker's start, cut (a lone "<" is ordinary text).
        if rest.startswith(OPEN) or (OPEN.startswith(rest) and len(rest) >= len("<tool")):
            self.cut = True
            return ""
        return rest


def _partial_suffix(text: str, word: str) -> int:
    """The length of the longest end of ``text`` that begins ``word``."""
    for n in range(min(len(text), len(word) - 1), 0, -1):
        if word.startswith(text[-n:]):
            return n
    return 0


def _block_end(text: str) -> tuple[int, ToolCall | None]:
    """Where the block that ``text`` opens ends, and its call (None: not a call, so
    content); -1 while it is unfinished. A ``</tool_call>`` inside one of the JSON's
    strings (a random argument may hold one) does not end it."""
    close = text.find(CLOSE)
    while close >= 0:
        try:
            return close + len(CLOSE), _parse_call(text[len(OPEN):close])
        except json.JSONDecodeError as exc:
            if not exc.msg.startswith("Unterminated string"):
                return close + len(CLOSE), None
        except RecursionError:  # nested past what the parser reads: no call, content
            return close + len(CLOSE), None
        close = text.find(CLOSE, close + 1)
    return -1, None


def _parse_call(body: str) -> ToolCall | None:
    """The call a block's JSON holds; None if it holds none. Raises JSONDecodeError."""
    obj = json.loads(body)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        with contextlib.suppress(json.JSONDecodeError):
            args = json.loads(args)
    if not isinstance(args, dict):
        return None  # the dialects return arguments as an object: this is text
    try:  # 1e400 reads as inf, which is not JSON: then it is text too
        canonical = json.dumps(args, allow_nan=False, ensure_ascii=False)
    except ValueError:
        return None
    return ToolCall(obj["name"], _written(body, canonical) or canonical)


_ARGUMENTS_KEY = re.compile(r'"arguments"\s*:\s*')
_raw_json = json.JSONDecoder()


def _written(body: str, canonical: str) -> str | None:
    """The arguments object as the model wrote it in ``body`` (its spaces and escapes),
    None if it wrote them otherwise (as a JSON string). A client that sends them back
    unchanged has the prompt repeat the model's own tokens (:func:`_call_text`)."""
    for key in _ARGUMENTS_KEY.finditer(body):
        try:
            value, end = _raw_json.raw_decode(body, key.end())
        except json.JSONDecodeError:
            continue
        # The same JSON value: dumps tells 1 from true and 1.0, which == does not.
        if isinstance(value, dict) and json.dumps(value, ensure_ascii=False) == canonical:
            return body[key.end():end]
    return None
