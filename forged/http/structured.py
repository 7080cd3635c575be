"""Structured output: ``response_format`` and its cousins, as a grammar for the engine.

A caller asks for JSON, JSON matching a schema, or a grammar of its own, in the words
of whichever API it was written for:

* OpenAI: ``response_format`` ``{"type": "json_object"}`` or ``{"type": "json_schema",
  "json_schema": {"name": ..., "schema": {...}}}`` (chat, and forged takes it on
  completions too);
* llama.cpp's server: ``json_schema`` (a schema) and ``grammar`` (GBNF), and a
  ``schema`` inside ``response_format`` of type ``json_object``;
* vLLM: ``guided_json`` (a schema) and ``guided_choice`` (a list of strings).

Each becomes one :class:`~forged.engine.request.Grammar` (:mod:`forged.engine.grammar`),
which llama.cpp checks on the daemon's vocabulary before a worker sees it.
"""

from __future__ import annotations

from typing import Any

from forged import errors as e
from forged.engine.grammar import (
    check_gbnf,
    choice_grammar,
    json_object_grammar,
    schema_grammar,
)
from forged.engine.request import Grammar
from forged.http.schemas import GenerationFields


def _asked(body: GenerationFields) -> list[str]:
    """The grammar fields the body sets (a text response_format asks for none)."""
    given = {"response_format": body.response_format, "json_schema": body.json_schema,
             "grammar": body.grammar, "guided_json": body.guided_json,
             "guided_choice": body.guided_choice}
    return [name for name, value in given.items() if value is not None
            and not (name == "response_format" and _is_text(value))]


def asks_grammar(body: GenerationFields) -> bool:
    """Whether the body asks for a grammar (cheap: nothing is converted)."""
    return bool(_asked(body))


def request_grammar(body: GenerationFields) -> Grammar | None:
    """The one grammar this request's body asks for, if any. Its cost grows with the
    schema: call it off the event loop."""
    asked = _asked(body)
    if not asked:
        return None
    if len(asked) > 1:
        raise e.BadRequest(f"{asked[0]} and {asked[1]} cannot be used together",
                           param=asked[1])
    if body.response_format is not None and asked == ["response_format"]:
        return _response_format(body.response_format)
    if body.json_schema is not None:
        return schema_grammar(body.json_schema, "json_schema")
    if body.guided_json is not None:
        return schema_grammar(body.guided_json, "guided_json")
    if body.guided_choice is not None:
        return choice_grammar(body.guided_choice, "guided_choice")
    assert body.grammar is not None  # the last one _asked knows
    # llama.cpp's grammar: checked by llama.cpp itself, once it is known to be safe to
    # give to its recursive parser.
    check_gbnf(body.grammar, "grammar")
    return Grammar(gbnf=body.grammar)


def _is_text(fmt: Any) -> bool:
    return isinstance(fmt, dict) and fmt.get("type") == "text"


def _response_format(fmt: Any) -> Grammar:
    if not isinstance(fmt, dict):
        raise e.BadRequest("response_format must be an object", param="response_format")
    match fmt.get("type"):
        case "json_object":
            schema = fmt.get("schema")  # llama.cpp's extension
            return json_object_grammar() if schema is None else \
                schema_grammar(schema, "response_format.schema")
        case "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise e.BadRequest("response_format.json_schema.schema is required",
                                   param="response_format.json_schema")
            return schema_grammar(spec["schema"], "response_format.json_schema.schema")
    raise e.BadRequest(f"response_format type {fmt.get('type')!r} is not supported; "
                       "use text, json_object or json_schema",
                       param="response_format.type")
