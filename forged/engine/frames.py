"""Wire schema between the daemon and its worker processes.

Frames are msgspec Structs in one tagged union, sent as msgpack with a 4-byte
big-endian length prefix over a socketpair. The daemon sends :data:`ToWorker`
frames; the worker answers with :data:`FromWorker` frames. Encoders and decoders
are built once, here.
"""

from __future__ import annotations

import struct

import msgspec

from forged.engine.events import Event
from forged.engine.limits import SchedulerLimits
from forged.engine.request import Request
from forged.engine.stats import WorkerStats

# Statistics cost a walk over the KV ledger: a Step frame carries them at most this
# often while only tokens flow.
STATS_INTERVAL = 0.05

MAX_FRAME = 64 * 1024 * 1024
# Bytes asked of the socket per read, on both sides. Below glibc's mmap threshold (128
# KiB): a larger buffer is mapped and unmapped around every read (the daemon's reader
# made five memory syscalls a streamed token with 1 MiB); a longer frame takes more reads.
READ_SIZE = 64 * 1024
_LEN = struct.Struct(">I")


class _Frame(msgspec.Struct, forbid_unknown_fields=True, tag_field="t", kw_only=True):
    pass


# --- daemon -> worker ------------------------------------------------------------------


class Init(_Frame, tag="init"):
    """The first frame: what the worker loads, and its scheduler's limits."""

    model_path: str
    threads: int
    flash_attn: bool | None  # None: chosen by measurement (forged.engine.attention)
    heartbeat_interval: float
    limits: SchedulerLimits
    test_hooks: bool = False
    # The disk tier's folder (sessions' KV states across restarts); "": none.
    cache_dir: str = ""
    # The nice value to load at. A swap's new model loads beside a serving one: nice,
    # its loading and calibration take the CPU only where the serving workers leave
    # it (llama.cpp's threads spin, and two sets of them on the same cores stall
    # both). Renice brings it back once it serves.
    nice: int = 0
    # The CPUs to keep to, before llama.cpp starts its threads ([]: where it started).
    cpus: list[int] = []
    # An embedding model's worker (forged.engine.embedcore): it pools, it never samples.
    embedding: bool = False


class Submit(_Frame, tag="submit"):
    rid: int  # the pool's routing id, unique in the daemon's life
    request: Request


class Cancel(_Frame, tag="cancel"):
    rid: int


class Renice(_Frame, tag="renice"):
    """Every thread of the worker to this nice value (a swap's new model serves)."""

    nice: int


class SetLimits(_Frame, tag="limits"):
    """After a reload: the whole of the new limits (a worker refuses a new geometry)."""

    limits: SchedulerLimits


class Unpin(_Frame, tag="unpin"):
    """No conversation holds ``session`` any more (its stored responses were deleted or
    evicted): its idle slot is ordinary cache from now on, not pinned to the end of
    session_ttl."""

    session: str


class Shutdown(_Frame, tag="shutdown"):
    pass


# --- the test seam (forged.engine.testhooks): honoured only with Init.test_hooks -------


class Hang(_Frame, tag="hang"):
    """Test hook (only honoured with ``test_hooks``): block the worker loop for a while."""

    seconds: float


class SlowSteps(_Frame, tag="slow"):
    """Test hook (only honoured with ``test_hooks``): sleep this long after every step."""

    seconds: float


class CrashOn(_Frame, tag="crash"):
    """Test hook (only honoured with ``test_hooks``): abort the process in the decode of
    a batch that holds ``token``."""

    token: int


ToWorker = (Init | Submit | Cancel | SetLimits | Unpin | Renice | Shutdown | Hang
            | SlowSteps | CrashOn)
# What the worker's core (forged.engine.core) takes; the worker itself the rest.
ToCore = Submit | Cancel | SetLimits | Unpin


# --- worker -> daemon ------------------------------------------------------------------


class Ready(_Frame, tag="ready"):
    pid: int
    flash_attn: bool = False  # what the worker runs with
    flash_attn_why: str = ""  # "set in the config", or what it measured


class Step(_Frame, tag="step"):
    """Everything one scheduling step produced, plus the worker's statistics."""

    events: list[Event]
    stats: WorkerStats | None  # None: unchanged since the last report
    # What the worker's caches hold, as prefix digests (forged.engine.routing), when
    # that changed since its last report; None: unchanged.
    digests: list[int] | None = None


FromWorker = Ready | Step


_encoder = msgspec.msgpack.Encoder()
to_worker_decoder = msgspec.msgpack.Decoder(ToWorker)
from_worker_decoder = msgspec.msgpack.Decoder(FromWorker)


def encode(frame: ToWorker | FromWorker) -> bytes:
    """The frame on the wire. Raises FrameTooLarge past MAX_FRAME, which the reader
    would refuse (the pool checks a request's size before it is queued)."""
    body = _encoder.encode(frame)
    if len(body) > MAX_FRAME:
        raise FrameTooLarge(f"frame of {len(body)} bytes is over the {MAX_FRAME} limit")
    return _LEN.pack(len(body)) + body


def encode_step(step: Step) -> list[bytes]:
    """``step`` on the wire: one frame, or several when one would pass MAX_FRAME (the
    embeddings of requests that finished together, each within it alone), its events
    in order, the statistics and digests with the first. One event past it raises."""
    try:
        return [encode(step)]
    except FrameTooLarge:
        if len(step.events) < 2:
            raise
    half = len(step.events) // 2
    return (encode_step(Step(events=step.events[:half], stats=step.stats,
                             digests=step.digests))
            + encode_step(Step(events=step.events[half:], stats=None)))


def encoded_size(frame: ToWorker | FromWorker) -> int:
    return len(_encoder.encode(frame))


class FrameTooLarge(ValueError):
    pass


class FrameBuffer:
    """Accumulates bytes and yields complete frame bodies (sans-IO)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        out: list[bytes] = []
        while len(self._buf) >= _LEN.size:
            (n,) = _LEN.unpack_from(self._buf)
            if n > MAX_FRAME:
                raise ValueError(f"frame of {n} bytes is over the {MAX_FRAME} limit")
            if len(self._buf) < _LEN.size + n:
                break
            out.append(bytes(self._buf[_LEN.size : _LEN.size + n]))
            del self._buf[: _LEN.size + n]
        return out
