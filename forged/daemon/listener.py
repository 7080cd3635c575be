"""The API listener: hypercorn's trio worker (``hypercorn.trio.run.worker_serve``),
with the hot door (forged.http.hotdoor) in front of each plain-TCP connection.

hypercorn's ``serve`` takes no per-connection hook, so this is its worker loop with one
change: a plain connection is first served by the hot door, which hands it to
hypercorn's ``TCPServer`` at its first request that is not a hot route. With door
processes (forged.daemon.doors), they accept the plain connections instead, and those
they hand over start at hypercorn here. TLS connections go to hypercorn directly. The
lifespan, the shutdown trigger, the graceful timeout and the binds are hypercorn's, as
before.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Protocol, cast

import trio
from hypercorn.config import Config as HyperConfig
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import (
    ASGIReceiveCallable,
    ASGISendCallable,
    ASGISendEvent,
    ConnectionState,
    Scope,
)
from hypercorn.utils import ShutdownError, raise_shutdown, repr_socket_addr, wrap_app

from forged.daemon.accept import Handler, ResponseTail, accept_bursts, connection
from forged.daemon.doors import Doors
from forged.daemon.doorwire import Counted, Handed, View
from forged.http.access import count_requests
from forged.http.direct import CONNECTION
from forged.http.hotdoor import Handoff, HotDoor, IdleConnections, Prefixed
from forged.http.hotpost import HotPosts
from forged.http.hubview import HubView
from forged.http.state import AppState


async def serve(app: Any, hc: HyperConfig, state: AppState | None, *,
                shutdown_trigger: Callable[[], Awaitable[None]], settled: trio.Event,
                task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``app`` as ``hypercorn.trio.serve`` does; with ``state``, through the hot
    door on plain-TCP sockets. ``settled`` is set once the shutdown has stopped the
    accepting and the connections accepted have had their grace (:func:`_stop`)."""
    wrapped = wrap_app(partial(_shielded_close, app), hc.wsgi_max_body_size, "asgi")
    lifespan_state: dict[str, Any] = {}
    lifespan = Lifespan(wrapped, hc, lifespan_state)
    context = WorkerContext(None)
    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as server_nursery:
            general, live = _general(wrapped, hc, context, lifespan_state)
            idle = IdleConnections(lambda: float(hc.keep_alive_timeout))
            listeners, binds, doors = _listeners(hc, general, state, idle, server_nursery)
            task_status.started(binds)
            try:
                async with trio.open_nursery(strict_exception_groups=True) as nursery:
                    for trigger in (shutdown_trigger, context.terminate.wait):
                        nursery.start_soon(raise_shutdown, partial(_closing, trigger, doors))
                    nursery.start_soon(idle.sweep)
                    for listener, handler in listeners:
                        nursery.start_soon(_accept, listener, handler, server_nursery)
                    if doors is not None:
                        nursery.start_soon(doors.run)
                    await trio.sleep_forever()
            except BaseExceptionGroup as error:
                _, other = error.split((ShutdownError, KeyboardInterrupt))
                if other is not None:
                    raise other from None
            finally:
                await _stop(doors, context, idle)
                settled.set()
                _grace(hc.graceful_timeout, server_nursery, lifespan_nursery, live)
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()


def _grace(grace_s: float, connections: trio.Nursery, outside: trio.Nursery,
           live: set[_Connection]) -> None:
    """The connections' grace at shutdown: ``grace_s``, then they are cancelled, and
    the sockets of hypercorn's that remain are closed (:func:`_cut_at`), from a task
    ``outside`` their nursery."""
    end = trio.current_time() + grace_s
    connections.cancel_scope.deadline = end
    outside.start_soon(_cut_at, end, live)


async def _cut_at(end: float, live: set[_Connection]) -> None:
    """At ``end``, or when the listener is ended from outside before (a drain's end:
    every generation has sent its last bytes, or had its drain_timeout), close the
    socket of each of hypercorn's connections still open. hypercorn shields
    every write, and forged the last one of each response (:func:`_shielded_close`):
    no cancellation ends one to a client that reads nothing (stopped, or gone without a
    word, its socket full), and the daemon's stop waited for it forever (under systemd,
    until its SIGKILL, with no session's KV state saved). A write to a closed socket
    ends at once. Once the connections have ended by themselves, ``live`` is empty."""
    try:
        await trio.sleep_until(end)
    finally:
        for conn in list(live):
            conn.cut()


async def _closing(trigger: Callable[[], Awaitable[None]], doors: Doors | None) -> None:
    """``trigger``, then the daemon's copies of the doors' sockets closed before the
    doors stop (Doors.close)."""
    await trigger()
    if doors is not None:
        doors.close()


async def _stop(doors: Doors | None, context: WorkerContext, idle: IdleConnections) -> None:
    """Once the accepting has ended (and the doors, if any, have stopped, handing over
    what they read meanwhile): hypercorn's connections told, and the hot door's
    connections accepted without their request yet given its grace to send one
    (``IdleConnections.close_all``)."""
    if doors is not None:
        doors.close()
    await context.terminated.set()
    await idle.close_all()


async def _shielded_close(app: Any, scope: Scope, receive: ASGIReceiveCallable,
                          send: ASGISendCallable) -> None:
    """``app``, with each response's last body message sent shielded. When a request
    asks for ``Connection: close``, hypercorn closes the connection inside that send,
    after telling the app the request is over; quart-trio's watcher hears that and
    cancels the handler, which cut the close short: the connection stayed open until
    the client closed it. hypercorn shields its socket writes already; this shields
    the close behind the last one."""
    async def send_last_shielded(message: ASGISendEvent) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            with trio.CancelScope(shield=True):
                await send(message)
        else:
            await send(message)

    await app(scope, receive, send_last_shielded)


Listening = tuple[socket.socket | trio.abc.Listener[Any], Handler]


class HotServe(Protocol):
    """The hot door's serve, its handoff bound."""

    async def __call__(self, stream: trio.SocketStream, first: bytes = b"",
                       served: int = 0) -> None: ...


async def _accept(listener: socket.socket | trio.abc.Listener[Any], handler: Handler,
                  nursery: trio.Nursery) -> None:
    if isinstance(listener, trio.abc.Listener):  # TLS: trio's loop, as hypercorn's
        await trio.serve_listeners(handler, [listener], handler_nursery=nursery)
    else:
        await accept_bursts(listener, handler, nursery)


def _general(app: Any, hc: HyperConfig, context: WorkerContext, lifespan_state: dict[str, Any],
             ) -> tuple[Callable[[Any], TCPServer], set[_Connection]]:
    """What makes hypercorn's connection on a stream, and the set of those open."""
    live: set[_Connection] = set()
    state = ConnectionState(lifespan_state.copy())
    return partial(_tcp_server, app, hc, context, state, live), live


def _tcp_server(app: Any, hc: HyperConfig, context: WorkerContext, state: ConnectionState,
                live: set[_Connection], stream: Any) -> TCPServer:
    """hypercorn's connection on ``stream``; on one the hot door answered requests of
    first, with its ``keep_alive_max_requests`` counting them (hypercorn counts from 0:
    a connection could make nearly twice as many)."""
    served = stream.served if isinstance(stream, Prefixed) else 0
    config = cast(HyperConfig, _Served(hc, served)) if served else hc
    return _Connection(live, app, config, context, state, stream)


class _Connection(TCPServer):
    """hypercorn's connection, closed at once when its client ends it (its FIN, or a
    reset) between requests, as the hot door closes one. hypercorn's trio server stops
    reading there but leaves its keep-alive timer running, and only that timer closes
    an idle connection: the socket (in CLOSE-WAIT), its descriptor and its task stayed
    for ``keep_alive_timeout`` (30 s) after the client had gone, and a client that
    half-closes after its request read its answer, then waited that long for the end.
    A request still being answered is not cut: the timer runs only between requests.

    ``live``: the connections open, which a shutdown past its grace cuts (:meth:`cut`)."""

    def __init__(self, live: set[_Connection], *args: Any) -> None:
        super().__init__(*args)
        self._live = live
        self._ended = False  # nothing more can be read
        self._idle = trio.CancelScope()  # the wait of the current (or last) idle period
        # Handed with part of a head: the first wait (for the rest) ends by its time, not
        # a whole keep-alive after the handoff (which let a slow head take twice as long).
        self._head_by = self.stream.head_by if isinstance(self.stream, Prefixed) else math.inf
        # Handed with a request's bytes: it has begun (below, _idle_timeout).
        self._begun = isinstance(self.stream, Prefixed) and bool(self.stream.first)

    async def run(self) -> None:
        self._live.add(self)
        try:
            await super().run()
        finally:
            self._live.discard(self)

    def cut(self) -> None:
        """Close the socket: a write blocked on it, shielded or not, ends at once."""
        stream = self.stream
        transport = getattr(stream, "transport_stream", stream)  # TLS: the socket under it
        transport.socket.close()

    async def _read_data(self) -> None:
        try:
            await super()._read_data()
        finally:
            self._ended = True
            self._idle.cancel()  # ends the wait if idle; a past period's: nothing

    async def _idle_timeout(self) -> None:
        # hypercorn's, but for the client's end, which also ends the wait
        end = min(trio.current_time() + self.config.keep_alive_timeout, self._head_by)
        self._head_by = math.inf
        begun, self._begun = self._begun, False
        with trio.move_on_at(end) as self._idle:
            if not self._ended:
                # A request handed over once the listener was shutting down (a hot POST
                # whose body came late) is answered, as the hot door answers one that
                # has arrived: hypercorn reads it at once, and its start ends this wait.
                # Closing it on the shutdown raced that read: the client got nothing.
                if begun:
                    await trio.sleep_forever()
                else:
                    await self.context.terminated.wait()
        with trio.CancelScope(shield=True):
            await self._initiate_server_close()


class _Served:
    """hypercorn's config as one connection sees it, ``served`` requests in: each
    setting read from ``hc`` when hypercorn needs it (a reload's apply)."""

    def __init__(self, hc: HyperConfig, served: int) -> None:
        self._hc, self._served = hc, served

    def __getattr__(self, name: str) -> Any:
        return getattr(self._hc, name)

    @property
    def keep_alive_max_requests(self) -> int:
        # At least 1: the hot door closes a connection at the limit, never hands it over.
        return max(1, int(self._hc.keep_alive_max_requests) - self._served)


def _listeners(hc: HyperConfig, general: Callable[[Any], TCPServer], state: AppState | None,
               idle: IdleConnections, nursery: trio.Nursery,
               ) -> tuple[list[Listening], list[str], Doors | None]:
    """Each bound socket's listener and the handler of its connections; the binds; the
    door processes that accept the plain-TCP connections instead, if any."""
    sockets = hc.create_sockets()
    out: list[Listening] = []
    binds = []
    ssl_context = hc.create_ssl_context()

    async def hypercorn(stream: Any) -> None:
        await general(stream)

    for sock in sockets.secure_sockets:
        assert ssl_context is not None  # hypercorn makes secure sockets only with one
        sock.listen(hc.backlog)
        out.append((trio.SSLListener(trio.SocketListener(trio.socket.from_stdlib_socket(sock)),
                                     ssl_context, https_compatible=True), hypercorn))
        binds.append(f"https://{repr_socket_addr(sock.family, sock.getsockname())}")
    for sock in sockets.insecure_sockets:
        sock.listen(hc.backlog)
        binds.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")
    plain = list(sockets.insecure_sockets)
    if state is None:
        return out + [(sock, hypercorn) for sock in plain], binds, None
    hub = HubView(state)
    door = HotDoor(hub, tail := ResponseTail(hc), HotPosts(state, tail))
    handoff = Handoff(hypercorn, lambda: int(hc.keep_alive_max_requests), idle)
    here = partial(door.serve, handoff=handoff)
    if plain and (n := state.cfg.door_processes[0]):
        async def accept_here() -> None:
            """No door ready: accept as without doors, on copies of the sockets (an
            accept loop closes its socket when it ends)."""
            async with trio.open_nursery() as accepting:
                for sock in plain:
                    accepting.start_soon(accept_bursts, sock.dup(), here, nursery)

        return out, binds, _doors(n, plain, hub, hc,
                                  partial(_after_door, hypercorn, here, nursery), accept_here)
    return out + [(sock, here) for sock in plain], binds, None


def _doors(n: int, sockets: list[socket.socket], hub: HubView, hc: HyperConfig,
           serve_handed: Callable[[trio.SocketStream, Handed], None],
           accept_here: Callable[[], Awaitable[None]]) -> Doors:
    state = hub.state

    def view() -> View:
        status, body = hub.health()
        return View(on=hub.on, health_status=status, health=body, models=hub.models(),
                    keys=list(hub.keys.by_hash.values()),
                    keep_alive_s=float(hc.keep_alive_timeout),
                    max_requests=int(hc.keep_alive_max_requests), log_level=state.cfg.log.level)

    def counted(message: Counted) -> None:
        for rule, status, key_name, count in message.counts:
            count_requests(state.metrics, rule, status, "none", key_name, "-", count)

    doors = Doors(n, sockets, view, serve_handed, counted, state.metrics.door_restarts.inc,
                  lambda: state.cfg.log.level, accept_here)
    state.door_report = doors.report
    return doors


def _after_door(serve_general: Handler, serve_here: HotServe, nursery: trio.Nursery,
                stream: trio.SocketStream, handed: Handed) -> None:
    """Serve a connection a door process handed over (the door read ``handed.data``
    from it): from a whole head, through the daemon's hot door, which answers the
    generations a door does not (forged.http.hotpost); from part of one, as the hot
    door hands one to hypercorn here, keeping the time the door gave it."""
    async def serve(stream: trio.SocketStream) -> None:
        if not handed.head_s:
            await serve_here(stream, first=handed.data, served=handed.served)
            return
        CONNECTION.set(stream)  # for its requests' direct streams (forged.http.direct)
        head_by = trio.current_time() + handed.head_s
        await serve_general(Prefixed(stream, handed.data, handed.served, head_by))

    nursery.start_soon(connection, stream, serve)
