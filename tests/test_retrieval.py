"""The repository index: chunking, identifier splitting, the SQLite store's incremental
update and ranking, and ``forged index``. Plain synchronous tests on tmp_path."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from forged.cli import main
from forged.retrieval.chunking import (
    MAX_CHUNK_CHARS,
    chunk_file,
    line_windows,
    split_identifier,
    split_words,
)
from forged.retrieval.errors import IndexError_
from forged.retrieval.query import Searcher
from forged.retrieval.source import SourceTree, list_source
from forged.retrieval.store import MAX_QUERY_TERMS, Index, cursor_names, query_words, rarest

PY = '''"""A module."""

import trio

LIMIT = 3


# Opens the nursery everybody uses.
@decorate
def open_nursery(strict: bool) -> Nursery:
    return Nursery(strict)


class Pool:
    size = 4

    def spawn(self) -> None:
        open_nursery(True)


run = trio.run
'''


def git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t",
                    *args], check=True, capture_output=True)


def make_repo(root: Path) -> None:
    root.mkdir()
    (root / "nursery.py").write_text(PY)
    (root / "caller.py").write_text("def main():\n    return open_nursery(False)\n")
    (root / "notes.md").write_text("nothing about it here\n")
    (root / ".gitignore").write_text("secret.txt\n")
    (root / "secret.txt").write_text("open_nursery leaked\n")
    (root / "blob.bin").write_bytes(b"open_nursery\0\1\2")
    (root / "huge.py").write_text("open_nursery = 1\n" * 80_000)  # > 1 MiB
    (root / "node_modules").mkdir()
    (root / "node_modules" / "dep.js").write_text("openNursery()\n")
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "init")


def test_identifiers_split_on_snake_and_camel_case() -> None:
    for name in ("open_nursery", "openNursery", "OpenNursery", "OPEN_NURSERY"):
        assert split_identifier(name) == ["open", "nursery"]
    assert split_identifier("HTTPServerError") == ["http", "server", "error"]
    assert split_identifier("parse_v2Header") == ["parse", "v", "2", "header"]


def test_python_chunks_follow_top_level_definitions() -> None:
    chunks = chunk_file("m.py", PY)
    lines = PY.splitlines()
    spans = [(c.start_line, c.end_line, c.defines) for c in chunks]
    assert spans == [(1, 5, ("LIMIT",)),
                     (8, 11, ("open_nursery",)),  # the comment and decorator come along
                     (14, 18, ("Pool", "size", "spawn")),
                     (21, 21, ("run",))]
    fn = chunks[1]
    assert fn.text == "\n".join(lines[7:11]) and fn.text.startswith("# Opens")
    assert "@decorate" in fn.text
    assert {"Nursery", "strict", "decorate"} <= set(fn.uses)
    assert "open_nursery" in chunks[2].uses and "open_nursery" not in chunks[2].defines


def test_long_definition_and_other_files_are_overlapping_windows() -> None:
    body = "def big():\n" + "".join(f"    x{i} = {i}\n" for i in range(149))
    chunks = chunk_file("big.py", body)
    assert [(c.start_line, c.end_line) for c in chunks] == [(1, 60), (46, 105), (91, 150)]
    assert all(c.defines == ("big",) for c in chunks)
    text = "".join(f"line {i}\n" for i in range(100))
    assert [(c.start_line, c.end_line) for c in chunk_file("a.c", text)] == [(1, 60), (46, 100)]
    assert line_windows(1, 10, 60, 15) == [(1, 10)]
    assert chunk_file("broken.py", "def (:\n")[0].end_line == 1  # unparsable: windows
    assert chunk_file("empty.py", "") == []


@pytest.mark.parametrize("line", ["\x0c", "s = 'a\u2028b'", "s = 'a\x85b'"])
def test_lines_are_the_lines_editors_and_ast_count(line: str) -> None:
    """str.splitlines also splits on form feeds, U+2028 and the like: the chunk of
    ``a`` lost its body and every later chunk's lines were off."""
    text = f"import os\n{line}\ndef a():\n    return 1\n\n\ndef b():\n    x = 2\n    return x\n"
    chunks = {c.defines[0]: c for c in chunk_file("m.py", text) if c.defines}
    assert chunks["a"].text.endswith("def a():\n    return 1")
    assert (chunks["b"].start_line, chunks["b"].end_line) == (7, 9)
    assert chunks["b"].text == "def b():\n    x = 2\n    return x"


def test_a_byte_order_mark_does_not_hide_the_definitions() -> None:
    chunks = chunk_file("m.py", "\ufeffdef a():\n    return 1\n")
    assert [c.defines for c in chunks] == [("a",)] and chunks[0].text.startswith("def a")


def test_a_comment_block_between_definitions_is_in_a_chunk() -> None:
    text = "def a():\n    pass\n\n# the retry policy\n# is three tries\n\ndef b():\n    pass\n"
    assert "retry policy" in "".join(c.text for c in chunk_file("m.py", text))


def test_a_chunk_is_bounded_however_long_its_lines() -> None:
    """A minified file is one line: it was one chunk of that size, built into every
    answer that retrieved it."""
    chunks = chunk_file("app.min.js", "x" * 1_000_000 + "\nmore\n")
    assert chunks and max(len(c.text) for c in chunks) <= MAX_CHUNK_CHARS


def test_git_repo_is_indexed_and_ranked(tmp_path: Path) -> None:
    make_repo(tmp_path / "repo")
    with Index.create(tmp_path / "index", "r", tmp_path / "repo") as idx:
        stats = idx.update()
        paths = dict(idx.db.execute("SELECT path, skipped FROM files"))
        assert paths == {"nursery.py": None, "caller.py": None, "notes.md": None,
                         ".gitignore": None, "blob.bin": "binary", "huge.py": "large"}
        assert stats.rechunked == 6
        for query in ("open_nursery", "openNursery", "OpenNursery"):
            hits = idx.search(query, 5)
            assert (hits[0].path, hits[0].start_line, hits[0].end_line) == ("nursery.py", 8, 11)
            assert {h.path for h in hits} >= {"caller.py"}  # a mere use, ranked below
            assert not {h.path for h in hits} & {"secret.txt", "blob.bin", "huge.py"}
        assert idx.search("Pool spawn")[0].start_line == 14
        assert idx.search("") == [] and idx.search('" OR (') == []


def test_update_is_incremental(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    make_repo(repo)
    with Index.create(tmp_path / "index", "r", repo) as idx:
        idx.update()
        assert idx.update().rechunked == 0  # unchanged: nothing read again
        (repo / "caller.py").write_text("def main():\n    return startSoon()\n")
        stats = idx.update()  # edited, not committed: size and mtime notice it
        assert (stats.rechunked, stats.removed) == (1, 0)
        assert [h.path for h in idx.search("start_soon")] == ["caller.py"]
        git(repo, "commit", "-qam", "edit")
        assert idx.update().rechunked == 1  # now versioned by its blob id again
        assert idx.update().rechunked == 0
        git(repo, "mv", "notes.md", "README.md")
        (repo / "nursery.py").unlink()
        stats = idx.update()
        assert (stats.rechunked, stats.removed) == (1, 2)
        assert [h.path for h in idx.search("nothing")] == ["README.md"]
        assert [h.path for h in idx.search("open_nursery")] == []
        assert idx.info().files == 3


def test_plain_folder_uses_size_and_mtime(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "__pycache__").mkdir(parents=True)
    (src / "__pycache__" / "x.py").write_text("def cached(): pass\n")
    (src / "a.py").write_text("def alpha(): pass\n")
    (src / "b.txt").write_text("beta\n")
    with SourceTree(src) as tree:
        assert sorted(p for p, _ in list_source(tree)) == ["a.py", "b.txt"]
    with Index.create(tmp_path / "index", "f", src) as idx:
        assert idx.update().rechunked == 2
        assert idx.update().rechunked == 0
        os.utime(src / "b.txt", ns=(1, 1))
        assert idx.update().rechunked == 1
        assert idx.search("alpha")[0].path == "a.py"


def test_a_repository_git_refuses_is_not_walked_without_its_gitignore(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / ".git").mkdir(parents=True)  # not a repository git can read
    (src / ".gitignore").write_text("secret.env\n")
    (src / "secret.env").write_text("TOKEN=1\n")
    with SourceTree(src) as tree, \
            pytest.raises(IndexError_, match="git cannot read this repository"):
        list(list_source(tree))


def test_cli_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "forged.toml"
    cfg.write_text(f"[server]\nstate_dir = '{tmp_path / 'state'}'\n")
    make_repo(tmp_path / "repo")
    c = ["--config", str(cfg)]
    assert main(["index", "add", "r", str(tmp_path / "repo"), *c]) == 0
    assert main(["index", "add", "r", str(tmp_path / "repo"), *c]) == 1  # exists already
    assert main(["index", "update", *c]) == 0
    assert "updated 'r': 6 files, 0 re-chunked" in capsys.readouterr().err
    assert main(["index", "update", "r", *c]) == 0
    assert "6 files, 0 re-chunked, 0 removed" in capsys.readouterr().err
    assert main(["index", "list", *c]) == 0
    row = capsys.readouterr().out.splitlines()[1].split()
    assert row[:3] == ["r", "4", "7"] and row[-1] == str(tmp_path / "repo")
    assert (tmp_path / "state" / "index" / "r.sqlite3").exists()
    assert main(["index", "rm", "r", *c]) == 0
    assert main(["index", "rm", "r", *c]) == 1
    assert main(["index", "update", "nope", *c]) == 1
    assert main(["index", "add", "../x", str(tmp_path), *c]) == 1
    main(["index", "list", *c])
    assert capsys.readouterr().out.count("\n") == 1  # the header only


def test_an_add_whose_first_update_fails_leaves_no_index(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty index was left behind: the daemon served it, and the retried add said
    it existed already."""
    cfg = tmp_path / "forged.toml"
    cfg.write_text(f"[server]\nstate_dir = '{tmp_path / 'state'}'\n")
    c = ["--config", str(cfg)]
    make_repo(tmp_path / "repo")

    def failing(self: Index, *args: object, **kw: object) -> None:
        raise IndexError_("the source went away")

    with monkeypatch.context() as m:
        m.setattr(Index, "update", failing)
        assert main(["index", "add", "r", str(tmp_path / "repo"), *c]) == 1
    assert not list((tmp_path / "state" / "index").iterdir())
    assert main(["index", "add", "r", str(tmp_path / "repo"), *c]) == 0


def test_an_index_that_fails_its_update_holds_up_no_other(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The hourly update runs every index: one that fails (its folder gone) is said and
    the exit status is 1, but the indexes after it are updated all the same."""
    cfg = tmp_path / "forged.toml"
    cfg.write_text(f"[server]\nstate_dir = '{tmp_path / 'state'}'\n")
    c = ["--config", str(cfg)]
    for name in ("a", "b"):
        make_repo(tmp_path / name)
        assert main(["index", "add", name, str(tmp_path / name), *c]) == 0
    subprocess.run(["rm", "-rf", str(tmp_path / "a")], check=True)
    (tmp_path / "b" / "new.py").write_text("def fresh(): pass\n")
    capsys.readouterr()
    assert main(["index", "update", *c]) == 1
    err = capsys.readouterr().err
    assert "'a'" in err and "updated 'b'" in err


def test_an_index_removed_while_the_daemon_reads_it_leaves_no_wal_behind(
        tmp_path: Path) -> None:
    """A reader keeps the index's -wal and -shm files; removing only the database left
    them, and SQLite would replay that stale log into a new index of the same name."""
    cfg = tmp_path / "forged.toml"
    cfg.write_text(f"[server]\nstate_dir = '{tmp_path / 'state'}'\n")
    make_repo(tmp_path / "repo")
    c = ["--config", str(cfg)]
    assert main(["index", "add", "r", str(tmp_path / "repo"), *c]) == 0
    folder = tmp_path / "state" / "index"
    reader = Searcher(folder)
    assert reader.search("r", "open_nursery", 3)
    assert main(["index", "rm", "r", *c]) == 0
    assert sorted(p.name for p in folder.iterdir()) == []
    assert main(["index", "add", "r", str(tmp_path / "repo"), *c]) == 0
    assert Searcher(folder).search("r", "open_nursery", 3)


def test_keywords_are_neither_indexed_nor_searched() -> None:
    assert split_words(("self", "return_value", "None", "x", "isNull", "openNursery")) == \
        "value open nursery"
    assert query_words("def f(self):\n    return self.open_nursery(None)") == \
        ["open", "nursery"]


def test_a_long_query_keeps_its_rarest_words(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    common = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "iota",
              "kappa", "omega", "sigma", "omicron"][:MAX_QUERY_TERMS]
    for i in range(5):  # every common word in every file
        (src / f"f{i}.py").write_text(f"def f{i}():\n    return {' + '.join(common)}\n")
    (src / "target.py").write_text("def zanzibar_helper():\n    return alpha\n")
    with Index.create(tmp_path / "index", "t", src) as idx:
        idx.update()
        query = " ".join([*common, "zanzibar_helper", "missing_word"])
        kept = rarest(idx.db, query_words(query))
        assert len(kept) == MAX_QUERY_TERMS and kept[:2] == ["zanzibar", "helper"]
        assert "missing" not in kept  # in no chunk: it would match nothing
        assert idx.search(query, 1)[0].path == "target.py"


def test_the_name_at_the_cursor_has_its_definition_first(tmp_path: Path) -> None:
    make_repo(tmp_path / "r")
    with Index.create(tmp_path / "index", "r", tmp_path / "r") as idx:
        idx.update()
        query = "class Pool:\n    size = 4\n    def spawn(self):\n        open_nursery("
        plain = idx.search(query, 3)
        assert "def open_nursery" not in plain[0].text  # Pool's own chunk wins
        focused = idx.search(query, 3, cursor_names(query))
        assert focused[0].text.lstrip().startswith("# Opens the nursery")
        assert focused[0].path == "nursery.py"
        # the rest follow as before, without repeating the definition
        rest = [(h.path, h.start_line) for h in focused[1:]]
        assert len(set(rest)) == len(rest) and (focused[0].path, focused[0].start_line) \
            not in rest


def test_the_definition_itself_comes_before_tests_named_after_it(tmp_path: Path) -> None:
    """A class with many members has a long ``defines``; tests named after it
    (``test_cancel_scope_*``) a short one, so BM25 on the name's words put them first,
    and the qualifier before the name (``_core`` in ``_core.CancelScope(``) weighed as
    much: on trio's call sites 119 of 400 definitions were not in the top five."""
    src = tmp_path / "src"
    src.mkdir()
    members = "".join(f"    def member_{i}(self):\n        return {i}\n" for i in range(12))
    (src / "scope.py").write_text("class CancelScope:\n    deadline = 0\n" + members)
    (src / "test_scope.py").write_text("".join(
        f"def test_cancel_scope_{kind}():\n    assert CancelScope().member_{i}() == {i}\n\n"
        for i, kind in enumerate(["repr", "deadline", "shield", "nested"])))
    (src / "core.py").write_text("def _core():\n    return 1\n")
    with Index.create(tmp_path / "index", "t", src) as idx:
        idx.update()
        query = "def run():\n    with _core.CancelScope("
        assert cursor_names(query) == ["CancelScope", "_core"]
        hits = idx.search(query, 5, cursor_names(query))
        assert (hits[0].path, hits[0].start_line) == ("scope.py", 1)
        assert ("core.py", 1) in [(h.path, h.start_line) for h in hits[:2]]


def test_a_window_of_a_long_class_defines_only_the_members_it_holds() -> None:
    methods = "".join(f"    def method_{i}(self):\n" + "        pass\n" * 8
                      for i in range(12))  # 108 lines: three windows
    chunks = chunk_file("k.py", "class Keeper:\n    size = 1\n" + methods)
    assert len(chunks) == 3
    assert chunks[0].defines[:3] == ("Keeper", "size", "method_0")
    for c in chunks:
        held = [f"method_{i}" for i in range(12) if c.start_line <= 3 + 9 * i <= c.end_line]
        assert [d for d in c.defines if d.startswith("method_")] == held
        assert "Keeper" in c.defines and "size" in c.defines
