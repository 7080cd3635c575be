from __future__ import annotations

import argparse
from pathlib import Path

import msgspec
import pytest

from forged import cli
from forged import config as fc
from tests.conftest import ROOT

SHIPPED = ROOT / "etc" / "forged" / "forged.toml"


def test_shipped_config_spells_out_every_default_with_a_comment() -> None:
    raw = msgspec.toml.decode(SHIPPED.read_bytes())
    defaults = msgspec.to_builtins(fc.Config())
    # Every key, every default; but [[models]], tables that models.d/ adds (a `models =
    # []` line made any [[models]] table an admin added a TOML error).
    assert defaults.pop("models") == [] and raw == defaults
    lines = SHIPPED.read_text().splitlines()
    for i, line in enumerate(lines):
        if "=" in line and not line.startswith("#"):
            assert lines[i - 1].startswith("#"), f"no comment above {line!r}"


@pytest.mark.parametrize(("text", "message"), [
    ("[engine]\nslotz = 1\n", "engine.slotz: unknown key"),
    ("[bogus]\n", "bogus: unknown key"),
    ("[engine]\nslots = 'x'\n", "engine.slots: Expected `int`, got `str`"),
    ("[engine]\nslots = 0\n", "engine.slots: Expected `int` >= 1"),
    ("[engine]\nslots = 32\nstep_tokens = 16\nmax_running = 8\n", "must be at least engine.slots"),
    ("[engine]\nmax_context = 4096\n", "may use (2048: kv_cells / slots)"),
    # the unified layout keeps kv_headroom out of every request's reach
    ("[engine]\nkv_layout = 'unified'\nkv_cells = 4096\nmax_context = 4096\n",
     "may use (4032: kv_cells - kv_headroom)"),
    # a step runs between two heartbeats: the timeout must outlast the longest one
    ("[engine]\ntarget_step_ms = 5000\n", "engine.heartbeat_timeout: must exceed 50 s"),
    ("[engine]\nheartbeat_interval = 20\n", "engine.heartbeat_timeout: must exceed 60 s"),
    ("[server]\nlisten = 'nowhere'\n", "server.listen: expected HOST:PORT"),
    ("[server]\ncors_origins = ['tools.example']\n", "server.cors_origins[0]: Expected"),
    ("not toml at all [", "Expected '=' after a key"),
])
def test_bad_configs_name_the_file_and_the_key(tmp_path: Path, text: str, message: str) -> None:
    p = tmp_path / "forged.toml"
    p.write_text(text)
    with pytest.raises(fc.ConfigError) as err:
        fc.load(p)
    assert str(err.value).startswith(f"{p}: ")
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_flags_override_the_file(tmp_path: Path) -> None:
    cfg = fc.with_overrides(fc.Config(), listen="127.0.0.1:9999", model="/m.gguf")
    assert cfg.server.listen == "127.0.0.1:9999" and cfg.model.path == "/m.gguf"
    with pytest.raises(fc.ConfigError):
        fc.with_overrides(fc.Config(), listen="nope")


def test_changed_keys_and_restart_keys() -> None:
    a = fc.Config()
    b = msgspec.structs.replace(a, limits=msgspec.structs.replace(a.limits, max_queued=3),
                                engine=msgspec.structs.replace(a.engine, slots=8))
    assert fc.changed_keys(a, b) == ["engine.slots", "limits.max_queued"]
    assert "engine.slots" in fc.RESTART_KEYS and "limits.max_queued" not in fc.RESTART_KEYS


def test_the_shipped_file_marks_exactly_the_restart_keys() -> None:
    """`[restart]` in a key's comment is what operators read; RESTART_KEYS is what a
    reload does. They must agree."""
    marked, section, comment = set(), "", ""
    for line in SHIPPED.read_text().splitlines():
        if line.startswith("["):
            section, comment = line.strip("[]"), ""
        elif line.startswith("#"):
            comment += line
        elif "=" in line:
            if "[restart]" in comment:
                key = line.split('=')[0].strip()
                marked.add(f"{section}.{key}" if section else key)
            comment = ""
    assert marked == set(fc.RESTART_KEYS)


def test_serve_runs_on_the_defaults_without_the_default_config_file(
        tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`forged serve --model X` on a machine without /etc/forged/forged.toml ran into
    "no such file" although every key has a default; a file named with --config must
    still exist."""
    missing = tmp_path / "etc" / "forged.toml"
    monkeypatch.setattr(fc, "DEFAULT_CONFIG_PATH", missing)
    args = argparse.Namespace(config=str(missing), model=str(tiny_model), listen=None)
    cfg = cli.load_checked(args)
    assert cfg.model.path == str(tiny_model) and cfg.server == fc.ServerConfig()
    with pytest.raises(fc.ConfigError, match="no such file"):
        cli.load_checked(argparse.Namespace(config=str(tmp_path / "typo.toml"),
                                     model=str(tiny_model), listen=None))


def _commands(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    out = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                out += _commands(sub)
    return out


def test_every_command_explains_itself_with_an_example() -> None:
    """The --help header read "``forged``: the command line." and several options had
    no help: every command now has a description and an example, every argument a
    help text."""
    commands = _commands(cli.build_parser())
    assert len(commands) >= 15
    for parser in commands:
        assert parser.description, parser.prog
        assert parser.epilog and "example:" in parser.epilog, parser.prog
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            assert action.help, (parser.prog, action.dest)
        assert "``" not in parser.format_help(), parser.prog
