"""The shape of the tree: the import arrows that must never exist (docs: STYLE.md's map)
and short functions. Read from the source with ``ast``; nothing is imported or run
(but the statistics' field names)."""

from __future__ import annotations

import ast
from pathlib import Path

import msgspec
import pytest

from forged.engine.stats import Totals, WorkerStats

ROOT = Path(__file__).resolve().parent.parent
# A function longer than this needs a comment saying why, on the line above its ``def``
# (or above its decorators), starting with "# Long:".
MAX_FUNCTION_LINES = 40

SANS_IO = ["forged/engine/scheduler.py", "forged/engine/kvledger.py",
           "forged/engine/costmodel.py", "forged/engine/core.py", "forged/engine/limits.py",
           "forged/engine/request.py", "forged/engine/textstream.py", "forged/engine/fim.py",
           "forged/engine/logprobs.py", "forged/engine/embedcore.py",
           "forged/engine/decoding.py", "forged/engine/layout.py",
           "forged/engine/slotcache.py", "forged/engine/waitqueue.py",
           "forged/agent/weight.py"]
# (modules, what they must never import)
NEVER = [
    (SANS_IO, ("trio", "llama_cpp", "forged.engine.backend", "forged.engine.worker",
               "forged.http", "socket", "select")),
    # http is imported by the daemon, never the other way (a Protocol stands for the
    # swapper: forged.http.state.Swapper)
    (["forged/http/*.py"], ("forged.engine.backend", "forged.engine.worker", "llama_cpp",
                            "forged.daemon")),
    # the worker's wire is the pool's business: http reads engine events
    # (forged.engine.events), with failures already turned into errors
    (["forged/http/*.py", "forged/daemon/*.py"], ("forged.engine.frames",)),
    (["forged/engine/backend.py"], ("forged.http", "forged.daemon")),
    # a request's own state is its Call (forged.http.lifetime), not Quart's untyped g
    (["forged/http/*.py"], ("quart.g",)),
    (["forged/config.py"], ("forged",)),
    (["bench/*.py"], ("tests",)),
    # the agent reports on the node; it does not reach into requests or the engine
    (["forged/agent/*.py"], ("forged.http", "forged.engine", "forged.daemon", "llama_cpp")),
    # retrieval and decoding meet only in http, which builds the prompt
    (["forged/retrieval/*.py"], ("forged.engine", "forged.http", "forged.daemon", "trio",
                                 "llama_cpp")),
]


def imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


@pytest.mark.parametrize(("patterns", "forbidden"), NEVER, ids=lambda v: str(v)[:40])
def test_no_forbidden_import_arrow(patterns: list[str], forbidden: tuple[str, ...]) -> None:
    files = [p for pat in patterns for p in sorted(ROOT.glob(pat))]
    assert files, patterns
    bad = [f"{p.relative_to(ROOT)} imports {name}" for p in files for name in imports(p)
           if any(name == f or name.startswith(f + ".") for f in forbidden)]
    assert not bad


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted((ROOT / "forged").rglob("*.py"))}


def arrows(module: str) -> set[str]:
    """The forged modules ``module`` imports (anywhere in it, a function's imports
    included), and "llama_cpp" if it imports llama.cpp."""
    out = set()
    for name in imports(MODULES[module]):
        if name in MODULES:
            out.add(name)
        elif name.split(".")[0] == "llama_cpp":
            out.add("llama_cpp")
    return out


def reached(module: str) -> dict[str, list[str]]:
    """Every module ``module`` loads, through any chain of imports, with one chain."""
    chains: dict[str, list[str]] = {}
    todo = [[module]]
    while todo:
        chain = todo.pop()
        for nxt in sorted(arrows(chain[-1]) - chains.keys() - {module}):
            chains[nxt] = [*chain, nxt]
            if nxt in MODULES:
                todo.append(chains[nxt])
    return chains


WORKER_SIDE = ("forged.engine.core", "forged.engine.scheduler", "forged.engine.worker",
               "forged.engine.embedcore")
# (modules, what they must never load through any chain of imports)
NEVER_REACH = [
    # http builds requests and reads events; the worker's decisions are not its business
    (["forged/http/*.py"], (*WORKER_SIDE, "forged.daemon")),
    # llama.cpp's module sits below the engine: the core drives it through
    # forged.engine.decoding, and it knows nothing of frames or the pool
    (["forged/engine/backend.py"], (*WORKER_SIDE, "forged.engine.frames",
                                    "forged.engine.pool", "forged.http", "forged.daemon")),
]


@pytest.mark.parametrize(("patterns", "forbidden"), NEVER_REACH, ids=lambda v: str(v)[:40])
def test_no_forbidden_chain_of_imports(patterns: list[str], forbidden: tuple[str, ...]) -> None:
    files = [p for pat in patterns for p in sorted(ROOT.glob(pat))]
    assert files, patterns
    bad = [" -> ".join(chain) for p in files for name, chain in reached(module_name(p)).items()
           if any(name == f or name.startswith(f + ".") for f in forbidden)]
    assert not bad


def test_llama_cpp_is_imported_by_one_module() -> None:
    importers = [m for m in MODULES if "llama_cpp" in arrows(m)]
    assert importers == ["forged.engine.backend"]


MEMORY_OPS = {"SeqRm", "SeqCp", "SeqSave", "SeqLoad"}


def test_only_the_slot_cache_makes_memory_ops() -> None:
    """Where a request's KV cells are freed is one file: nothing else constructs the
    operations that change llama.cpp's memory."""
    makers = set()
    for path in sorted((ROOT / "forged").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in MEMORY_OPS):
                makers.add(str(path.relative_to(ROOT)))
    assert makers == {"forged/engine/slotcache.py"}


# A class with more methods than this is several concerns (the scheduler had 68).
MAX_METHODS = 40


def test_classes_keep_to_one_concern() -> None:
    big = []
    for path in sorted((ROOT / "forged").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = [m for m in node.body
                           if isinstance(m, ast.FunctionDef | ast.AsyncFunctionDef)]
                if len(methods) > MAX_METHODS:
                    big.append(f"{path.relative_to(ROOT)}: {node.name} ({len(methods)})")
    assert not big


def long_functions(path: Path) -> list[str]:
    lines = path.read_text().splitlines()
    out = []
    for node in ast.walk(ast.parse("\n".join(lines))):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        length = (node.end_lineno or node.lineno) - node.lineno + 1
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        if length > MAX_FUNCTION_LINES and not lines[first - 2].strip().startswith("# Long:"):
            out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)")
    return out


def test_functions_are_short_or_say_why() -> None:
    found = [f for p in sorted((ROOT / "forged").rglob("*.py")) for f in long_functions(p)]
    assert not found


# Strings that happen to share a statistic's name: ollama's image option "steps".
STAT_NAME_ELSEWHERE = {("forged/http/ollama.py", "steps")}


def test_worker_statistics_are_read_by_field_never_by_string_key() -> None:
    """A statistic spelt as a string (``stats["wait_estimate_s"]``) reads 0 when it is
    misspelt or renamed; read as a field of ``forged.engine.stats``' Structs, it cannot
    be. Only that module names them."""
    names = {f.name for cls in (WorkerStats, Totals) for f in msgspec.structs.fields(cls)}
    spelt = {(str(p.relative_to(ROOT)), node.value)
             for p in sorted((ROOT / "forged").rglob("*.py"))
             if p != ROOT / "forged/engine/stats.py"
             for node in ast.walk(ast.parse(p.read_text()))
             if isinstance(node, ast.Constant) and node.value in names}
    assert spelt == STAT_NAME_ELSEWHERE


# An engine module longer than this is more than one concern (the scheduler's 999 lines
# were seven). llama.cpp's module is the exception: every llama.cpp call sits in it, by
# the rule above, so it grows with what forged asks of llama.cpp.
MAX_ENGINE_MODULE_LINES = 610
LONG_BY_RULE = {"forged/engine/backend.py"}


def test_engine_modules_keep_to_one_concern() -> None:
    long = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / "forged/engine").glob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_ENGINE_MODULE_LINES}
    assert long.keys() <= LONG_BY_RULE, long
