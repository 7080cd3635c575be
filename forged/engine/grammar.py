"""Grammars for constrained output, written with llama-cpp-python's JSON-schema-to-GBNF
converter (pure Python: it builds GBNF text and calls nothing of llama.cpp; the daemon
uses it, and llama.cpp checks and runs the result in :mod:`forged.engine.backend`).

The converter ignores what it cannot express (``minimum``, ``uniqueItems``, ...), and
the output would then not validate. So a schema is walked first (:func:`check_schema`)
and any keyword outside what the converter enforces is a 400 that names the keyword and
where it is: what forged returns always validates against the schema it accepted.
"""

from __future__ import annotations

import copy
import json
import math
import re
from typing import Any

from forged import errors as e
from forged.engine.backend import JSON_OBJECT_GBNF, gbnf_alternatives, schema_gbnf
from forged.engine.jsonpattern import json_pattern
from forged.engine.numrange import BOUNDS, integer_bounds, integers
from forged.engine.patternfit import FORMATS, Matcher, pattern_implies
from forged.engine.request import Grammar
from forged.engine.schemawalk import mapped, subschemas
from forged.engine.schemawords import plain

# The Hermes tool-call markers: the one tool-call syntax forged writes and parses.
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"

# What the converter turns into grammar, by the kind of schema it applies to.
_ENFORCED = frozenset({
    "type", "$ref", "anyOf", "allOf", "const", "enum",
    "properties", "required", "additionalProperties",
    "items", "prefixItems", "minItems", "maxItems",
    "pattern", "format", "minLength", "maxLength",
    "$defs", "definitions", *BOUNDS, "propertyNames",
})
# Words that describe a schema and constrain nothing.
_ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment",
    "deprecated", "readOnly", "writeOnly", "strict",
})
# The string formats the converter has rules for.
_FORMATS = frozenset({"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3",
                      "uuid4", "uuid5", "uri"})
# A "uri" is written as one of RFC 3986's absolute URIs: a scheme, then "//" and a host
# (letters, digits, "._~-") with an optional port, or a path, then a query and a
# fragment, each character unreserved, a sub-delimiter, ":", "@" or a %-escape. Every
# one is a URI, and a URL to `new URL()` (Claude Code's WebFetch takes a "uri").
_PCHAR = r"(?:[A-Za-z0-9._~!$&'()*+,;=:@-]|%[0-9A-Fa-f]{2})"
URI_PATTERN = (rf"^[A-Za-z][A-Za-z0-9+.-]*:(?://[A-Za-z0-9._~-]*(?::[0-9]+)?(?:/{_PCHAR}*)*"
               rf"|/?{_PCHAR}+(?:/{_PCHAR}*)*)(?:\?(?:{_PCHAR}|[/?])*)?(?:#(?:{_PCHAR}|[/?])*)?$")
# What a "uri" string cannot have beside it: the converter would enforce one of them.
_URI_ALONE = ("pattern", "minLength", "maxLength")
# propertyNames that ask for nothing: every key of a JSON object is a string.
_ANY_NAME: list[Any] = [True, {}, {"type": "string"}]
_WHY = {
    "oneOf": "a grammar cannot enforce that exactly one branch matches; use anyOf",
}
MAX_SCHEMA_BYTES = 64 * 1024
# Bounds on what a grammar may cost. llama-cpp-python's converter writes a repetition
# out in full, one nesting level per optional item (``maxLength: 200000`` is a grammar
# 200,000 levels deep), and llama.cpp's parser recurses once per level, on the stack of
# whichever thread checks the grammar: deep enough, the whole process dies (SIGSEGV).
# llama.cpp itself refuses repetitions over 2,000 (MAX_REPETITION_THRESHOLD); forged
# refuses them earlier, before converting, and bounds the result's size and nesting.
MAX_REPETITION = 1000
MAX_GRAMMAR_BYTES = 256 * 1024
MAX_GRAMMAR_DEPTH = 1200  # a full MAX_REPETITION nests about MAX_REPETITION deep
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems")
# A repetition in a regex pattern: whatever is between braces, as the converter reads
# it ({n}, {n,}, {,m}, { n}, {n, m}, and after an escaped backslash, \\{n}). A literal
# brace with a large number inside is refused too: rare, and said clearly.
_PATTERN_BRACES = re.compile(r"\{([^}]*)\}")
# What each keyword's value must be, checked before the converter reads it (it raised
# AttributeError or TypeError on the others).
_KINDS: dict[str, type | tuple[type, ...]] = {
    "properties": dict, "$defs": dict, "definitions": dict, "anyOf": list, "allOf": list,
    "prefixItems": list, "$ref": str, "format": str, "pattern": str, "required": list,
    "enum": list, "type": (str, list), "items": (dict, bool, list),
    "additionalProperties": (dict, bool),
}
# llama-cpp-python's converter lets a string hold raw control characters, which JSON
# forbids (llama.cpp's own converter and JSON grammar exclude them): its rule, mended.
_LOOSE_CHAR = r'char ::= [^"\\] |'
_JSON_CHAR = r'char ::= [^"\\\x7F\x00-\x1F] |'


def schema_grammar(schema: Any, param: str) -> Grammar:
    """The grammar of JSON that matches ``schema``, or a BadRequest naming what the
    grammar could not enforce."""
    if not isinstance(schema, dict):
        raise e.BadRequest("a JSON schema must be an object", param=param)
    if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
        raise e.BadRequest(f"the JSON schema is larger than {MAX_SCHEMA_BYTES} bytes",
                           param=param)
    check_schema(schema, param)
    gbnf = _convert(schema, "", param)
    check_gbnf(gbnf, param)
    return Grammar(gbnf=gbnf)


def check_gbnf(gbnf: str, param: str) -> None:
    """A BadRequest unless llama.cpp's recursive parser can read ``gbnf`` safely: at
    most MAX_GRAMMAR_BYTES, its groups nested at most MAX_GRAMMAR_DEPTH deep."""
    if len(gbnf) > MAX_GRAMMAR_BYTES:
        raise e.BadRequest(f"the grammar is larger than {MAX_GRAMMAR_BYTES} bytes "
                           f"({len(gbnf)}); lower its repetition counts", param=param)
    if (depth := gbnf_depth(gbnf)) > MAX_GRAMMAR_DEPTH:
        raise e.BadRequest(f"the grammar nests {depth} levels deep, more than "
                           f"{MAX_GRAMMAR_DEPTH}; lower its repetition counts", param=param)


# What the depth scan skips: a quoted literal, a character class, a comment.
_GBNF_SKIP = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|#[^\n]*')


def gbnf_depth(gbnf: str) -> int:
    """The deepest nesting of parentheses in ``gbnf``, outside literals and classes."""
    depth = deepest = 0
    for ch in _GBNF_SKIP.sub("", gbnf):
        if ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth -= 1
    return deepest


def _convert(schema: dict[str, Any], name: str, param: str,
             written: dict[str, str] | None = None) -> str:
    """GBNF for ``schema``, its top rule ``name`` ("" is ``root``): schema_gbnf's."""
    order = {"name": 0, "arguments": 1}  # a tool call's name before its arguments
    try:
        schema = _for_converter(schema)  # a copy: resolve_refs rewrites the $refs in place
        gbnf = schema_gbnf(schema, name, param, order, written)
    except (AssertionError, ValueError, KeyError, TypeError, AttributeError, IndexError,
            RecursionError) as exc:
        raise e.BadRequest(f"the JSON schema cannot be turned into a grammar: {exc}",
                           param=param) from exc
    return gbnf.replace(_LOOSE_CHAR, _JSON_CHAR)


def _for_converter(node: Any) -> Any:
    """A copy of ``node`` as the converter can take it: an allOf of one schema is that
    schema, a pattern speaks of JSON text (forged.engine.jsonpattern), and a schema whose
    ``type`` is a list is an anyOf of one copy per type (the converter made each type a
    bare branch, dropping every other constraint: ``"type": ["string", "null"]``,
    OpenAI's optional field, with maxLength was any string). Definitions stay where the
    $refs find them."""
    if not isinstance(node, dict):
        return copy.deepcopy(node)
    node = plain(node, "")  # check_schema named what is wrong with it
    if node.get("format") == "uri":
        node = {**{k: v for k, v in node.items() if k != "format"}, "pattern": URI_PATTERN}
    if isinstance(node.get("enum"), list):  # the converter writes the values alone
        node = {**node, "enum": _fitting(node["enum"], node)}
    out = {key: _split_within(key, value) for key, value in node.items()
           if key != "propertyNames"}  # one that asks for nothing (check_schema)
    if isinstance(parts := out.get("allOf"), list) and len(parts) == 1 and isinstance(
            parts[0], dict):
        # pydantic's {"allOf": [{"$ref": ...}], "description": ...}: the converter merges
        # only an allOf's properties, and made one of an enum's ref accept just {}.
        del out["allOf"]
        out.update(parts[0])
    if not isinstance(types := out.get("type"), list):
        return out
    defs = {k: out.pop(k) for k in ("$defs", "definitions") if k in out}
    del out["type"]
    return {"anyOf": [{**out, "type": t} for t in types], **defs}


def _split_within(key: str, value: Any) -> Any:
    if key == "pattern" and isinstance(value, str):
        return json_pattern(value)
    out = mapped(key, value, _for_converter)  # copies of the schemas inside
    return copy.deepcopy(value) if out is value else out


def json_object_grammar() -> Grammar:
    return Grammar(gbnf=JSON_OBJECT_GBNF)


def choice_grammar(choices: list[str], param: str) -> Grammar:
    """vLLM's guided_choice: the answer is exactly one of ``choices``."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise e.BadRequest("guided_choice must be a list of non-empty strings", param=param)
    return Grammar(gbnf="root ::= " + gbnf_alternatives(choices))


def check_schema(node: Any, where: str, depth: int = 0, root: Any = None) -> None:
    """A BadRequest naming the first keyword of ``node`` the grammar cannot enforce
    (``root``: the whole schema its $refs point into; ``node`` itself at the top)."""
    root = node if root is None else root
    if depth > 32:
        raise e.BadRequest("the JSON schema is nested more than 32 levels deep", param=where)
    if isinstance(node, bool):
        return
    if not isinstance(node, dict):
        raise e.BadRequest(f"{where}: a schema must be an object", param=where)
    node = plain(node, where)  # OpenAPI's nullable and number widths (schemawords)
    for key, value in node.items():
        at = f"{where}.{key}"
        if key in _ANNOTATIONS:
            continue
        if key not in _ENFORCED:
            why = _WHY.get(key, "the grammar cannot enforce it")
            raise e.BadRequest(f"the JSON schema keyword {key!r} is not supported ({why})",
                               param=at)
        if key in _KINDS and not isinstance(value, _KINDS[key]):
            raise e.BadRequest(f"{at} must be a JSON {_kind_name(_KINDS[key])}", param=at)
        if key in _COUNTS:
            _check_count(value, at)
        if key == "pattern":
            _check_pattern(value, at)
        if key == "allOf" and len(value) > 1:
            _check_all_of(node, at, root)
        if key == "format" and value not in _FORMATS:
            raise e.BadRequest(f"the string format {value!r} is not supported; forged "
                               f"enforces {', '.join(sorted(_FORMATS))}", param=at)
        _check_extra(node, key, value, at)
        for i, sub in subschemas(key, value):
            check_schema(sub, f"{at}{i}", depth + 1, root)
    _check_object(node, where)
    _check_satisfiable(node, where)


def _check_extra(node: dict[str, Any], key: str, value: Any, at: str) -> None:
    """The keywords forged enforces beyond the converter: numeric bounds
    (forged.engine.numrange), a "uri" and propertyNames that ask for nothing."""
    if key in BOUNDS:
        _check_bound(node, key, value, at)
    elif key == "propertyNames" and value not in _ANY_NAME:
        raise e.BadRequest("the JSON schema keyword 'propertyNames' is supported only as "
                           "{\"type\": \"string\"} (the grammar cannot enforce more)", param=at)
    elif key == "format" and value == "uri" and (beside := set(_URI_ALONE) & set(node)):
        raise e.BadRequest(f"a \"uri\" is written as a pattern of its own; "
                           f"{sorted(beside)[0]!r} beside it is not supported", param=at)


def _check_bound(node: dict[str, Any], key: str, value: Any, at: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(
            value):
        raise e.BadRequest(f"{at} must be a JSON number", param=at)
    types = node.get("type")
    if not {"integer", "number"} & set(types if isinstance(types, list) else [types]):
        raise e.BadRequest(f"the JSON schema keyword {key!r} is enforced only on a schema "
                           "whose type is \"integer\" or \"number\"", param=at)
    if beside := {"enum", "const", "anyOf", "allOf", "$ref"} & set(node):
        raise e.BadRequest(f"the JSON schema keyword {key!r} beside {sorted(beside)[0]!r} "
                           "is not supported (one of them would be ignored)", param=at)
    if not integers(*integer_bounds(node)):
        raise e.BadRequest(f"the bounds ({key!r}) admit no integer, and forged writes a "
                           "number within them as an integer part and digits", param=at)


# An object schema's own keywords: all a part of a multi-part allOf may have.
_OBJECT_PART = frozenset({"type", "properties", "required", "additionalProperties"})


def _check_all_of(node: dict[str, Any], where: str, root: Any) -> None:
    """An allOf of several schemas as the converter enforces one: it merges the parts'
    properties into one object (each part's all required, nothing else allowed) and
    ignores everything else, so a part that is not an object's properties, a property
    named twice or a keyword beside the allOf would be silently half-applied."""
    why = "an allOf of several schemas is enforced only as objects' properties merged"
    beside = set(node) - _ANNOTATIONS - {"allOf", "$defs", "definitions", "type"}
    if beside or node.get("type", "object") != "object":
        raise e.BadRequest(f"{why}; {sorted(beside or {'type'})[0]!r} beside it would be "
                           "ignored", param=where)
    names: set[str] = set()
    for i, part in enumerate(node["allOf"]):
        part = _resolved(part, root)
        if not isinstance(part, dict):
            continue  # check_schema says what is wrong with it
        other = set(part) - _ANNOTATIONS - _OBJECT_PART
        props = part.get("properties")
        if other or not isinstance(props, dict) or part.get("type", "object") != "object":
            raise e.BadRequest(f"{why}: each part must be an object's properties "
                               f"({sorted(other)[0]!r} would be ignored)" if other else
                               f"{why}: each part must be an object's properties",
                               param=f"{where}[{i}]")
        if twice := names & set(props):
            raise e.BadRequest(f"{why}: the property {sorted(twice)[0]!r} is named in two "
                               "parts (each would be written)", param=f"{where}[{i}]")
        names |= set(props)


def _resolved(part: Any, root: Any) -> Any:
    """``part``, or the definition its local ``$ref`` names (the converter reads an
    allOf part's $ref alone, its siblings ignored)."""
    for _ in range(32):
        if not isinstance(part, dict) or not isinstance(ref := part.get("$ref"), str):
            return part
        if set(part) - _ANNOTATIONS - {"$ref"}:
            return {**part, "$ref": None}  # siblings the converter would drop: refused
        kind, _, name = ref.removeprefix("#/").partition("/")
        defs = root.get(kind) if isinstance(root, dict) else None
        if kind not in ("$defs", "definitions") or not isinstance(defs, dict):
            return part
        part = defs.get(name, part)
    return part


def _kind_name(kind: type | tuple[type, ...]) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean"}
    return " or ".join(names[k] for k in (kind if isinstance(kind, tuple) else (kind,)))


def _check_object(node: dict[str, Any], where: str) -> None:
    """What the converter would turn into an object no answer can give: a required
    property that is not listed, or one named "" (its rule became the root's)."""
    props = node.get("properties", {})
    if "" in props:
        raise e.BadRequest("a property's name must not be empty", param=f"{where}.properties")
    types = node.get("type")
    if not all(isinstance(t, str) for t in (types if isinstance(types, list) else [types or ""])):
        raise e.BadRequest(f"{where}.type must name JSON types", param=f"{where}.type")
    for name in node.get("required", []):
        if not isinstance(name, str) or ("properties" in node and name not in props):
            raise e.BadRequest(f"required names {name!r}, which is not among the properties",
                               param=f"{where}.required")


# Bounds whose minimum above their maximum admit nothing: the converter wrote the
# minimum's repetition and left the maximum out (a 200 whose answer broke the schema).
_LEAST_MOST = (("minLength", "maxLength"), ("minItems", "maxItems"))
# Keywords whose empty list admits nothing: llama.cpp could not parse what the converter
# wrote for them (a 400 naming `grammar`, a field the client never sent).
_NONE_OF = ("enum", "type", "anyOf")


def _check_satisfiable(node: dict[str, Any], where: str) -> None:
    """A BadRequest naming what makes ``node`` match no answer at all (its counts are
    checked already)."""
    for low, high in _LEAST_MOST:
        least, most = node.get(low), node.get(high)
        if isinstance(least, int) and isinstance(most, int) and least > most:
            raise e.BadRequest(f"{low} ({least}) is more than {high} ({most}): no answer "
                               "matches the schema", param=f"{where}.{low}")
    for key in _NONE_OF:
        if node.get(key) == []:
            raise e.BadRequest(f"{where}.{key} is empty: no answer matches the schema",
                               param=f"{where}.{key}")
    _check_values_typed(node, where)
    _check_string_parts(node, where)


# The lengths of the strings each format's rule writes (llama-cpp-python's: a time
# is hh:mm:ss, then maybe .sss, then Z or +hh:mm).
_FORMAT_LENGTHS = {"date": (10, 10), "time": (9, 18), "date-time": (20, 29),
                   **{f"uuid{v}": (36, 36) for v in ("", "1", "2", "3", "4", "5")}}


def _check_string_parts(node: dict[str, Any], where: str) -> None:
    """A BadRequest where the converter would write one of a string's keywords alone
    and drop another, and the answer could break the one dropped. It takes the first
    of: enum or const, pattern, format, the lengths. An enum's values those forbid are
    left out of its grammar (:func:`_for_converter`): a 400 where none is left."""
    least, most = node.get("minLength", 0), node.get("maxLength", math.inf)
    if "enum" in node or "const" in node:
        key = "enum" if "enum" in node else "const"
        if not _fitting(node["enum"] if key == "enum" else [node["const"]], node):
            raise e.BadRequest(f"no value of {where}.{key} meets the schema's minLength, "
                               "maxLength, pattern and format: no answer matches the "
                               "schema", param=f"{where}.{key}")
    elif node.get("format", "uri") != "uri" and "pattern" in node and not pattern_implies(
            node["pattern"], node["format"]):  # zod 4's z.uuid(), z.iso.date(): implied
        raise e.BadRequest("a pattern beside a format is supported only where every "
                           "string it matches is of the format (the grammar writes the "
                           "pattern alone): not proven here", param=f"{where}.format")
    elif "pattern" not in node and (span := _FORMAT_LENGTHS.get(node.get("format", ""))) \
            and not least <= span[0] <= span[1] <= most:
        raise e.BadRequest(f"a {node['format']!r} is {span[0]} to {span[1]} characters "
                           "long, which the schema's minLength or maxLength does not "
                           "admit (the grammar writes the format alone)",
                           param=f"{where}.format")


def _fitting(values: list[Any], node: dict[str, Any]) -> list[Any]:
    """An enum's or const's ``values`` that meet ``node``'s string keywords, which the
    converter drops beside them (it wrote "tomorrow" for a date). The pattern is walked
    as an automaton (forged.engine.patternfit.Matcher), in time linear in the values:
    Python's re backtracks (``^(a+)+$`` took 4.8 s on 26 a's and a b, twice that with
    each a more, in a door thread). A pattern it does not model admits every value."""
    pattern = node.get("pattern")
    matcher = Matcher(pattern) if isinstance(pattern, str) else None
    return [v for v in values if _fits(v, node, matcher)]


def _fits(value: Any, node: dict[str, Any], matcher: Matcher | None) -> bool:
    if not isinstance(value, str):
        return True  # the string keywords ask nothing of another type
    if not node.get("minLength", 0) <= len(value) <= node.get("maxLength", math.inf):
        return False
    fmt = node.get("format")
    shape = URI_PATTERN if fmt == "uri" else FORMATS.get(fmt) if isinstance(fmt, str) else None
    if shape is not None and not re.fullmatch(shape, value):
        return False
    return matcher is None or matcher.admits(value)


def _check_values_typed(node: dict[str, Any], where: str) -> None:
    """A BadRequest naming an enum or const value that ``node``'s type forbids: the
    converter writes the values alone, and the answer broke the type (`1` for a
    string)."""
    types = node.get("type")
    if not types or ("enum" not in node and "const" not in node):
        return
    allowed = {types} if isinstance(types, str) else set(types)
    key = "enum" if "enum" in node else "const"
    for value in node["enum"] if key == "enum" else [node["const"]]:
        if not _json_types(value) & allowed:
            raise e.BadRequest(f"{where}.{key} holds {json.dumps(value)}, which its type "
                               f"{json.dumps(types)} forbids: the answer could break the "
                               "schema", param=f"{where}.{key}")


def _json_types(value: Any) -> set[str]:
    """The schema types ``value`` has (1.0 is an integer, as JSON Schema counts)."""
    match value:
        case None:
            return {"null"}
        case bool():
            return {"boolean"}
        case int():
            return {"integer", "number"}
        case float():
            return {"integer", "number"} if value.is_integer() else {"number"}
        case str():
            return {"string"}
        case list():
            return {"array"}
        case dict():
            return {"object"}
    return set()


def _check_count(value: Any, where: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise e.BadRequest(f"{where} must be a non-negative integer", param=where)
    if value > MAX_REPETITION:
        raise e.BadRequest(f"{where} is {value}; a grammar can enforce at most "
                           f"{MAX_REPETITION}", param=where)


def _check_pattern(value: Any, where: str) -> None:
    if not isinstance(value, str):
        raise e.BadRequest(f"{where} must be a string", param=where)
    if why := _Pattern(value).costly():
        raise e.BadRequest(f"{where}: {why}", param=where)
    for m in _PATTERN_BRACES.finditer(value):
        if max((int(n) for n in re.findall(r"\d+", m.group(1))), default=0) > MAX_REPETITION:
            raise e.BadRequest(f"{where} repeats {m.group()}; a grammar can enforce at "
                               f"most {MAX_REPETITION} repetitions", param=where)


# A bounded repetition of a group multiplies the ways a text can match it: llama.cpp
# keeps one parse per way at every token. (a{0,30}){0,30} cost 1.2 s a token,
# (a{0,1000}){0,1000} hung the worker; a group that may match nothing, repeated
# {0,50}, cost 80-300 ms a token (llama_sampler_apply over the default model's
# vocabulary).
MAX_NESTED_SPREAD = 256
_EVERY_WAY = "; llama.cpp's grammar would follow every way of matching it at every token"


class _Pattern:
    """A pass over a pattern, as llama-cpp-python's converter reads one (groups,
    alternatives, classes, escapes, quantifiers), for what it cannot take: repetitions
    too costly to run, a stray ] or } (on which the converter never returns), and the
    escapes no grammar class expresses (\\D, \\W, \\S, \\b, \\B).
    ``costly()`` says why, or "". Each part's result: whether it may match nothing,
    and the widest bounded repetition inside it (its max minus its min)."""

    def __init__(self, text: str) -> None:
        self.text, self.i, self.why = text, 0, ""

    def costly(self) -> str:
        self._alternatives()
        return self.why

    def _alternatives(self) -> tuple[bool, int]:
        nullable, spread = self._sequence()
        while self.i < len(self.text) and self.text[self.i] == "|":
            self.i += 1
            n, s = self._sequence()
            nullable, spread = nullable or n, max(spread, s)
        return nullable, spread

    def _sequence(self) -> tuple[bool, int]:
        nullable, spread = True, 0
        while self.i < len(self.text) and self.text[self.i] not in "|)":
            n, s = self._item()
            nullable, spread = nullable and n, max(spread, s)
        return nullable, spread

    def _item(self) -> tuple[bool, int]:
        nullable, spread = self._atom()
        lo, hi = self._quantifier()
        if (lo, hi) == (1, 1):
            return nullable, spread
        if hi is not None and hi > max(lo, 1):
            if nullable:  # (a?){0,50}: each a may be any of the 50
                self.why = self.why or ("a bounded repetition of what may match nothing"
                                        + _EVERY_WAY)
            elif (hi - lo) * spread > MAX_NESTED_SPREAD:
                self.why = self.why or (f"repetitions inside a repetition span more than "
                                        f"{MAX_NESTED_SPREAD} ways together" + _EVERY_WAY)
        return nullable or lo == 0, max(spread, hi - lo if hi is not None else 0)

    def _atom(self) -> tuple[bool, int]:
        t, c = self.text, self.text[self.i]
        self.i += 1
        if c in "]}":  # the converter has no case for them: it looped forever (a thread)
            self.why = self.why or f"an unescaped {c!r} outside a class or a repetition"
        if c == "(":
            if t.startswith("?:", self.i):
                self.i += 2
            out = self._alternatives()
            self.i += 1  # ")"
            return out
        if c == "[":
            self.i += t.startswith("^", self.i) + t.startswith("]", self.i)
            while self.i < len(t) and t[self.i] != "]":
                self.i += 1
                if t[self.i - 1] == "\\":
                    self._escape()
            self.i += 1
        elif c == "\\":
            self._escape()
        return c in "^$", 0

    def _escape(self) -> None:
        x = self.text[self.i] if self.i < len(self.text) else ""
        self.i += 1
        if x and x in "DWSbB":
            self.why = self.why or (f"\\{x} is not supported (a grammar can enforce "
                                    "\\d, \\w, \\s and classes)")

    def _quantifier(self) -> tuple[int, int | None]:
        t = self.text
        c = t[self.i] if self.i < len(t) else ""
        if c in ("*", "+", "?"):
            self.i += 1
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        if c != "{" or (end := t.find("}", self.i)) < 0:
            return 1, 1
        nums = [n.strip() for n in t[self.i + 1:end].split(",")]
        self.i = end + 1
        if not all(n.isdigit() or n == "" for n in nums) or len(nums) > 2:
            return 1, 1  # the converter says what is wrong
        lo = int(nums[0] or 0)
        hi = lo if len(nums) == 1 else (int(nums[1]) if nums[1] else None)
        if hi is not None and lo > hi:  # the converter wrote {lo} and dropped the most
            self.why = self.why or f"the repetition {{{nums[0]},{nums[1]}}} matches nothing"
        return lo, hi
