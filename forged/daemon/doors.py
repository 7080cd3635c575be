"""Door processes (``server.door_processes``): more cores for the API's connections.

One door is one core of HTTP. With door processes, the daemon (the *hub*) no longer
accepts the API's plain-TCP connections itself: N processes (forged.daemon.doorproc)
inherit its listening sockets, as systemd's socket activation passes them, and the
kernel gives each accepted connection to one of them. A door answers the hot routes
(``GET /health``, ``GET /v1/models``, forged.http.hotdoor) from a :class:`View` of the
daemon that the daemon sends whenever it changes, and hands every other connection, its
descriptor and the bytes already read, to the daemon over a Unix socket
(``SCM_RIGHTS``). The daemon serves a handed connection as it serves its own: hypercorn,
Quart, the direct streams. So everything that must be exact (admission, per-key limits,
tenants, routing, the early refusal, drains) stays in one process, by construction.

The daemon restarts a door that dies (at most one restart a second), kills one that
does not take its view, and at a drain's end stops them with SIGTERM and serves the
connections they handed before they went. While no door is ready (none could start,
or every one keeps dying), the daemon accepts the connections itself, as it does
without doors: a broken door costs its cores, never the API.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
import trio

from forged.daemon.doorwire import DATAGRAM_MAX, Counted, Handed, View, framed, from_door

log = logging.getLogger("forged.door")
PUBLISH_EVERY_S = 0.1  # how stale a door's /health may be (a drain's 503, a swap's list)
VIEW_TIMEOUT_S = 5.0  # a door that does not take its view for this long is stuck
STOP_S = 5.0  # a door stopping: for its last handoffs and its exit
RESTART_EVERY_S = 1.0  # a door that keeps dying restarts at most this often
# With no door ready for this long, the daemon accepts itself: longer than a door takes
# to start (about half a second), so a normal start or restart is not a fallback.
FALLBACK_AFTER_S = 2.0


@dataclass
class Door:
    """One door process, as ``/stats`` shows it."""

    pid: int = 0
    answered: int = 0  # hot requests it answered itself
    handed: int = 0  # connections it handed to the daemon
    restarts: int = 0
    process: trio.Process | None = None
    sent: bytes = b""  # the last view it was sent

    def report(self) -> dict[str, int]:
        return {"pid": self.pid, "answered": self.answered, "handed": self.handed,
                "restarts": self.restarts}

    @property
    def ready(self) -> bool:
        """Running, with its view: accepting."""
        return bool(self.sent) and self.process is not None and self.process.returncode is None


class Doors:
    """The door processes of one listener and the daemon's side of their sockets."""

    def __init__(self, n: int, sockets: list[socket.socket], view: Callable[[], View],
                 serve_handed: Callable[[trio.SocketStream, bytes], None],
                 counted: Callable[[Counted], None], restarted: Callable[[], None],
                 log_level: str, accept_here: Callable[[], Awaitable[None]]) -> None:
        """``view()``: what the doors answer from now; ``serve_handed(stream, data)``
        serves a connection a door handed; ``counted`` takes a door's answered counts;
        ``restarted`` counts a door's restart (forged_door_restarts); ``accept_here()``
        accepts and serves the connections in the daemon until cancelled (no door is
        ready)."""
        self.doors = [Door() for _ in range(n)]
        self._sockets = sockets
        self._view = view
        self._serve_handed = serve_handed
        self._counted = counted
        self._restarted = restarted
        self._log_level = log_level
        self._accept_here = accept_here
        self.accepting_here = False  # no door ready: the daemon accepts (/stats)

    async def run(self) -> None:
        """Keep the doors running, with the current view, until cancelled."""
        async with trio.open_nursery() as nursery:
            for door in self.doors:
                nursery.start_soon(self._keep, door)
            nursery.start_soon(self._publish)
            nursery.start_soon(self._fall_back)

    def report(self) -> dict[str, object]:
        """What ``/stats`` shows: each door, and whether the daemon accepts itself."""
        return {"process": [door.report() for door in self.doors],
                "daemon_accepts": self.accepting_here}

    def close(self) -> None:
        """Close the daemon's copies of the listening sockets, once the doors are
        stopped: then nothing accepts on them."""
        for sock in self._sockets:
            sock.close()

    async def _keep(self, door: Door) -> None:
        while True:
            started = trio.current_time()
            try:
                code = await self._run_one(door)
                log.error("door process %d exited with code %s: restarting", door.pid, code)
            except OSError as exc:  # out of processes or memory: the next try may not be
                log.error("cannot start a door process: %s; retrying", exc)
            door.restarts += 1
            self._restarted()
            await trio.sleep(max(0.0, started + RESTART_EVERY_S - trio.current_time()))

    async def _run_one(self, door: Door) -> int:
        """Run one door process until it exits (its exit code), or stop it when
        cancelled, serving what it handed before it went."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        try:
            door.process = await trio.lowlevel.open_process(
                self._argv(theirs.fileno()), stdin=subprocess.PIPE,
                pass_fds=[theirs.fileno(), *(s.fileno() for s in self._sockets)])
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        door.pid, door.sent = door.process.pid, b""
        try:
            async with trio.open_nursery() as nursery:  # its view comes with the next
                nursery.start_soon(self._read, ours, door)  # publish
                return await door.process.wait()
        finally:
            with trio.CancelScope(shield=True):
                await self._stop(ours, door)

    def _argv(self, hub_fd: int) -> list[str]:
        listen = [a for s in self._sockets for a in ("--listen", str(s.fileno()))]
        return [sys.executable, "-m", "forged.daemon.doorproc", "--hub", str(hub_fd),
                "--log-level", self._log_level, *listen]

    async def _stop(self, ours: socket.socket, door: Door) -> None:
        """SIGTERM the door if it runs, and serve what it hands until it has gone
        (its end of the socket closes with it), within ``STOP_S``."""
        assert door.process is not None
        with trio.move_on_after(STOP_S):
            if door.process.returncode is None:
                door.process.terminate()
            await self._read(ours, door)
            await door.process.wait()
        if door.process.returncode is None:
            door.process.kill()
            await door.process.wait()
        ours.close()

    async def _read(self, sock: socket.socket, door: Door) -> None:
        """Take the door's datagrams until its end closes."""
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(sock, DATAGRAM_MAX, 1)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(sock)
                continue
            if not data and not fds:
                return
            self._take(door, data, fds)

    def _take(self, door: Door, data: bytes, fds: list[int]) -> None:
        try:
            message: Handed | Counted | None = from_door.decode(data)
        except msgspec.DecodeError as exc:  # never expected: both ends are forged's
            log.error("door process %d sent a message that does not decode: %s",
                      door.pid, exc)
            message = None
        if isinstance(message, Handed) and fds:
            door.handed += 1
            conn = socket.socket(fileno=fds[0])
            self._serve_handed(trio.SocketStream(trio.socket.from_stdlib_socket(conn)),
                               message.data)
            return
        for fd in fds:  # a descriptor with no Handed: never expected, never leaked
            os.close(fd)
        if isinstance(message, Counted):
            door.answered += sum(n for *_, n in message.counts)
            self._counted(message)

    async def _fall_back(self) -> None:
        """Accept in the daemon after ``FALLBACK_AFTER_S`` with no door ready; stop
        when one is. Checked as often as views are published."""
        none_since = trio.current_time()
        here: trio.CancelScope | None = None
        async with trio.open_nursery() as nursery:
            while True:
                await trio.sleep(PUBLISH_EVERY_S)
                if any(door.ready for door in self.doors):
                    none_since = trio.current_time()
                    if here is not None:
                        here.cancel()
                        here = None
                        log.info("a door process is ready: the doors accept the API's "
                                 "connections again")
                elif here is None and trio.current_time() - none_since >= FALLBACK_AFTER_S:
                    here = await nursery.start(self._accepting)

    async def _accepting(self, task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        with trio.CancelScope() as scope:
            log.error("no door process is ready: the daemon accepts the API's connections "
                      "itself until one is")
            self.accepting_here = True
            task_status.started(scope)
            try:
                await self._accept_here()
            finally:
                self.accepting_here = False

    async def _publish(self) -> None:
        """Send each door the view whenever it changes."""
        while True:
            view = framed(self._view())
            for door in self.doors:
                if door.sent != view:
                    await self._send_view(door, view)
            await trio.sleep(PUBLISH_EVERY_S)

    async def _send_view(self, door: Door, view: bytes) -> None:
        """A door that does not take it within ``VIEW_TIMEOUT_S`` is stuck: killed,
        and restarted by its keeper (a half-sent view cannot be taken back)."""
        process = door.process
        if process is None or process.returncode is not None or process.stdin is None:
            return
        with trio.move_on_after(VIEW_TIMEOUT_S) as scope:
            try:
                await process.stdin.send_all(view)
                door.sent = view
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return  # it has exited: its keeper restarts it
        if scope.cancelled_caught:
            log.error("door process %d took no view for %gs: killing it", door.pid,
                      VIEW_TIMEOUT_S)
            process.kill()
