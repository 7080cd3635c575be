"""The daemon's end of one worker's socket: an outbox, the handshake, the writer and
the reader. Frames are defined (and split from bytes) in :mod:`forged.engine.frames`.

Resource handling: the caller owns the stream and the tasks; nothing here spawns.

Error handling: a worker that exits during the handshake, answers it with anything but
``Ready`` and a first ``Step``, stays silent past a timeout, or stops reading its
frames, raises one of the worker faults the supervisor restarts on (``ValueError``,
``trio.TooSlowError``, ``msgspec.MsgspecError``, ``OSError``, ``trio`` stream errors).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import trio

from forged.engine import frames as fr


class Outbox:
    """Frames for one worker process, sent by :func:`write_frames`.

    Bounded: an open request puts at most a submit and a cancel, and open requests
    are bounded by the admission limits, so ``limit`` frames waiting means the worker
    has stopped reading. ``put`` never blocks (a cancel is put from a cancelled
    scope); past the limit the writer raises ``TooSlowError`` instead, and the
    supervisor replaces the process, as it does a worker whose heartbeat stopped.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._q: deque[fr.ToWorker] = deque()
        self._wake = trio.Event()

    def put(self, frame: fr.ToWorker) -> None:
        self._q.append(frame)
        self._wake.set()

    @property
    def unsent(self) -> tuple[fr.ToWorker, ...]:
        """The frames put and not yet taken, oldest first."""
        return tuple(self._q)

    async def take(self) -> list[fr.ToWorker]:
        while not self._q:
            await self._wake.wait()
            self._wake = trio.Event()
        if len(self._q) > self.limit:
            raise trio.TooSlowError(f"the worker left {len(self._q)} frames unread")
        out = list(self._q)
        self._q.clear()
        return out


async def handshake(stream: trio.SocketStream, init: fr.Init
                    ) -> tuple[fr.Ready, list[fr.Step], fr.FrameBuffer]:
    """Send ``init``; wait for ``Ready`` and the first ``Step`` with statistics, so that
    no one sees a ready worker without numbers. Returns them with any later steps that
    came along, and the buffer, which may hold the start of the next frame: the reader
    goes on with it. The caller bounds the wait (loading a model takes a while)."""
    await stream.send_all(fr.encode(init))
    buf = fr.FrameBuffer()
    frames: list[fr.FromWorker] = []
    while len(frames) < 2:
        data = await stream.receive_some(fr.READ_SIZE)
        if not data:
            raise ValueError("the worker exited while loading the model")
        frames += [fr.from_worker_decoder.decode(b) for b in buf.feed(data)]
    ready, steps = frames[0], [f for f in frames[1:] if isinstance(f, fr.Step)]
    if not isinstance(ready, fr.Ready) or len(steps) != len(frames) - 1:
        raise ValueError("the worker did not start with ready and statistics")
    return ready, steps, buf


async def write_frames(outbox: Outbox, stream: trio.SocketStream) -> None:
    while True:
        frames = await outbox.take()
        await stream.send_all(b"".join(fr.encode(f) for f in frames))


async def read_steps(stream: trio.SocketStream, buf: fr.FrameBuffer,
                     silence: Callable[[], float],
                     on_step: Callable[[fr.Step], None]) -> None:
    """Hand every ``Step`` to ``on_step`` until the worker closes its end. Raises
    ``TooSlowError`` when it sends nothing (not even a heartbeat) for ``silence()`` s,
    read at every frame: a reload changes it for the running process too."""
    # One scope whose deadline moves on with each read, not a scope per read: a
    # streamed token is a read, and making, entering and leaving a scope for each was
    # about a tenth of the daemon's time on one stream.
    with trio.CancelScope() as silent:
        while True:
            silent.deadline = trio.current_time() + silence()
            data = await stream.receive_some(fr.READ_SIZE)
            if not data:
                return
            for body in buf.feed(data):
                frame = fr.from_worker_decoder.decode(body)
                if isinstance(frame, fr.Step):
                    on_step(frame)
    raise trio.TooSlowError("no heartbeat from the worker")
