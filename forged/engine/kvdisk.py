"""The disk tier: sessions' saved KV states as files, kept across restarts and upgrades.

One file per state, under ``server.state_dir/kvcache/worker-N``: a magic line, a
msgpack header (the model's identity, tenant, session, tokens, the state's length and
SHA-256), then the state as ``llama_state_seq_get_data`` wrote it. A file is written
to a temporary name and renamed, so a crash leaves no half file under a real name.

A file is trusted only when everything checks out: the magic, the header, the model
identity (the GGUF's size and first and last MiB, llama.cpp's version and the KV
layout flags that change the state's format), the state's length and hash, and, on
restore, the tokens the scheduler matched. Anything else is deleted with a log line
and the request computes its prompt: never a wrong answer.
"""

from __future__ import annotations

import hashlib
import os
import sys
import uuid
from pathlib import Path

import msgspec

from forged.engine.kvtiers import Entry, Tier

MAGIC = b"forged-kv 1\n"
_SUFFIX = ".kv"
_HEADER_LEN = 4  # bytes of the header's length, little-endian


class _Header(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: str
    tenant: str
    session: str | None
    tokens: list[int]
    nbytes: int
    sha256: str


def model_identity(path: str, *extra: str) -> str:
    """What a saved state is only valid for: this model file's content (its size and
    its first and last MiB, which hold the header and the last tensors) and ``extra``
    (llama.cpp's version, KV flags)."""
    h = hashlib.sha256()
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    h.update(repr((size, *extra)).encode())
    return h.hexdigest()


def _log(message: str) -> None:
    print(f"forged worker: kv cache: {message}", file=sys.stderr, flush=True)


class DiskStore:
    def __init__(self, root: Path, model: str) -> None:
        self.root = root
        self.model = model
        root.mkdir(parents=True, exist_ok=True, mode=0o700)

    def scan(self) -> list[Entry]:
        """The valid files' entries, oldest first; invalid ones are deleted."""
        found: list[tuple[float, Entry]] = []
        for path in self.root.glob("*" + _SUFFIX):
            header = self._header(path)
            if header is not None:
                found.append((path.stat().st_mtime, Entry(
                    0, header.tokens, header.tenant, header.session, Tier.DISK,
                    path.stat().st_size, path.stem)))
        for tmp in self.root.glob("*.tmp"):
            tmp.unlink(missing_ok=True)  # a write the last run did not finish
        return [e for _, e in sorted(found, key=lambda f: f[0])]

    def write(self, entry: Entry, state: bytes) -> bool:
        header = msgspec.msgpack.encode(_Header(
            self.model, entry.tenant, entry.session, entry.tokens, len(state),
            hashlib.sha256(state).hexdigest()))
        key = uuid.uuid4().hex
        tmp = self.root / (key + ".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC + len(header).to_bytes(_HEADER_LEN, "little") + header)
                f.write(state)
                f.flush()
                os.fsync(f.fileno())
            tmp.rename(self._path(key))
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            _log(f"cannot write a session's state: {exc}")
            return False
        entry.key, entry.nbytes = key, len(state) + len(header) + len(MAGIC) + _HEADER_LEN
        return True

    def read(self, entry: Entry) -> bytes | None:
        path = self._path(entry.key)
        try:
            data = path.read_bytes()
        except OSError as exc:
            _log(f"{path.name}: cannot read: {exc}")
            return None
        header, state = self._parse(data, path)
        if header is None:
            return None
        if header.tokens != entry.tokens or header.tenant != entry.tenant:
            self._reject(path, "its tokens are not what was indexed")
            return None
        if len(state) != header.nbytes or hashlib.sha256(state).hexdigest() != header.sha256:
            self._reject(path, "its state is damaged")
            return None
        return state

    def remove(self, entry: Entry) -> None:
        if entry.key:
            self._path(entry.key).unlink(missing_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / (key + _SUFFIX)

    def _header(self, path: Path) -> _Header | None:
        try:
            with open(path, "rb") as f:
                head = f.read(len(MAGIC) + _HEADER_LEN)
                size = int.from_bytes(head[len(MAGIC):], "little")
                data = head + f.read(size)
        except OSError as exc:
            _log(f"{path.name}: cannot read: {exc}")
            return None
        return self._parse(data, path)[0]

    def _parse(self, data: bytes, path: Path) -> tuple[_Header | None, bytes]:
        start = len(MAGIC) + _HEADER_LEN
        if not data.startswith(MAGIC) or len(data) < start:
            self._reject(path, "not a forged KV file")
            return None, b""
        end = start + int.from_bytes(data[len(MAGIC):start], "little")
        try:
            header = msgspec.msgpack.decode(data[start:end], type=_Header)
        except msgspec.DecodeError:
            self._reject(path, "its header is damaged")
            return None, b""
        if header.model != self.model:
            self._reject(path, "saved by another model or llama.cpp version")
            return None, b""
        return header, data[end:]

    def _reject(self, path: Path, why: str) -> None:
        _log(f"{path.name} dropped: {why}")
        path.unlink(missing_ok=True)
