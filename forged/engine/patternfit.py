"""Whether every string a ``pattern`` admits has a string ``format``: then a schema with
both is enforced in full by the pattern's grammar alone.

Why: llama-cpp-python's converter writes a string's pattern and drops its format, and
forged refuses what it would drop. But zod 4 (``z.uuid()``, ``z.iso.date()``, the
TypeScript MCP SDK's and the AI SDK's tool schemas) sends every such format with the
pattern zod checks it by, as do OpenAPI documents (Microsoft Graph's GUIDs); where the
pattern proves the format, the schema is enforced as it is, not refused.

The proof walks the pattern (as Python's own regex parser reads it, each ``\\d`` a
digit as forged writes it) and the format (RFC 3339's and RFC 4122's syntax, which a
validator checks; a day is 01 to 31, as the converter writes it) together, character
range by character range, as two automata: a string the pattern can still take that
the format cannot is a counterexample. Anything it does not model (lookarounds,
backreferences, flags, an anchor inside) or a walk past its bound proves nothing.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

# Python's regex parser (re._parser): private, typed here as what it is to us.
_sre: Any = importlib.import_module("re._parser")

_DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
_HOUR_MINUTE = r"([01][0-9]|2[0-3]):[0-5][0-9]"
_TIME = rf"{_HOUR_MINUTE}:([0-5][0-9]|60)(\.[0-9]+)?([Zz]|[+-]{_HOUR_MINUTE})"
_UUID = r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
# The formats a proof knows, as the strings they admit (the uuidN forged writes as any
# uuid: that is what it enforces for them alone).
FORMATS = {"date": _DATE, "time": _TIME, "date-time": f"{_DATE}[Tt]{_TIME}",
           **{f"uuid{v}": _UUID for v in ("", "1", "2", "3", "4", "5")}}
_MAX_STATES = 20_000  # bounds the pattern's automaton and the walk: a proof is cheap
# Bounds the walk's steps (each one's characters times the states it carries): zod's
# formats take under 20,000; [0-9]{1,900}[0-9]{0,900} in a time took 6 s unbounded.
_MAX_WORK = 300_000
_ALL = [(0, 0x10FFFF)]
_CATEGORIES = {"CATEGORY_DIGIT": [(0x30, 0x39)],
               "CATEGORY_WORD": [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]}


class _Unproven(Exception):
    pass


class _Automaton:
    """A nondeterministic automaton: each state's character ranges and its moves."""

    def __init__(self, pattern: str) -> None:
        self.edges: list[list[tuple[list[tuple[int, int]], int]]] = []
        self.empty: list[list[int]] = []
        parsed = _sre.parse(pattern)
        items = list(parsed)
        if parsed.state.flags & ~_sre.SRE_FLAG_UNICODE:
            raise _Unproven
        if items[:1] == [(_sre.AT, _sre.AT_BEGINNING)] and items[-1:] == [
                (_sre.AT, _sre.AT_END)]:
            items = items[1:-1]  # anchored at both ends, as forged requires
        else:
            raise _Unproven
        self.start = self._state()
        self.end = self._sequence(items, self.start)

    def _state(self) -> int:
        if len(self.edges) >= _MAX_STATES:
            raise _Unproven
        self.edges.append([])
        self.empty.append([])
        return len(self.edges) - 1

    def _sequence(self, items: Any, state: int) -> int:
        for op, arg in items:
            state = self._item(op.name, arg, state)
        return state

    def _item(self, op: str, arg: Any, state: int) -> int:
        if op in ("LITERAL", "NOT_LITERAL", "IN", "ANY"):
            out = self._state()
            self.edges[state].append((_ranges(op, arg), out))
            return out
        if op == "SUBPATTERN":
            return self._sequence(arg[3], state)
        if op == "BRANCH":
            out = self._state()
            for alt in arg[1]:
                self.empty[self._sequence(alt, state)].append(out)
            return out
        if op in ("MAX_REPEAT", "MIN_REPEAT"):
            return self._repeat(arg[0], arg[1], arg[2], state)
        raise _Unproven  # an anchor inside, a lookaround, a backreference

    def _repeat(self, least: int, most: int, sub: Any, state: int) -> int:
        for _ in range(least):
            state = self._sequence(sub, state)
        if most == _sre.MAXREPEAT:  # a loop: sub any number of times more
            loop = self._state()
            self.empty[state].append(loop)
            self.empty[self._sequence(sub, loop)].append(loop)
            return loop
        out = self._state()
        for _ in range(most - least):
            self.empty[state].append(out)
            state = self._sequence(sub, state)
        self.empty[state].append(out)
        return out

    def closure(self, states: frozenset[int]) -> frozenset[int]:
        seen, todo = set(states), list(states)
        while todo:
            for nxt in self.empty[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return frozenset(seen)

    def step(self, states: frozenset[int], char: int) -> frozenset[int]:
        return self.closure(frozenset(to for s in states for ranges, to in self.edges[s]
                                      if any(lo <= char <= hi for lo, hi in ranges)))


def _ranges(op: str, arg: Any) -> list[tuple[int, int]]:
    """The character ranges a one-character item admits (a category forged does not
    narrow, any character: a wider pattern proves less, never more)."""
    if op == "LITERAL":
        return [(arg, arg)]
    if op in ("NOT_LITERAL", "ANY"):
        return _ALL  # wider than it is: sound
    out: list[tuple[int, int]] = []
    for kind, value in arg:
        kind = str(kind)
        if kind == "NEGATE":
            return _ALL
        if kind == "LITERAL":
            out.append((value, value))
        elif kind == "RANGE":
            out.append(value)
        else:
            out += _CATEGORIES.get(str(value), _ALL)
    return out


def pattern_implies(pattern: str, fmt: str) -> bool:
    """Whether every string ``pattern`` matches is a ``fmt`` (False: not proven)."""
    try:
        return _included(_Automaton(pattern), _Automaton(f"^{FORMATS[fmt]}$"))
    except (_Unproven, re.error, KeyError, ValueError, RecursionError):
        return False


class Matcher:
    """Whether ``pattern`` matches a whole string, walked as its automaton: linear in
    the string, with one budget of work for every string it is asked about (an enum's
    values). Where it does not model the pattern, or the budget is spent, it admits:
    the caller keeps the value, as before it checked."""

    def __init__(self, pattern: str) -> None:
        try:
            self._a: _Automaton | None = _Automaton(pattern)
        except (_Unproven, re.error, ValueError, RecursionError):
            self._a = None
        self._work = 0

    def admits(self, value: str) -> bool:
        a = self._a
        if a is None:
            return True
        states = a.closure(frozenset([a.start]))
        for char in value:
            if (work := self._work + len(states)) > _MAX_WORK:
                return True
            self._work = work
            if not (states := a.step(states, ord(char))):
                return False
        return a.end in states


def _included(p: _Automaton, f: _Automaton) -> bool:
    first = (p.closure(frozenset([p.start])), f.closure(frozenset([f.start])))
    seen, todo, work = {first}, [first], 0
    while todo:
        ps, fs = todo.pop()
        if p.end in ps and f.end not in fs:
            return False  # a string the pattern ends on and the format does not
        if (work := work + len(cuts := _cuts(p, ps) | _cuts(f, fs)) * len(ps)) > _MAX_WORK:
            raise _Unproven
        for char in cuts:
            if not (nps := p.step(ps, char)):
                continue
            if not (nfs := f.step(fs, char)):
                return False
            if (pair := (nps, nfs)) not in seen:
                if len(seen) >= _MAX_STATES:
                    raise _Unproven
                seen.add(pair)
                todo.append(pair)
    return True


def _cuts(a: _Automaton, states: frozenset[int]) -> set[int]:
    """The first characters of the ranges the states' edges make: one of each piece of
    the alphabet on which every edge is wholly in or out."""
    return {c for s in states for ranges, _ in a.edges[s] for lo, hi in ranges
            for c in (lo, hi + 1)}
