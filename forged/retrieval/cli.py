"""``forged index add|update|list|rm``: the admin's side of the repository index."""

from __future__ import annotations

import argparse
import os
import pwd
import sys
import time
from pathlib import Path
from typing import Any

from forged import config as fc
from forged.retrieval.store import Index, IndexError_, index_path, list_indexes

DAEMON_USER = "forged"  # systemd/forged.sysusers


def index_dir(args: argparse.Namespace) -> Path:
    return Path(fc.load(Path(args.config)).server.state_dir) / "index"


def give_to_daemon(directory: Path, name: str) -> None:
    """Run as root (``sudo forged index add``), leave the index the daemon's user's, as
    if that user had made it: the hourly timer updates it as that user."""
    if os.geteuid() != 0:
        return
    try:
        user = pwd.getpwnam(DAEMON_USER)
    except KeyError:
        return  # a development machine without the forged user
    for path in (directory, index_path(directory, name)):
        os.chown(path, user.pw_uid, user.pw_gid)


def cmd_add(args: argparse.Namespace) -> int:
    directory = index_dir(args)
    with Index.create(directory, args.name, Path(args.path)) as idx:
        give_to_daemon(directory, args.name)
        stats = idx.update()
    print(f"forged: indexed {args.name!r}: {stats.files} files, "
          f"{stats.rechunked} chunked, in {stats.seconds:.1f} s", file=sys.stderr)
    return 0


def cmd_update(args: argparse.Namespace) -> int:
    directory = index_dir(args)
    for name in [args.name] if args.name else list_indexes(directory):
        with Index.open(directory, name) as idx:
            stats = idx.update()
        print(f"forged: updated {name!r}: {stats.files} files, {stats.rechunked} "
              f"re-chunked, {stats.removed} removed, in {stats.seconds:.1f} s",
              file=sys.stderr)
    return 0


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
    path.unlink()
    return 0


def _guarded(func: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        try:
            return int(func(args))
        except IndexError_ as exc:
            print(f"forged: {exc}", file=sys.stderr)
            return 1
    return run


def add_index_commands(sub: Any) -> None:
    """Add ``index`` and its subcommands to ``forged``'s subparsers."""
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
        p.set_defaults(func=_guarded(func))
