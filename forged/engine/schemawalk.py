"""Where a JSON schema holds other schemas: the one place that says which keywords'
values are schemas, and which are data (``const``, ``enum``, ``default``: walked as
schemas, an object in them with a ``"$ref"`` key was rewritten as a reference)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def subschemas(key: str, value: Any) -> list[tuple[str, Any]]:
    """The schemas inside ``key``'s value, each with its place for error messages."""
    match key:
        case "properties" | "$defs" | "definitions" if isinstance(value, dict):
            return [(f".{k}", v) for k, v in value.items()]
        case "anyOf" | "allOf" | "prefixItems" | "items" if isinstance(value, list):
            return [(f"[{i}]", v) for i, v in enumerate(value)]
        case "items" | "additionalProperties":
            return [("", value)]
    return []


def mapped(key: str, value: Any, fn: Callable[[Any], Any]) -> Any:
    """``key``'s value with ``fn`` applied to each schema inside it; data as it is."""
    match key:
        case "properties" | "$defs" | "definitions" if isinstance(value, dict):
            return {k: fn(v) for k, v in value.items()}
        case "anyOf" | "allOf" | "prefixItems" | "items" if isinstance(value, list):
            return [fn(v) for v in value]
        case "items" | "additionalProperties":
            return fn(value)
    return value
