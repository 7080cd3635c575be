"""Structured output and tool calls (issue 18): grammars, tools and their parser.

The unit tests check the schema walk, the tools' checks and the parser without a
model. The end-to-end tests go through the official openai client: on the tiny
random-weight model (whose chat template renders tools and whose vocabulary has
<tool_call> as a special token) and on SmolLM2 (whose template knows nothing of
tools, so forged's system message carries them). Every sampled output at temperature
1 must parse and validate against its schema.
"""

from __future__ import annotations

import ctypes
import functools
import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import jsonschema
import llama_cpp as ll
import numpy as np
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from prometheus_client.parser import text_string_to_metric_families

from forged import errors as e
from forged.engine import grammar as grammar_module
from forged.engine.backend import Model, check_grammar, grammar_sampler
from forged.engine.callgrammar import call_grammar
from forged.engine.grammar import check_schema, choice_grammar, schema_grammar
from forged.engine.patternfit import pattern_implies
from forged.engine.prompts import Prompter
from forged.engine.request import Grammar
from forged.http.chat import message_dict
from forged.http.schemas import ChatMessage
from forged.http.tools import ToolCallParser, fold_into_messages, plan_tools
from tests.daemonproc import DaemonProcess, client, serve_model
from tests.tinymodel import write_tiny_llama

# A schema that uses most of what the grammar enforces, and bounds every part of the
# answer, so that a sample at temperature 1 ends well within max_tokens.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "admin": {"type": "boolean"},
        "role": {"enum": ["dev", "ops", "qa"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                 "maxItems": 3},
        "team": {"$ref": "#/$defs/team"},
        "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 8}]},
        "code": {"type": "string", "pattern": "^[a-z]{2,4}$"},
    },
    "required": ["name", "age", "admin", "role", "tags", "team", "note", "code"],
    "additionalProperties": False,
    "$defs": {"team": {"type": "object", "properties": {
        "id": {"type": "integer"}, "lead": {"type": "boolean"}},
        "required": ["id", "lead"], "additionalProperties": False}},
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "maxLength": 10}}, "required": ["zone"],
        "additionalProperties": False}}}


# --- units ------------------------------------------------------------------------------


@pytest.mark.parametrize(("schema", "param"), [
    ({"type": "string", "minimum": 3}, "s.minimum"),
    ({"type": "integer", "enum": [1, 5], "maximum": 3}, "s.maximum"),
    ({"type": "object", "propertyNames": {"pattern": "^a"}}, "s.propertyNames"),
    ({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}},
     "s.properties.a.uniqueItems"),
    ({"oneOf": [{"type": "string"}, {"type": "integer"}]}, "s.oneOf"),
    ({"type": "string", "format": "email"}, "s.format"),
    ({"anyOf": [{"type": "string"}, {"not": {"type": "null"}}]}, "s.anyOf[1].not"),
    ({"$defs": {"x": {"type": "number", "multipleOf": 2}}}, "s.$defs.x.multipleOf"),
])
def test_a_schema_keyword_the_grammar_cannot_enforce_is_named(schema: dict[str, Any],
                                                              param: str) -> None:
    with pytest.raises(e.BadRequest) as info:
        check_schema(schema, "s")
    assert info.value.param == param
    assert repr(param.rsplit(".", 1)[-1]) in str(info.value) or "format" in param


@pytest.mark.parametrize(("schema", "param"), [
    # the converter wrote minLength's repetition and left maxLength out: 200, "Hello"
    ({"type": "string", "minLength": 5, "maxLength": 2}, "s.minLength"),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 1},
     "s.minItems"),
    # llama.cpp could not parse what was written: a 400 naming `grammar`, never sent
    ({"enum": []}, "s.enum"), ({"type": []}, "s.type"), ({"anyOf": []}, "s.anyOf"),
    ({"type": "object", "properties": {"a": {"enum": []}}}, "s.properties.a.enum"),
])
def test_a_schema_no_answer_matches_is_named(schema: dict[str, Any], param: str) -> None:
    with pytest.raises(e.BadRequest) as info:
        schema_grammar(schema, "s")
    assert info.value.param == param and "no answer" in str(info.value)


@pytest.mark.parametrize(("schema", "param"), [
    # the converter writes the enum (or const) alone: the answer was 1, not a string
    ({"type": "string", "enum": [1]}, "s.enum"), ({"type": "string", "enum": ["a", 1]}, "s.enum"),
    ({"type": "integer", "const": "a"}, "s.const"), ({"type": "number", "enum": [True]}, "s.enum"),
    ({"type": ["string", "null"], "enum": [None, 2.5]}, "s.enum"),
])
def test_an_enum_or_const_its_type_forbids_is_named(schema: dict[str, Any], param: str) -> None:
    with pytest.raises(e.BadRequest) as info:
        schema_grammar(schema, "s")
    assert info.value.param == param
    # what the type allows, 1.0 an integer as JSON Schema says
    schema_grammar({"type": ["string", "null"], "enum": [None, "a"]}, "s")
    schema_grammar({"type": "integer", "enum": [1, 2.0]}, "s")


@pytest.mark.parametrize(("schema", "param"), [
    # the converter wrote a date and dropped maxLength: "2024-01-01" for maxLength 1
    ({"type": "string", "format": "date", "maxLength": 1}, "s.format"),
    ({"type": "string", "format": "uuid", "minLength": 50}, "s.format"),
    ({"type": "string", "format": "time", "maxLength": 12}, "s.format"),
    # it wrote the pattern and dropped the format: "x", not a date
    ({"type": "string", "format": "date", "pattern": "^x$"}, "s.format"),
    # it wrote the enum and dropped maxLength: "bbb" (now left out; here, all are)
    ({"enum": ["abc", "bbb"], "maxLength": 2}, "s.enum"),
    ({"type": "string", "const": "", "minLength": 1}, "s.const"),
    # it wrote {2} for {2,1} (which no text matches): "aa"
    ({"type": "string", "pattern": "^a{2,1}$"}, "s.pattern"),
])
def test_a_keyword_the_converter_would_drop_beside_another_is_named(
        schema: dict[str, Any], param: str) -> None:
    """The converter writes the first of a string's enum or const, pattern, format and
    lengths, and drops the rest: where the answer could then break the schema, a 400;
    where the one written implies the rest, the schema passes."""
    with pytest.raises(e.BadRequest) as info:
        schema_grammar(schema, "s")
    assert info.value.param == param
    for fine in ({"type": "string", "format": "date", "minLength": 10, "maxLength": 10},
                 {"type": "string", "format": "date-time", "maxLength": 64},
                 {"enum": ["a", "bb", 3], "maxLength": 2}, {"const": "a", "minLength": 1},
                 {"type": "string", "pattern": "^a{1,2}$"}):
        schema_grammar(fine, "s")


# zod 4's z.uuid() and z.iso.date(), as its toJSONSchema writes them (format and pattern).
_ZOD_UUID = ("^([0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[1-8][0-9a-fA-F]{3}-[89abAB][0-9a-fA-F]{3}-"
             "[0-9a-fA-F]{12}|00000000-0000-0000-0000-000000000000|"
             "ffffffff-ffff-ffff-ffff-ffffffffffff)$")
_ZOD_DATE = (r"^(?:(?:\d\d[2468][048]|\d\d[13579][26]|\d\d0[48]|[02468][048]00|"
             r"[13579][26]00)-02-29|\d{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12]\d|3[01])|"
             r"(?:0[469]|11)-(?:0[1-9]|[12]\d|30)|(?:02)-(?:0[1-9]|1\d|2[0-8])))$")


def test_a_pattern_that_proves_its_format_passes(real_model: Path) -> None:
    """zod 4 writes each string format with the pattern it checks it by, and a pattern
    beside a format was a 400: every MCP or AI SDK tool with a z.uuid() could not be
    used. Where every string the pattern matches is of the format, the pattern's
    grammar enforces both; where it is not proven (Microsoft Graph's year of 4 or more
    digits), it is still a 400."""
    uuid = {"type": "string", "format": "uuid", "pattern": _ZOD_UUID}
    g = schema_grammar(uuid, "s")
    schema_grammar({"type": "string", "format": "date", "pattern": _ZOD_DATE}, "s")
    schema_grammar({"type": "string", "format": "uuid4",
                    "pattern": "^[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}$"}, "s")
    for unproven in (r"^[0-9]{4,}-[0-9]{2}-[0-9]{2}T[0-9:]{8}Z$", r"^\d{4}-\d\d-\d\dT.*$",
                     "^(?=2).*$", "^(?i)[0-9a-f]{8}-.*$"):
        with pytest.raises(e.BadRequest) as info:
            schema_grammar({"type": "string", "format": "date-time", "pattern": unproven},
                           "s")
        assert info.value.param == "s.format"
    with Model(str(real_model), vocab_only=True) as m:
        assert _grammar_writes(m, g.gbnf, '"123e4567-e89b-42d3-a456-426614174000"',
                               per_character=False)
        assert not _grammar_writes(m, g.gbnf, '"123e4567-e89b-02d3-a456-426614174000"',
                                   per_character=False)


@pytest.mark.parametrize(("schema", "good", "bad"), [
    ({"enum": ["a", "bbb", 3], "maxLength": 2}, ["a", 3], ["bbb"]),
    ({"type": "string", "enum": ["2024-01-01", "tomorrow"], "format": "date"},
     ["2024-01-01"], ["tomorrow"]),
    ({"type": "string", "enum": ["EUR", "euro"], "pattern": "^[A-Z]{3}$"}, ["EUR"], ["euro"]),
    ({"type": "string", "enum": ["https://a.example/", "home"], "format": "uri"},
     ["https://a.example/"], ["home"]),
])
def test_an_enums_values_its_string_keywords_forbid_are_left_out(
        real_model: Path, schema: dict[str, Any], good: list[Any], bad: list[Any]) -> None:
    """The converter writes an enum alone and drops a string's lengths, pattern and
    format beside it: "tomorrow" was written for a date (and a value past maxLength
    was a 400 since 1cce0ba, the whole schema refused for one value). The values they
    forbid are left out of the grammar."""
    g = schema_grammar(schema, "s")
    with Model(str(real_model), vocab_only=True) as m:
        for value in good:
            assert _grammar_writes(m, g.gbnf, json.dumps(value), per_character=False)
        for value in bad:
            assert not _grammar_writes(m, g.gbnf, json.dumps(value), per_character=False)
    with pytest.raises(e.BadRequest) as info:
        schema_grammar({**schema, "enum": bad}, "s")
    assert info.value.param == "s.enum"


def test_annotations_and_enforced_keywords_pass() -> None:
    check_schema({**SCHEMA, "title": "T", "description": "d", "$schema": "x"}, "s")
    assert "root ::=" in schema_grammar(SCHEMA, "s").gbnf


def test_a_schema_string_excludes_raw_control_characters() -> None:
    """llama-cpp-python's converter allows them; JSON does not (a temperature-1 sample
    on the tiny model wrote an ESC into a string before forged mended the rule)."""
    gbnf = schema_grammar({"type": "string", "maxLength": 3}, "s").gbnf
    assert r'char ::= [^"\\\x7F\x00-\x1F]' in gbnf


def test_the_parser_holds_back_a_partial_marker_and_splits_calls() -> None:
    text = ('Let me look.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    whole = ToolCallParser()
    content, calls = whole.feed(text)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1}), ("g", {})]
    streamed = ToolCallParser()
    parts = [streamed.feed(ch) for ch in text]  # one character at a time
    assert "".join(p[0] for p in parts) == "Let me look."
    assert [c.name for p in parts for c in p[1]] == ["f", "g"]
    # "<tool_" may begin a call: held back until it cannot
    held = ToolCallParser()
    assert held.feed("a <tool_") == ("a ", [])
    assert held.feed("box>") == ("<tool_box>", [])


def test_a_closing_marker_inside_an_argument_string_does_not_end_the_call() -> None:
    """Seen at temperature 1 on the tiny model: the grammar lets a string hold
    "</tool_call>", and the call was cut there and sent as content."""
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "f,[</tool_call>V"}}'
            '</tool_call>')
    for pieces in ([text], list(text)):  # whole, and one character at a time
        p = ToolCallParser()
        out = [p.feed(piece) for piece in pieces]
        assert "".join(c for c, _ in out) == "" and p.flush() == ""
        calls = [call for _, cs in out for call in cs]
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("get_weather", {"city": "f,[</tool_call>V"})]


def test_a_block_nested_past_the_parsers_depth_is_content() -> None:
    """A model may write arguments nested thousands deep (a grammar of any JSON lets
    it): the parser's RecursionError escaped into the answer's stream."""
    deep = "[" * 3000 + "]" * 3000
    text = f'<tool_call>{{"name": "f", "arguments": {{"a": {deep}}}}}</tool_call>'
    p = ToolCallParser()
    assert p.feed(text) == (text, []) and p.flush() == ""


def test_a_block_that_is_not_a_call_is_content() -> None:
    p = ToolCallParser()
    content, calls = p.feed("<tool_call>not json</tool_call> and <tool_call>{")
    assert calls == [] and content == "<tool_call>not json</tool_call> and "
    # An unfinished block at the end is a call the limit cut: dropped, markup and all.
    assert p.flush() == "" and p.cut


def test_a_call_cut_by_the_limit_is_never_half_sent_nor_content() -> None:
    for tail in ('<tool_call>\n{"name": "f", "argu', "<tool_call>", "<tool_c"):
        p = ToolCallParser()
        content, calls = p.feed('<tool_call>{"name": "f", "arguments": {}}</tool_call>\n'
                                + tail)
        assert content == "" and [c.name for c in calls] == ["f"]
        assert p.flush() == "" and p.cut, tail
    p = ToolCallParser()
    assert p.feed("plain text <tool") == ("plain text ", [])
    assert p.flush() == "" and p.cut  # the marker's start, cut: not shown either
    p = ToolCallParser()
    assert p.feed("if a <") == ("if a ", [])
    assert p.flush() == "<" and not p.cut  # too short to be the marker: text


@pytest.mark.parametrize(("tools", "choice", "param"), [
    (None, "required", "tool_choice"),
    ([{"type": "retrieval"}], None, "tools[0].type"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}},
     "tool_choice.function.name"),
    ([WEATHER], "sometimes", "tool_choice"),
    ([WEATHER, WEATHER], None, "tools"),
    ([{"type": "function", "function": {"name": "bad name"}}], None,
     "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}}}}],
     None, "tools[0].function.parameters.properties.n.multipleOf"),
])
def test_bad_tools_are_named(tools: Any, choice: Any, param: str) -> None:
    with pytest.raises(e.BadRequest) as info:
        plan_tools(tools, choice, None)
    assert info.value.param == param


def test_tool_choice_shapes_the_grammar() -> None:
    none = plan_tools([WEATHER], "none", None)  # listed in the prompt, never parsed
    assert none is not None and none.grammar is None and not none.parse and none.tools
    auto = plan_tools([WEATHER, TIME], "auto", None)
    assert auto is not None and auto.grammar is not None and auto.grammar.lazy
    named = plan_tools([WEATHER, TIME], {"type": "function",
                                         "function": {"name": "get_time"}}, False)
    assert named is not None and named.grammar is not None and not named.grammar.lazy
    assert "get_time" in named.grammar.gbnf and "get_weather" not in named.grammar.gbnf
    assert "tool-call)*" not in named.grammar.gbnf  # one call: parallel_tool_calls false
    assert "tool-call)*" in call_grammar([WEATHER["function"]], many=True, lazy=False).gbnf


def test_a_template_without_tools_gets_them_in_a_system_message() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12 C"},
    ]
    out = fold_into_messages(messages, [WEATHER])
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.")
    assert '"name": "get_weather"' in out[0]["content"] and "<tools>" in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", '
                      '"arguments": {"city": "Oslo"}}\n</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\n12 C\n</tool_response>"}


def test_a_call_sent_back_unchanged_is_written_as_the_model_wrote_it() -> None:
    """Seen with SmolLM2: it wrote { "city": "Paris" }, the next turn's prompt had
    {"city": "Paris"}, and that turn reused the KV only to there (228 of 251 tokens)."""
    block = ('<tool_call>\n{"name": "get_weather", "arguments": { "city": "Paris",'
             ' "note": "\\u00e9" }}\n</tool_call>')
    content, calls = ToolCallParser().feed(block)
    assert content == "" and json.loads(calls[0].arguments) == {"city": "Paris", "note": "é"}
    sent = ChatMessage(role="assistant", tool_calls=[calls[0].openai(0)])
    out = fold_into_messages([message_dict(0, sent, json_text=True)], None)
    assert out == [{"role": "assistant", "content": block}]
    # A template that renders tools takes the arguments as a value
    assert message_dict(0, sent)["tool_calls"][0]["function"]["arguments"] == {
        "city": "Paris", "note": "é"}


def test_text_before_a_call_sent_back_unchanged_is_written_as_the_model_wrote_it() -> None:
    """Its line break was written twice: the next turn's prompt left the model's tokens
    between the text and the call."""
    for text in ("Let me look.\n", "Let me look. "):
        call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
        content, calls = ToolCallParser().feed(text + call)
        sent = ChatMessage(role="assistant", content=content,
                           tool_calls=[c.openai(i) for i, c in enumerate(calls)])
        out = fold_into_messages([message_dict(0, sent, json_text=True)], None)
        assert out == [{"role": "assistant", "content": text + call}]
    # Text of the client's own, without one, still gets its line
    sent = ChatMessage(role="assistant", content="Look.", tool_calls=[calls[0].openai(0)])
    out = fold_into_messages([message_dict(0, sent, json_text=True)], None)
    assert out[0]["content"] == "Look.\n" + call


def test_arguments_sent_back_as_a_value_are_written_as_the_parser_reads_them() -> None:
    """Anthropic's input and Ollama's arguments are objects: "Zürich" came back in the
    next turn's prompt as "Z\\u00fcrich", which the model had not written."""
    block = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
    _, calls = ToolCallParser().feed(block)
    sent = ChatMessage(role="assistant", tool_calls=[{"id": "c1", "function": {
        "name": "get_weather", "arguments": json.loads(calls[0].arguments)}}])
    out = fold_into_messages([message_dict(0, sent, json_text=True)], None)
    assert out == [{"role": "assistant", "content": block}]


# --- end to end -------------------------------------------------------------------------


def _start(model: Path, tmp: Path) -> Iterator[DaemonProcess]:
    yield from serve_model(model, tmp, kv_cells=8192, kv_layout="unified", max_context=2048,
                           slots=16, max_running=16)


@pytest.fixture(scope="module")
def tiny_tools(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    tmp = tmp_path_factory.mktemp("tools")
    yield from _start(write_tiny_llama(tmp / "tiny-tools.gguf", tools=True), tmp)


@pytest.fixture(scope="module")
def smol(real_model: Path, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[DaemonProcess]:
    yield from _start(real_model, tmp_path_factory.mktemp("smol"))


def _client(d: DaemonProcess) -> openai.OpenAI:
    return client(d, timeout=300)


def _model(d: DaemonProcess) -> str:
    return str(_client(d).models.list().data[0].id)


def _samples(d: DaemonProcess, n: int, **kw: Any) -> list[ChatCompletion]:
    """``n`` chat completions at temperature 1, several at once, each validated
    against openai's own response type."""
    def one(seed: int) -> ChatCompletion:
        raw = _client(d).chat.completions.with_raw_response.create(
            model=_model(d), temperature=1.0, seed=seed, **kw)
        return ChatCompletion.model_validate(raw.http_response.json())
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(n)))


def _assert_all_validate(answers: list[ChatCompletion]) -> None:
    for a in answers:
        assert a.choices[0].finish_reason == "stop", a
        jsonschema.validate(json.loads(a.choices[0].message.content or ""), SCHEMA)


RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}


def test_json_schema_output_always_validates_tiny(tiny_tools: DaemonProcess) -> None:
    _assert_all_validate(_samples(
        tiny_tools, 48, messages=[{"role": "user", "content": "A person"}],
        response_format=RESPONSE_FORMAT, max_tokens=400))


@pytest.mark.model
def test_json_schema_output_always_validates_smollm2(smol: DaemonProcess) -> None:
    # Fewer than on the tiny model: SmolLM2's 49k tokens make each step slower.
    _assert_all_validate(_samples(
        smol, 8, messages=[{"role": "user", "content": "Describe an engineer as JSON."}],
        response_format=RESPONSE_FORMAT, max_tokens=300))


def test_json_object_and_completions_fields(tiny_tools: DaemonProcess) -> None:
    c = _client(tiny_tools)
    model = _model(tiny_tools)
    small = {"type": "object", "properties": {"ok": {"type": "boolean"}},
             "required": ["ok"], "additionalProperties": False}
    for body in ({"response_format": {"type": "json_schema",
                                      "json_schema": {"name": "s", "schema": small}}},
                 {"json_schema": small}, {"guided_json": small},
                 {"response_format": {"type": "json_object", "schema": small}}):
        raw = c.completions.with_raw_response.create(
            model=model, prompt="JSON:", max_tokens=40, extra_body=body)
        done = Completion.model_validate(raw.http_response.json())
        jsonschema.validate(json.loads(done.choices[0].text), small)
    choice = c.completions.create(model=model, prompt="?", max_tokens=10,
                                  extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no")
    gbnf = c.completions.create(model=model, prompt="?", max_tokens=10,
                                extra_body={"grammar": 'root ::= "a" [0-9]'})
    assert len(gbnf.choices[0].text) == 2 and gbnf.choices[0].text[0] == "a"


@pytest.mark.parametrize(("body", "param"), [
    ({"grammar": "root ::= ("}, "grammar"),
    ({"grammar": 'root ::= "x"', "ignore_eos": True}, "ignore_eos"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "multipleOf": 2}}}},
     "response_format.json_schema.schema.multipleOf"),
    ({"json_schema": {"type": "object"}, "grammar": 'root ::= "x"'}, "grammar"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_constraints_get_a_400_that_names_them(tiny_tools: DaemonProcess,
                                                   body: dict[str, Any], param: str) -> None:
    r = httpx.post(tiny_tools.url + "/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    ok = httpx.post(tiny_tools.url + "/v1/completions", timeout=30,
                    json={"prompt": "still", "max_tokens": 2})
    assert ok.status_code == 200  # the worker is alive and nothing leaked


def _restarts(d: DaemonProcess) -> float:
    admin = httpx.Client(transport=httpx.HTTPTransport(uds=str(d.config.parent / "admin.sock")))
    with admin:
        text = admin.get("http://admin/metrics").text
    # Parsed, not matched: every sample carries labels (the node's, at least).
    return sum(s.value for fam in text_string_to_metric_families(text)
               if fam.name == "forged_worker_restarts" for s in fam.samples)


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_that_leaves_no_token_fails_the_request_not_the_worker(
        tiny_tools: DaemonProcess, stream: bool) -> None:
    """A surrogate is no valid UTF-8, so the guard bans what the grammar asks for:
    before, llama.cpp aborted the worker on accepting a token the grammar refused."""
    before = _restarts(tiny_tools)
    r = httpx.post(tiny_tools.url + "/v1/completions", timeout=30, json={
        "prompt": "x", "max_tokens": 8, "grammar": 'root ::= "ab\\uD800"', "stream": stream})
    # Streamed, the failure comes after "ab" was drawn: an error event if the stream had
    # begun, else (all in the worker's first frames) the same error as a 400.
    error = (r.json() if r.status_code == 400 else
             json.loads(r.text.split("data: ")[-2]) if stream else {})
    assert error["error"]["type"] == "invalid_request_error", r.text
    assert "grammar" in error["error"]["message"]
    ok = httpx.post(tiny_tools.url + "/v1/completions", timeout=30,
                    json={"prompt": "still", "max_tokens": 2})
    assert ok.status_code == 200 and _restarts(tiny_tools) == before


def _args_valid(call: Any, tools: list[dict[str, Any]]) -> None:
    schema = next(t["function"]["parameters"] for t in tools
                  if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)


def _tool_loop(d: DaemonProcess) -> None:
    """The openai client's loop: a call, the tool's result, then an answer."""
    c, tools = _client(d), [WEATHER, TIME]
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Oslo?"}]
    raw = c.chat.completions.with_raw_response.create(
        model=_model(d), messages=messages, tools=tools, tool_choice="required",
        # Room for a random model's call: the grammar allows up to 20 spaces at each gap.
        parallel_tool_calls=False, max_tokens=400, seed=3)
    first = ChatCompletion.model_validate(raw.http_response.json())
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    _args_valid(call, tools)
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "12 degrees, sunny"}]
    answer = c.chat.completions.create(model=_model(d), messages=messages, tools=tools,
                                       tool_choice="none", max_tokens=30, temperature=0)
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].message.content
    # the tool's result reached the prompt: the second prompt is the first plus the turns
    assert answer.usage is not None and first.usage is not None
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens


def test_tool_loop_tiny(tiny_tools: DaemonProcess) -> None:
    _tool_loop(tiny_tools)


@pytest.mark.model
def test_tool_loop_smollm2(smol: DaemonProcess) -> None:
    _tool_loop(smol)


def _streamed_calls(d: DaemonProcess, **kw: Any) -> tuple[list[Any], str | None, str]:
    with httpx.stream("POST", d.url + "/v1/chat/completions", timeout=120, json={
            "model": _model(d), "stream": True, "tools": [WEATHER, TIME], **kw}) as r:
        chunks = [ChatCompletionChunk.model_validate_json(line[6:])
                  for line in r.iter_lines() if line.startswith("data: {")]
    calls = [tc for ch in chunks for tc in ch.choices[0].delta.tool_calls or []]
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    return calls, chunks[-1].choices[0].finish_reason, content


@pytest.mark.model
@pytest.mark.parametrize("parallel", [False, None])
def test_a_named_function_streams_as_tool_call_deltas(smol: DaemonProcess,
                                                      parallel: bool | None) -> None:
    """Sampled at temperature 1 with a fresh seed. With ``parallel_tool_calls`` false the
    grammar allows one call, so the turn always ends with it; by default it allows call
    after call, and a sampled model may make distinct ones until the limit (about one
    run in forty here, each call a new zone): then every call sent is still whole."""
    calls, reason, content = _streamed_calls(
        smol, messages=[{"role": "user", "content": "Time in Oslo?"}], max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=parallel)
    assert content == ""
    assert reason == "tool_calls" if parallel is False else reason in ("tool_calls", "length")
    assert len(calls) == 1 if parallel is False else calls
    assert all(c.function.name == "get_time" for c in calls)
    assert [c.index for c in calls] == list(range(len(calls)))
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments or ""),
                            TIME["function"]["parameters"])


@pytest.mark.model
@pytest.mark.parametrize("max_tokens", [64, 256])
def test_required_calls_end_cleanly_smollm2(smol: DaemonProcess, max_tokens: int) -> None:
    """Issue 32's measurement: SmolLM2, the openai client, tool_choice required and one
    tool. Before, at 256 the answer held the same call twice (the grammar allows another
    call after each and the model repeats it), and at 64 the second copy was cut by the
    limit and its raw <tool_call> markup leaked into content."""
    c = _client(smol)
    for stream in (False, True):
        messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
        if stream:
            calls, reason, content = _streamed_calls(
                smol, messages=messages, tool_choice="required", max_tokens=max_tokens,
                temperature=0, tools=[WEATHER])
            names = [(tc.function.name, tc.function.arguments) for tc in calls]
        else:
            r = c.chat.completions.create(model=_model(smol), messages=messages,  # type: ignore[arg-type]
                                          tools=[WEATHER], tool_choice="required",  # type: ignore[list-item]
                                          max_tokens=max_tokens, temperature=0)
            choice = r.choices[0]
            reason, content = choice.finish_reason, choice.message.content or ""
            names = [(tc.function.name, tc.function.arguments)  # type: ignore[union-attr]
                     for tc in choice.message.tool_calls or []]
        assert "<tool" not in content and "tool_call>" not in content, content
        # Calls, each whole and valid; never the same call twice (before: the model
        # wrote its calls again and again until the limit).
        assert names and len(set(names)) == len(names), names
        for name, arguments in names:
            assert name == "get_weather"
            jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
        # A repeat ends the turn at 256; at 64 a call cut by the limit is dropped.
        assert reason == "tool_calls" if max_tokens == 256 else reason in ("length",
                                                                         "tool_calls")


def test_auto_constrains_a_call_once_the_model_starts_one(tiny_tools: DaemonProcess) -> None:
    """``auto``: the random model would never call; a logit bias on the <tool_call>
    token makes it start one, and from there the lazy grammar makes it a valid call
    (one: the bias would otherwise open call after call until the length limit)."""
    opener = _special_id(tiny_tools)
    for seed in range(6):
        calls, reason, _ = _streamed_calls(
            tiny_tools, messages=[{"role": "user", "content": "Weather in Oslo?"}],
            max_tokens=200, temperature=1.0, seed=seed, tool_choice="auto",
            parallel_tool_calls=False, logit_bias={str(opener): 100})
        assert reason == "tool_calls", calls
        for c in calls:
            _args_valid(c, [WEATHER, TIME])


def _special_id(d: DaemonProcess) -> int:
    """The id of the special token <tool_call> in the tiny vocabulary."""
    with Model(str(_model_path(d)), vocab_only=True) as m:
        ids = m.tokenize("<tool_call>", add_special=False, parse_special=True)
    assert len(ids) == 1
    return ids[0]


def _model_path(d: DaemonProcess) -> Path:
    for line in d.config.read_text().splitlines():
        if line.startswith("path = "):
            return Path(json.loads(line.split(" = ", 1)[1]))
    raise AssertionError("no model path in the config")


def test_a_literal_with_escapes_is_valid_json_in_the_grammar() -> None:
    """JSON escapes in an enum's or const's value (a newline, a quote, a backslash) are
    literal backslashes in the JSON the model writes: the converter left them as the
    grammar's own escapes (a raw newline inside a JSON string; a quote that ended the
    grammar's literal)."""
    newline = schema_grammar({"enum": ["a\nb"]}, "s").gbnf
    assert '"\\"a\\\\nb\\""' in newline  # the grammar's "\"a\\nb\"": JSON's "a\nb"
    assert "\\\\\\\"hi\\\\\\\"" in schema_grammar({"enum": ['say "hi"']}, "s").gbnf
    assert '"\\"C:\\\\\\\\dir\\""' in schema_grammar({"const": "C:\\dir"}, "s").gbnf


def test_a_type_list_keeps_the_schemas_other_constraints() -> None:
    """``"type": ["string", "null"]`` (OpenAI's way to say optional) with maxLength: the
    converter made it any string or null."""
    gbnf = schema_grammar({"type": ["string", "null"], "maxLength": 3}, "s").gbnf
    assert "(char (char (char)?)?)?" in gbnf and "null" in gbnf


def test_a_tools_parameters_with_defs_and_refs_make_a_grammar() -> None:
    """pydantic, openai.pydantic_function_tool and the Agents SDK write nested models as
    $defs and $ref: the call's grammar nests each function's parameters under its own
    root, where "#/$defs/Team" found nothing (a 400 for every such tool)."""
    team = {"type": "object", "properties": {"name": {"type": "string"}},
            "required": ["name"]}
    tools = [{"type": "function", "function": {"name": f, "parameters": {
        "type": "object", "properties": {"team": {"$ref": "#/$defs/Team"}},
        "required": ["team"], "$defs": {"Team": {**team, "properties": {
            f: {"type": "integer"}}, "required": [f]}}}}} for f in ("f", "g")]
    plan = plan_tools(tools, "required", None)
    assert plan is not None and plan.grammar is not None
    gbnf = plan.grammar.gbnf
    assert '"\\"f\\""' in gbnf and '"\\"g\\""' in gbnf  # each function's own Team


def test_data_that_looks_like_a_ref_is_kept_as_it_is() -> None:
    """A const or enum value is data: an object in it with a "$ref" key was rewritten
    as a reference, by the tools' hoisting of $defs and by the converter itself, so the
    model had to write "tools#/$defs/f0-Team" or "s#/$defs/Team" where the schema says
    "#/$defs/Team"."""
    ref = {"$ref": "#/$defs/Team"}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": ["link", "team"], "properties": {
            "link": {"const": ref}, "team": ref},
        "$defs": {"Team": {"type": "object", "properties": {
            "kind": {"enum": [ref, "x"]}}, "required": ["kind"]}}}}}]
    plan = plan_tools(tools, "required", None)
    assert plan is not None and plan.grammar is not None
    written = json.dumps(json.dumps(ref))[1:-1]  # as the grammar's literal holds it
    assert plan.grammar.gbnf.count(written) == 2
    plain = schema_grammar({"type": "object", "properties": {"a": {"const": ref}},
                            "required": ["a"]}, "s").gbnf
    assert written in plain


def test_a_lazy_tool_grammar_waits_for_its_marker_searched_as_a_literal(
        real_model: Path) -> None:
    """llama.cpp searches the whole text so far with the trigger at every token until
    it triggers. The whole-text form [\\s\\S]*?(<tool_call>)[\\s\\S]* backtracked: 148 ms a
    token at 1,000 tokens of prose, stalling every sequence of the worker (bench.trigger);
    a literal is found in linear time. Prose passes free; a call after it is held."""
    plan = plan_tools([WEATHER], "auto", None)
    assert plan is not None and plan.grammar is not None
    assert plan.grammar.trigger_patterns == ["<tool_call>"]
    with Model(str(real_model), vocab_only=True) as m:
        ptr = grammar_sampler(m, plan.grammar)
        try:
            n_vocab = ll.llama_vocab_n_tokens(m.vocab)
            for tok in m.tokenize("Sure, here is prose. " * 20, add_special=False,
                                  parse_special=False):
                ll.llama_sampler_accept(ptr, tok)
            assert _allowed(ptr, n_vocab) == n_vocab  # nothing constrained yet
            for tok in m.tokenize("Now <tool_call>", add_special=False, parse_special=True):
                ll.llama_sampler_accept(ptr, tok)
            assert 0 < _allowed(ptr, n_vocab) < 100  # the call's grammar holds
        finally:
            ll.llama_sampler_free(ptr)


def test_a_lazy_tool_grammar_waits_for_the_marker_token_where_there_is_one(
        tmp_path: Path, real_model: Path) -> None:
    """Where <tool_call> is one special token (Qwen2.5, Hermes models), the lazy grammar
    waits for that token: llama.cpp then searches no text at every token (its search of
    the whole answer so far grows with it), and prose that writes the marker as text
    does not fire it. A vocabulary without the token keeps the literal pattern."""
    plan = plan_tools([WEATHER], "auto", None)
    assert plan is not None and plan.grammar is not None
    with Prompter(str(write_tiny_llama(tmp_path / "t.gguf", tools=True))) as p:
        g = p.triggered(plan.grammar)
        (marker,) = p.vocab.tokenize("<tool_call>", add_special=False, parse_special=True)
        assert g.trigger_tokens == [marker] and g.trigger_patterns == []
        ptr = grammar_sampler(p.vocab, g)
        try:
            n_vocab = ll.llama_vocab_n_tokens(p.vocab.vocab)
            for tok in p.vocab.tokenize("prose <tool_call> as text ", add_special=False,
                                        parse_special=False):
                ll.llama_sampler_accept(ptr, tok)
            assert _allowed(ptr, n_vocab) == n_vocab  # the text did not fire it
            ll.llama_sampler_accept(ptr, marker)
            assert 0 < _allowed(ptr, n_vocab) < 20  # the call's grammar holds
        finally:
            ll.llama_sampler_free(ptr)
    with Prompter(str(real_model)) as p:
        assert p.triggered(plan.grammar) == plan.grammar  # SmolLM2 has no such token


def _allowed(ptr: Any, n_vocab: int) -> int:
    """How many tokens the grammar sampler leaves possible."""
    data = np.zeros(n_vocab, dtype=[("id", np.int32), ("logit", np.float32),
                                    ("p", np.float32)])
    data["id"] = np.arange(n_vocab, dtype=np.int32)
    array = ll.llama_token_data_array(
        data=data.ctypes.data_as(ctypes.POINTER(ll.llama_token_data)), size=n_vocab,
        selected=-1, sorted=False)
    ll.llama_sampler_apply(ptr, ctypes.byref(array))
    return int(np.isfinite(data["logit"][:array.size]).sum())


@pytest.mark.parametrize("pattern", [
    "^\\d{3}-\\d{4}$", "^[\\w.-]+@[\\w-]+\\.[a-z]{2,}$", "^\\d+(\\.\\d+){0,2}$",
    "^v\\d+\\/\\w+$", "^\\$\\d+$", "^\\s*x$", "^[^\\s]+$", "^a\\]b$"])
def test_a_pattern_with_the_usual_escapes_makes_a_grammar_llama_cpp_takes(
        real_model: Path, pattern: str) -> None:
    """The converter copied \\d, \\w, \\s, \\. and \\/ into the grammar, which llama.cpp
    refused: an e-mail or version pattern was a 400 ("could not parse the grammar")."""
    g = schema_grammar({"type": "string", "pattern": pattern}, "s")
    with Model(str(real_model), vocab_only=True) as m:
        check_grammar(m, g)


def _grammar_writes(m: Model, gbnf: str, text: str, *, per_character: bool = True) -> bool:
    """Whether llama.cpp's grammar ``gbnf`` lets a model write exactly ``text`` and then
    end: a token a character (each checked before it is accepted), or the tokens the
    tokenizer makes of it (a character of several bytes may be several tokens)."""
    tokens = ([t for ch in text for t in m.tokenize(ch, add_special=False,
                                                    parse_special=False)]
              if per_character else m.tokenize(text, add_special=False, parse_special=False))
    ptr = grammar_sampler(m, Grammar(gbnf=gbnf))
    try:
        for tok in tokens:
            if not _fits(ptr, tok):
                return False
            ll.llama_sampler_accept(ptr, tok)
        return _fits(ptr, m.eos)
    finally:
        ll.llama_sampler_free(ptr)


def _fits(ptr: Any, token: int) -> bool:
    one = ll.llama_token_data(token, 1.0, 0.0)
    array = ll.llama_token_data_array(data=ctypes.pointer(one), size=1, selected=-1,
                                      sorted=False)
    ll.llama_sampler_apply(ptr, ctypes.byref(array))
    return bool(np.isfinite(one.logit))


@pytest.mark.parametrize("choices", [["😀", "🙁"], ["a\fb", "x\by"], ['say "hi"\n', "a\\b"],
                                     ["tab\there", "é"]])
def test_guided_choice_writes_each_choice_as_it_is(real_model: Path,
                                                   choices: list[str]) -> None:
    """json.dumps wrote the choices: an emoji became \\ud83d\\ude00, two code points
    no token can write ("no token can continue"), and \\b, \\f are escapes llama.cpp's
    GBNF does not know ("could not parse the grammar")."""
    g = choice_grammar(choices, "guided_choice")
    with Model(str(real_model), vocab_only=True) as m:
        check_grammar(m, g)
        for choice in choices:
            assert _grammar_writes(m, g.gbnf, choice, per_character=False), choice
        assert not _grammar_writes(m, g.gbnf, choices[0] + choices[1],
                                   per_character=False)


@pytest.mark.parametrize(("pattern", "written", "refused"), [
    ("^[^,]+$", ['"ab"', '"a\\"b"', '"a\\\\b"', '"a\\nb"'],
     ['"a"b"', '"a\\qb"', '"a\nb"', '"a,b"']),
    ("^.+$", ['"a\\"}"', '"a\\tb"'], ['"a"}"', '"a\tb"', '"a\\nb"']),
    ("^[ -~]{1,4}$", ['"a\\"b"', '"~\\\\"'], ['"a"b"', '"a\\qb"', '"a\\b"']),
    ('^a"b$', ['"a\\"b"'], ['"a"b"']),
    ("^a\\\\b$", ['"a\\\\b"'], ['"a\\b"']),
    ("^a\\tb$", ['"a\\tb"'], ['"a\tb"']),
    ("^(?:ab|c){2}[\\^x]$", ['"abc^"', '"ccx"'], ['"ab^"', '"abcd"']),
])
def test_a_pattern_admits_each_character_as_json_text_writes_it(
        real_model: Path, pattern: str, written: list[str], refused: list[str]) -> None:
    """A pattern speaks of the string's value; the grammar writes its JSON text. The
    converter copied classes and "." as they were, so [^,]+ let the model write a raw
    quote (the answer was no longer JSON: "a"b"), a lone backslash or a raw control
    character, and a literal quote or backslash bare. Now each is its escape, and
    every text the grammar writes is JSON whose value matches the pattern. (And a
    non-capturing group, or an escaped ^ in a class, was a 400.)"""
    gbnf = schema_grammar({"type": "string", "pattern": pattern}, "s").gbnf
    with Model(str(real_model), vocab_only=True) as m:
        for text in written:
            assert _grammar_writes(m, gbnf, text), text
            assert jsonschema.Draft202012Validator({"pattern": pattern}).is_valid(
                json.loads(text))
        for text in refused:
            assert not _grammar_writes(m, gbnf, text), text


# Claude Code 2.1's own tools (its Task, TaskOutput, WebFetch, TaskCreate input schemas).
@pytest.mark.parametrize(("schema", "written", "refused"), [
    ({"type": "integer", "exclusiveMinimum": 0, "maximum": 9007199254740991},
     ["1", "42", "9007199254740991"], ["0", "-1", "9007199254740992", "01", "1.5"]),
    ({"type": "number", "minimum": 0, "maximum": 600000},
     ["0", "30000", "600000", "12.5", "599999.25"],
     ["-1", "600001", "600000.5", "1e3", "1." + "1" * 17]),
    ({"type": "integer", "minimum": -20, "exclusiveMaximum": 7}, ["-20", "-3", "0", "6"],
     ["-21", "7", "-0"]),
    ({"type": "number", "exclusiveMaximum": 0}, ["-1", "-250"], ["0", "0.5", "-0.5"]),
    # JavaScript's largest numbers as bounds: the digit ranges up to them were over 256 KiB.
    ({"type": "integer", "minimum": -1.7976931348623157e308,
      "maximum": 1.7976931348623157e308}, ["0", "-7", "9007199254740991"], ["1.5", "--1"]),
    ({"type": "string", "format": "uri"},
     ['"https://example.com:8080/a/b?q=1&r=%20#top"', '"mailto:a@b.c"', '"file:///etc/x"'],
     ['"example.com"', '"not a url"', '"https://a b"', '"http://x/%zz"']),
    ({"type": "object", "propertyNames": {"type": "string"},
      "additionalProperties": {"type": "string"}}, ['{"a": "b"}', "{}"], ['{"a": 1}']),
])
def test_claude_codes_tool_schemas_are_enforced(real_model: Path, schema: dict[str, Any],
                                                written: list[str],
                                                refused: list[str]) -> None:
    """Each of them was a 400 (minimum, exclusiveMinimum, the format uri,
    propertyNames), so every request Claude Code sends with its tools was refused. Now
    the grammar writes only values within the bounds, URIs and any object's names."""
    gbnf = schema_grammar(schema, "s").gbnf
    check = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    with Model(str(real_model), vocab_only=True) as m:
        check_grammar(m, Grammar(gbnf=gbnf))
        for text in written:
            assert _grammar_writes(m, gbnf, text), text
            assert check.is_valid(json.loads(text)), text
        for text in refused:
            assert not _grammar_writes(m, gbnf, text), text


# Zed's read_file tool (its ReadFileToolInput through schemars): as draft-07 to Ollama,
# an Option<u32> is ["integer", "null"] with the format uint32; as OpenAPI 3.0's subset
# to an OpenAI-compatible server (its default tool format there), the format is dropped
# and the Option is "nullable": true.
_LINE = "Optional line number to start reading on (1-based index)"
_ZED_DRAFT07 = {
    "type": "object", "description": "Reads the content of the given file in the project.",
    "properties": {
        "path": {"description": "The relative path of the file to read.", "type": "string"},
        "start_line": {"description": _LINE, "type": ["integer", "null"], "format": "uint32",
                       "minimum": 0, "default": None},
        "end_line": {"type": ["integer", "null"], "format": "uint32", "minimum": 0,
                     "default": None}},
    "required": ["path"], "additionalProperties": False}
_ZED_SUBSET = {
    "type": "object", "description": "Reads the content of the given file in the project.",
    "properties": {
        "path": {"description": "The relative path of the file to read.", "type": "string"},
        "start_line": {"description": _LINE, "type": "integer", "minimum": 0,
                       "nullable": True, "default": None},
        "end_line": {"type": "integer", "minimum": 0, "nullable": True, "default": None}},
    "required": ["path"]}
# What each says in JSON Schema's own words, to validate the texts the grammar writes.
_LINE_AS_JSON_SCHEMA = {"type": ["integer", "null"], "minimum": 0, "maximum": 2**32 - 1}


@pytest.mark.parametrize(("schema", "bounded"), [(_ZED_DRAFT07, True), (_ZED_SUBSET, False)])
def test_zeds_tool_schemas_are_enforced(real_model: Path, schema: dict[str, Any],
                                        bounded: bool) -> None:
    """Every request of Zed's agent with tools was a 400: to Ollama's API naming the
    format uint32, to OpenAI's naming nullable. Now nullable is null among the types
    and a number format of a fixed width its range."""
    gbnf = schema_grammar(schema, "tools[0].function.parameters").gbnf
    lines = {**schema["properties"], "start_line": _LINE_AS_JSON_SCHEMA,
             "end_line": _LINE_AS_JSON_SCHEMA}
    check = jsonschema.Draft7Validator({**schema, "properties": lines})
    written = ['{"path": "src/main.rs"}', '{"path": "a", "start_line": 3, "end_line": 40}',
               '{"path": "a", "start_line": null}', '{"path": "a", "end_line": 4294967295}']
    refused = ['{"path": "a", "start_line": -1}', '{"path": "a", "start_line": "3"}',
               '{"start_line": 3}'] + (['{"path": "a", "end_line": 4294967296}'] if bounded
                                       else [])
    with Model(str(real_model), vocab_only=True) as m:
        check_grammar(m, Grammar(gbnf=gbnf))
        for text in written:
            assert _grammar_writes(m, gbnf, text, per_character=False), text
            assert check.is_valid(json.loads(text)), text
        for text in refused:
            assert not _grammar_writes(m, gbnf, text, per_character=False), text


def test_a_nullable_that_is_not_a_boolean_is_named() -> None:
    with pytest.raises(e.BadRequest) as info:
        check_schema({"type": "integer", "nullable": "yes"}, "s")
    assert info.value.param == "s.nullable"
    check_schema({"anyOf": [{"type": "string"}], "nullable": False}, "s")  # asks nothing


def test_a_class_of_control_characters_alone_is_a_400() -> None:
    with pytest.raises(e.BadRequest) as caught:
        schema_grammar({"type": "string", "pattern": "^[\\x00-\\x07]$"}, "s")
    assert caught.value.param == "s"


@pytest.mark.parametrize("escape", ["\\D", "\\W", "\\S", "\\b", "\\B"])
def test_an_escape_no_class_expresses_is_a_400_naming_it(escape: str) -> None:
    with pytest.raises(e.BadRequest) as caught:
        schema_grammar({"type": "string", "pattern": f"^a{escape}$"}, "s")
    assert caught.value.param == "s.pattern" and escape in str(caught.value)


def test_an_all_of_one_ref_is_that_schema() -> None:
    """pydantic writes a field of an enum type as {"allOf": [{"$ref": ...}]}: the
    converter merged only an allOf's properties, and the field accepted only {}."""
    gbnf = schema_grammar({
        "type": "object", "required": ["c"], "$defs": {"Color": {"enum": ["red", "green"]}},
        "properties": {"c": {"allOf": [{"$ref": "#/$defs/Color"}], "description": "a colour"}},
    }, "s").gbnf
    assert "red" in gbnf and "green" in gbnf


_A = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
_B = {"properties": {"b": {"type": "string", "maxLength": 3}}}


@pytest.mark.parametrize("schema", [
    {"allOf": [{"type": "string"}, {"maxLength": 3}]},
    {"allOf": [_A, {"required": ["b"]}]},
    {"allOf": [_A, {"properties": {"a": {"type": "string"}}}]},
    {"properties": {"c": {"type": "string"}}, "allOf": [_A, _B]},
    {"type": "string", "allOf": [_A, _B]},
    {"allOf": [_A, {"anyOf": [_B, {"properties": {"d": {}}}]}]},
    {"allOf": [_A, {"$ref": "#/$defs/E"}], "$defs": {"E": {"enum": ["x", "y"]}}},
])
def test_an_all_of_the_converter_would_half_apply_is_a_400(schema: dict[str, Any]) -> None:
    """The converter enforces an allOf of several schemas only as one object whose
    properties are the parts' (each required, nothing else), and ignores the rest: a
    part that is not an object's properties, a property in two parts (written twice)
    or a keyword beside the allOf. The answer then did not match the schema."""
    with pytest.raises(e.BadRequest) as caught:
        schema_grammar(schema, "s")
    assert caught.value.param is not None and caught.value.param.startswith("s")


def test_an_all_of_objects_is_their_properties_merged(real_model: Path) -> None:
    schema = {"allOf": [_A, {"$ref": "#/$defs/B", "description": "b"}],
              "$defs": {"B": _B}}
    gbnf = schema_grammar(schema, "s").gbnf
    with Model(str(real_model), vocab_only=True) as m:
        assert _grammar_writes(m, gbnf, '{"a": 1, "b": "xy"}')
        assert not _grammar_writes(m, gbnf, '{"a": 1}')  # each part's properties required
    assert jsonschema.Draft202012Validator(schema).is_valid({"a": 1, "b": "xy"})


@pytest.mark.parametrize(("values", "refused"), [
    (["ab", "abc", "abd", "b", "a"], ['"abcd"', '"ac"', '""', '"ba"', '"ab']),
    ([1, 12, 2, None, True, "x", [1], {"k": "v"}], ["3", "21", '"y"', "[1, 2]", "false"]),
    (["é", "e", "😀", 'q"', "a\\b"], ['"\\u00e8"', '"q"', '"a\\b"', '"ee"']),
])
def test_an_enum_writes_each_of_its_values_and_nothing_else(
        real_model: Path, values: list[Any], refused: list[str]) -> None:
    """The enum is written as a prefix tree (forged.engine.backend.gbnf_alternatives):
    a value that is a prefix of another, values of every JSON type and escapes all
    still make the same language as the converter's flat list."""
    g = schema_grammar({"enum": values}, "s")
    with Model(str(real_model), vocab_only=True) as m:
        check_grammar(m, g)
        for value in values:
            assert _grammar_writes(m, g.gbnf, json.dumps(value), per_character=False), value
        for text in refused:
            assert not _grammar_writes(m, g.gbnf, text, per_character=False), text


def _widest_group(gbnf: str) -> int:
    """The most alternatives side by side at one place of ``gbnf``'s rules (outside
    literals): how many stacks llama.cpp's grammar keeps alive there at most."""
    widest, counts, quoted, escaped = 0, [1], False, False
    for ch in gbnf:
        if quoted:
            quoted, escaped = (escaped or ch != '"'), (not escaped and ch == "\\")
        elif ch == '"':
            quoted = True
        elif ch == "(":
            counts.append(1)
        elif ch == ")":
            widest = max(widest, counts.pop())
        elif ch == "|":
            counts[-1] += 1
        elif ch == "\n":
            widest, counts = max(widest, counts[0]), [1]
    return max(widest, counts[0])


def test_a_large_enum_keeps_few_alternatives_alive_for_the_grammar() -> None:
    """An enum was a flat list of alternatives, and llama.cpp checks every candidate
    token against each one still alive: 3,500 words cost 490 ms a token over SmolLM2's
    vocabulary, in the worker's step, where every other stream waited (bench.grammar,
    "enum"). As a prefix tree, at most the characters that can come next are alive:
    here the ten digits. vLLM's guided_choice gets the same tree."""
    words = [f"w{i:04d}" for i in range(3500)]
    assert _widest_group(schema_grammar({"type": "string", "enum": words}, "s").gbnf) <= 10
    assert _widest_group(choice_grammar(words, "guided_choice").gbnf) <= 10
    assert _widest_group('root ::= "a" | "(|" | ("b" | "c")') == 3  # the counter itself


def _two_tools(n: int) -> list[dict[str, Any]]:
    """``n`` functions: the even ones take a path, the odd ones a count."""
    path = {"type": "object", "properties": {"path": {"type": "string"}},
            "required": ["path"], "additionalProperties": False}
    count = {"type": "object", "properties": {"count": {"type": "integer"}},
             "required": ["count"], "additionalProperties": False}
    return [{"name": f"tool_{i:03d}", "parameters": count if i % 2 else path}
            for i in range(n)]


def test_many_tools_keep_few_alternatives_alive_for_the_grammar() -> None:
    """A call was the converter's anyOf of one object per function: every function's
    stack stayed alive through `{"name": "` and the name's first characters, each
    checked against every candidate token (150 tools: 65-310 ms a token there over
    SmolLM2's vocabulary, in the worker's step). The part every call shares is now
    written once and the names as a prefix tree."""
    gbnf = call_grammar(_two_tools(150), many=False, lazy=False).gbnf
    call = next(line for line in gbnf.splitlines() if line.startswith("call ::="))
    assert _widest_group(call) <= 10


def _call_writes(m: Model, g: Grammar, call: str) -> bool:
    """Whether the tool-call grammar ``g`` lets a model write ``call`` in its block."""
    return _grammar_writes(m, g.gbnf, f"<tool_call>\n{call}\n</tool_call>",
                           per_character=False)


def test_a_call_writes_each_functions_name_with_its_own_arguments(real_model: Path) -> None:
    g = call_grammar(_two_tools(12), many=False, lazy=False)
    with Model(str(real_model), vocab_only=True) as m:
        check_grammar(m, g)
        writes = functools.partial(_call_writes, m, g)
        assert writes('{"name": "tool_004", "arguments": {"path": "a"}}')
        assert writes('{ "name":"tool_011","arguments":{"count":7}}')
        assert not writes('{"name": "tool_004", "arguments": {"count": 7}}')
        assert not writes('{"name": "tool_011", "arguments": {"path": "a"}}')
        assert not writes('{"name": "tool_012", "arguments": {"path": "a"}}')
        assert not writes('{"name": "tool_00", "arguments": {"path": "a"}}')


def test_a_parameter_named_kv_keeps_the_calls_arguments(real_model: Path) -> None:
    """The call rule named each function's arguments `calls-N-arguments-kv`, the
    converter's usual name; but a parameter "kv" takes that name first (its value's
    rule), the arguments' own rule becoming `calls-N-arguments-kv0`, and the grammar
    then wrote the parameter's value in place of the whole arguments: no call of the
    function could be written."""
    pair = {"type": "object", "properties": {"k": {"type": "string"}},
            "required": ["k"], "additionalProperties": False}
    g = call_grammar([{"name": "put", "parameters": {
        "type": "object", "properties": {"kv": pair}, "required": ["kv"],
        "additionalProperties": False}}], many=False, lazy=False)
    with Model(str(real_model), vocab_only=True) as m:
        check_grammar(m, g)
        writes = functools.partial(_call_writes, m, g)
        assert writes('{"name": "put", "arguments": {"kv": {"k": "a"}}}')
        assert not writes('{"name": "put", "arguments": {"k": "a"}}')
        assert not writes('{"name": "put", {"k": "a"}}')


def test_a_tool_whose_parameters_refer_into_themselves_is_a_grammar(
        real_model: Path) -> None:
    """zod-to-json-schema (zod 3: the MCP TypeScript SDK's tools) writes a schema used
    twice as a $ref to its first place, "#/properties/from"; the call grammar moves the
    parameters under its own root, where that pointed at nothing: a 400 on the tool."""
    point = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
             "additionalProperties": False}
    params = {"type": "object", "properties": {"from": point,
                                                "to": {"$ref": "#/properties/from"}},
              "required": ["from", "to"], "additionalProperties": False}
    plan = plan_tools([{"type": "function", "function": {"name": "move", "parameters": params}},
                       {"type": "function", "function": {"name": "stay", "parameters": {}}}],
                      "required", False)
    assert plan is not None and plan.grammar is not None
    with Model(str(real_model), vocab_only=True) as m:
        check_grammar(m, plan.grammar)

        def writes(arguments: str) -> bool:
            return _grammar_writes(m, plan.grammar.gbnf if plan.grammar else "",
                                   f'<tool_call>\n{{"name": "move", "arguments": {arguments}}}'
                                   "\n</tool_call>", per_character=False)

        assert writes('{"from": {"x": 1}, "to": {"x": 2}}')
        assert not writes('{"from": {"x": 1}, "to": {"y": 2}}')


@pytest.mark.parametrize("taken", ["call", "tool-call", "tool-ws"])
def test_a_parameters_rule_named_as_the_calls_own_keeps_the_call(
        real_model: Path, taken: str) -> None:
    """The converter names a $ref's rule by the ref's last part: a property "call"
    used twice ("$ref": "#/properties/call") made a second rule `call`, and llama.cpp
    kept the later one, so the whole call had to be that property's value."""
    inner = {"type": "object", "properties": {"q": {"type": "integer"}}, "required": ["q"],
             "additionalProperties": False}
    params = {"type": "object", "properties": {taken: inner,
                                                "again": {"$ref": f"#/properties/{taken}"}},
              "required": [taken, "again"], "additionalProperties": False}
    g = call_grammar([{"name": "f", "parameters": params}], many=True, lazy=False)
    with Model(str(real_model), vocab_only=True) as m:
        check_grammar(m, g)
        call = f'<tool_call>\n{{"name": "f", "arguments": {{"{taken}": {{"q": 1}}, ' \
               '"again": {"q": 2}}}\n</tool_call>'
        assert _grammar_writes(m, g.gbnf, call, per_character=False)
        assert _grammar_writes(m, g.gbnf, f"{call}\n{call}", per_character=False)
        assert not _grammar_writes(m, g.gbnf, '{"q": 1}', per_character=False)


def test_two_refs_that_end_alike_keep_their_own_schemas(real_model: Path) -> None:
    """The converter named a $ref's rule by the ref's last part and reused any rule so
    named: two tools each with zod's "#/properties/from" both wrote the first tool's
    schema, and a ref to one object's "item" wrote another's."""
    def tool(name: str, prop: str, kind: str) -> dict[str, Any]:
        inner = {"type": "object", "properties": {prop: {"type": kind}}, "required": [prop],
                 "additionalProperties": False}
        return {"name": name, "parameters": {
            "type": "object", "properties": {"from": inner, "to": {"$ref": "#/properties/from"}},
            "required": ["from", "to"], "additionalProperties": False}}

    g = call_grammar([tool("a", "x", "integer"), tool("b", "y", "string")], many=False,
                     lazy=False)
    item = {"type": "object", "properties": {"item": {"type": "object", "properties": {
        "z": {"type": "integer"}}, "required": ["z"], "additionalProperties": False}},
        "required": ["item"], "additionalProperties": False}
    s = schema_grammar({"type": "object", "$defs": {"A": item}, "properties": {
        "item": {"type": "object", "properties": {"w": {"type": "string"}}, "required": ["w"],
                 "additionalProperties": False},
        "z": {"$ref": "#/$defs/A/properties/item"}},
        "required": ["item", "z"], "additionalProperties": False}, "s")
    with Model(str(real_model), vocab_only=True) as m:
        def call(arguments: str) -> bool:
            return _grammar_writes(m, g.gbnf, '<tool_call>\n{"name": "b", "arguments": '
                                   f"{arguments}}}\n</tool_call>", per_character=False)

        assert call('{"from": {"y": "s"}, "to": {"y": "t"}}')
        assert not call('{"from": {"y": "s"}, "to": {"x": 1}}')
        assert _grammar_writes(m, s.gbnf, '{"item": {"w": "a"}, "z": {"z": 1}}',
                               per_character=False)
        assert not _grammar_writes(m, s.gbnf, '{"item": {"w": "a"}, "z": {"w": "b"}}',
                                   per_character=False)


def test_a_recursive_pydantic_model_is_a_grammar(real_model: Path) -> None:
    """Pydantic writes a model that holds itself as a $ref beside its $defs at the top;
    the $refs inside the definitions were never resolved there: a 400."""
    tree = {"$defs": {"Tree": {"type": "object", "title": "Tree", "properties": {
        "v": {"type": "integer"},
        "kids": {"type": "array", "items": {"$ref": "#/$defs/Tree"}, "maxItems": 2}},
        "required": ["v", "kids"], "additionalProperties": False}},
        "$ref": "#/$defs/Tree"}
    g = schema_grammar(tree, "response_format")
    with Model(str(real_model), vocab_only=True) as m:
        check_grammar(m, g)
        assert _grammar_writes(m, g.gbnf, '{"v": 1, "kids": [{"v": 2, "kids": []}]}',
                               per_character=False)
        assert not _grammar_writes(m, g.gbnf, '{"v": 1, "kids": [{"v": 2}]}',
                                   per_character=False)


def test_a_call_written_as_a_flat_list_keeps_its_shared_part(
        real_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the names' tree nests past Python's stack, they are a flat list; after the
    call's shared '{"name": ' it was not a group, so every name but the first was a
    whole call of its own ('"tool_001", "arguments": ...')."""
    def too_deep(words: list[tuple[str, str]]) -> str:
        raise RecursionError

    monkeypatch.setattr("forged.engine.backend._tree", too_deep)
    g = call_grammar(_two_tools(3), many=False, lazy=False)
    with Model(str(real_model), vocab_only=True) as m:
        writes = functools.partial(_call_writes, m, g)
        assert writes('{"name": "tool_001", "arguments": {"count": 7}}')
        assert not writes('"tool_001", "arguments": {"count": 7}}')


def test_a_proof_that_a_pattern_is_of_its_format_is_bounded() -> None:
    """Each step of the proof carries every state the pattern may be in: a pattern of
    two long repetitions in a row (a time with 1 to 1,800 digits of fraction) took 6 s
    of a thread to prove. Past its bound it proves nothing (the schema is a 400)."""
    fraction = r"^(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]\.[0-9]{1,900}"
    assert pattern_implies(fraction + "Z$", "time")
    assert not pattern_implies(fraction + "[0-9]{0,900}Z$", "time")


def test_an_enums_values_meet_a_pattern_without_a_backtracking_search(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An enum's values the pattern forbids are left out of its grammar; they were
    matched with Python's re, which backtracks: ^(a+)+$ took 4.8 s on 26 a's and a b,
    twice that with each a more, in one of the door's few threads. They are walked as
    the pattern's automaton now, and re.search is never asked."""
    def backtracking(*args: Any) -> None:
        raise AssertionError("a backtracking regex search")

    monkeypatch.setattr(grammar_module, "re",
                        SimpleNamespace(**{**vars(re), "search": backtracking}))
    schema = {"type": "string", "pattern": "^(a+)+$", "enum": ["a" * 40 + "b", "aa", "ab"]}
    assert schema_grammar(schema, "s").gbnf.splitlines()[0] == 'root ::= "\\"aa\\""'
