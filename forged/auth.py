"""API keys: stored as SHA-256 hashes with a name and per-key limits.

The keys file (``auth.keys_file``, by default ``/etc/forged/keys.toml``, mode 0640,
root:forged) holds one ``[[key]]`` table per key. ``forged keys add NAME`` writes
one and prints the key once; only its hash is ever stored. ``forged keys list``,
``rotate NAME`` (a new secret, same name and limits) and ``revoke NAME`` edit the file
in place, keeping its other text, and a reload applies them. With no key configured
the API is open (the daemon logs a warning); with any key, every ``/v1/`` request
needs ``Authorization: Bearer <key>``.

Keys are high-entropy random strings, so an unsalted SHA-256 is enough: the hash
cannot be reversed, and lookups by hash take the same time for every wrong key.
"""

from __future__ import annotations

import grp
import hashlib
import os
import re
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import msgspec

from forged.config import ConfigError, Priority

KEY_PREFIX = "fgd-"
# An index's name, as `forged index add` accepts it.
RepoName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]


class KeyEntry(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.@-]+$")]
    sha256: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]
    # Requests of this key generating at once; more get 429.
    max_streams: Annotated[int, msgspec.Meta(ge=1)] = 16
    # Requests of this key waiting for a slot; more get 429.
    max_queued: Annotated[int, msgspec.Meta(ge=0)] = 32
    priority: Priority = "interactive"
    # Keys of one tenant share the prefix cache (what one sent may show in another's
    # cached_tokens); keys of different tenants never do. By default all keys are one
    # tenant, as one organisation is.
    tenant: Annotated[str, msgspec.Meta(max_length=64, pattern=r"^[A-Za-z0-9_.@-]*$")] = ""
    # The repository indexes this key may search (/v1/retrieve, `repo`); absent: all.
    repos: list[RepoName] | None = None
    # The index a generation of this key draws on when it names no `repo`; "": none.
    default_repo: Annotated[str, msgspec.Meta(
        pattern=r"^([A-Za-z0-9][A-Za-z0-9._-]{0,63})?$")] = ""

    def may_read(self, repo: str) -> bool:
        return self.repos is None or repo in self.repos


class KeysFile(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    key: list[KeyEntry] = []


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass
class KeyStore:
    by_hash: dict[str, KeyEntry] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return bool(self.by_hash)

    def lookup(self, authorization: str | None) -> KeyEntry | None:
        if not authorization or not authorization.startswith("Bearer "):
            return None
        return self.by_hash.get(hash_key(authorization[7:].strip()))

    @classmethod
    def load(cls, path: Path, missing_ok: bool = True) -> KeyStore:
        """Read the keys file; a missing file means no keys (an open API), unless not
        ``missing_ok`` (a reload with keys: a moved file or a typo must not open it)."""
        try:
            if path.stat().st_mode & stat.S_IWOTH:
                raise ConfigError(f"{path}: writable by anyone, who could add a key of "
                                  f"their own: chmod 0640 {path}")
            raw = path.read_bytes()
        except FileNotFoundError as exc:
            if not missing_ok:
                raise ConfigError(f"{path}: no such file, and keys are in use: an empty "
                                  "file opens the API, if that is meant") from exc
            return cls()
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
        try:
            entries = msgspec.toml.decode(raw, type=KeysFile).key
        except msgspec.MsgspecError as exc:
            raise ConfigError(f"{path}: {exc}") from exc
        names = [e.name for e in entries]
        if len(set(names)) != len(names):
            raise ConfigError(f"{path}: key names must be unique")
        return cls({e.sha256: e for e in entries})


def add_key(path: Path, name: str, *, max_streams: int, max_queued: int,
            priority: Priority, tenant: str = "", repos: list[str] | None = None,
            default_repo: str = "") -> str:
    """Append a new key to ``path`` and return it; it is never written in clear."""
    store = KeyStore.load(path)
    if any(e.name == name for e in store.by_hash.values()):
        raise ConfigError(f"{path}: a key named {name!r} exists already")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    entry = KeyEntry(name=name, sha256=hash_key(key), max_streams=max_streams,
                     max_queued=max_queued, priority=priority, tenant=tenant, repos=repos,
                     default_repo=default_repo)
    try:  # validates the name, the limits and the repositories
        msgspec.convert(msgspec.to_builtins(entry), KeyEntry)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    block = (f'\n[[key]]\nname = "{name}"\nsha256 = "{entry.sha256}"\n'
             f"max_streams = {max_streams}\nmax_queued = {max_queued}\n"
             f'priority = "{priority}"\n' + (f'tenant = "{tenant}"\n' if tenant else "")
             + (f"repos = {msgspec.json.encode(repos).decode()}\n" if repos is not None
                else "")
             + (f"default_repo = {msgspec.json.encode(default_repo).decode()}\n"
                if default_repo else ""))
    new = not path.exists()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        with os.fdopen(fd, "a") as f:
            if new:
                f.write("# forged API keys: SHA-256 hashes only. Manage them with `forged "
                        "keys add`,\n# `list`, `rotate` and `revoke`, then `systemctl "
                        "reload forged`.\n")
            f.write(block)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot write: {exc.strerror}") from exc
    if new:
        _give_to_forged_group(path)
    return key


def list_keys(path: Path) -> list[KeyEntry]:
    """The keys of ``path`` in file order; none if it does not exist."""
    return [entry for entry, _ in _tables(path) if entry is not None]


def revoke_key(path: Path, name: str, *, allow_open: bool = False) -> None:
    """Remove the key named ``name`` from ``path``. What else the file says (other
    keys, comments) is kept as written, but for comments between its table and the
    next, which are read as its own.

    Error handling: the last key is kept unless ``allow_open``: with no key at all the
    daemon serves anyone (its documented default), which a revocation must not turn on
    by surprise."""
    tables = _tables(path)
    _named(path, tables, name)
    if not allow_open and not any(e is not None and e.name != name for e, _ in tables):
        raise ConfigError(f"{path}: {name!r} is the last key; without any key the API "
                          "is open to anyone. Add another key first, or pass --allow-open")
    _rewrite(path, [text for entry, text in tables if entry is None or entry.name != name])


def rotate_key(path: Path, name: str) -> str:
    """Give the key named ``name`` a new secret, with the same name, limits and tenant;
    return it. The old secret stops working when the daemon reloads."""
    tables = _tables(path)
    _named(path, tables, name)
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    texts = []
    for entry, text in tables:
        if entry is not None and entry.name == name:
            text, n = _SHA_LINE.subn(rf'\g<1>"{hash_key(key)}"', text, count=1)
            if n != 1:  # written by hand in another form: say so rather than guess
                raise ConfigError(f"{path}: key {name!r}: no `sha256 = \"...\"` line to "
                                  "replace")
        texts.append(text)
    _rewrite(path, texts)
    return key


# A line that opens a key's table; what follows it, up to the next one, is that key's.
_TABLE_START = re.compile(r"(?m)^(?=[ \t]*\[\[key\]\][ \t]*(?:#.*)?$)")
_SHA_LINE = re.compile(r'(?m)^([ \t]*sha256[ \t]*=[ \t]*)"[0-9a-f]{64}"')


def _tables(path: Path) -> list[tuple[KeyEntry | None, str]]:
    """The file cut into its text before the first key (entry None) and one text per
    key, each checked as the whole file is."""
    KeyStore.load(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    out: list[tuple[KeyEntry | None, str]] = []
    for part in _TABLE_START.split(text):
        try:
            keys = msgspec.toml.decode(part.encode(), type=KeysFile).key
        except msgspec.MsgspecError as exc:  # e.g. a `[[key]]` line inside a string
            raise ConfigError(f"{path}: cannot be edited in place ({exc}); edit it by "
                              "hand") from exc
        # TOML also spells a table `[[ key ]]` or `[["key"]]`, or writes the keys as an
        # inline array: a part holding two keys would be revoked or listed as one.
        if len(keys) > 1:
            raise ConfigError(f"{path}: cannot be edited in place: keys "
                              f"{', '.join(repr(k.name) for k in keys)} are not each "
                              "under a `[[key]]` line of their own")
        out.append((keys[0] if keys else None, part))
    return out


def _named(path: Path, tables: list[tuple[KeyEntry | None, str]], name: str) -> None:
    if not any(e is not None and e.name == name for e, _ in tables):
        raise ConfigError(f"{path}: no key named {name!r}")


def _rewrite(path: Path, texts: list[str]) -> None:
    """Replace ``path`` by ``texts`` at once (a reload never reads half a file), with
    its owner, group and mode."""
    try:
        _replace(path, texts)
    except OSError as exc:  # not root, say: the folder or the file is root's
        raise ConfigError(f"{path}: cannot write: {exc.strerror}") from exc


def _replace(path: Path, texts: list[str]) -> None:
    st = path.stat()
    tmp = path.with_name(f".{path.name}.new")
    tmp.unlink(missing_ok=True)  # a crash's leftover: its mode must not be kept
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            # os.open's mode is cut by the umask (077 would leave the daemon, group
            # forged, unable to read the file, and the reload would keep the old keys).
            os.fchmod(f.fileno(), stat.S_IMODE(st.st_mode))
            f.write("".join(texts))
            f.flush()
            os.fsync(f.fileno())
        if os.geteuid() == 0:
            os.chown(tmp, st.st_uid, st.st_gid)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _give_to_forged_group(path: Path) -> None:
    try:
        gid = grp.getgrnam("forged").gr_gid
    except KeyError:
        return  # a development machine without the forged group
    try:
        os.chown(path, 0 if os.geteuid() == 0 else -1, gid)
    except PermissionError:  # neither root nor in the group: the file stays the user's
        return
    os.chmod(path, 0o640)
