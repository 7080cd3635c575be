"""forged: a repo-aware coding assistant serving a local llama.cpp model to a whole
engineering organisation, over OpenAI's API and the dialects of the tools engineers use.

Every command has ``--help`` with an example (:data:`EXAMPLES`); ``man forged`` has
them all.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import logging
import os
import re
import ssl
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import msgspec
import trio

from forged import __version__
from forged import config as fc
from forged.daemon.startup import check_gguf_header, model_key
from forged.placement import keep_to

if TYPE_CHECKING:
    from forged.retrieval.vectors import Embedding


_QUOTED = re.compile(r'[ "\\=\x00-\x1f]')  # what a bare logfmt value cannot hold


def logfmt_value(value: object) -> str:
    """``value`` as a logfmt value: bare if it can be, else JSON-quoted, whose escapes
    keep any text (a logged prompt, say) on its one line."""
    text = str(value)
    if not text or _QUOTED.search(text):
        return json.dumps(text, ensure_ascii=False)
    return text


class LogfmtFormatter(logging.Formatter):
    """One line per event, key=value, so journald stores it and tools can grep it.
    With ``priorities`` (the output is journald's stream), each line starts with its
    syslog priority (``<3>`` error, ``<4>`` warning, ``<6>`` info, ``<7>`` debug), which
    journald takes as the entry's priority: ``journalctl -p err`` then works."""

    def __init__(self, priorities: bool = False) -> None:
        super().__init__()
        self.priorities = priorities

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage().replace('"', "'")
        line = f'level={record.levelname.lower()} logger={record.name} msg="{msg}"'
        for key, value in getattr(record, "fields", {}).items():
            line += f" {key}={logfmt_value(value)}"
        if record.exc_info:
            line += ' exc="' + self.formatException(record.exc_info).replace("\n", " | ") + '"'
        if self.priorities:
            line = f"<{_syslog_priority(record.levelno)}>{line}"
        return line


def _syslog_priority(levelno: int) -> int:
    if levelno >= logging.ERROR:
        return 3
    if levelno >= logging.WARNING:
        return 4
    return 6 if levelno >= logging.INFO else 7


def on_journal(stream: TextIO) -> bool:
    """Whether ``stream`` is the one systemd connected to the journal (sd-daemon(3):
    JOURNAL_STREAM names its device and inode)."""
    try:
        dev, ino = (int(n) for n in os.environ.get("JOURNAL_STREAM", "").split(":"))
        st = os.fstat(stream.fileno())
    except (ValueError, OSError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def fatal(message: str) -> None:
    """A command's last word on what stopped it, on stderr: with the ``<3>`` prefix
    when stderr is the journal, so that ``journalctl -p err`` shows why a start
    failed (a bad config at `forged serve`)."""
    prefix = "<3>" if on_journal(sys.stderr) else ""
    print(f"{prefix}forged: {message}", file=sys.stderr)


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(LogfmtFormatter(priorities=on_journal(sys.stdout)))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def load_checked(args: argparse.Namespace) -> fc.Config:
    from forged.auth import KeyStore

    # Every key has a default: without the default file (a developer's machine, a
    # trial), forged runs on them. A file named with --config must exist.
    cfg = _with_flags(_config(args), args)
    fc.check_model(args.config, cfg)
    for place, model in enumerate(cfg.served):  # a file that is no model is one too
        check_gguf_header(args.config, model, model_key(place))
    KeyStore.load(Path(cfg.auth.keys_file))  # a broken keys file is a config error too
    _check_tls(args.config, cfg.server)
    return cfg


def _check_tls(path: str, server: fc.ServerConfig) -> None:
    """The TLS pair reads as one, now: serve found out only after loading the model,
    and check-config (the unit's ExecStartPre) said OK."""
    from forged.daemon.tls import TLS

    if server.tls_cert:
        try:
            TLS(server.tls_cert, server.tls_key)
        except (OSError, ssl.SSLError) as exc:
            raise fc.ConfigError(f"{path}: server.tls_cert {server.tls_cert} and "
                                 f"server.tls_key {server.tls_key}: {exc}") from exc


class StateDirError(Exception):
    pass


def check_state_dir(path: str) -> None:
    """Prove the state directory is writable now, rather than fail later mid-request."""
    probe = Path(path) / ".forged-write-test"
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as exc:
        with contextlib.suppress(OSError):
            probe.unlink(missing_ok=True)
        raise StateDirError(f"state directory {path} is not usable: "
                            f"{exc.strerror or exc}") from exc


def cmd_check_config(args: argparse.Namespace) -> int:
    from forged.daemon.memplan import plan, render

    cfg = load_checked(args)
    # Each vocabulary loads, as serve's will, and the memory plan must fit.
    memory = plan(Path(args.config), cfg)
    if not memory.fits:
        print(f"forged: {args.config}: the models do not fit in memory:\n{render(memory)}",
              file=sys.stderr)
        return fc.EX_CONFIG
    models = ", ".join(m.model_id for m in cfg.served)
    print(f"{args.config}: OK (model {models}, API on {cfg.server.listen})")
    return 0


def cmd_model_plan(args: argparse.Namespace) -> int:
    """Print the memory plan of the config's models; 1 if it does not fit."""
    from forged.daemon.memplan import plan, render

    memory = plan(Path(args.config), load_checked(args))
    if args.json:
        print(json.dumps({"fits": memory.fits, "total_bytes": memory.total,
                          "checks": [{"what": w, "bytes": u, "allowed_bytes": a}
                                     for w, u, a in memory.checks()],
                          "ram_tier_bytes": memory.ram_tier,
                          "models": [{**dataclasses.asdict(m), "kv_bytes": m.kv,
                                      "total_bytes": m.total} for m in memory.models]},
                         indent=2))
    else:
        print(render(memory))
    return 0 if memory.fits else 1


def cmd_serve(args: argparse.Namespace) -> int:
    from forged.daemon.lifespan import Daemon  # heavy imports only when serving
    from forged.errors import sole_fault

    cfg = load_checked(args)
    setup_logging(cfg.log.level)
    if not Path(args.config).exists():
        logging.getLogger("forged").warning(
            "no config file at %s: running on the built-in defaults (every key is in "
            "etc/forged/forged.toml)", args.config)
    try:
        check_state_dir(cfg.server.state_dir)
    except StateDirError as exc:
        fatal(str(exc))
        return fc.EX_CANTCREAT
    daemon = Daemon(cfg, Path(args.config), test_hooks=args.test_hooks,
                    reread=lambda: _with_flags(_config(args), args))
    keep_to(cfg.door_cpus)  # its workers get theirs in their Init
    try:
        trio.run(daemon.run)
    except (Exception, BaseExceptionGroup) as exc:
        # A start-up failure (a worker that cannot load the model, an address in use)
        # is one line, also when nurseries have wrapped it in groups; anything else is
        # a bug, and its traceback is what to report.
        fault = sole_fault(exc, (fc.ConfigError, RuntimeError, OSError))
        if fault is None:
            raise
        if isinstance(fault, fc.ConfigError):
            raise fault from exc  # main() prints it and exits 78
        logging.getLogger("forged").error("cannot start: %s", fault)
        return 1
    return 0


def _with_flags(cfg: fc.Config, args: argparse.Namespace) -> fc.Config:
    """``cfg`` with forged serve's --listen and --model over the file's."""
    return fc.with_overrides(cfg, listen=getattr(args, "listen", None),
                             model=getattr(args, "model", None))


def _config(args: argparse.Namespace) -> fc.Config:
    """The config as forged serve reads it: the default file may be absent (the daemon
    then runs on the defaults); a file named with --config must exist."""
    path = Path(args.config)
    return fc.load(path, require_file=path != fc.DEFAULT_CONFIG_PATH)


def cmd_status(args: argparse.Namespace) -> int:
    from forged.errors import ForgedError
    from forged.observe.status import fetch_stats, render

    if args.url and len(args.url) > 1:
        return _status_pool(args.url, as_json=args.json)
    admin = (args.url or [args.admin])[0] or _config(args).server.admin_listen
    try:
        stats = fetch_stats(admin)
    except ForgedError as exc:
        print(f"forged: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(stats, indent=2) if args.json else render(stats))
    return 0


def _index_embedding(config_path: Path) -> Embedding | None:
    """The config's embedding model for ``forged index``: imported only when a command
    embeds (it loads llama.cpp)."""
    from forged.indexembed import index_embedding

    return index_embedding(config_path)


def cmd_model_convert(args: argparse.Namespace) -> int:
    """Write a BERT embedding model as a GGUF; 1 if the source is not one."""
    try:
        from forged.convert import ConvertError, convert_bert
    except ImportError as exc:
        fatal(f"forged model convert needs the gguf and safetensors packages ({exc}): "
              "pip install 'forged[convert]'")
        return 1
    try:
        out = convert_bert(Path(args.source), Path(args.output), name=args.name)
    except ConvertError as exc:
        fatal(str(exc))
        return 1
    print(f"{out}: written")
    return 0


def cmd_model_package(args: argparse.Namespace) -> int:
    """Build a model's .deb; 1 if the model or its settings would be refused."""
    from forged.modelpkg import PackageError, Spec, build, parse_settings

    gguf = Path(args.gguf).absolute()
    try:
        spec = Spec(gguf=gguf, model_id=args.id or gguf.name.removesuffix(".gguf"),
                    version=args.version, aliases=args.alias, role=args.role,
                    engine=parse_settings(args.engine), drop_in=not args.no_config,
                    maintainer=args.maintainer)
        deb, role = build(spec, Path(args.out))
    except PackageError as exc:
        fatal(str(exc))
        return 1
    print(f"{deb}: {spec.model_id} ({role}), installs {spec.installed_path}"
          + (f" and {spec.drop_in_path}" if spec.drop_in else ""))
    return 0


def cmd_model_swap(args: argparse.Namespace) -> int:
    """Ask the running daemon to serve another model file; prints the new model once
    it serves, or why the swap was refused (the old model serves on)."""
    from forged.errors import ForgedError
    from forged.observe.status import admin_call
    from forged.progress import Progress

    cfg = fc.load(Path(args.config), require_file=False)
    admin = args.admin or cfg.server.admin_listen
    body = {"path": str(Path(args.path).absolute()), "model": args.model}
    try:
        with Progress().waiting(f"loading {args.path} beside the running model"):
            status, answer = admin_call(admin, "POST", "/models/swap", body,
                                        timeout=cfg.engine.startup_timeout + 90,
                                        token=cfg.server.admin_token)
    except ForgedError as exc:
        print(f"forged: {exc}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"forged: model swap refused: {answer.get('error')}", file=sys.stderr)
        return 1
    print(f"serving {answer['path']} as {', '.join(answer['ids'])}; the old model drains")
    return 0


def _status_pool(urls: list[str], *, as_json: bool) -> int:
    """Several nodes' admin listeners: a line each and the pool's sums; 1 if any node
    could not be read."""
    from forged.errors import ForgedError
    from forged.observe.status import fetch_stats, render_pool

    nodes: list[tuple[str, dict[str, object] | str]] = []
    for url in urls:
        try:
            nodes.append((url, fetch_stats(url)))
        except ForgedError as exc:
            nodes.append((url, str(exc)))
    print(json.dumps(dict(nodes), indent=2) if as_json else render_pool(nodes))
    return 1 if any(isinstance(s, str) for _, s in nodes) else 0


def cmd_report(args: argparse.Namespace) -> int:
    import sqlite3

    from forged.observe.telemetry import read_report, render_report, telemetry_path

    path = Path(_config(args).server.state_dir)
    try:
        since = (dt.datetime.strptime(args.since, "%Y-%m-%d").replace(tzinfo=dt.UTC)
                 .timestamp() if args.since else 0.0)
    except ValueError:
        print(f"forged: --since {args.since!r}: expected YYYY-MM-DD (UTC)", file=sys.stderr)
        return 2
    try:
        rows = read_report(path, since)
    except (OSError, sqlite3.Error) as exc:  # unreadable to this user, or not a database
        print(f"forged: cannot read {telemetry_path(path)}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([{**dataclasses.asdict(r), "acceptance": r.acceptance}
                          for r in rows], indent=2))
    else:
        print(render_report(rows))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from forged.observe.loadtest import main as bench_main

    return bench_main(args)


def cmd_keys_add(args: argparse.Namespace) -> int:
    from forged.auth import add_key

    path = _keys_path(args)
    key = add_key(path, args.name, max_streams=args.max_streams, max_queued=args.max_queued,
                  priority=args.priority, tenant=args.tenant, repos=args.repo,
                  default_repo=args.default_repo)
    print(key)
    print(f"forged: added key {args.name!r} to {path}; it is shown only this once. "
          "Run `systemctl reload forged` to apply it.", file=sys.stderr)
    return 0


def _keys_path(args: argparse.Namespace) -> Path:
    return Path(args.keys_file or fc.load(Path(args.config), require_file=False)
                .auth.keys_file)


def cmd_keys_list(args: argparse.Namespace) -> int:
    from forged.auth import list_keys

    entries = list_keys(_keys_path(args))
    if args.json:
        print(json.dumps([msgspec.to_builtins(e) for e in entries], indent=2))
        return 0
    print(f"{'NAME':<24} {'TENANT':<12} {'PRIORITY':<12} {'STREAMS':>7} {'QUEUED':>6}  "
          f"{'HASH':<12}  REPOS")
    for e in entries:
        repos = "all" if e.repos is None else ",".join(e.repos) or "none"
        print(f"{e.name:<24} {e.tenant or '-':<12} {e.priority:<12} {e.max_streams:>7} "
              f"{e.max_queued:>6}  {e.sha256[:12]:<12}  {repos}")
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    from forged.auth import revoke_key

    path = _keys_path(args)
    revoke_key(path, args.name, allow_open=args.allow_open)
    print(f"forged: removed key {args.name!r} from {path}. Run `systemctl reload forged` "
          "to apply it; its streams in flight finish, new requests get 401.",
          file=sys.stderr)
    return 0


def cmd_keys_rotate(args: argparse.Namespace) -> int:
    from forged.auth import rotate_key

    path = _keys_path(args)
    key = rotate_key(path, args.name)
    print(key)
    print(f"forged: key {args.name!r} in {path} has a new secret, shown only this once. "
          "Run `systemctl reload forged` to apply it; the old secret then gets 401.",
          file=sys.stderr)
    return 0


def _keys_file_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=str(fc.DEFAULT_CONFIG_PATH))
    p.add_argument("--keys-file", help="default: auth.keys_file from the config")


def _add_keys_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    keys = sub.add_parser("keys", help="manage API keys")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    listing = keys_sub.add_parser("list", help="the keys: names, tenants, priorities, "
                                  "limits, repositories; never a secret")
    _keys_file_options(listing)
    listing.add_argument("--json", action="store_true", help="as JSON")
    listing.set_defaults(func=cmd_keys_list)
    for name, func, text in (
            ("revoke", cmd_keys_revoke, "remove a key; a reload applies it"),
            ("rotate", cmd_keys_rotate, "give a key a new secret, keeping its name and "
                                        "limits; print it once")):
        p = keys_sub.add_parser(name, help=text)
        p.add_argument("name", help="the key's name, as `forged keys list` shows it")
        _keys_file_options(p)
        p.set_defaults(func=func)
        if name == "revoke":
            p.add_argument("--allow-open", action="store_true",
                           help="revoke even the last key, which opens the API to anyone")
    _add_keys_add(keys_sub)


def _add_keys_add(keys_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    add = keys_sub.add_parser("add", help="create a key, print it once, store its hash")
    add.add_argument("name", help="the key's name, as logs, metrics and reports show it")
    _keys_file_options(add)
    add.add_argument("--max-streams", type=int, default=16,
                     help="sequences it may generate at once (default: 16)")
    add.add_argument("--max-queued", type=int, default=32,
                     help="requests it may have waiting for a slot (default: 32; 0: never "
                          "wait)")
    add.add_argument("--priority", choices=fc.PRIORITIES, default="interactive",
                     help="its class, and the highest it may ask for (default: "
                          "interactive)")
    add.add_argument("--tenant", default="", help="keys of one tenant share the prefix "
                     "cache; of different tenants never (default: the one shared tenant)")
    add.add_argument("--repo", action="append", help="an index this key may search "
                     "(repeatable; default: every index)")
    add.add_argument("--default-repo", default="", help="the index its generations "
                     "draw on when they name no `repo`")
    add.set_defaults(func=cmd_keys_add)


def _add_model_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    model = sub.add_parser("model", help="package, plan, convert and swap models")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    swap = model_sub.add_parser("swap", help="load a GGUF beside the running model, then "
                                "route to it and drain the old one")
    swap.add_argument("path", help="the new GGUF file")
    swap.add_argument("--model", help="the id of the model to replace (default: "
                      "[model]'s)")
    swap.add_argument("--config", default=str(fc.DEFAULT_CONFIG_PATH))
    swap.add_argument("--admin", help="admin listener: unix:PATH or HOST:PORT "
                      "(default: server.admin_listen from the config)")
    swap.set_defaults(func=cmd_model_swap)
    planned = model_sub.add_parser("plan", help="will the config's models fit in memory? "
                                   "weights, KV caches, RAM tier and workers, per model")
    planned.add_argument("--config", default=str(fc.DEFAULT_CONFIG_PATH))
    planned.add_argument("--json", action="store_true", help="as JSON")
    planned.set_defaults(func=cmd_model_plan)
    convert = model_sub.add_parser("convert", help="a BERT embedding model (Hugging Face "
                                   "safetensors and tokenizer.json) as a GGUF, without torch")
    convert.add_argument("source", help="the folder with config.json, tokenizer.json and "
                         "model.safetensors (and 1_Pooling/ for sentence-transformers)")
    convert.add_argument("output", help="the GGUF to write")
    convert.add_argument("--name", default="", help="the model's name in the GGUF")
    convert.set_defaults(func=cmd_model_convert)
    _add_package_command(model_sub)


def _add_package_command(model_sub: argparse._SubParsersAction[argparse.ArgumentParser]
                         ) -> None:
    package = model_sub.add_parser(
        "package", help="a GGUF as a .deb: the model, its [[models]] table in "
        "/etc/forged/models.d/, and a reload that adds it (removes it, on removal) "
        "under live traffic")
    package.add_argument("gguf", help="the GGUF model file")
    package.add_argument("--id", default="", help="the model's id, which requests name "
                         "and the package is named after (forged-model-ID); default: the "
                         "file name without .gguf")
    package.add_argument("--alias", action="append", default=[], metavar="ID",
                         help="another id it answers to, for tools that hard-code one "
                         "(repeatable)")
    package.add_argument("--role", choices=("chat", "fim", "embed"), default="",
                         help="which requests naming no model it serves (default: from "
                         "the GGUF when the daemon loads it)")
    package.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                         help="its own [engine] setting, such as slots=32 or "
                         "max_context=8192 (repeatable)")
    package.add_argument("--version", default="1.0", help="the package's version (higher "
                         "for an upgrade; default 1.0)")
    package.add_argument("--maintainer", default="forged administrators <root@localhost>",
                         help="the package's Maintainer field (NAME <EMAIL>)")
    package.add_argument("--no-config", action="store_true", help="install the GGUF only, "
                         "for the [model] table of forged.toml (as the default model's "
                         "package does)")
    package.add_argument("--out", default=".", help="the folder to write the .deb to")
    package.set_defaults(func=cmd_model_package)


# One example per command, shown under its --help (and in the man page).
EXAMPLES = {
    "forged": "sudo systemctl status forged; forged status; forged --help",
    "forged serve": "forged serve --model models/SmolLM2-135M-Instruct.Q4_1.gguf "
                    "--listen 127.0.0.1:8080",
    "forged check-config": "sudo forged check-config --config /etc/forged/forged.toml",
    "forged keys": "sudo forged keys add team-web --max-streams 8",
    "forged keys add": "sudo forged keys add nightly-evals --priority batch "
                       "&& sudo systemctl reload forged",
    "forged keys list": "sudo forged keys list   (or: sudo forged keys list --json)",
    "forged keys revoke": "sudo forged keys revoke intern-laptop && sudo systemctl reload "
                          "forged",
    "forged keys rotate": "sudo forged keys rotate team-web && sudo systemctl reload forged",
    "forged index": "sudo forged index add backend /srv/git/backend",
    "forged index add": "sudo forged index add backend /srv/git/backend",
    "forged index update": "sudo forged index update backend",
    "forged index list": "sudo forged index list",
    "forged index rm": "sudo forged index rm backend",
    "forged status": "sudo forged status   (or: forged status --json)",
    "forged model": "sudo forged model swap /usr/share/forged/models/coder.gguf",
    "forged model swap": "sudo forged model swap /usr/share/forged/models/coder.gguf",
    "forged model plan": "forged model plan --config /etc/forged/forged.toml",
    "forged model convert": "forged model convert all-MiniLM-L6-v2/ minilm.gguf",
    "forged model package": "forged model package qwen2.5-coder-1.5b-q8_0.gguf --id "
                            "coder --role fim --engine slots=32 && sudo dpkg -i "
                            "forged-model-coder_1.0_all.deb",
    "forged report": "sudo forged report --since 2026-12-01",
    "forged bench": "forged bench --url http://127.0.0.1:8080 --concurrency 1,8,32 "
                    "--api-key fgd-...",
}
# The help of options that many commands share, where a command gives none.
_SHARED_HELP = {
    "--config": f"the config file (default: {fc.DEFAULT_CONFIG_PATH})",
    "name": "the index's name (letters, digits, '.', '_', '-')",
    "path": "a git work tree or a folder",
}


def _explain(parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` and every command below it a description, an example and a help
    text for each argument (a test checks that none is missing)."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    if parser.prog in EXAMPLES:
        parser.epilog = f"example:\n  {EXAMPLES[parser.prog]}"
    for action in parser._actions:
        if action.help is None:
            action.help = _SHARED_HELP.get(action.option_strings[0] if action.option_strings
                                           else action.dest)
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                sub = action.choices[choice.dest]
                sub.description = sub.description or choice.help
                _explain(sub)


def _add_serve_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = sub.add_parser("serve", help="run the daemon")
    serve.add_argument("--config", default=str(fc.DEFAULT_CONFIG_PATH))
    serve.add_argument("--listen", help="HOST:PORT for the API (overrides server.listen)")
    serve.add_argument("--model", help="GGUF file (overrides model.path)")
    serve.add_argument("--test-hooks", action="store_true", help=argparse.SUPPRESS)
    serve.set_defaults(func=cmd_serve)
    check = sub.add_parser("check-config", help="validate a config file and exit")
    check.add_argument("--config", default=str(fc.DEFAULT_CONFIG_PATH))
    check.set_defaults(func=cmd_check_config)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="forged", description=__doc__.split("\n\n")[0]
                                if __doc__ else None)
    p.add_argument("--version", action="version", version=f"forged {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    _add_serve_commands(sub)
    _add_keys_commands(sub)
    from forged.retrieval.cli import add_index_commands

    add_index_commands(sub, _index_embedding)
    status = sub.add_parser("status", help="summarise a running daemon")
    status.add_argument("--config", default=str(fc.DEFAULT_CONFIG_PATH))
    status.add_argument("--admin", help="admin listener: unix:PATH or HOST:PORT "
                        "(default: server.admin_listen from the config)")
    status.add_argument("--url", action="append", help="a node's admin listener, "
                        "http://HOST:PORT, where the admin exposes it; repeat it for a "
                        "line per node of a pool and the pool's sums")
    status.add_argument("--json", action="store_true", help="print the raw statistics")
    status.set_defaults(func=cmd_status)
    _add_model_commands(sub)
    report = sub.add_parser("report", help="usage (requests, prompt and generated tokens), "
                            "completions shown and accepted, acceptance rate and infill "
                            "latency, per API key name and day")
    report.add_argument("--config", default=str(fc.DEFAULT_CONFIG_PATH))
    report.add_argument("--since", help="from this UTC day on (YYYY-MM-DD)")
    report.add_argument("--json", action="store_true", help="print the rows as JSON")
    report.set_defaults(func=cmd_report)
    from forged.observe.loadtest import add_arguments

    bench = sub.add_parser("bench", help="load-test an OpenAI-compatible server")
    add_arguments(bench)
    bench.set_defaults(func=cmd_bench)
    _explain(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except fc.ConfigError as exc:
        fatal(str(exc))
        return fc.EX_CONFIG
    except BrokenPipeError:  # `forged status --json | head`: the reader left, no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor at exit's flush
        return 1


if __name__ == "__main__":
    sys.exit(main())
