"""The repository index never reads outside the folder it indexes: symlinks inside the
tree (to files or folders, committed or swapped in later, also between the listing and
the reading of a file) are never followed, and an index built by root is built as the
daemon's user. Plain synchronous tests on tmp_path."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from forged.retrieval import store
from forged.retrieval.errors import IndexError_
from forged.retrieval.source import SourceTree
from forged.retrieval.store import Index

SECRET = "outside_secret_marker"
ROOT = Path(__file__).resolve().parent.parent


def git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t",
                    *args], check=True, capture_output=True)


def outside(tmp_path: Path) -> Path:
    """A folder beside the repository, holding what must never be indexed."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "guide.md").write_text(f"def {SECRET}(): pass\n")
    (folder / "secret.py").write_text(f"{SECRET} = 'root:x:0:0'\n")
    return folder


def make_repo(root: Path) -> None:
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "guide.md").write_text("how to open_nursery\n")
    (root / "main.py").write_text("def open_nursery(): pass\n")
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "init")


def indexed_text(idx: Index) -> str:
    return "\n".join(t for (t,) in idx.db.execute("SELECT text FROM chunks"))


def swap_for_symlink(path: Path, target: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()
    path.symlink_to(target)


@pytest.mark.parametrize("kind", ["git", "folder"])
def test_symlinked_folders_and_files_inside_the_tree_are_not_followed(
        tmp_path: Path, kind: str) -> None:
    secret = outside(tmp_path)
    repo = tmp_path / "repo"
    make_repo(repo)
    if kind == "folder":
        subprocess.run(["rm", "-rf", str(repo / ".git")], check=True)
    # The committed docs/ folder replaced by a symlink to another folder (the measured
    # hole), a symlinked file, and a symlinked folder git has never seen.
    swap_for_symlink(repo / "docs", secret)
    (repo / "config.py").symlink_to(secret / "secret.py")
    (repo / "vendor").symlink_to(secret)
    with Index.create(tmp_path / "index", "r", repo) as idx:
        idx.update()
        paths = {p for (p,) in idx.db.execute("SELECT path FROM files")}
        assert SECRET not in indexed_text(idx)
        assert idx.search(SECRET) == []
        assert paths == {"main.py"}


def swapping_after_listing(monkeypatch: pytest.MonkeyPatch, path: Path, target: Path
                           ) -> None:
    """Let the index list its source, then swap ``path`` for a symlink to ``target``
    before any file is read: the gap between a check and a use."""
    listed = store.list_source

    def list_then_swap(*args: Any, **kwargs: Any) -> Iterator[tuple[str, str]]:
        files = list(listed(*args, **kwargs))
        swap_for_symlink(path, target)
        return iter(files)

    monkeypatch.setattr(store, "list_source", list_then_swap)


@pytest.mark.parametrize("swapped", ["docs/guide.md", "docs"])
def test_a_file_or_folder_swapped_for_a_symlink_after_listing_is_not_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, swapped: str) -> None:
    secret = outside(tmp_path)
    repo = tmp_path / "repo"
    make_repo(repo)
    (repo / "main.py").write_text("def changed(): pass\n")  # dirty: versioned by stat
    target = secret / "guide.md" if swapped.endswith(".md") else secret
    swapping_after_listing(monkeypatch, repo / swapped, target)
    with Index.create(tmp_path / "index", "r", repo) as idx:
        idx.update()
        assert SECRET not in indexed_text(idx)
        skipped = dict(idx.db.execute("SELECT path, skipped FROM files"))
        assert skipped["docs/guide.md"] == "unreadable"
        assert skipped["main.py"] is None


def test_a_source_folder_replaced_by_a_symlink_is_refused(tmp_path: Path) -> None:
    secret = outside(tmp_path)
    repo = tmp_path / "repo"
    make_repo(repo)
    with Index.create(tmp_path / "index", "r", repo) as idx:
        idx.update()
    # The repository's owner replaces it with a symlink before the hourly update.
    repo.rename(tmp_path / "moved")
    repo.symlink_to(secret)
    with Index.open(tmp_path / "index", "r") as idx, \
            pytest.raises(IndexError_, match="symlink"):
        idx.update()
    with Index.open(tmp_path / "index", "r") as idx:
        assert SECRET not in indexed_text(idx)
        assert "open_nursery" in indexed_text(idx)  # the previous index stays whole


def test_special_files_and_paths_that_leave_the_folder_are_not_read(tmp_path: Path) -> None:
    secret = outside(tmp_path)
    src = tmp_path / "src"
    src.mkdir()
    os.mkfifo(src / "pipe.py")  # opening it to read would block for ever
    with SourceTree(src) as tree:
        assert tree.version("pipe.py") is None
        assert tree.read("pipe.py", 100) == (None, "unreadable")
        for rel in ("../outside/secret.py", str(secret / "secret.py"), "./pipe.py", ""):
            assert tree.version(rel) is None
            assert tree.read(rel, 100) == (None, "unreadable")


NOBODY = "nobody"


@pytest.fixture
def public_tmp() -> Iterator[Path]:
    """A folder another user can reach (pytest's tmp_path is under a 0700 folder)."""
    folder = Path(tempfile.mkdtemp(prefix="forged-index-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping privileges needs root")
def test_index_commands_run_by_root_run_as_the_daemons_user(public_tmp: Path) -> None:
    """``sudo forged index add`` builds the index as the daemon's user: it holds only
    what the daemon's user may read, as the hourly update (systemd/forged-index.service,
    User=forged) will, and its files are that user's. ("nobody" stands in for
    "forged", which a test machine lacks; a child process, since the drop is for
    good.)"""
    user = pwd.getpwnam(NOBODY)
    repo = public_tmp / "repo"
    repo.mkdir()
    (repo / "open.py").write_text("def readable_by_all(): pass\n")
    (repo / "root_only.py").write_text(f"def {SECRET}(): pass\n")
    (repo / "root_only.py").chmod(0o600)
    state = public_tmp / "state"
    state.mkdir()
    os.chown(state, user.pw_uid, user.pw_gid)
    config = public_tmp / "forged.toml"
    config.write_text(f"[server]\nstate_dir = '{state}'\n")
    # tomllib (and llama.cpp's binding, which the command loads to look for an embedding
    # model) are imported before the drop: this machine's Python lives under /root.
    script = ("import sys, tomllib, forged.indexembed; from forged.retrieval import cli; "
              "from forged.cli import main; "
              f"cli.DAEMON_USER = {NOBODY!r}; sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", script, "index", "add", "r", str(repo),
                           "--config", str(config)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert done.returncode == 0, done.stderr
    db = state / "index" / "r.sqlite3"
    assert (db.stat().st_uid, (state / "index").stat().st_uid) == (user.pw_uid,) * 2
    with Index.open(state / "index", "r") as idx:
        assert dict(idx.db.execute("SELECT path, skipped FROM files")) == {
            "open.py": None, "root_only.py": "unreadable"}
        assert SECRET not in indexed_text(idx)


def _filtered_repo(tmp_path: Path) -> tuple[Path, Path]:
    """A repository whose *.py pass a clean filter its owner set: the filter, if ever
    run, leaves a file in the folder returned beside it."""
    repo, ran = tmp_path / "repo", tmp_path / "ran"
    make_repo(repo)
    (repo / ".gitattributes").write_text("*.py filter=evil\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "attributes")
    ran.mkdir()
    git(repo, "config", "filter.evil.clean", f"touch {ran}/clean; cat")
    return repo, ran


def test_the_repositorys_git_config_runs_no_command(tmp_path: Path) -> None:
    """The repository's owner writes its .git/config; the index runs git on it as the
    daemon's user. A file monitor hook and a clean filter are commands git would run."""
    repo, ran = _filtered_repo(tmp_path)
    git(repo, "config", "core.fsmonitor", f"touch {ran}/fsmonitor; false")
    os.utime(repo / "main.py", ns=(1, 1))  # stat data changed: git would re-read it
    with Index.create(tmp_path / "index", "r", repo) as idx:
        idx.update()
        assert idx.search("open_nursery")
    assert list(ran.iterdir()) == []


def test_a_racily_clean_file_runs_no_clean_filter(tmp_path: Path) -> None:
    """A file whose time is later than the git index's is "racily clean": git reads its
    content to compare, through the clean filter, even in diff-files. The repository's
    owner can make one at will (a future mtime, then `git update-index --refresh`)."""
    repo, ran = _filtered_repo(tmp_path)
    later = 2_051_222_400  # 2035: after the git index's own time
    os.utime(repo / "main.py", (later, later))
    git(repo, "update-index", "--refresh")  # the owner's git runs the filter: fine
    for made in ran.iterdir():
        made.unlink()
    with Index.create(tmp_path / "index", "r", repo) as idx:
        idx.update()
        assert idx.search("open_nursery")
    assert list(ran.iterdir()) == []


@pytest.mark.parametrize("in_git", [True, False])
def test_a_file_named_in_no_utf8_or_too_deep_for_ast_fails_no_update(
        tmp_path: Path, in_git: bool) -> None:
    """A file name that is not UTF-8 (SQLite cannot store it) and Python that ``ast``
    cannot parse for recursion made every update of the index fail, every hour."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "main.py").write_text("def open_nursery(): pass\n")
    (repo / os.fsdecode(b"caf\xe9.py")).write_text("def cafe(): pass\n")
    (repo / "deep.py").write_text("x = " + "+".join(["1"] * 20_000) + "\n")
    if in_git:
        git(repo, "init", "-q")
        git(repo, "add", "-A")
        git(repo, "commit", "-qm", "init")
    with Index.create(tmp_path / "index", "r", repo) as idx:
        idx.update()
        assert idx.search("open_nursery")
        paths = {p for (p,) in idx.db.execute("SELECT path FROM files")}
    assert "deep.py" in paths and not [p for p in paths if p.startswith("caf")]
