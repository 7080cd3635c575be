"""Streams written straight to their sockets: one write per stream per worker frame
(a step's tokens, or several steps' when the worker held them), by the pool's reader,
without waking the stream's task.

Through Quart, hypercorn and h11, each streamed frame cost a wake of the stream's task,
a generator step, an ASGI message, h11's framing and a locked, shielded write: with
the socket write itself, about 100 µs of the door's CPU per token
(docs/benchmarks.md, "The front door's cost"), a core at the token rates of an
accelerator. So on a plain HTTP/1.1 connection that came through the hot door
(forged.http.hotdoor), a stream's body after its headers is written here:

- As the pool delivers a worker's frame, the request's :class:`StepSink` formats each
  text event, and writes their chunk to the socket once the frame is pushed whole
  (``RequestStream.sink``, ``RequestStream.delivered``). The stream's
  task sleeps through the whole stream but for what only it does: the end, an error,
  a write the socket did not take whole, and a stream whose tokens come faster than
  ``server.stream_coalesce_ms`` (the task gathers those into one write, as before).
- The bytes are h11's, so a client sees no difference: hypercorn sends the head (Quart
  sends it before it enters the body), each write is one chunk framed as h11 frames
  one, and hypercorn sends the last chunk when the body ends. Between the two it
  writes nothing to the connection: HTTP/1.1 answers one request at a time. (A hot
  generation's writer, forged.http.hotpost, takes hypercorn's part, in the same way.)

Order holds: the sink takes an event only when nothing is queued before it, nothing
the task took is still unwritten (``held``) and no earlier bytes wait for the socket.

Resource handling: the writer writes to a duplicate of the connection's descriptor,
closed when the body ends, so a late write can never reach a connection that reused
the number.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextvars import ContextVar
from typing import Protocol

import trio

from forged.engine.events import Delta, Event

# The socket of the hot door's connection that the current request came on; None on
# TLS, which hypercorn serves alone. Set by the hot door before it hands the connection
# to hypercorn, whose request tasks inherit it.
CONNECTION: ContextVar[trio.SocketStream | None] = ContextVar("forged.connection",
                                                              default=None)


class ChunkWriter:
    """Chunks of one response's chunked body, written without blocking; what the
    socket does not take at once waits in ``pending`` for :meth:`drain`."""

    def __init__(self, sock: trio.SocketStream) -> None:
        self.fd = os.dup(sock.socket.fileno())  # shares the socket's O_NONBLOCK
        self.pending = b""
        self.broken = False  # the peer is gone: later chunks are dropped

    def send(self, data: bytes) -> None:
        """``data`` as one chunk (h11's framing; nothing for no data), written as far as
        the socket takes it now, the rest kept after what already waits."""
        if not data or self.broken:
            return
        chunk = b"%x\r\n%s\r\n" % (len(data), data)
        if self.pending:
            self.pending += chunk
        else:
            self._write(chunk)

    def _write(self, data: bytes) -> None:
        try:
            sent = os.write(self.fd, data)
        except BlockingIOError:
            sent = 0
        except OSError:  # EPIPE, ECONNRESET: the client left; its watcher ends the call
            self.broken, self.pending = True, b""
            return
        self.pending = data[sent:]

    async def drain(self) -> None:
        """Wait until every pending byte is written (or the peer is gone). Cancellable:
        only a client that left or a shutdown past its grace time cancels it, and
        either ends the connection."""
        while self.pending and not self.broken:
            await trio.lowlevel.wait_writable(self.fd)
            self._write(self.pending)

    def close(self) -> None:
        trio.lowlevel.notify_closing(self.fd)
        os.close(self.fd)


class Framer(Protocol):
    """A stream's frames (forged.http.generate's ``_Frames``)."""

    def read(self, events: list[Event]) -> bool: ...

    def take(self) -> bytes: ...


class StepSink:
    """The pool reader's side of one direct stream: ``RequestStream.push`` offers it
    each event as it arrives. It takes a text event when it may write it in order,
    makes its frame, writes the frames of a worker's frame together once it is
    delivered, and wakes the stream's task (``nudge``) only if that task must finish
    the write or raise what went wrong."""

    def __init__(self, framer: Framer, writer: ChunkWriter, nudge: Callable[[], None],
                 coalesces: Callable[[], bool]) -> None:
        self.framer, self.writer = framer, writer
        self._nudge = nudge
        self._coalesces = coalesces  # the task gathers this stream's next events
        # The task holds events it has not written yet: later ones queue behind them.
        self.held = True
        self.error: Exception | None = None
        self._taken = False  # events taken from the frame being delivered

    def __call__(self, ev: Event) -> bool:
        if (type(ev) is not Delta or self.held or self.writer.pending or self.writer.broken
                or self.error is not None or self._coalesces()):
            return False
        # The frame is made here, in the pool's reader: an error in it must not end
        # the reader (every stream of the worker would go), so it is kept and raised
        # in this stream's own task.
        try:
            self.framer.read([ev])  # a text event: never the stream's last
            self._taken = True
        except Exception as exc:
            self.error = exc
            self._nudge()
        return True

    def delivered(self) -> None:
        """The worker's frame is pushed whole: the frames of the events taken from it
        go in one write (a worker holding tokens sends several steps' in one frame)."""
        if not self._taken:
            return
        self._taken = False
        writer = self.writer
        try:
            writer.send(self.framer.take())
        except Exception as exc:
            self.error = exc
        if writer.pending or writer.broken or self.error is not None:
            self._nudge()

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error
