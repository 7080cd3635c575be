"""`forged model package`: a GGUF as a model .deb (issue 35). The package's contents
are checked with dpkg-deb, and its drop-in through the daemon's own config loader;
installing one beside a running daemon is in the package test (test_package.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from forged import cli
from forged import config as fc


def _package(tmp_path: Path, gguf: Path, *flags: str) -> int:
    return cli.main(["model", "package", str(gguf), "--out", str(tmp_path / "out"), *flags])


def _dpkg_deb(*args: str) -> str:
    return subprocess.run(["dpkg-deb", *args], check=True, capture_output=True, text=True,
                          timeout=60).stdout


def test_a_fim_model_becomes_a_package_whose_drop_in_the_daemon_reads(
        tmp_path: Path, fim_model: Path, tiny_model: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    assert _package(tmp_path, fim_model, "--id", "Coder:1.5b", "--alias", "fim",
                    "--role", "fim", "--engine", "slots=4", "--engine", "max_running=4",
                    "--engine", "kv_layout=unified", "--version", "2.1") == 0
    deb = tmp_path / "out" / "forged-model-coder-1.5b_2.1_all.deb"
    assert str(deb) in capsys.readouterr().out
    fields = _dpkg_deb("-f", str(deb), "Package", "Version", "Architecture", "Enhances")
    assert fields.split("\n")[:4] == ["Package: forged-model-coder-1.5b", "Version: 2.1",
                                      "Architecture: all", "Enhances: forged"]
    files = _dpkg_deb("-c", str(deb))
    assert "./usr/share/forged/models/coder-1.5b/tiny-fim.gguf" in files
    assert "./etc/forged/models.d/coder-1.5b.toml" in files
    # Root's, and readable by the daemon's user whatever the builder's umask.
    modes = {line.split()[-1]: line.split()[:2] for line in files.splitlines()}
    assert modes["./usr/share/forged/models/coder-1.5b/tiny-fim.gguf"] == ["-rw-r--r--",
                                                                    "root/root"]
    assert {m[0] for p, m in modes.items() if p.endswith("/")} == {"drwxr-xr-x"}
    meta = tmp_path / "meta"
    _dpkg_deb("-e", str(deb), str(meta))
    assert (meta / "conffiles").read_text() == "/etc/forged/models.d/coder-1.5b.toml\n"
    assert "try-reload-or-restart forged" in (meta / "postinst").read_text()
    assert "try-reload-or-restart forged" in (meta / "postrm").read_text()
    # The drop-in, with the package's files where they would be, read by the daemon.
    root = tmp_path / "root"
    _dpkg_deb("-x", str(deb), str(root))
    drop_in = (root / "etc/forged/models.d/coder-1.5b.toml").read_text()
    config = tmp_path / "etc" / "forged.toml"
    fc.drop_in_dir(config).mkdir(parents=True)
    config.write_text(f'[model]\npath = "{tiny_model}"\n')
    (fc.drop_in_dir(config) / "coder-1.5b.toml").write_text(
        drop_in.replace("/usr/share", f"{root}/usr/share"))
    (model,) = fc.load(config).models
    assert (model.model_id, model.aliases, model.role) == ("Coder:1.5b", ["fim"], "fim")
    assert model.engine == {"slots": 4, "max_running": 4, "kv_layout": "unified"}
    assert (root / "usr/share/forged/models/coder-1.5b/tiny-fim.gguf").read_bytes() == \
        fim_model.read_bytes()


def test_the_drop_in_is_toml_whatever_its_values(tmp_path: Path, tiny_model: Path) -> None:
    # first_token_weight's default is inf, which JSON writes Infinity; an emoji is a
    # surrogate pair in JSON's escapes: TOML takes neither, and the daemon read nothing.
    assert _package(tmp_path, tiny_model, "--id", "chat-b", "--alias", "llama-\U0001f999",
                    "--engine", "first_token_weight=inf", "--engine", "target_step_ms=250.5",
                    "--engine", "cpus=[0]") == 0
    root = tmp_path / "root"
    _dpkg_deb("-x", str(tmp_path / "out" / "forged-model-chat-b_1.0_all.deb"), str(root))
    config = tmp_path / "etc" / "forged.toml"
    fc.drop_in_dir(config).mkdir(parents=True)
    config.write_text(f'[model]\npath = "{tiny_model}"\n')
    (fc.drop_in_dir(config) / "chat-b.toml").write_text(
        (root / "etc/forged/models.d/chat-b.toml").read_text().replace("/usr/share",
                                                                     f"{root}/usr/share"))
    (model,) = fc.load(config).models
    assert model.aliases == ["llama-\U0001f999"]
    assert model.engine == {"first_token_weight": float("inf"), "target_step_ms": 250.5,
                            "cpus": [0]}


def test_one_gguf_packaged_twice_installs_side_by_side(tmp_path: Path, fim_model: Path) -> None:
    """A coder as chat and as fim: both packages installed its file at one path, and
    dpkg refused the second ("trying to overwrite ..., which is also in package")."""
    assert _package(tmp_path, fim_model, "--id", "coder", "--role", "chat") == 0
    assert _package(tmp_path, fim_model, "--id", "coder-fim", "--role", "fim") == 0
    listed = [{line.split()[-1] for line in _dpkg_deb("-c", str(
        tmp_path / "out" / f"forged-model-{name}_1.0_all.deb")).splitlines()
        if not line.split()[-1].endswith("/")} for name in ("coder", "coder-fim")]
    assert not listed[0] & listed[1]
    assert "./usr/share/forged/models/coder-fim/tiny-fim.gguf" in listed[1]


def test_the_default_model_s_package_installs_the_file_only(
        tmp_path: Path, tiny_model: Path) -> None:
    assert _package(tmp_path, tiny_model, "--no-config") == 0
    deb = tmp_path / "out" / "forged-model-tiny_1.0_all.deb"
    files = _dpkg_deb("-c", str(deb))
    assert "models.d" not in files
    assert "./usr/share/forged/models/tiny.gguf" in files  # where [model] names it
    meta = tmp_path / "meta"
    _dpkg_deb("-e", str(deb), str(meta))
    # An upgrade's new file is swapped in by the reload; a removal changes nothing.
    assert (meta / "postinst").exists() and not (meta / "postrm").exists()
    assert not (meta / "conffiles").exists()


@pytest.mark.parametrize(("model", "flags", "message"), [
    ("tiny", ["--role", "fim"], "--role fim, but it has no fill-in-the-middle tokens"),
    ("tiny", ["--role", "embed"], "--role embed, but it pools nothing"),
    ("bert", ["--role", "chat"], "--role chat, but it is an embedding model"),
    ("tiny", ["--engine", "slotz=1"], "models[0].engine.slotz: unknown key"),
    ("tiny", ["--engine", "slots=0"], "models[0].engine.slots: Expected `int` >= 1"),
    ("tiny", ["--engine", "slots"], "expected KEY=VALUE"),
    ("tiny", ["--id", "my model"], "letters, digits"),
    ("text", [], "not a GGUF model file"),
])
def test_a_model_the_daemon_would_refuse_is_not_packaged(
        tmp_path: Path, tiny_model: Path, tiny_bert: Path, model: str, flags: list[str],
        message: str, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "notes.gguf"
    text.write_text("not a model\n" * 10)
    gguf = {"tiny": tiny_model, "bert": tiny_bert, "text": text}[model]
    assert _package(tmp_path, gguf, *flags) == 1
    assert message in capsys.readouterr().err
    assert not list((tmp_path / "out").glob("*.deb"))
