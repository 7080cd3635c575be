"""A JSON schema's ``pattern`` rewritten for llama-cpp-python's converter, in JSON's terms.

A pattern speaks of a string's *value*; the grammar writes the string's *JSON text*.
The converter copies classes and ``.`` into the grammar as they are, so ``[^,]+`` let
the model write a raw ``"`` (which ends the string: the answer was no longer JSON),
a lone ``\\`` or a raw control character; it wrote a literal ``\\"`` or ``\\\\`` as
the bare character. So every character the pattern admits is written here as the
JSON text that stands for it:

- a class or ``.`` admits its characters that JSON writes as they are, and ``"`` and
  ``\\`` as their escapes ``\\"`` and ``\\\\`` (and a tab, a newline, a carriage
  return, a form feed and a backspace as theirs) where it admits them; the other
  control characters (U+0000 to U+001F) are left out: JSON text would hold them as
  ``\\u00XX``, which no model means to write;
- a literal character is its JSON text;
- the escapes the converter does not know become what they mean (``\\d`` a class,
  ``\\.`` its character); it copied them into the grammar, where llama.cpp refused it;
  a non-capturing group ``(?:...)``, which it refused, is a group.

The converter's own syntax (groups, ``|``, quantifiers) passes through unchanged:
:class:`forged.engine.grammar._Pattern` has checked the pattern's shape and cost.
"""

from __future__ import annotations

# Characters JSON text never holds raw inside a string, and their short escapes.
_SHORT = {'"': '"', "\\": "\\", "\t": "t", "\n": "n", "\r": "r", "\f": "f", "\b": "b"}
_CONTROLS = (0x00, 0x1F)
MAX_CODE = 0x10FFFF
# What a shorthand stands for (\s a space: a tab or a newline would be an escape of
# its own in JSON text, and a whitespace class of one character is what models mean).
_SHORTHANDS: dict[str, list[tuple[int, int]]] = {
    "d": [(0x30, 0x39)],
    "w": [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)],
    "s": [(0x20, 0x20)],
}
_CHAR_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "f": "\f", "v": "\v"}
# Outside a class, these are syntax; escaped, they are characters (the converter knows
# its own escapes of them; "." and "$" it does not, so they go in a class of their own).
_CONVERTER_ESCAPED = "[]()|{}*+?"
_CLASS_PLAIN = frozenset(range(0x20, 0x7F)) - {ord(c) for c in "]\\^-["}


class PatternError(ValueError):
    """A pattern no JSON string can match as the grammar writes strings."""


def json_pattern(pattern: str) -> str:
    """``pattern`` (``^...$``, as the converter requires) with every character it admits
    written as JSON text."""
    return _Translator(pattern).run()


class _Translator:
    def __init__(self, text: str) -> None:
        self.text, self.i = text, 0
        self.out: list[str] = []

    def run(self) -> str:
        t = self.text
        while self.i < len(t):
            c = t[self.i]
            self.i += 1
            if c == "\\" and self.i < len(t):
                self._escape_outside()
            elif c == "[":
                self.out.append(_class_text(self._class(), set()))
            elif c == ".":
                self.out.append(_class_text([(0, MAX_CODE)], {0x0A, 0x0D}))
            elif c == "{" and (end := t.find("}", self.i)) >= 0:
                self.out.append(t[self.i - 1:end + 1])  # a repetition, as it is
                self.i = end + 1
            elif c == "(" and t.startswith("?:", self.i):
                self.out.append("(")  # the converter knows no (?:...), the same group
                self.i += 2
            elif c in "()|*+?^$":
                self.out.append(c)
            else:
                self.out.append(_literal(c))
        return "".join(self.out)

    def _escape_outside(self) -> None:
        x = self.text[self.i]
        self.i += 1
        if x in _SHORTHANDS:
            self.out.append(_class_text(_SHORTHANDS[x], set()))
        elif (ch := self._escaped_char(x)) is not None:
            self.out.append(_literal(ch))
        else:
            self.out.append("\\" + x)  # \1, \k...: the converter or llama.cpp refuses

    def _escaped_char(self, x: str) -> str | None:
        """The character an escape (after its ``\\``) stands for, reading a \\x or \\u
        code; None for an escape that stands for no one character."""
        if x in _CHAR_ESCAPES:
            return _CHAR_ESCAPES[x]
        width = {"x": 2, "u": 4}.get(x)
        if width is not None:
            code = self.text[self.i:self.i + width]
            if len(code) == width and all(h in "0123456789abcdefABCDEF" for h in code):
                self.i += width
                return chr(int(code, 16))
            return None
        return None if x.isalnum() else x

    def _class(self) -> list[tuple[int, int]]:
        """The ranges the class admits, read from after its ``[`` to after its ``]``
        (a negated class's complement)."""
        t = self.text
        negated = t.startswith("^", self.i)
        self.i += negated
        ranges: list[tuple[int, int]] = []
        first = True
        while self.i < len(t) and (t[self.i] != "]" or first):
            first = False
            lo = self._class_atom(ranges)
            if lo is None:
                continue
            if t.startswith("-", self.i) and self.i + 1 < len(t) and t[self.i + 1] != "]":
                self.i += 1
                hi = self._class_atom(ranges)
                if hi is None:  # a-\d: the dash is a character
                    ranges += [(lo, lo), (0x2D, 0x2D)]
                    continue
                ranges.append((lo, hi) if lo <= hi else (hi, lo))
            else:
                ranges.append((lo, lo))
        self.i += 1  # "]"
        return _complement(ranges) if negated else ranges

    def _class_atom(self, ranges: list[tuple[int, int]]) -> int | None:
        """One character of a class as a code point; a shorthand's ranges go straight
        into ``ranges`` (None)."""
        c = self.text[self.i]
        self.i += 1
        if c != "\\" or self.i >= len(self.text):
            return ord(c)
        x = self.text[self.i]
        self.i += 1
        if x in _SHORTHANDS:
            ranges += _SHORTHANDS[x]
            return None
        ch = self._escaped_char(x)
        if ch is None:
            raise PatternError(f"the escape \\{x} in a class is not supported")
        return ord(ch)


def _complement(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out, at = [], 0
    for lo, hi in sorted(ranges):
        if lo > at:
            out.append((at, lo - 1))
        at = max(at, hi + 1)
    if at <= MAX_CODE:
        out.append((at, MAX_CODE))
    return out


def _minus(ranges: list[tuple[int, int]], cut: set[int]) -> list[tuple[int, int]]:
    """``ranges`` without the code points in ``cut``."""
    out = []
    for lo, hi in ranges:
        for c in sorted(x for x in cut if lo <= x <= hi):
            if c > lo:
                out.append((lo, c - 1))
            lo = c + 1
        if lo <= hi:
            out.append((lo, hi))
    return out


def _class_text(ranges: list[tuple[int, int]], excluded: set[int]) -> str:
    """A class admitting ``ranges`` less ``excluded``, as the converter takes it: the
    characters JSON writes raw in one class, and the escapes of those it cannot."""
    admitted = _minus(ranges, excluded)
    escapes = [ch for ch in _SHORT if any(lo <= ord(ch) <= hi for lo, hi in admitted)]
    raw = _minus(admitted, {ord('"'), ord("\\")} | set(range(_CONTROLS[0], _CONTROLS[1] + 1)))
    parts = [_class_of(raw)] if raw else []
    parts += [_literal(ch) for ch in escapes]
    if not parts:
        raise PatternError("a class in the pattern admits only control characters, "
                           "which a JSON string can hold only escaped")
    return parts[0] if len(parts) == 1 else "(" + "|".join(parts) + ")"


def _class_of(ranges: list[tuple[int, int]]) -> str:
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    body = "".join(_class_char(lo) if lo == hi else f"{_class_char(lo)}-{_class_char(hi)}"
                   for lo, hi in merged)
    return f"[{body}]"


def _class_char(code: int) -> str:
    if code in _CLASS_PLAIN:
        return chr(code)
    if code < 0x100:
        return f"\\x{code:02X}"
    if code < 0x10000:
        return f"\\u{code:04X}"
    return f"\\U{code:08X}"


def _literal(ch: str) -> str:
    """One character of the value as its JSON text, in the converter's syntax: ``"``
    becomes the grammar's escaped quote by itself, so the escape's backslash is written
    as the converter's ``\\\\``; each escape in a group, so that a quantifier after it
    repeats the whole escape."""
    if ch in _SHORT:
        return "(\\\\" + ("\\\\" if ch == "\\" else _SHORT[ch]) + ")"
    if ord(ch) <= _CONTROLS[1]:
        return f"(\\\\u{ord(ch):04x})"
    if ch in _CONVERTER_ESCAPED:
        return "\\" + ch
    if ch in ".$":
        return f"[{ch}]"  # unescaped, "." would be any character
    return "[\\x5E]" if ch == "^" else ch
