"""Start-up checks of the model file, so that a bad one is a config error (exit 78).

A file that is not a model is not a transient fault: under ``Restart=on-failure`` a
plain exit 1 would restart forever, while 78 (EX_CONFIG) is in the unit's
``RestartPreventExitStatus=``. Two levels, both cheap:

* :func:`check_gguf_header` reads the first 24 bytes: GGUF's magic, a version that
  llama.cpp reads (2 or 3) and tensor and metadata counts that fit in the file.
* :func:`open_prompter` loads the vocabulary only (what the daemon needs anyway, and
  what ``check-config`` does too), which parses every metadata entry. A failure there
  names the file and the config key.

Error handling: both raise :class:`~forged.config.ConfigError`, one line, naming the
config file, the key and the model file.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import TYPE_CHECKING

from forged import config as fc

if TYPE_CHECKING:
    from forged.engine.prompts import Prompter

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
# The smallest metadata entry (key length, a one-byte key, type, a one-byte value) and
# tensor description (name length, a one-byte name, n_dims, one dim, type, offset).
_MIN_KV, _MIN_TENSOR = 8 + 1 + 4 + 1, 8 + 1 + 4 + 8 + 4 + 8


def gguf_header_problem(path: Path) -> str | None:
    """What is wrong with ``path``'s GGUF header, or None if it looks like a model."""
    with open(path, "rb") as f:
        head = f.read(24)
        size = f.seek(0, 2)
    if len(head) < 24 or head[:4] != _MAGIC:
        return "not a GGUF model file (no GGUF header)"
    version, tensors, kvs = struct.unpack("<IQQ", head[4:])
    if version not in _VERSIONS:
        return f"GGUF version {version} is not supported (only {_VERSIONS})"
    if tensors * _MIN_TENSOR + kvs * _MIN_KV > size - 24:
        return (f"a damaged GGUF file: its header announces {tensors} tensors and "
                f"{kvs} metadata entries, more than its {size} bytes can hold")
    return None


def model_key(place: int) -> str:
    """The config table of the model in ``place``: [model], then [[models]]."""
    return "model" if place == 0 else f"models[{place - 1}]"


def named_path(config_path: Path | str, key: str, path: str, *, given: bool = False) -> str:
    """How an error names a model file: after the config key that names it; or alone,
    when ``given`` to ``forged model swap``: no config file names it, and a missing
    file read as a fault of the config (``/etc/forged/forged.toml: model.path: ...``)."""
    return path if given else f"{config_path}: {key}.path: {path}"


def check_gguf_header(config_path: Path | str, model: fc.ModelConfig,
                      key: str = "model", *, given: bool = False) -> None:
    try:
        problem = gguf_header_problem(Path(model.path))
    except OSError as exc:
        problem = f"cannot read: {exc.strerror or exc}"
    if problem is not None:
        raise fc.ConfigError(f"{named_path(config_path, key, model.path, given=given)}: "
                             f"{problem}")


def open_prompter(config_path: Path | str, model: fc.ModelConfig,
                  key: str = "model", *, given: bool = False) -> Prompter:
    """Check the model file's header, then load its vocabulary and chat template; a
    file llama.cpp cannot load, or a template that does not compile, is a config
    error (``given``: see named_path). Its caller closes it (it is a context manager)
    or hands it on."""
    import jinja2  # here, with llama.cpp: the header check stays light to import

    from forged.engine.backend import BackendError
    from forged.engine.prompts import Prompter

    check_gguf_header(config_path, model, key, given=given)
    named = named_path(config_path, key, model.path, given=given)
    try:
        prompter = Prompter(model.path, model.chat_template)
    except BackendError as exc:
        raise fc.ConfigError(f"{named}: llama.cpp cannot load it (a damaged or "
                             "unsupported GGUF file)") from exc
    except jinja2.TemplateError as exc:
        where = f"{config_path}: {key}.chat_template" if model.chat_template else \
            f"{named}: its chat template"
        raise fc.ConfigError(f"{where}: {exc}".replace("\n", " ")) from exc
    if why := role_problem(model.role, prompter.embedding):
        prompter.close()  # not handed on
        raise fc.ConfigError(f"{config_path}: {key}.role: \"{model.role}\", but "
                             f"{model.path} {why}")
    return prompter


def role_problem(role: str, embedding: bool, fim: bool = True) -> str:
    """Why a model cannot serve as ``role`` (empty: it can). An embedding model serves
    embeddings only, and only it does. ``fim``: whether it has FIM tokens (the
    daemon serves a "fim" model without them, with a 400 for each FIM request; a
    package refuses it)."""
    if role == "embed" and not embedding:
        return "pools nothing: it is not an embedding model"
    if embedding and role not in ("", "embed"):
        return "is an embedding model: it makes embeddings only"
    if role == "fim" and not fim:
        return "has no fill-in-the-middle tokens"
    return ""
