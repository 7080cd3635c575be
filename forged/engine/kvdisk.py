"""The disk tier: sessions' saved KV states as files, kept across restarts and upgrades.

One file per state, under ``server.state_dir/kvcache/worker-N``: a magic line, a
msgpack header (the model's identity, tenant, session, tokens, the state's length and
SHA-256), then the state as ``llama_state_seq_get_data`` wrote it. A file is written
to a temporary name and renamed, so a crash leaves no half file under a real name.

Writes, and the reads that stage a state before its restore, happen in a thread of
their own (:meth:`DiskStore.write_later`, :meth:`DiskStore.read_later`), beside the
decode loop: a step hands them over and never waits on the disk. The caller keeps a
state it handed over until :meth:`DiskStore.finished` says it was written.

A file is trusted only when everything checks out: the magic, the header, the model
identity (the GGUF's size and first and last MiB, llama.cpp's version and the KV
layout flags that change the state's format), the state's length and hash, and, on
restore, the tokens the scheduler matched. Anything else is deleted with a log line
and the request computes its prompt: never a wrong answer.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import sys
import threading
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

import msgspec

from forged.engine.kvtiers import Entry, Read, Tier, Written

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


# How much of a model file its identity reads: the first and last MiB (the header and
# the last tensors) and samples spread between them, so that a fine-tune that left the
# ends alone (its middle layers changed, the same size) is another model.
_ENDS = 1 << 20
_SAMPLES = 32
_SAMPLE = 64 << 10


def model_identity(path: str, *extra: str) -> str:
    """What a saved state is only valid for: this model file's content (its size, its
    ends and samples between them: about 4 MiB read) and ``extra`` (llama.cpp's
    version, KV flags)."""
    h = hashlib.sha256()
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        h.update(f.read(_ENDS))
        for k in range(1, _SAMPLES + 1):
            f.seek(size * k // (_SAMPLES + 1))
            h.update(f.read(_SAMPLE))
        f.seek(max(0, size - _ENDS))
        h.update(f.read(_ENDS))
    h.update(repr((size, *extra)).encode())
    return h.hexdigest()


def _log(message: str) -> None:
    print(f"forged worker: kv cache: {message}", file=sys.stderr, flush=True)


def _unlink(path: Path) -> None:
    """Delete ``path`` if it is there. On a file system remounted read-only (a disk's
    errors), unlink fails with EROFS even for a missing file: logged, never raised,
    so that a disk gone bad costs the disk tier, not the worker."""
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        _log(f"cannot delete {path.name}: {exc}")


# States waiting for the writer thread at most: past it, the caller writes at once (the
# disk is slower than eviction, and the states waiting are held in memory).
WRITES_QUEUED = 8


class DiskStore:
    def __init__(self, root: Path, model: str) -> None:
        self.root = root
        self.model = model
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        # Work for the I/O thread: a state to write, or (None) an entry to read.
        self._todo: queue.Queue[tuple[Entry, bytearray | None]] = queue.Queue(WRITES_QUEUED)
        self._done: queue.SimpleQueue[Written | Read] = queue.SimpleQueue()
        self._waited: list[Written | Read] = []  # taken off _done by wait_done
        self._io: threading.Thread | None = None

    def write_later(self, entry: Entry, state: bytearray) -> bool:
        """Hand ``state`` to the I/O thread; False when its queue is full. The caller
        must not change ``state`` until :meth:`finished` reports it."""
        return self._hand_over(entry, state)

    def read_later(self, entry: Entry) -> bool:
        """Read and check ``entry``'s file in the I/O thread (as :meth:`read`); False
        when its queue is full."""
        return self._hand_over(entry, None)

    def _hand_over(self, entry: Entry, state: bytearray | None) -> bool:
        if self._io is None:
            self._io = threading.Thread(target=self._serve_io, daemon=True,
                                        name="kv-disk-io")
            self._io.start()
        try:
            self._todo.put_nowait((entry, state))
        except queue.Full:
            return False
        return True

    def finished(self) -> list[Written | Read]:
        """The writes and reads that ended since the last call (never blocks)."""
        out, self._waited = self._waited, []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def wait_done(self, timeout: float) -> None:
        """Until a write or read has ended that :meth:`finished` has not returned yet,
        or ``timeout`` seconds."""
        if not self._waited:
            with contextlib.suppress(queue.Empty):
                self._waited.append(self._done.get(timeout=timeout))

    def wait_writes(self) -> None:
        """Until everything handed over has ended (the worker is stopping)."""
        if self._io is not None:
            self._todo.join()

    def _serve_io(self) -> None:
        while True:
            entry, state = self._todo.get()
            try:
                self._done.put(self._io_one(entry, state))
            finally:
                self._todo.task_done()

    def _io_one(self, entry: Entry, state: bytearray | None) -> Written | Read:
        """One write or read; whatever goes wrong is its failure, never the thread's
        end (the step would wait for the rest forever, and a stop for every write)."""
        try:
            if state is None:
                return Read(entry, self.read(entry))
            key, nbytes = self._write_file(entry, state) or ("", 0)
            return Written(entry, key, nbytes)
        except Exception as exc:
            _log(f"cannot {'read' if state is None else 'write'} a session's state: {exc}")
            return Read(entry, None) if state is None else Written(entry, "", 0)

    def scan(self) -> list[Entry]:
        """The valid files' entries, oldest first; invalid ones are deleted."""
        found: list[tuple[int, Entry]] = []
        for path in self.root.glob("*" + _SUFFIX):
            header = self._header(path)
            if header is not None:
                found.append((path.stat().st_mtime_ns, Entry(
                    0, header.tokens, header.tenant, header.session, Tier.DISK,
                    path.stat().st_size, path.stem)))
        for tmp in self.root.glob("*.tmp"):
            _unlink(tmp)  # a write the last run did not finish
        return [e for _, e in sorted(found, key=lambda f: f[0])]

    def write(self, entry: Entry, state: bytearray) -> tuple[str, int] | None:
        """Write ``state`` now: the file's key and size, or None (logged) if it failed.
        The entry is the tiers' to update (Tiers.resized): they account its bytes."""
        return self._write_file(entry, state)

    def _write_file(self, entry: Entry, state: bytearray) -> tuple[str, int] | None:
        """The file's key and size, or None (logged) if it could not be written."""
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
            _unlink(tmp)
            _log(f"cannot write a session's state: {exc}")
            return None
        return key, len(state) + len(header) + len(MAGIC) + _HEADER_LEN

    def read(self, entry: Entry) -> bytearray | None:
        path = self._path(entry.key)
        try:
            with open(path, "rb") as f:
                header = self._parse(f.read(len(MAGIC) + _HEADER_LEN), f, path)
                # One past what the header says (a longer file is damaged too), never
                # more than the file holds (a damaged header may say anything).
                size = min(header.nbytes + 1, os.fstat(f.fileno()).st_size) if header else 0
                state = bytearray(max(0, size))
                got = f.readinto(state)
        except OSError as exc:
            _log(f"{path.name}: cannot read: {exc}")
            return None
        if header is None:
            return None
        del state[got:]
        if header.tokens != entry.tokens or header.tenant != entry.tenant:
            self._reject(path, "its tokens are not what was indexed")
            return None
        if len(state) != header.nbytes or hashlib.sha256(state).hexdigest() != header.sha256:
            self._reject(path, "its state is damaged")
            return None
        return state

    def order(self, entries: Iterable[Entry]) -> None:
        """Times a microsecond apart from now on, in ``entries``' order: ``scan`` orders
        by time, and a stop writes the newest first (Tiers.demote_sessions)."""
        t0 = time.time_ns()
        for i, e in enumerate(x for x in entries if x.key):
            with contextlib.suppress(OSError):  # gone or read-only: only its rank is lost
                os.utime(self._path(e.key), ns=(t0 + 1000 * i, t0 + 1000 * i))

    def remove(self, entry: Entry) -> None:
        if entry.key:
            self.remove_key(entry.key)

    def remove_key(self, key: str) -> None:
        _unlink(self._path(key))

    def _path(self, key: str) -> Path:
        return self.root / (key + _SUFFIX)

    def _header(self, path: Path) -> _Header | None:
        try:
            with open(path, "rb") as f:
                return self._parse(f.read(len(MAGIC) + _HEADER_LEN), f, path)
        except OSError as exc:
            _log(f"{path.name}: cannot read: {exc}")
            return None

    def _parse(self, head: bytes, f: BinaryIO, path: Path) -> _Header | None:
        """The header of the file ``f``, read past ``head`` (its magic and length)."""
        if not head.startswith(MAGIC) or len(head) < len(MAGIC) + _HEADER_LEN:
            self._reject(path, "not a forged KV file")
            return None
        try:
            header = msgspec.msgpack.decode(
                f.read(int.from_bytes(head[len(MAGIC):], "little")), type=_Header)
        except msgspec.DecodeError:
            self._reject(path, "its header is damaged")
            return None
        if header.model != self.model:
            self._reject(path, "saved by another model, llama.cpp version or flash_attn")
            return None
        return header

    def _reject(self, path: Path, why: str) -> None:
        _log(f"{path.name} dropped: {why}")
        _unlink(path)
