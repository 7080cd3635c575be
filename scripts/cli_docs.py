"""Build forged's man page and bash completion from its argparse parser.

Usage: .venv/bin/python scripts/cli_docs.py OUT_DIR

Writes OUT_DIR/forged.1 (argparse-manpage, with an EXAMPLES section made of every
command's example and the files an admin touches) and OUT_DIR/completions/forged
(shtab). Run at package time by scripts/build-deb.sh with the dev venv, which has both
tools; the package's own virtualenv needs neither.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from forged import __version__
from forged.cli import EXAMPLES

FILES = [
    ("/etc/forged/forged.toml", "the configuration; every key is documented in it"),
    ("/etc/forged/keys.toml", "API keys' hashes, names and limits (forged keys)"),
    ("/etc/forged/tls/", "the self-signed certificate made on first install"),
    ("/run/forged/admin.sock", "the admin listener: forged status, forged model swap"),
    ("/var/lib/forged/", "the state: repository indexes, saved KV states, telemetry"),
    ("/usr/share/forged/prometheus/", "Prometheus scrape job and alert rules"),
    ("/usr/share/forged/grafana/", "the Grafana dashboard"),
    ("/usr/share/forged/haproxy/", "an HAProxy configuration for a pool of nodes"),
]


def roff(text: str) -> str:
    """``text`` as one roff line: backslashes and hyphens escaped, never a request."""
    out = text.replace("\\", "\\e").replace("-", "\\-")
    return "\\&" + out if out.startswith((".", "'")) else out


def sections() -> str:
    """argparse-manpage's --include file: sections named in brackets, roff below."""
    lines = ["[EXAMPLES]"]
    for command, example in EXAMPLES.items():
        lines += [".TP", f"\\fB{roff(command)}\\fR", roff(example)]
    lines.append("[FILES]")
    for path, what in FILES:
        lines += [".TP", f"\\fI{roff(path)}\\fR", roff(what)]
    lines += ["[SEE ALSO]", "systemctl(1), journalctl(1), haproxy(1), promtool(1); "
              "/usr/share/doc/forged/README.md and the guides beside it."]
    return "\n".join(lines) + "\n"


def main(out: Path) -> None:
    (out / "completions").mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".include") as include:
        include.write(sections())
        include.flush()
        subprocess.run([
            sys.executable, "-c", "import sys; from argparse_manpage.cli import main; "
            "sys.exit(main())", "--module", "forged.cli",
            "--function", "build_parser", "--project-name", "forged", "--prog", "forged",
            "--version", __version__, "--manual-title", "forged manual",
            "--description", "serve a local llama.cpp model to an engineering organisation",
            "--author", "the forged developers", "--include", include.name,
            "--output", str(out / "forged.1")], check=True)
    completion = subprocess.run(
        [sys.executable, "-m", "shtab", "--shell=bash", "forged.cli.build_parser"],
        check=True, capture_output=True, text=True).stdout
    (out / "completions" / "forged").write_text(completion)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
