"""What the daemon and its door processes (forged.daemon.doors) say to each other.

Daemon to door, on the door's stdin: :class:`View`, each a 4-byte length and msgpack,
whenever what the hot routes answer changes. Door to daemon, on a ``SOCK_SEQPACKET``
pair: :class:`Handed` with the connection's descriptor attached (``SCM_RIGHTS``), and
:class:`Counted`. A datagram per message: no framing, and a descriptor always travels
with its own bytes.
"""

from __future__ import annotations

import struct

import msgspec

from forged.auth import KeyEntry
from forged.http.hotdoor import MAX_HEAD, READ_SIZE


class View(msgspec.Struct, tag=True, frozen=True, forbid_unknown_fields=True):
    """What a door answers from: the hot routes' bodies as the daemon would send them,
    the keys, the hypercorn settings a connection's loop reads, and the daemon's log
    level (``log.level``, which a reload changes: a door's access lines follow it)."""

    on: bool
    health_status: int
    health: bytes
    models: bytes
    keys: list[KeyEntry]
    keep_alive_s: float
    max_requests: int
    # "" from a daemon older than the door (a package upgraded under a running daemon
    # that then restarts a door): the door keeps the level it started with.
    log_level: str = ""


class Handed(msgspec.Struct, tag=True, frozen=True, forbid_unknown_fields=True,
             omit_defaults=True):
    """A connection the door does not answer: the daemon serves it from here, with the
    bytes the door already read from it and the number of requests it answered on it
    (they count towards hypercorn's ``keep_alive_max_requests``). ``served`` is left
    out when 0, so a daemon older than the door (a package upgraded under it) still
    takes a fresh connection. ``head_s``: when ``data`` ends in part of a head, the
    seconds left of the door's keep-alive for the rest of it, which the daemon keeps
    (0, left out: none, the daemon's own keep-alive from here). Most heads come whole
    in the door's first read; one that did not is, like a ``served`` one, lost to a
    daemon older than the door."""

    data: bytes
    served: int = 0
    head_s: float = 0.0


class Counted(msgspec.Struct, tag=True, frozen=True, forbid_unknown_fields=True):
    """Requests a door answered since its last count: (rule, status, key name, n)."""

    counts: list[tuple[str, int, str, int]]


FromDoor = Handed | Counted
# The largest datagram a door sends: a Handed with everything the hot door may have
# read before it gave up on a head, and msgpack's few bytes around it.
DATAGRAM_MAX = MAX_HEAD + READ_SIZE + 64
LENGTH = struct.Struct(">I")

encoder = msgspec.msgpack.Encoder()
from_door = msgspec.msgpack.Decoder(FromDoor)
view_decoder = msgspec.msgpack.Decoder(View)


def framed(view: View) -> bytes:
    body = encoder.encode(view)
    return LENGTH.pack(len(body)) + body
