"""forged's maintainer scripts run against a temporary root, without dpkg or a container.

The scripts prefix every path they make or remove with ``$DPKG_ROOT`` (dpkg's own
variable for a root other than /), so a test can point them at a temp dir. Commands the
host cannot run as the package would (``chgrp forged``: no such group here; ``hostname``:
the host's own name) are fakes first on PATH. The whole life cycle in a booted system is
tests/test_package.py's.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT

DEBIAN = ROOT / "packaging" / "debian"
# An Azure VM's name: its FQDN is past X.509's 64-character bound for a CN.
LONG_FQDN = "forged-node-0123456789.abcdefghijklmnopqrstuvwxyz.bx.internal.cloudapp.net"


def fake(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A root with the forged package's conffile unpacked, as dpkg leaves it before
    postinst configure."""
    (tmp_path / "root" / "etc" / "forged").mkdir(parents=True)
    (tmp_path / "root" / "etc" / "forged" / "forged.toml").write_text("# the conffile\n")
    return tmp_path / "root"


@pytest.fixture
def fakes(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    short = LONG_FQDN.split(".")[0]
    fake(bin_dir, "hostname", f'[ "$1" = -f ] && echo {LONG_FQDN} || echo {short}')
    fake(bin_dir, "chgrp", "exit 0")
    return bin_dir


def maintscript(name: str, root: Path, fakes: Path, *args: str) -> subprocess.CompletedProcess[str]:
    script = DEBIAN / name
    # This runs as root in CI: a script whose paths are not all under $DPKG_ROOT would
    # change the host's /etc.
    code = [line for line in script.read_text().splitlines() if not line.lstrip().startswith("#")]
    assert not [line for line in code if "/etc/" in line.replace("$DPKG_ROOT/etc/", "")]
    env = {**os.environ, "DPKG_ROOT": str(root), "PATH": f"{fakes}:{os.environ['PATH']}"}
    return subprocess.run(["sh", str(script), *args], env=env, capture_output=True, text=True,
                          timeout=120, check=False)


def x509(cert: Path, *what: str) -> str:
    return subprocess.run(["openssl", "x509", "-in", str(cert), "-noout", *what], check=True,
                          capture_output=True, text=True, timeout=30).stdout


def test_first_install_makes_the_pair_when_the_fqdn_is_longer_than_a_cn(
        root: Path, fakes: Path) -> None:
    assert len(LONG_FQDN) > 64
    done = maintscript("forged.postinst", root, fakes, "configure", "")
    assert done.returncode == 0, done.stderr
    tls = root / "etc" / "forged" / "tls"
    assert sorted(p.name for p in tls.iterdir()) == ["forged.crt", "forged.key"]
    assert stat.S_IMODE((tls / "forged.key").stat().st_mode) == 0o640
    assert stat.S_IMODE((tls / "forged.crt").stat().st_mode) == 0o644
    assert x509(tls / "forged.crt", "-subject").strip() == "subject=CN = forged-node-0123456789"
    # Clients match the subjectAltName: the full name is there.
    assert f"DNS:{LONG_FQDN}" in x509(tls / "forged.crt", "-ext", "subjectAltName")
    assert "localhost" in x509(tls / "forged.crt", "-ext", "subjectAltName")


def test_a_failed_openssl_leaves_neither_file_and_the_next_configure_makes_both(
        root: Path, fakes: Path) -> None:
    # openssl as it fails on a name it refuses: the key written, then no certificate.
    fake(fakes, "openssl", 'while [ $# -gt 0 ]; do [ "$1" = -keyout ] && echo k > "$2"; '
                           "shift; done; exit 1")
    done = maintscript("forged.postinst", root, fakes, "configure", "")
    assert done.returncode == 0, done.stderr
    tls = root / "etc" / "forged" / "tls"
    assert not (tls / "forged.key").exists() and not (tls / "forged.crt").exists()
    (fakes / "openssl").unlink()
    done = maintscript("forged.postinst", root, fakes, "configure", "")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tls.iterdir()) == ["forged.crt", "forged.key"]


def installed(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


# What forged's postinst and tools leave (dpkg has removed forged.toml, its conffile,
# before postrm purge).
FORGED_MADE = {"etc/forged/tls/forged.key": "k", "etc/forged/tls/forged.crt": "c",
               "etc/forged/keys.toml": "[[key]]\n", "var/lib/forged/kvcache/x": "state"}


def test_purge_keeps_a_model_package_s_table(root: Path, fakes: Path) -> None:
    (root / "etc" / "forged" / "forged.toml").unlink()
    installed(root, {**FORGED_MADE, "etc/forged/models.d/minilm.toml": "[[models]]\n"})
    done = maintscript("forged.postrm", root, fakes, "purge")
    assert done.returncode == 0, done.stderr
    # forged-model-minilm's conffile: deleted here, dpkg would never bring it back.
    assert (root / "etc" / "forged" / "models.d" / "minilm.toml").read_text() == "[[models]]\n"
    left = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert left == ["etc/forged/models.d/minilm.toml"]
    assert not (root / "var" / "lib" / "forged").exists()


def test_purge_removes_forged_s_files_and_then_its_empty_folders(root: Path,
                                                                   fakes: Path) -> None:
    (root / "etc" / "forged" / "forged.toml").unlink()
    installed(root, FORGED_MADE)
    (root / "etc" / "forged" / "models.d").mkdir()
    done = maintscript("forged.postrm", root, fakes, "purge")
    assert done.returncode == 0, done.stderr
    assert not (root / "etc" / "forged").exists()
    assert not (root / "var" / "lib" / "forged").exists()
    # A remove (not a purge) leaves everything.
    installed(root, FORGED_MADE)
    done = maintscript("forged.postrm", root, fakes, "remove")
    assert done.returncode == 0, done.stderr
    assert all((root / name).is_file() for name in FORGED_MADE)
