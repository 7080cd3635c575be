"""The man page and the bash completion the package ships, built as scripts/build-deb.sh
builds them: every command is in the page with its example, groff renders it without a
warning, and bash completes commands and subcommands from the completion."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from forged import cli
from tests.conftest import ROOT
from tests.test_config import _commands


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cli")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "cli_docs.py"), str(out)],
                   check=True, timeout=120)
    return out


def test_the_man_page_has_every_command_and_example(built: Path) -> None:
    r = subprocess.run(["groff", "-man", "-Tutf8", "-ww", "-P-c", "-P-b", "-P-u",
                        str(built / "forged.1")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    page = " ".join(re.sub("\u2010\n\\s*", "", r.stdout).split())  # joined, unhyphenated
    for parser in _commands(cli.build_parser()):
        assert f"COMMAND '{parser.prog}'" in page or parser.prog == "forged", parser.prog
    for command, example in cli.EXAMPLES.items():
        assert f"{command} {' '.join(example.split())}" in page, command
    assert "/etc/forged/keys.toml" in page and "SEE ALSO" in page


def complete(built: Path, line: str) -> list[str]:
    """What bash offers for ``line`` (the last word partial), from the completion."""
    words = line.split(" ")
    script = (f"source {built / 'completions' / 'forged'}; COMP_WORDS=({line}); "
              f"COMP_CWORD={len(words) - 1}; COMP_LINE='{line}'; COMP_POINT={len(line)}; "
              "_shtab_forged; printf '%s\\n' \"${COMPREPLY[@]}\"")
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30,
                       check=True)
    return sorted(w.strip() for w in r.stdout.split("\n") if w.strip())


def test_bash_completes_commands_and_subcommands(built: Path) -> None:
    assert complete(built, "forged ke") == ["keys"]
    assert complete(built, "forged keys r") == ["revoke", "rotate"]
    assert "--max-streams" in complete(built, "forged keys add --max")
