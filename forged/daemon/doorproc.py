"""A door process (``server.door_processes``, forged.daemon.doors): it accepts the API's
plain-TCP connections beside its siblings, answers the hot routes
(forged.http.hotdoor) from the daemon's last :class:`~forged.daemon.doorwire.View`, and
hands every other connection, with the bytes it read, to the daemon.

It holds no engine state, so nothing it does needs to be exact across processes: the
daemon alone admits, counts and limits generations. It stops on SIGTERM from the daemon,
or when its stdin closes: the daemon holds the pipe's only other end, so that is also
how a door learns the daemon has died, however it died (PR_SET_PDEATHSIG would not do:
it follows the thread that started the process, and trio starts processes from a
worker thread that ends when idle). It ignores SIGINT and SIGHUP, which a terminal
sends to the whole process group: the daemon decides when a drain stops the accepting,
and a reload is the daemon's.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import signal
import socket
from collections import Counter
from functools import partial

import trio
from hypercorn.config import Config as HyperConfig

from forged.auth import KeyEntry, KeyStore
from forged.daemon.accept import ResponseTail, accept_bursts
from forged.daemon.doorwire import LENGTH, Counted, Handed, View, encoder, view_decoder
from forged.http.hotdoor import Handoff, HotDoor, IdleConnections, Prefixed

log = logging.getLogger("forged.door")
# How often the answered requests' counts go to the daemon: also when there are none,
# which tells the daemon this door accepts (forged.daemon.doors.HEARD_WITHIN_S).
REPORT_EVERY_S = 0.25
COUNTS_A_DATAGRAM = 500  # (rule, status, key, n) entries: well within DATAGRAM_MAX
HAND_TIMEOUT_S = 10.0  # a daemon that takes no connection for this long has stalled
FIRST_VIEW_S = 30.0  # the daemon sends the first view as it starts a door
STOP_S = 2.0  # after the last accept, for the requests of connections accepted


class DoorView:
    """The hot door's view in a door process: the daemon's last :class:`View`, and the
    requests answered since the last report."""

    def __init__(self, view: View) -> None:
        self.counts: Counter[tuple[str, int, str]] = Counter()
        # Told to stop (a drain's start), or the daemon has gone: what the door still
        # reads, the daemon answers, from its state now (a drain's 503), not from a view
        # that may predate it; with the daemon gone, the handoff fails and it is closed.
        self.stopping = False
        self.set(view)

    def set(self, view: View) -> None:
        self.view = view
        self._keys = KeyStore(by_hash={k.sha256: k for k in view.keys})
        # The daemon's level, as a reload left it: its --log-level was the start's.
        level = logging.getLevelName(view.log_level.upper()) if view.log_level else None
        if isinstance(level, int) and logging.getLogger().level != level:
            logging.getLogger().setLevel(level)

    @property
    def on(self) -> bool:
        return self.view.on and not self.stopping

    @property
    def keys(self) -> KeyStore:
        return self._keys

    def health(self) -> tuple[int, bytes]:
        return self.view.health_status, self.view.health

    def models(self) -> bytes:
        return self.view.models

    def count(self, rule: str, status: int, key: KeyEntry | None) -> None:
        self.counts[rule, status, key.name if key else "-"] += 1

    def take_counts(self) -> list[Counted]:
        """The counts since the last take, in datagrams of at most ``COUNTS_A_DATAGRAM``
        entries; one empty one when there are none (the door's heartbeat)."""
        entries = [(rule, status, key, n) for (rule, status, key), n in self.counts.items()]
        self.counts.clear()
        return [Counted(entries[i:i + COUNTS_A_DATAGRAM])
                for i in range(0, max(1, len(entries)), COUNTS_A_DATAGRAM)]


class ViewReader:
    """The daemon's views, each a 4-byte length and msgpack, from the door's stdin."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream = stream
        self._buf = b""

    async def next(self) -> View | None:
        """The next view; None once the daemon has closed the pipe."""
        while True:
            if len(self._buf) >= LENGTH.size:
                (size,) = LENGTH.unpack_from(self._buf)
                end = LENGTH.size + size
                if len(self._buf) >= end:
                    view = view_decoder.decode(self._buf[LENGTH.size:end])
                    self._buf = self._buf[end:]
                    return view
            data = await self._stream.receive_some(65536)
            if not data:
                return None
            self._buf += data


async def send_datagram(sock: socket.socket, data: bytes, fds: list[int]) -> None:
    """One datagram to the daemon (with ``fds`` attached), waiting while its socket is
    full."""
    while True:
        try:
            socket.send_fds(sock, [data], fds)
            return
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)


async def hand(hub: socket.socket, stream: trio.abc.Stream) -> None:
    """The hot door's handoff, across processes: the connection's descriptor and the
    bytes read from it go to the daemon, which serves it from here. The caller then
    closes the door's copy of the descriptor."""
    assert isinstance(stream, Prefixed)
    # The time left for a head begun here: a slow one gets no second keep-alive there.
    head_s = max(0.001, stream.head_by - trio.current_time()) if stream.head_by < math.inf \
        else 0.0
    with trio.move_on_after(HAND_TIMEOUT_S) as scope:
        try:
            await send_datagram(hub, encoder.encode(Handed(stream.first, stream.served, head_s)),
                                [stream.transport.socket.fileno()])
        except OSError as exc:  # the daemon is gone: this door stops with it
            log.error("cannot hand a connection to the daemon: %s", exc)
    if scope.cancelled_caught:
        log.error("the daemon took no connection for %gs: one closed", HAND_TIMEOUT_S)


async def follow(views: ViewReader, view: DoorView, stop: trio.CancelScope) -> None:
    """Take each view the daemon sends; stop when it closes the pipe (it has died):
    what the door reads meanwhile is handed, as at a drain, never answered from the
    view of a daemon that is gone (a dead node's /health would say "ok")."""
    while (new := await views.next()) is not None:
        view.set(new)
    view.stopping = True
    stop.cancel()


async def report(hub: socket.socket, view: DoorView) -> None:
    """Send the counts of the requests answered (or none), a few times a second."""
    while True:
        await trio.sleep(REPORT_EVERY_S)
        await flush(hub, view)


async def flush(hub: socket.socket, view: DoorView) -> None:
    # OSError: the daemon is gone; its closed pipe stops this door
    with trio.move_on_after(HAND_TIMEOUT_S), contextlib.suppress(OSError):
        for counted in view.take_counts():
            await send_datagram(hub, encoder.encode(counted), [])


async def until_term(stop: trio.CancelScope, view: DoorView) -> None:
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async for _ in signals:
            break
    # A second SIGTERM (``systemctl kill`` and then the daemon's, say) must not cut
    # short the stop, which reads and hands the requests of connections accepted.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    view.stopping = True
    stop.cancel()


async def serve(listen_fds: list[int], hub_fd: int) -> None:
    hub = socket.socket(fileno=hub_fd)
    hub.setblocking(False)
    views = ViewReader(trio.lowlevel.FdStream(os.dup(0)))
    with trio.move_on_after(FIRST_VIEW_S):
        first = await views.next()
    if first is None:
        log.error("no view from the daemon: stopping")
        return
    view = DoorView(first)
    door = HotDoor(view, ResponseTail(HyperConfig()))
    idle = IdleConnections(lambda: view.view.keep_alive_s)
    handoff = Handoff(partial(hand, hub), lambda: view.view.max_requests, idle)
    async with trio.open_nursery() as connections:
        async with trio.open_nursery() as top:
            top.start_soon(follow, views, view, top.cancel_scope)
            top.start_soon(report, hub, view)
            top.start_soon(idle.sweep)
            top.start_soon(until_term, top.cancel_scope, view)
            for fd in listen_fds:
                top.start_soon(accept_bursts, socket.socket(fileno=fd),
                               partial(door.serve, handoff=handoff), connections)
        await idle.close_all()
        connections.cancel_scope.deadline = trio.current_time() + STOP_S
    await flush(hub, view)


def main(argv: list[str] | None = None) -> int:
    from forged.cli import setup_logging  # the daemon's log format, on the same stdout

    parser = argparse.ArgumentParser(prog="forged-door", description=__doc__)
    parser.add_argument("--listen", type=int, action="append", default=[],
                        help="a listening socket's descriptor (repeatable)")
    parser.add_argument("--hub", type=int, required=True,
                        help="the descriptor of the daemon's SOCK_SEQPACKET socket")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a reload is the daemon's, not a door's
    setup_logging(args.log_level)
    trio.run(serve, args.listen, args.hub)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
