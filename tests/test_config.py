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


def _fake_cpus(root: Path, cores: dict[int, int]) -> None:
    """A sysfs CPU tree: logical CPU -> its core (one package)."""
    for cpu, core in cores.items():
        top = root / f"cpu{cpu}" / "topology"
        top.mkdir(parents=True)
        (top / "physical_package_id").write_text("0\n")
        (top / "core_id").write_text(f"{core}\n")


def test_physical_cores_count_hyperthreads_once(tmp_path: Path) -> None:
    _fake_cpus(tmp_path, {0: 0, 1: 0, 2: 1, 3: 1, 4: 2})
    assert fc.physical_cores([0, 1, 2, 3, 4], tmp_path) == 3
    assert fc.physical_cores([1, 3], tmp_path) == 2
    assert fc.physical_cores([0, 9], tmp_path) == 2  # no topology: a core of its own


def test_threads_default_to_the_workers_share_of_their_cores(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """engine.threads = 0: the physical cores of the workers' CPUs, shared evenly by
    every worker of every model on the same CPUs; a number set is kept."""
    _fake_cpus(tmp_path, {cpu: cpu // 2 for cpu in range(16)})  # 8 cores, 2 threads each
    monkeypatch.setattr(fc, "_SYS_CPU", tmp_path)
    monkeypatch.setattr(fc, "STARTED_ON", frozenset(range(16)))

    def threads(cfg: fc.Config, model: fc.ModelConfig | None = None) -> int:
        return cfg.for_model(model or cfg.model).engine.threads

    def config(engine: dict[str, object] | None = None, server: dict[str, object] | None
               = None, models: list[dict[str, object]] | None = None) -> fc.Config:
        # The door shares the CPUs unless a test says otherwise (the default, "auto",
        # would take a core of these 8: see the test below).
        shared: dict[str, object] = {"door_cpus": []}
        return msgspec.convert({"engine": engine or {}, "models": models or [],
                                "server": shared if server is None else server}, fc.Config)

    assert fc.Config().engine.threads == 0
    assert threads(config()) == 8
    assert threads(config(server={})) == 7  # "auto": the door took a core
    assert threads(config({"workers": 3})) == 2  # 8 cores for 3 workers
    assert threads(config(server={"door_cpus": [0, 1]})) == 7  # the door's core is not theirs
    assert threads(config({"threads": 5, "workers": 3})) == 5  # set: kept
    # A second model on the same CPUs shares them; one with CPUs of its own does not.
    shared = config(models=[{"path": "b.gguf", "engine": {"workers": 2}}])
    assert threads(shared) == 2 and threads(shared, shared.models[0]) == 2
    apart = config(models=[{"path": "b.gguf", "engine": {"cpus": [12, 13, 14, 15]}}])
    assert threads(apart) == 8 and threads(apart, apart.models[0]) == 2
    assert threads(config({"workers": 16})) == 1  # at least one each
    # forged status says why
    assert config({"workers": 3}).threads_why(fc.ModelConfig()) == \
        "engine.threads = 0: 8 physical cores for 3 workers"
    assert config({"threads": 5}).threads_why(fc.ModelConfig()) == "set in the config"


def test_the_door_takes_a_core_of_its_own_from_eight_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """server.door_cpus = "auto" (the default): with at least 8 physical cores the door
    keeps to the core of the lowest CPU forged may use, hyperthreads included, and the
    workers get the rest; with fewer it shares them; a list set is kept."""
    assert fc.Config().server.door_cpus == "auto"
    _fake_cpus(tmp_path, {cpu: cpu % 8 for cpu in range(16)})  # siblings: 0 and 8, ...
    monkeypatch.setattr(fc, "_SYS_CPU", tmp_path)

    def placed(started_on: range, setting: object = "auto") -> tuple[list[int], str, int]:
        monkeypatch.setattr(fc, "STARTED_ON", frozenset(started_on))
        cfg = msgspec.convert({"server": {"door_cpus": setting}}, fc.Config)
        cpus, why = fc.door_placement(cfg.server.door_cpus)
        assert cfg.door_cpus == cpus
        return cpus, why, cfg.for_model(cfg.model).engine.threads

    assert placed(range(16)) == (
        [0, 8], 'server.door_cpus = "auto": one of 8 physical cores', 7)
    # systemd's CPUAffinity= left CPUs 0 and 8 out: the lowest core forged may use
    assert placed(range(1, 16))[0] == [1, 9]
    assert placed(range(4)) == ([], 'server.door_cpus = "auto": 4 physical cores, fewer '
                                    "than 8: the door shares them", 4)
    assert placed(range(16), [3]) == ([3], "set in the config", 8)
    assert placed(range(16), [])[0] == []
