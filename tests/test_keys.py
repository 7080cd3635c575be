"""`forged keys`: add, list, rotate and revoke edit the keys file in place (the daemon's
side, a reload under a live stream, is in test_security)."""

from __future__ import annotations

import grp
import os
from pathlib import Path
from typing import Any

import msgspec
import pytest

from forged import auth, cli
from forged.auth import KeyStore, add_key, hash_key, list_keys, revoke_key, rotate_key
from forged.config import ConfigError


def three_keys(tmp: Path) -> tuple[Path, dict[str, str]]:
    path = tmp / "keys.toml"
    secrets = {"alice": add_key(path, "alice", max_streams=2, max_queued=0,
                                priority="batch")}
    secrets["bob"] = add_key(path, "bob", max_streams=16, max_queued=32,
                             priority="interactive", tenant="t1", repos=["x"])
    with path.open("a") as f:
        f.write("# a note an admin wrote\n")
    secrets["carol"] = add_key(path, "carol", max_streams=4, max_queued=8,
                               priority="interactive", default_repo="x")
    return path, secrets


def test_revoke_removes_one_table_and_keeps_the_rest_as_written(tmp_path: Path) -> None:
    path, secrets = three_keys(tmp_path)
    before = path.read_text()
    revoke_key(path, "bob")
    after = path.read_text()
    assert [e.name for e in list_keys(path)] == ["alice", "carol"]
    assert 'name = "bob"' not in after and "# a note an admin wrote" not in after
    assert after == before.replace(before[before.index("[[key]]\nname = \"bob\""):
                                          before.index("[[key]]\nname = \"carol\"")], "")
    store = KeyStore.load(path)
    assert store.lookup(f"Bearer {secrets['bob']}") is None
    assert store.lookup(f"Bearer {secrets['carol']}") is not None
    assert oct(path.stat().st_mode & 0o777) == "0o640"
    assert [p.name for p in tmp_path.iterdir()] == ["keys.toml"]  # no temporary left


def test_rotate_keeps_name_limits_and_tenant_with_a_new_secret(tmp_path: Path) -> None:
    path, secrets = three_keys(tmp_path)
    old = {e.name: e for e in list_keys(path)}
    new_secret = rotate_key(path, "bob")
    new = {e.name: e for e in list_keys(path)}
    assert new_secret != secrets["bob"] and new_secret.startswith("fgd-")
    assert new["bob"].sha256 == hash_key(new_secret)
    assert new["bob"] == msgspec.structs.replace(old["bob"], sha256=hash_key(new_secret))
    assert {k: v for k, v in new.items() if k != "bob"} == \
        {k: v for k, v in old.items() if k != "bob"}
    assert new_secret not in path.read_text()
    assert "# a note an admin wrote" in path.read_text()
    store = KeyStore.load(path)
    assert store.lookup(f"Bearer {secrets['bob']}") is None
    assert store.lookup(f"Bearer {new_secret}") == new["bob"]


def test_unknown_names_and_missing_files_are_clear_errors(tmp_path: Path) -> None:
    path, _ = three_keys(tmp_path)
    for fn in (revoke_key, rotate_key):
        with pytest.raises(ConfigError, match="no key named 'dave'"):
            fn(path, "dave")
    assert list_keys(tmp_path / "none.toml") == []
    with pytest.raises(ConfigError, match="no key named 'alice'"):
        revoke_key(tmp_path / "none.toml", "alice")


def test_the_cli_lists_without_secrets_and_rotates_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, secrets = three_keys(tmp_path)
    keys = ["--keys-file", str(path)]
    assert cli.main(["keys", "list", *keys]) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines()] == ["NAME", "alice", "bob", "carol"]
    assert "t1" in out and "batch" in out
    assert not any(s in out for s in secrets.values())
    assert cli.main(["keys", "rotate", "alice", *keys]) == 0
    new = capsys.readouterr().out.strip()
    assert KeyStore.load(path).lookup(f"Bearer {new}") is not None
    assert cli.main(["keys", "revoke", "dave", *keys]) == 78
    assert "no key named 'dave'" in capsys.readouterr().err


def test_the_last_key_is_revoked_only_when_asked_to_open_the_api(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    add_key(path, "only", max_streams=1, max_queued=0, priority="batch")
    with pytest.raises(ConfigError, match="last key"):
        revoke_key(path, "only")
    assert [e.name for e in list_keys(path)] == ["only"]
    revoke_key(path, "only", allow_open=True)
    assert not KeyStore.load(path).enabled


def test_tables_spelled_otherwise_are_refused_not_half_edited(tmp_path: Path) -> None:
    path, _ = three_keys(tmp_path)
    text = path.read_text().replace('[[key]]\nname = "carol"', '[[ key ]]\nname = "carol"')
    path.write_text(text)
    assert len(KeyStore.load(path).by_hash) == 3  # valid TOML, and three keys
    for call in (lambda: revoke_key(path, "bob"), lambda: rotate_key(path, "bob"),
                 lambda: list_keys(path)):
        with pytest.raises(ConfigError, match="cannot be edited in place"):
            call()
    assert path.read_text() == text


def test_a_rewrite_keeps_the_mode_whatever_the_umask(tmp_path: Path) -> None:
    path, _ = three_keys(tmp_path)
    path.chmod(0o640)
    old = os.umask(0o077)
    try:
        revoke_key(path, "bob")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o640


@pytest.mark.parametrize(("extra", "named"), [
    (["bad name"], "name"), (["dev", "--max-streams", "0"], "max_streams"),
    (["dev", "--repo", "../x"], "repos")])
def test_a_bad_argument_is_a_clear_error_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str],
        named: str) -> None:
    """These were tracebacks (msgspec.ValidationError)."""
    assert cli.main(["keys", "add", *extra, "--keys-file", str(tmp_path / "k.toml")]) == 78
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err
    assert not (tmp_path / "k.toml").exists()


def test_a_keys_file_it_cannot_write_is_a_clear_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An admin in the forged group (which may read the file) running add or rotate
    without sudo got a PermissionError traceback."""
    path, _ = three_keys(tmp_path)
    real_open = os.open

    def refused(file: Any, flags: int, *args: Any, **kw: Any) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, flags, *args, **kw)

    monkeypatch.setattr(os, "open", refused)
    for argv in (["add", "dave"], ["rotate", "alice"]):
        assert cli.main(["keys", *argv, "--keys-file", str(path)]) == 78
        err = capsys.readouterr().err
        assert str(path) in err and "Permission denied" in err and "Traceback" not in err


def test_a_group_it_cannot_give_the_file_still_prints_the_key(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Not root and not in the forged group: chown failed after the key's hash was
    written, and the key was never shown (and its name taken)."""
    def refused(*args: Any) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "chown", refused)
    monkeypatch.setattr(auth.grp, "getgrnam", lambda name: grp.struct_group(
        ("forged", "x", 4242, [])))
    assert cli.main(["keys", "add", "dev", "--keys-file", str(tmp_path / "k.toml")]) == 0
    key = capsys.readouterr().out.strip()
    assert KeyStore.load(tmp_path / "k.toml").lookup(f"Bearer {key}") is not None


def test_a_keys_file_anyone_may_write_is_refused(tmp_path: Path) -> None:
    """Whoever may write the file may add a hash of their own and get in at the next
    reload: a world-writable file is refused, naming it (as sshd refuses such keys)."""
    path, _ = three_keys(tmp_path)
    path.chmod(0o666)
    with pytest.raises(ConfigError, match=f"{path}.*writable"):
        KeyStore.load(path)
    path.chmod(0o640)
    assert KeyStore.load(path).enabled
