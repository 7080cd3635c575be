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
import math
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
# A door reports four times a second (its counts, or none) once it accepts: one silent
# for HEARD_WITHIN_S is not accepting (stuck, stopped, or gone).
HEARD_WITHIN_S = 1.0
# Steady: reporting without a break for STEADY_S. A door that keeps dying soon after it
# starts never is, whatever it managed before it died.
STEADY_S = 2.0
# With no steady door for this long, the daemon accepts itself: longer than a door
# takes to start and become steady (about 2.5 s), so a normal start is no fallback.
FALLBACK_AFTER_S = 5.0
# A running door silent this long (stopped, or its loop blocked) is stuck: killed, and
# restarted. Before its first report, a door gets FIRST_REPORT_S (a slow start).
STUCK_S = 10.0
FIRST_REPORT_S = 30.0


@dataclass
class Door:
    """One door process, as ``/stats`` shows it."""

    pid: int = 0
    answered: int = 0  # hot requests it answered itself
    handed: int = 0  # connections it handed to the daemon
    restarts: int = 0
    process: trio.Process | None = None
    sent: bytes = b""  # the last view it was sent
    heard_at: float = -math.inf  # its last report
    reporting_since: float | None = None  # reports without a break since
    started_at: float = 0.0

    def report(self) -> dict[str, int]:
        return {"pid": self.pid, "answered": self.answered, "handed": self.handed,
                "restarts": self.restarts, "steady": int(self.steady(trio.current_time()))}

    def started(self, process: trio.Process) -> None:
        self.process, self.pid, self.sent = process, process.pid, b""
        self.heard_at, self.reporting_since = -math.inf, None
        self.started_at = trio.current_time()

    def heard(self, now: float) -> None:
        if self.reporting_since is None or now - self.heard_at > HEARD_WITHIN_S:
            self.reporting_since = now
        self.heard_at = now

    def stuck(self, now: float) -> bool:
        """Running, and silent past ``STUCK_S`` (past ``FIRST_REPORT_S`` from its start
        if it never reported)."""
        if self.heard_at == -math.inf:
            return now - self.started_at > FIRST_REPORT_S
        return now - self.heard_at > STUCK_S

    def steady(self, now: float) -> bool:
        """Accepting, by its own reports, without a break for ``STEADY_S``."""
        return (self.process is not None and self.process.returncode is None
                and self.reporting_since is not None and now - self.heard_at <= HEARD_WITHIN_S
                and now - self.reporting_since >= STEADY_S)


class Doors:
    """The door processes of one listener and the daemon's side of their sockets."""

    def __init__(self, n: int, sockets: list[socket.socket], view: Callable[[], View],
                 serve_handed: Callable[[trio.SocketStream, Handed], None],
                 counted: Callable[[Counted], None], restarted: Callable[[], None],
                 log_level: Callable[[], str], accept_here: Callable[[], Awaitable[None]]
                 ) -> None:
        """``view()``: what the doors answer from now; ``serve_handed(stream, handed)``
        serves a connection a door handed; ``counted`` takes a door's answered counts;
        ``restarted`` counts a door's restart (forged_door_restarts); ``log_level()``,
        the level a door starts with (its views then carry it); ``accept_here()``
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
        self.accepting_here = False  # no door steady: the daemon accepts (/stats)
        self.closed = False  # the listening sockets are closed: no door starts
        self._latest = b""  # the view as the doors should have it, framed

    async def run(self) -> None:
        """Keep the doors running, with the current view, until cancelled."""
        self._latest = framed(self._view())
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
        """Close the daemon's copies of the listening sockets, before the doors are
        told to stop: the sockets then close as the last door's accept loop ends.
        (Closed after the doors had gone, the daemon's copy queued the connections made
        while they stopped, which its close then reset; under socket activation
        systemd's copy keeps them for the next daemon either way.)"""
        self.closed = True
        for sock in self._sockets:
            sock.close()

    async def _keep(self, door: Door) -> None:
        while not self.closed:
            started = trio.current_time()
            try:
                code = await self._run_one(door)
                log.error("door process %d exited with code %s: restarting", door.pid, code)
            except OSError as exc:  # out of processes or memory: the next try may not be
                log.error("cannot start a door process: %s; retrying", exc)
            except Exception:
                # A bug in the hub's side of one door: that door restarts, the API goes on.
                log.exception("door process %d failed: restarting it", door.pid)
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
        door.started(door.process)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read, ours, door)
                nursery.start_soon(self._views_to, door)
                return await door.process.wait()
        finally:
            with trio.CancelScope(shield=True):
                await self._stop(ours, door)

    def _argv(self, hub_fd: int) -> list[str]:
        listen = [a for s in self._sockets for a in ("--listen", str(s.fileno()))]
        # -P: nothing from the working directory shadows an installed module
        return [sys.executable, "-P", "-m", "forged.daemon.doorproc", "--hub", str(hub_fd),
                "--log-level", self._log_level(), *listen]

    async def _stop(self, ours: socket.socket, door: Door) -> None:
        """SIGTERM the door if it runs, and serve what it hands until it has gone
        (its end of the socket closes with it), within ``STOP_S``."""
        assert door.process is not None
        try:
            with trio.move_on_after(STOP_S):
                if door.process.returncode is None:
                    door.process.terminate()
                await self._read(ours, door)
                await door.process.wait()
        finally:  # whatever _read raised: no door outlives its stop, no pipe stays open
            if door.process.returncode is None:
                door.process.kill()
                await door.process.wait()
            if door.process.stdin is not None:
                await door.process.stdin.aclose()
            ours.close()

    async def _read(self, sock: socket.socket, door: Door) -> None:
        """Take the door's datagrams until its end closes."""
        while True:
            try:
                data, fds, flags, _ = socket.recv_fds(sock, DATAGRAM_MAX, 1)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(sock)
                continue
            if not data and not fds:
                return
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                # Never expected (a datagram is at most DATAGRAM_MAX): out of descriptors
                # here (CTRUNC), the connection is lost, and this says why.
                log.error("a datagram from door process %d was cut short (flags %#x): "
                          "a handed connection or some counts are lost", door.pid, flags)
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
                               message)
            return
        for fd in fds:  # a descriptor with no Handed: never expected, never leaked
            os.close(fd)
        if isinstance(message, Counted):
            door.heard(trio.current_time())
            door.answered += sum(n for *_, n in message.counts)
            self._counted(message)

    async def _fall_back(self) -> None:
        """Accept in the daemon after ``FALLBACK_AFTER_S`` with no steady door; stop
        when one is. Checked as often as views are published."""
        last_steady = trio.current_time()
        while True:
            await trio.sleep(PUBLISH_EVERY_S)
            now = trio.current_time()
            if any(door.steady(now) for door in self.doors):
                last_steady = now
            elif now - last_steady >= FALLBACK_AFTER_S:
                await self._accept_until_steady()
                last_steady = trio.current_time()

    async def _accept_until_steady(self) -> None:
        log.error("no door process is ready: the daemon accepts the API's connections "
                  "itself until one is")
        self.accepting_here = True
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._accepting)
                while True:
                    await trio.sleep(PUBLISH_EVERY_S)
                    if any(door.steady(trio.current_time()) for door in self.doors):
                        break
                nursery.cancel_scope.cancel()
        finally:
            self.accepting_here = False
        log.info("a door process is ready: the doors accept the API's connections again")

    async def _accepting(self) -> None:
        """The daemon's own accepting; an error in it (out of descriptors to copy the
        sockets with) is logged and tried again, never the end of the listener."""
        while True:
            try:
                await self._accept_here()
            except* OSError as group:  # from the accept loops' nursery: in a group
                log.error("the daemon cannot accept either: %s; retrying in 1 s",
                          "; ".join(map(str, group.exceptions)))
            await trio.sleep(1.0)

    async def _publish(self) -> None:
        """Keep the view the doors should have; each door's sender sends it when it
        changes (:meth:`_views_to`)."""
        while True:
            await trio.sleep(PUBLISH_EVERY_S)
            self._latest = framed(self._view())

    async def _views_to(self, door: Door) -> None:
        """Send ``door`` the latest view whenever it changes, while it runs: one
        sender a door, so one that is stuck delays no other's view (a drain's 503).
        A door that stops reporting is killed (its keeper restarts it)."""
        process = door.process
        assert process is not None
        while process.returncode is None:
            if door.stuck(trio.current_time()):
                log.error("door process %d has not reported for %gs: killing it",
                          door.pid, trio.current_time() - max(door.heard_at, door.started_at))
                process.kill()
                return
            if door.sent != self._latest:
                await self._send_view(door, self._latest)
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
