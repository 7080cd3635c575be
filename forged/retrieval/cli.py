"""``forged index add|update|list|rm``: the admin's side of the repository index."""

from __future__ import annotations

import argparse
import os
import pwd
import sqlite3
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from forged import config as fc
from forged.progress import Progress
from forged.retrieval.errors import IndexError_
from forged.retrieval.store import Index, UpdateStats, index_path, list_indexes, remove_index
from forged.retrieval.vectors import Embedding

DAEMON_USER = "forged"  # systemd/forged.sysusers


def index_dir(args: argparse.Namespace) -> Path:
    return Path(fc.load(Path(args.config)).server.state_dir) / "index"


def run_as_daemon_user() -> None:
    """Run by root (``sudo forged index ...``), become the daemon's user, for good,
    before anything is read or written.

    An index built by root would hold what only root may read (another user's 0600
    files, a repository git trusts root alone with), and the API serves it to every
    key allowed the index. As the daemon's user, ``add`` sees exactly what the hourly
    update (``systemd/forged-index.service``, ``User=forged``) will, and the files it
    makes are that user's. Without that user (a development machine) the commands run
    as whoever runs them."""
    if os.geteuid() != 0:
        return
    try:
        user = pwd.getpwnam(DAEMON_USER)
    except KeyError:
        return
    # As systemd's User= does: the user's groups, then its ids, real and saved too.
    os.initgroups(user.pw_name, user.pw_gid)
    os.setresgid(user.pw_gid, user.pw_gid, user.pw_gid)
    os.setresuid(user.pw_uid, user.pw_uid, user.pw_uid)
    # git reads the user's own configuration, not root's.
    os.environ.update(HOME=user.pw_dir, USER=user.pw_name, LOGNAME=user.pw_name)
    os.environ.pop("XDG_CONFIG_HOME", None)
    print(f"forged: running as {user.pw_name!r}, the daemon's user", file=sys.stderr)


def cmd_add(args: argparse.Namespace) -> int:
    directory = index_dir(args)
    embedding = _embedding(args)
    progress = Progress()
    try:
        with Index.create(directory, args.name, Path(args.path)) as idx:
            try:
                stats = idx.update(progress=progress.counter(
                    f"indexing {args.name!r}: files"), embedding=embedding,
                    embed_progress=progress.counter(f"embedding {args.name!r}: chunks"))
            except BaseException:
                # Nothing committed: an empty index would be served, and a retried add
                # refused. (Chunks committed, an embedding cut short goes on at the
                # next update: the index stays.)
                if not idx.db.execute("SELECT 1 FROM files LIMIT 1").fetchone():
                    idx.db.close()
                    remove_index(index_path(directory, args.name))
                raise
    finally:
        progress.clear()  # an error's message then starts on a line of its own
    print(f"forged: indexed {args.name!r}: {stats.files} files, "
          f"{stats.rechunked} chunked, in {stats.seconds:.1f} s{_embedded(stats)}",
          file=sys.stderr)
    return 0


def cmd_update(args: argparse.Namespace) -> int:
    directory = index_dir(args)
    embedding = _embedding(args)
    failed = 0
    for name in [args.name] if args.name else list_indexes(directory):
        progress = Progress()
        try:
            with Index.open(directory, name) as idx:
                stats = idx.update(progress=progress.counter(f"updating {name!r}: files"),
                                   embedding=embedding, embed_progress=progress.counter(
                                       f"embedding {name!r}: chunks"))
        except (IndexError_, sqlite3.Error, OSError) as exc:
            # One index's failure (its folder gone, its file damaged) is said, and the
            # others are updated all the same: the hourly timer runs them all.
            print(f"forged: cannot update {name!r}: {exc}", file=sys.stderr)
            failed += 1
            continue
        finally:
            progress.clear()
        print(f"forged: updated {name!r}: {stats.files} files, {stats.rechunked} "
              f"re-chunked, {stats.removed} removed, in {stats.seconds:.1f} s"
              f"{_embedded(stats)}", file=sys.stderr)
    return 1 if failed else 0


def _embedding(args: argparse.Namespace) -> Embedding | None:
    """The config's embedding model (args.embedding: forged.indexembed's loader, given
    by forged.cli), unless --no-embed; None without one: BM25 alone."""
    if args.no_embed or args.embedding is None:
        return None
    loaded: Embedding | None = args.embedding(Path(args.config))
    return loaded


def _embedded(stats: UpdateStats) -> str:
    """What the embeddings cost, when there were any."""
    if not stats.embedded:
        return ""
    return (f"; {stats.embedded} chunks embedded in {stats.embed_seconds:.1f} s "
            f"({stats.embedded / max(stats.embed_seconds, 1e-9):.0f}/s, at nice 19)")


def cmd_list(args: argparse.Namespace) -> int:
    directory = index_dir(args)
    print(f"{'NAME':<20} {'FILES':>7} {'CHUNKS':>8} {'SIZE':>10}  {'UPDATED (UTC)':<19}  SOURCE")
    for name in list_indexes(directory):
        with Index.open(directory, name) as idx:
            i = idx.info()
        when = (time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(i.updated_at))
                if i.updated_at else "never")
        print(f"{i.name:<20} {i.files:>7} {i.chunks:>8} {i.size:>10}  {when:<19}  {i.source}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    path = index_path(index_dir(args), args.name)
    if not path.exists():
        raise IndexError_(f"no index {args.name!r} in {path.parent}")
    remove_index(path)
    return 0


def _guarded(func: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        run_as_daemon_user()
        try:
            return int(func(args))
        except IndexError_ as exc:
            print(f"forged: {exc}", file=sys.stderr)
            return 1
    return run


def add_index_commands(sub: Any, embedding: Callable[[Path], Embedding | None] | None = None
                       ) -> None:
    """Add ``index`` and its subcommands to ``forged``'s subparsers; ``embedding`` loads
    the config's embedding model (none: chunks get no vectors)."""
    index = sub.add_parser("index", help="manage the repository indexes for retrieval")
    index_sub = index.add_subparsers(dest="index_command", required=True)
    specs: list[tuple[str, str, Any, list[str]]] = [
        ("add", "index a git work tree or a folder under NAME", cmd_add, ["name", "path"]),
        ("update", "update one index (default: all) incrementally", cmd_update, ["name?"]),
        ("list", "files, chunks, size and last update of each index", cmd_list, []),
        ("rm", "delete an index", cmd_rm, ["name"]),
    ]
    for command, help_, func, positionals in specs:
        p = index_sub.add_parser(command, help=help_)
        for pos in positionals:
            p.add_argument(pos.rstrip("?"), nargs="?" if pos.endswith("?") else None)
        p.add_argument("--config", default=str(fc.DEFAULT_CONFIG_PATH))
        if command in ("add", "update"):
            p.add_argument("--no-embed", action="store_true", help="index for BM25 "
                           "only: give no chunk a vector (the config's embedding model "
                           "embeds them otherwise)")
        p.set_defaults(func=_guarded(func), embedding=embedding, no_embed=False)
