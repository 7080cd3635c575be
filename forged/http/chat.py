"""A chat request's prompt: its messages (and tools) through the model's chat template.

The messages are checked and turned into what chat templates expect (Hugging Face's
conventions: ``role``, ``content``, and for tools ``tool_calls`` with ``arguments`` as
a value, ``tool_call_id``). With tools, :mod:`forged.http.tools` decides whether the
template renders them or forged's system message carries them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from forged import errors as e
from forged.config import LimitsConfig
from forged.engine.groups import ModelGroup
from forged.http.refused import part_error
from forged.http.schemas import ChatMessage, ChatRequest
from forged.http.state import AppState
from forged.http.tools import ToolPlan, fold_into_messages, parse_arguments, plan_tools


@dataclass(frozen=True)
class ChatPrompt:
    tokens: list[int]
    tools: ToolPlan | None


async def chat_prompt(state: AppState, group: ModelGroup, req: ChatRequest) -> ChatPrompt:
    """The chat's tokens and tool plan, made in one of the door's threads: templates,
    tool grammars and the messages' tool-call JSON all grow with the request."""
    return await state.off_loop(_chat_prompt, state.cfg.limits, group, req)


async def chat_text(state: AppState, group: ModelGroup, req: ChatRequest) -> str:
    """The prompt as text, as the chat template writes it (llama.cpp's /apply-template),
    made in one of the door's threads as :func:`chat_prompt` is."""
    return await state.off_loop(_chat_text, state.cfg.limits, group, req)


def _chat_prompt(lim: LimitsConfig, group: ModelGroup, req: ChatRequest) -> ChatPrompt:
    messages, tools, plan = _turns(lim, group, req)
    tokens = group.prompter.encode_chat(messages, tools, req.chat_template_kwargs)
    return ChatPrompt(tokens, plan)


def _chat_text(lim: LimitsConfig, group: ModelGroup, req: ChatRequest) -> str:
    messages, tools, _ = _turns(lim, group, req)
    return group.prompter.render_chat(messages, tools, req.chat_template_kwargs)


def _turns(lim: LimitsConfig, group: ModelGroup, req: ChatRequest
           ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, ToolPlan | None]:
    """The messages and tools as the template takes them, and the request's tool plan."""
    if len(req.messages) > lim.max_messages:
        raise e.BadRequest(f"at most {lim.max_messages} messages are allowed", param="messages")
    plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    if plan is not None and group.prompter.renders_tools:
        return [message_dict(i, m) for i, m in enumerate(req.messages)], plan.tools, plan
    # The template knows nothing of tools: forged writes them into the turns, and the
    # calls' arguments as the client sent them (tools._call_text).
    messages = [message_dict(i, m, json_text=True) for i, m in enumerate(req.messages)]
    return fold_into_messages(messages, plan.tools if plan else None), None, plan


def message_dict(i: int, m: ChatMessage, *, json_text: bool = False) -> dict[str, Any]:
    """Message ``i`` as templates take it; with ``json_text``, a tool call's arguments
    sent as JSON text stay that text (checked), for forged's own blocks."""
    where = f"messages[{i}]"
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                           "content": _text(m, f"{where}.content")}
    if m.tool_calls:
        if m.role != "assistant":
            raise e.BadRequest("only assistant messages carry tool_calls",
                               param=f"{where}.tool_calls")
        out["tool_calls"] = [_call(c, f"{where}.tool_calls[{j}]", json_text)
                             for j, c in enumerate(m.tool_calls)]
    if m.role == "tool":
        out["tool_call_id"] = m.tool_call_id or ""
    return out


def _text(m: ChatMessage, where: str) -> str:
    content = m.content
    if not isinstance(content, list):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type != "text":
            raise part_error(part.type, f"{where}[{j}].type")
        if part.text is None:
            raise e.BadRequest("a text part needs its text", param=f"{where}[{j}].text")
        texts.append(part.text)
    return "\n".join(texts)  # a line each, as llama-server and vLLM join them


def _call(call: dict[str, Any], where: str, json_text: bool) -> dict[str, Any]:
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise e.BadRequest("a tool call needs function.name", param=f"{where}.function")
    raw = fn.get("arguments", "{}")
    args = parse_arguments(raw, f"{where}.function.arguments")
    if json_text and isinstance(raw, str):
        args = raw
    return {"id": str(call.get("id", "")), "type": "function",
            "function": {"name": fn["name"], "arguments": args}}
