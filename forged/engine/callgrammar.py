"""The grammar of a tool call: ``<tool_call>`` blocks, each ``{"name": NAME,
"arguments": ...}`` with one of the request's functions' names and its own arguments.

Each function's parameters go through the schema converter as one branch of an anyOf
(:mod:`forged.engine.grammar` checked them), their definitions hoisted to its root; the
call itself is written here, with the names as a prefix tree
(:func:`forged.engine.backend.gbnf_alternatives`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from forged.engine.backend import gbnf_alternatives
from forged.engine.grammar import TOOL_CLOSE, TOOL_OPEN, _convert, check_gbnf
from forged.engine.request import Grammar
from forged.engine.schemawalk import mapped


def call_grammar(functions: list[dict[str, Any]], *, many: bool, lazy: bool) -> Grammar:
    """A grammar for ``<tool_call>`` blocks, each a call of one of ``functions``."""
    hoisted = [_hoisted(i, f["parameters"]) for i, f in enumerate(functions)]
    calls = {"anyOf": [{
        "type": "object",
        "properties": {"name": {"const": f["name"]}, "arguments": params},
        "required": ["name", "arguments"], "additionalProperties": False,
    } for f, (params, _) in zip(functions, hoisted, strict=True)],
        "$defs": {k: v for _, defs in hoisted for k, v in defs.items()}}
    written: dict[str, str] = {}
    converted = _convert(calls, _CALLS, "tools", written)
    tool, ws, call = _own_names(converted, ("tool-call", "tool-ws", "call"))
    rules = [
        f'root ::= {tool}{f" ({ws} {tool})*" if many else ""}',
        f'{tool} ::= "{TOOL_OPEN}" {ws} {call} {ws} "{TOOL_CLOSE}"',
        f'{ws} ::= [ \\n]{{0,2}}',
        f"{call} ::= {_call_rule([f['name'] for f in functions], written)}",
        converted,
    ]
    check_gbnf("\n".join(rules), "tools")
    # Lazy: from the first "<tool_call>" the model writes, the grammar holds. llama.cpp
    # searches the whole text so far with the pattern at every token until then: the
    # literal is found in linear time (43 us a token at 1,000 tokens of prose), where
    # the whole-text form "[\s\S]*?(<tool_call>)[\s\S]*" backtracked (148 ms a token
    # at 1,000, stalling every sequence of the worker: bench.trigger).
    triggers = [re.escape(TOOL_OPEN)] if lazy else []
    return Grammar(gbnf="\n".join(rules), lazy=lazy, trigger_patterns=triggers)


# The converter's rules of the calls, one per function (``calls-0``, ...: its names for
# an anyOf's branches and their properties); :func:`_call_rule` writes the one used.
_CALLS = "calls"


def _call_rule(names: list[str], written: dict[str, str]) -> str:
    """A call as the converter writes each function's (``{"name": "NAME", "arguments":
    ...}``), with the part every call shares written once and the names as a prefix
    tree, each followed by its own function's arguments. The converter's anyOf kept
    one stack per function alive up to the name's first characters, each checked
    against every candidate token: about 0.5 ms per function per token there over
    SmolLM2's vocabulary (150 tools: 65-310 ms for each of about eight tokens), in the
    worker's step (see backend.gbnf_alternatives). The arguments' rule: as ``written``."""
    then = {json.dumps(name): f'"," space "\\"arguments\\"" space ":" space '
            f'{written[f"{_CALLS}-{i}-arguments"]} "}}" space' for i, name in enumerate(names)}
    return '"{" space "\\"name\\"" space ":" space ' + gbnf_alternatives(list(then), then)


def _own_names(converted: str, names: tuple[str, ...]) -> list[str]:
    """``names`` for the rules written here, each with a digit added where the
    converter's rules hold it already: it names a $ref's rule by the ref's last part,
    so a parameter ``"$ref": "#/properties/call"`` made a second rule ``call``, and
    llama.cpp kept the later one: the whole call was then that parameter's value."""
    taken = set(re.findall(r"^([-\w]+) ::=", converted, re.MULTILINE))
    out = []
    for name in names:
        fresh = next(n for n in (name, *(f"{name}{k}" for k in range(len(taken) + 1)))
                     if n not in taken)
        taken.add(fresh)
        out.append(fresh)
    return out


def _hoisted(i: int, params: Any) -> tuple[Any, dict[str, Any]]:
    """Function ``i``'s parameters without their definitions, and those definitions
    named ``f{i}-NAME``, its $refs rewritten to match: the call's grammar nests the
    parameters under its own root, where "#/$defs/NAME" finds nothing, and the
    converter names a rule by a $ref's last segment (two functions' Team would share
    one)."""
    if not isinstance(params, dict):
        return params, {}
    defs = {**params.get("definitions", {}), **params.get("$defs", {})}
    rest = {k: v for k, v in params.items() if k not in ("$defs", "definitions")}
    return _renamed(rest, i), {f"f{i}-{k}": _renamed(v, i) for k, v in defs.items()}


def _renamed(node: Any, i: int) -> Any:
    """Schema ``node`` with its local $refs named as :func:`_hoisted` names them, and
    one into the parameters themselves (zod-to-json-schema's ``#/properties/a`` for a
    schema used twice) to where they sit in the call grammar; only schemas are walked:
    a ``const`` or ``enum`` value is data, kept as it is."""
    if not isinstance(node, dict):
        return node
    out = {k: _renamed_within(k, v, i) for k, v in node.items()}
    if isinstance(ref := out.get("$ref"), str) and ref.startswith("#/"):
        kind, _, rest = ref[2:].partition("/")
        out["$ref"] = (f"#/$defs/f{i}-{rest}" if kind in ("$defs", "definitions")
                       else f"#/anyOf/{i}/properties/arguments/{ref[2:]}")
    return out


def _renamed_within(key: str, value: Any, i: int) -> Any:
    return mapped(key, value, lambda v: _renamed(v, i))
