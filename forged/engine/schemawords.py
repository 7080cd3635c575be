"""OpenAPI's words in a JSON schema, written as JSON Schema's own.

Editors generate their tools' schemas from their own types, and two words of OpenAPI
come with them that the grammar converter does not know. Zed writes its tools with
Rust's schemars: as draft-07 for Ollama (``"format": "uint32"`` beside ``"minimum": 0``
on every ``u32``, ``"int64"``, ``"double"``, ...), and as OpenAPI 3.0's subset for
OpenAI-compatible servers (``"nullable": true`` on every ``Option``). Each has an exact
meaning in JSON Schema's words, so each is enforced as that:

* ``nullable: true`` beside ``type`` adds ``"null"`` to the types (OpenAPI 3.0.3: it
  does nothing without a ``type``; ``false`` asks for nothing);
* a number format of a fixed width (OpenAPI's ``int32``, ``int64``, ``float``,
  ``double``; schemars' ``int8`` to ``uint128``, ``int``, ``uint``) on an integer or a
  number is the range of that width, as ``minimum`` and ``maximum`` (a bound past the
  grammar's digits bounds nothing it writes: forged.engine.numrange); ``float`` and
  ``double`` bound nothing a finite JSON number can break.
"""

from __future__ import annotations

from typing import Any

from forged import errors as e

# The integers each width holds; None: no integer bound (a float's range).
_WIDTHS: dict[str, tuple[int, int] | None] = {
    **{f"int{n}": (-(2 ** (n - 1)), 2 ** (n - 1) - 1) for n in (8, 16, 32, 64, 128)},
    **{f"uint{n}": (0, 2**n - 1) for n in (8, 16, 32, 64, 128)},
    "int": (-(2**63), 2**63 - 1), "uint": (0, 2**64 - 1),  # schemars' isize and usize
    "float": None, "double": None,
}


def plain(node: dict[str, Any], where: str) -> dict[str, Any]:
    """``node`` with ``nullable`` and a number format as JSON Schema writes them
    (``node`` itself when it has neither); a BadRequest naming a ``nullable`` that is
    not a boolean. A format on a string, or one no width names, is left as it is."""
    if "nullable" in node:
        node = _nullable(node, where)
    types = node.get("type")
    listed = types if isinstance(types, list) else [types]
    numeric = {"integer", "number"} & {t for t in listed if isinstance(t, str)}
    if numeric and isinstance(fmt := node.get("format"), str) and fmt in _WIDTHS:
        node = _width(node, _WIDTHS[fmt])
    return node


def _nullable(node: dict[str, Any], where: str) -> dict[str, Any]:
    nullable = node["nullable"]
    if not isinstance(nullable, bool):
        raise e.BadRequest(f"{where}.nullable must be a JSON boolean",
                           param=f"{where}.nullable")
    out = {k: v for k, v in node.items() if k != "nullable"}
    types = out.get("type")
    if nullable and isinstance(types, str | list):
        listed = [types] if isinstance(types, str) else list(types)
        out["type"] = listed if "null" in listed else [*listed, "null"]
    return out


def _width(node: dict[str, Any], bounds: tuple[int, int] | None) -> dict[str, Any]:
    """The node with its format's range as bounds: the tighter of each pair. A bound
    given that is not a number is left for check_schema to name."""
    out = {k: v for k, v in node.items() if k != "format"}
    if bounds is None:
        return out
    if "enum" in node or "const" in node:
        # The values are the constraint (a bound beside them is refused): the format
        # goes if they are within its range, else it stays and is named.
        values = node.get("enum", [node.get("const")])
        within = all(not isinstance(v, int | float) or isinstance(v, bool)
                     or bounds[0] <= v <= bounds[1] for v in values)
        return out if within else node
    for key, edge, pick in (("minimum", bounds[0], max), ("maximum", bounds[1], min)):
        given = out.get(key)
        if given is None:
            out[key] = edge
        elif isinstance(given, int | float) and not isinstance(given, bool):
            out[key] = pick(given, edge)
    return out
