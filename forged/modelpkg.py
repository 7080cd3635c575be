"""``forged model package``: any GGUF as a model .deb.

The package installs the GGUF under ``/usr/share/forged/models/<id>/`` and its
[[models]] table as a drop-in, ``/etc/forged/models.d/<id>.toml`` (a conffile: an
admin's edits survive upgrades). Its maintainer scripts reload a running daemon, which then adds
the model under live traffic, swaps it on an upgrade, and withdraws it on removal
(the drop-in stays until purged, and is skipped while its GGUF is gone). With
``--no-config`` it installs the GGUF only: a model that forged.toml's [model] names,
as the default model's package does.

The GGUF is checked first as the daemon would load it (header, vocabulary, chat
template, and the role: FIM tokens for "fim", pooling for "embed"), and the engine
settings as the daemon would read them. Built with ``dpkg-deb`` alone, so that it
runs on the appliance itself.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from forged import config as fc
from forged.daemon.startup import gguf_header_problem, role_problem

if TYPE_CHECKING:
    from forged.engine.prompts import Prompter

MODELS_DIR = "/usr/share/forged/models"
DROP_IN_DIR = "/etc/forged/models.d"
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")


class PackageError(Exception):
    """A package that was not built; ``str()`` says why, in one line."""


@dataclass(frozen=True)
class Spec:
    gguf: Path
    model_id: str
    version: str = "1.0"
    aliases: list[str] = field(default_factory=list)
    role: str = ""  # empty: detected by the daemon from the GGUF
    engine: dict[str, Any] = field(default_factory=dict)
    drop_in: bool = True
    maintainer: str = "forged administrators <root@localhost>"

    @property
    def slug(self) -> str:
        """The id in Debian's rules for a package name: lower case, digits, ``+-.``."""
        return re.sub(r"[^a-z0-9+.-]+", "-", self.model_id.lower())

    @property
    def package(self) -> str:
        return f"forged-model-{self.slug}"

    @property
    def drop_in_path(self) -> str:
        return f"{DROP_IN_DIR}/{self.slug}.toml"

    @property
    def installed_path(self) -> str:
        """A model with a table of its own has a folder of its own: one GGUF packaged
        twice (as chat and as fim, say) is two packages' files, which dpkg refuses to
        install at one path. A file for [model] goes where forged.toml names it."""
        folder = f"{MODELS_DIR}/{self.slug}" if self.drop_in else MODELS_DIR
        return f"{folder}/{self.gguf.name}"

    @property
    def table(self) -> fc.ModelConfig:
        """Its [[models]] table, as the daemon will read it."""
        return msgspec.convert({"path": self.installed_path, "name": self.model_id,
                                "aliases": self.aliases, "role": self.role,
                                "engine": self.engine}, fc.ModelConfig)


def parse_settings(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs of [engine] keys; a value is read as TOML (``4``, ``true``,
    ``"unified"``), or else as a string (``unified``)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise PackageError(f"--engine {pair!r}: expected KEY=VALUE")
        try:
            out[key.strip()] = msgspec.toml.decode(f"v = {value}")["v"]
        except msgspec.DecodeError:
            out[key.strip()] = value
    return out


def check(spec: Spec) -> str:
    """The role the model will serve as; PackageError if the daemon would refuse it."""
    if not _ID.match(spec.model_id):
        raise PackageError(f"--id {spec.model_id!r}: letters, digits and ._:- only")
    try:
        fc.check_model_engine(Path(spec.drop_in_path), "models[0]", fc.Config(),
                              spec.table)
    except (fc.ConfigError, msgspec.ValidationError) as exc:
        raise PackageError(str(exc)) from exc
    prompter = _load(spec)
    try:
        role = spec.role or ("embed" if prompter.embedding else
                             "fim" if prompter.fim is not None else "chat")
        if why := role_problem(role, prompter.embedding, prompter.fim is not None):
            raise PackageError(f"{spec.gguf}: --role {role}, but it {why}")
        return role
    finally:
        prompter.close()


def _load(spec: Spec) -> Prompter:
    """Its vocabulary and chat template, as the daemon loads them."""
    import jinja2

    from forged.engine.backend import BackendError
    from forged.engine.prompts import Prompter

    try:
        problem = gguf_header_problem(spec.gguf)
    except OSError as exc:
        problem = f"cannot read: {exc.strerror or exc}"
    if problem is not None:
        raise PackageError(f"{spec.gguf}: {problem}")
    try:
        return Prompter(str(spec.gguf))
    except BackendError as exc:
        raise PackageError(f"{spec.gguf}: llama.cpp cannot load it (a damaged or "
                           "unsupported GGUF file)") from exc
    except jinja2.TemplateError as exc:
        raise PackageError(f"{spec.gguf}: its chat template: {exc}".replace("\n", " ")
                           ) from exc


def drop_in(spec: Spec) -> str:
    """The drop-in's text: the table, with what installed it."""
    table = msgspec.to_builtins(spec.table)
    lines = [f"# Installed by {spec.package} (`forged model package`). Edits are kept on",
             "# upgrades (a conffile); `systemctl reload forged` applies them.",
             "[[models]]"]
    lines += [f"{key} = {toml_value(table[key])}" for key in ("path", "name", "aliases")]
    if spec.role:
        lines.append(f"role = {toml_value(spec.role)}")
    if spec.engine:
        lines += ["[models.engine]", *(f"{k} = {toml_value(v)}"
                                       for k, v in spec.engine.items())]
    return "\n".join(lines) + "\n"


def toml_value(value: Any) -> str:
    """``value`` (a string, number, boolean or list of them) as TOML writes it. JSON's
    text is TOML's but for two: an infinite or NaN float, which JSON writes Infinity
    and NaN (``--engine first_token_weight=inf``, the documented default, made a
    drop-in the daemon could not read), and a character past U+FFFF, which JSON
    escapes as a surrogate pair TOML refuses (an emoji in an alias or file name)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"
    if isinstance(value, list):
        return "[" + ", ".join(map(toml_value, value)) + "]"
    if isinstance(value, str):  # TOML wants DEL escaped too; JSON leaves it raw
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    return json.dumps(value)


_RELOAD = """\
if [ -d /run/systemd/system ]; then
    # A running daemon applies the change under live traffic ({what}); a stopped
    # one reads it when it starts.
    deb-systemd-invoke try-reload-or-restart forged.service >/dev/null 2>&1 || true
fi
"""


def _scripts(spec: Spec) -> dict[str, str]:
    post = ("#!/bin/sh\nset -e\nif [ \"$1\" = configure ]; then\n" + _indent(_RELOAD.format(
        what="an install adds the model, an upgrade swaps it")) + "fi\nexit 0\n")
    scripts = {"postinst": post}
    if spec.drop_in:
        # On removal the GGUF is gone and the drop-in (a conffile) stays, skipped.
        scripts["postrm"] = ("#!/bin/sh\nset -e\nif [ \"$1\" = remove ]; then\n" + _indent(
            _RELOAD.format(what="the model is withdrawn, its streams drained"))
            + "fi\nexit 0\n")
    return scripts


def _modes(root: Path) -> None:
    """Folders 0755 and files 0644 (scripts 0755), whatever the builder's umask: the
    daemon's user must read the GGUF and the table, and the temporary folder that is
    the package's root is 0700."""
    for path in [root, *root.rglob("*")]:
        if path.is_dir():
            path.chmod(0o755)
        elif path.parent.name != "DEBIAN" or path.name in ("conffiles", "control"):
            path.chmod(0o644)


def _indent(text: str) -> str:
    return "".join(f"    {line}\n" if line else "\n" for line in text.splitlines())


def _control(spec: Spec, role: str, size_kib: int) -> str:
    served = f'served as "{spec.model_id}"' if spec.drop_in else \
        "for the [model] table of /etc/forged/forged.toml"
    return (f"Package: {spec.package}\nVersion: {spec.version}\nArchitecture: all\n"
            f"Maintainer: {spec.maintainer}\nInstalled-Size: {size_kib}\n"
            "Section: misc\nPriority: optional\nEnhances: forged\n"
            f"Description: {spec.model_id} ({role}) model for forged\n"
            f" The GGUF model {spec.installed_path}, {served}.\n"
            " Built by `forged model package`.\n")


def build(spec: Spec, out_dir: Path) -> tuple[Path, str]:
    """Check ``spec``, then write ``<package>_<version>_all.deb`` into ``out_dir``;
    the package's path and the model's role."""
    if shutil.which("dpkg-deb") is None:
        raise PackageError("dpkg-deb is not installed (Debian's dpkg package)")
    role = check(spec)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="forged-package-", dir=out_dir) as tmp:
        root = Path(tmp)
        installed = root / spec.installed_path.lstrip("/")
        installed.parent.mkdir(parents=True)
        shutil.copyfile(spec.gguf, installed)
        meta = root / "DEBIAN"
        meta.mkdir()
        if spec.drop_in:
            conf = root / spec.drop_in_path.lstrip("/")
            conf.parent.mkdir(parents=True)
            conf.write_text(drop_in(spec))
            (meta / "conffiles").write_text(f"{spec.drop_in_path}\n")
        for name, text in _scripts(spec).items():
            (meta / name).write_text(text)
            (meta / name).chmod(0o755)
        size = sum(p.stat().st_size for p in root.rglob("*")
                   if p.is_file() and meta not in p.parents)
        (meta / "control").write_text(_control(spec, role, -(-size // 1024)))
        _modes(root)
        deb = out_dir / f"{spec.package}_{spec.version}_all.deb"
        # Uncompressed: quantized weights barely compress, and xz would take minutes
        # for a model of gigabytes.
        done = subprocess.run(["dpkg-deb", "--root-owner-group", "-Znone", "--build",
                               str(root), str(deb)], capture_output=True, text=True,
                              timeout=3600)
        if done.returncode != 0:
            raise PackageError(f"dpkg-deb failed: {done.stderr.strip()}")
    return deb, role
