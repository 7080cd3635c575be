"""Cut a source file into chunks worth retrieving, and split identifiers into words.

Pure: text in, chunks out. No file system, no database.

Python files are cut along their top-level statements (``ast``): each top-level
``def``/``class`` is one chunk together with its decorators and the comment lines
directly above it, and the module-level code between definitions is grouped into
one chunk. A definition longer than ``window`` lines is split into overlapping line
windows, every window keeping the definition's name in ``defines`` so that a query
for the name still reaches each part. Other files, and Python that does not parse,
are cut into overlapping line windows.
"""

from __future__ import annotations

import ast
import functools
import itertools
import keyword
import re
from dataclasses import dataclass, field

WINDOW = 60
OVERLAP = 15
# A chunk's text at most (a minified file is one line): what a prompt or an answer
# takes of one hit stays bounded.
MAX_CHUNK_CHARS = 16 * 1024

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LINE_END = re.compile(r"\r\n|\r|\n")
# Word boundaries inside an identifier: "HTTPServer" -> HTTP|Server, "openNursery" ->
# open|Nursery, "v2Api" -> v|2|Api.
_PARTS = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|[0-9]+")


@dataclass(frozen=True)
class Chunk:
    path: str
    start_line: int  # 1-based, inclusive
    end_line: int  # inclusive
    text: str
    defines: tuple[str, ...] = ()
    uses: tuple[str, ...] = ()


@dataclass
class _Span:
    start: int
    end: int
    defines: list[str] = field(default_factory=list)
    # A class's members and their lines: a window of a long class defines only the
    # members it holds (with the class's name), so that a method's own window ranks
    # first for it, not every window of its class alike.
    member_lines: dict[str, int] = field(default_factory=dict)

    def defines_in(self, start: int, end: int) -> tuple[str, ...]:
        return tuple(dict.fromkeys(
            d for d in self.defines
            if d not in self.member_lines or start <= self.member_lines[d] <= end))


# Words every chunk has: keywords of the common languages and the receiver names.
# Indexed, they made a third of the index and matched most chunks for every query (an
# OR over "def", "self" and "return" scored 50,000-75,000 chunks each: 0.4 s a search
# on a 20,000-file index) while telling nothing apart. Single letters go too.
_OTHER_KEYWORDS = """
    self cls this none null nil true false undefined void var let const func fn pub
    mut impl struct enum trait match int str bool float char long short unsigned
    signed static final public private protected new delete function begin end then
    do done fi esac switch case default break continue goto typeof instanceof extends
    implements package import export require include define ifdef ifndef endif
    """
STOP_WORDS = frozenset(w.lower() for w in [*keyword.kwlist, *keyword.softkwlist,
                                            *_OTHER_KEYWORDS.split()])


def split_identifier(name: str) -> list[str]:
    """``open_nursery``, ``openNursery``, ``OpenNursery`` -> ``["open", "nursery"]``."""
    return [p.lower() for p in _PARTS.findall(name)]


def split_words(names: list[str] | tuple[str, ...]) -> str:
    """The identifiers' parts as one space-separated string, for full-text indexing."""
    return " ".join(w for w in map(_words, names) if w)


def search_words(name: str) -> list[str]:
    """The words of ``name`` worth indexing and searching: no stop words."""
    return [w for w in split_identifier(name) if len(w) > 1 and w not in STOP_WORDS]


@functools.lru_cache(maxsize=1 << 16)
def _words(name: str) -> str:
    # A codebase repeats its identifiers endlessly: splitting each once saved about a
    # fifth of a build's time.
    return " ".join(search_words(name))


def identifiers(text: str) -> list[str]:
    """Distinct identifier-like tokens of ``text``, in first-seen order."""
    return list(dict.fromkeys(_IDENT.findall(text)))


def chunk_file(path: str, text: str, *, window: int = WINDOW,
               overlap: int = OVERLAP) -> list[Chunk]:
    # Lines as editors and ast count them: str.splitlines also splits on form feeds,
    # U+2028 and the like, and every line number after one was off.
    text = text.removeprefix("\ufeff")  # a BOM: ast refused the file
    lines = _LINE_END.split(text)
    if lines[-1] == "":
        lines.pop()  # the newline ending the last line starts no line
    if not lines:
        return []
    spans = _python_spans(text, lines) if path.endswith((".py", ".pyi")) else None
    if spans is None:
        spans = [_Span(1, len(lines))]
    out: list[Chunk] = []
    for span in spans:
        for start, end in line_windows(span.start, span.end, window, overlap):
            body = "\n".join(lines[start - 1:end])[:MAX_CHUNK_CHARS]
            defines = span.defines_in(start, end)
            uses = tuple(n for n in identifiers(body) if n not in defines)
            out.append(Chunk(path, start, end, body, defines, uses))
    return out


def line_windows(start: int, end: int, window: int, overlap: int) -> list[tuple[int, int]]:
    """Overlapping ``(first, last)`` line ranges covering ``start..end``."""
    if end - start + 1 <= window:
        return [(start, end)]
    step = max(1, window - overlap)
    out = []
    first = start
    while True:
        last = min(end, first + window - 1)
        out.append((first, last))
        if last == end:
            return out
        first += step


def _python_spans(text: str, lines: list[str]) -> list[_Span] | None:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        # Not Python we can read (or nested past the parser's limits, as a generated
        # 20,000-term sum is): line windows will do.
        return None
    spans: list[_Span] = []
    loose: _Span | None = None  # module-level code gathered between definitions
    for node in tree.body:
        start = _leading_comments(lines, min([node.lineno,
                                              *(d.lineno for d in _decorators(node))]))
        end = node.end_lineno or node.lineno
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            loose = None
            spans.append(_Span(start, end, _defined_by(node), _member_lines(node)))
            continue
        if loose is None:
            loose = _Span(start, end)
            spans.append(loose)
        loose.end = end
        loose.defines += _assigned_names(node)
    _cover_gaps(spans, lines)
    return spans


def _decorators(node: ast.stmt) -> list[ast.expr]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return node.decorator_list
    return []


def _leading_comments(lines: list[str], first: int) -> int:
    """Move ``first`` up over the comment lines directly above it."""
    while first > 1 and lines[first - 2].lstrip().startswith("#"):
        first -= 1
    return first


def _defined_by(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> list[str]:
    names = [node.name]
    if isinstance(node, ast.ClassDef):
        for item in node.body:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.append(item.name)
            else:
                names += _assigned_names(item)
    return names


def _member_lines(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
                  ) -> dict[str, int]:
    if not isinstance(node, ast.ClassDef):
        return {}
    return {item.name: item.lineno for item in node.body
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            and item.name != node.name}


def _assigned_names(node: ast.stmt) -> list[str]:
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, ast.AnnAssign | ast.AugAssign):
        targets = [node.target]
    # An import is a use, not a definition: ranking the importer level with the
    # definition would defeat "definitions above mere uses".
    return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]


def _cover_gaps(spans: list[_Span], lines: list[str]) -> None:
    """Give blank lines and trailing comments to a neighbour so no line is lost; the
    module docstring's leading lines and a file's tail belong to the nearest span."""
    if not spans:
        spans.append(_Span(1, len(lines)))
        return
    spans[0].start = 1
    spans[-1].end = len(lines)
    for span, following in itertools.pairwise(spans):
        # A comment block between two (not above the second: that is the second's).
        if any(line.strip() for line in lines[span.end:following.start - 1]):
            span.end = following.start - 1
