"""A source folder's files, listed and read without ever leaving the folder.

Theory of operation. The folder is written by other people (a repository's committers,
a work tree's owner), and the index is built by the daemon's user, whose index the API
serves. A symlink anywhere in the folder, committed or swapped in at any moment, must
not make the index read what it points at: ``/etc``, another team's repository, the
daemon's own keys. So no read goes by path:

* the folder itself is opened once, component by component from ``/``, each component
  with ``O_NOFOLLOW`` beneath the descriptor of the one before (``openat``): the folder
  named when the index was added (symlinks resolved then), or nothing;
* each file beneath it is opened the same way, relative to the folder's descriptor,
  every component ``O_NOFOLLOW``: a symlink at any depth fails the open, whether it was
  there when the folder was listed or swapped in between the listing and the read;
* what was opened is checked with ``fstat`` (a regular file, its size), never by path,
  and read from the descriptor; ``O_NONBLOCK`` keeps a FIFO swapped in from blocking
  the open.

Listing still yields names (git's, or ``os.fwalk``'s, which never follows a symlink
either), and a name is only ever looked up beneath the folder's descriptor. Folders are
opened ``O_PATH``: crossing one needs only search permission, as a path lookup does.

Error handling: a folder that cannot be opened this way raises ``IndexError_`` naming it;
a file that cannot is skipped (``read`` says why), as an unreadable file always was.
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

from forged.retrieval.errors import IndexError_

BINARY_PROBE = 8192
SKIP_DIRS = frozenset({".git", "node_modules", "__pycache__", "build", "dist", ".venv",
                       "venv", ".tox", ".mypy_cache", ".pytest_cache", ".ruff_cache"})
_DIR = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


class SourceTree:
    """The folder an index reads, open as a descriptor.

    Resource handling: holds one descriptor; use as a context manager."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.fd = open_root(root)

    def __enter__(self) -> SourceTree:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)

    def version(self, rel: str) -> str | None:
        """``size:mtime_ns`` of the regular file ``rel``; None for anything else (a
        symlink, a folder, a file gone or beyond a symlink)."""
        try:
            st = self._stat(rel)
        except OSError:
            return None
        return f"{st.st_size}:{st.st_mtime_ns}" if stat.S_ISREG(st.st_mode) else None

    def as_recorded(self, rel: str, recorded: dict[str, int]) -> bool:
        """Whether the file ``rel`` is as the git index recorded it (``_index_entries``),
        by its stat data as git compares it (32 bits of ino and size), and older than
        the index itself (else git would read it to know)."""
        try:
            st = self._stat(rel)
        except OSError:
            return False
        mask = 0xFFFFFFFF
        return (st.st_mtime_ns == recorded.get("mtime") and st.st_ctime_ns == recorded.get(
            "ctime") and st.st_ino & mask == recorded.get("ino") and st.st_size & mask ==
            recorded.get("size") and st.st_mtime_ns < recorded["index"])

    def read(self, rel: str, max_bytes: int) -> tuple[bytes | None, str | None]:
        """The bytes of the regular file ``rel``, or None and why it is skipped: too
        large, binary, or unreadable (also: a symlink, or beyond one)."""
        try:
            fd = self._open_file(rel)
        except OSError:
            return None, "unreadable"
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None, "unreadable"
            if st.st_size > max_bytes:
                return None, "large"
            data = _read_at_most(fd, max_bytes + 1)
        except OSError:
            return None, "unreadable"
        finally:
            os.close(fd)
        if len(data) > max_bytes:  # it grew since the fstat
            return None, "large"
        if b"\0" in data[:BINARY_PROBE]:
            return None, "binary"
        return data, None

    def _stat(self, rel: str) -> os.stat_result:
        parts = _parts(rel)
        parent = _open_dirs(self.fd, parts[:-1])
        try:
            return os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
        finally:
            os.close(parent)

    def _open_file(self, rel: str) -> int:
        parts = _parts(rel)
        parent = _open_dirs(self.fd, parts[:-1])
        try:
            return os.open(parts[-1], _FILE, dir_fd=parent)
        finally:
            os.close(parent)


def open_root(root: Path) -> int:
    """A descriptor of the folder ``root`` (absolute), reached without a symlink."""
    if not root.is_absolute():
        raise IndexError_(f"{root}: the source folder must be an absolute path")
    top = os.open("/", _DIR)
    try:
        return _open_dirs(top, root.parts[1:])
    except OSError as exc:
        raise IndexError_(_why_not(root, exc)) from exc
    finally:
        os.close(top)


def _why_not(root: Path, exc: OSError) -> str:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return (f"{root}: the source folder is now reached through a symlink, or is "
                "not a folder; the index never follows one: `forged index rm` it and "
                "add it again by the folder's real path")
    return f"{root}: cannot open the source folder: {exc.strerror}"


def _parts(rel: str) -> list[str]:
    """``rel``'s components; one that could step out of the folder fails the open."""
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise FileNotFoundError(errno.ENOENT, "not a plain relative path", rel)
    return parts


def _open_dirs(start: int, names: Sequence[str]) -> int:
    """A new descriptor of the folder ``names`` beneath ``start``, each component
    opened ``O_NOFOLLOW`` relative to the one before: a symlink fails the walk."""
    fd = os.dup(start)
    try:
        for name in names:
            child = os.open(name, _DIR, dir_fd=fd)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_at_most(fd: int, n: int) -> bytes:
    pieces = []
    while n > 0 and (piece := os.read(fd, min(n, 1 << 20))):
        pieces.append(piece)
        n -= len(piece)
    return b"".join(pieces)


# --- listing ---------------------------------------------------------------------------


def list_source(tree: SourceTree) -> Iterator[tuple[str, str]]:
    """``(relative path, version)`` of every candidate file in ``tree``; never one whose
    name is not UTF-8 (the index, SQLite's text, cannot hold it: it failed the whole
    update)."""
    return (f for f in _listed(tree) if _utf8(f[0]))


def _utf8(rel: str) -> bool:
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _listed(tree: SourceTree) -> Iterator[tuple[str, str]]:
    root = tree.root
    if _git(root, "rev-parse", "--is-inside-work-tree") == b"true\n":
        yield from _list_git(tree)
    elif (root / ".git").exists():
        # A repository git refuses to read (another owner's: "dubious ownership") would
        # be walked as a plain folder, its .gitignore ignored: refuse instead.
        raise IndexError_(f"{root}: git cannot read this repository; `git -C {root} "
                          "status`, run as the user that indexes, says why")
    else:
        yield from _list_folder(tree)


def _skipped_dir(rel: str) -> bool:
    return any(part in SKIP_DIRS for part in rel.split("/")[:-1])


def _list_git(tree: SourceTree) -> Iterator[tuple[str, str]]:
    # Tracked files carry their blob id from the git index; those edited since (and
    # untracked ones, .gitignore applied) are versioned by size and mtime instead. A
    # tracked file beyond a symlink (its folder swapped for one) is "edited" to git, and
    # has no version here: it is left out.
    root = tree.root
    for entry, recorded in _index_entries(root):
        meta, _, raw = entry.partition(b"\t")
        mode, blob, _stage = meta.split(b" ")
        rel = os.fsdecode(raw)
        if mode in (b"120000", b"160000") or _skipped_dir(rel):
            continue  # symlinks and submodules are not this repository's text
        if not tree.as_recorded(rel, recorded):
            version = tree.version(rel)
            if version:
                yield rel, version
        else:
            yield rel, blob.decode()
    for rel in _git_paths(root, "ls-files", "--others", "--exclude-standard", "-z"):
        version = tree.version(rel)
        if version and not _skipped_dir(rel):
            yield rel, version


def _list_folder(tree: SourceTree) -> Iterator[tuple[str, str]]:
    # fwalk never descends into a symlinked folder; a symlinked file has no version.
    for folder, dirnames, filenames, _fd in os.fwalk(".", dir_fd=tree.fd):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            rel = os.path.normpath(os.path.join(folder, name))
            version = tree.version(rel)
            if version:
                yield rel, version


# `git ls-files --debug` writes these lines of stat data after each entry.
_DEBUG_LINES = 5  # ctime, mtime, dev and ino, uid and gid, size and flags


def _index_entries(root: Path) -> Iterator[tuple[bytes, dict[str, int]]]:
    """The git index's entries ("mode blob stage\\tpath"), each with the stat data git
    recorded for it (mtime and ctime in ns, ino, size) and the index file's mtime
    (``index``). Edited files are found by comparing these here: any git command that
    compares them (diff-files too) reads a "racily clean" file's content through the
    repository's clean filter, a command its owner chose (a file newer than the index
    is one, and the owner can make one at will)."""
    where = (_git(root, "rev-parse", "--git-path", "index") or b"").strip()
    try:  # .git may be a file naming the folder (a worktree's)
        index_ns = (root / os.fsdecode(where)).stat().st_mtime_ns if where else 0
    except OSError:
        index_ns = 0  # no index file: every entry counts as edited
    pieces = (_git(root, "ls-files", "-s", "--debug", "-z") or b"").split(b"\0")
    entry = pieces[0]
    for piece in pieces[1:]:
        *lines, following = piece.split(b"\n", _DEBUG_LINES)
        yield entry, {"index": index_ns, **_stat_data(lines)}
        entry = following


def _stat_data(lines: list[bytes]) -> dict[str, int]:
    """``  mtime: SEC:NSEC`` as ns, ``  ino: N`` as N; what does not read so is left out
    (and the file then counts as edited)."""
    out: dict[str, int] = {}
    for field in b"\t".join(lines).split(b"\t"):
        name, _, value = field.strip().partition(b": ")
        sec, colon, ns = value.partition(b":")
        if (sec + ns).isdigit():
            out[name.decode()] = int(sec) * 1_000_000_000 + int(ns) if colon else int(sec)
    return out


def _git_paths(root: Path, *args: str) -> list[str]:
    return [os.fsdecode(p) for p in (_git(root, *args) or b"").split(b"\0") if p]


# The repository's own configuration must not run commands as the indexing user:
# core.fsmonitor names one, which git runs on every command that reads the work tree.
_GIT = ("git", "-c", "core.fsmonitor=false")


def _git(root: Path, *args: str) -> bytes | None:
    try:
        done = subprocess.run([*_GIT, "-C", str(root), *args], capture_output=True,
                              check=False, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None
