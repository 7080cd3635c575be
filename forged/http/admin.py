"""The admin listener: statistics and health details, never exposed on the API port.

By default it listens on a Unix socket under ``/run/forged/``, so only local users
with access to that directory (root and the forged group) can reach it. On TCP (for a
Prometheus on another host), statistics, metrics and health stay open to whoever can
reach the port, but actions (a model swap) need ``server.admin_token`` as a bearer
token, and are refused when none is set.
"""

from __future__ import annotations

import dataclasses
import hmac
import os
import time

import msgspec
import trio
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from quart import Response, request
from quart_trio import QuartTrio

from forged import __version__
from forged.config import ServerConfig, door_placement
from forged.engine import testhooks
from forged.engine.groups import ModelGroup
from forged.errors import ModelNotFound, SwapRefused
from forged.http.state import AppState
from forged.observe.page import PAGE_HEADERS, status_page

_json = msgspec.json.Encoder()


def create_admin_app(state: AppState, *, test_hooks: bool = False) -> QuartTrio:
    """The admin listener: what the read-only one serves, and the actions."""
    app = create_metrics_app(state, "forged-admin", cross_origin=False)
    _add_swap(app, state)
    if test_hooks:
        _add_test_hooks(app, state)
    return app


def create_metrics_app(state: AppState, name: str = "forged-metrics", *,
                       cross_origin: bool = True) -> QuartTrio:
    """The read-only routes: the status page, statistics, metrics and health. Served
    alone on ``server.metrics_listen``, where nothing can change the daemon.
    ``cross_origin``: any web page may read /stats (a pool's pages read each other's);
    never on the admin listener, which a TCP admin_listen would otherwise expose to
    every page its admins' browsers open."""
    app = QuartTrio(name)
    app.config.update(RESPONSE_TIMEOUT=30, MAX_CONTENT_LENGTH=64 * 1024)
    page = status_page()
    indexes = _IndexInfos(state)

    @app.get("/")
    @app.get("/status")
    async def status_page_route() -> Response:
        return Response(page, content_type="text/html; charset=utf-8",
                        headers=PAGE_HEADERS)

    @app.get("/stats")
    async def stats() -> Response:
        body = {**_status(state), "indexes": await indexes.get()}
        # The status pages of a pool's other nodes read it from their own origin.
        headers = {"Access-Control-Allow-Origin": "*"} if cross_origin else {}
        return Response(_json.encode(body), content_type="application/json",
                        headers=headers)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.exposed),
                        content_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health() -> Response:
        status = _status(state)
        return Response(_json.encode(status), status=200 if status["ready"] else 503,
                        content_type="application/json")

    return app


class _IndexInfos:
    """The indexes' sizes and ages for /stats: read in a thread (they are SQLite
    queries), at most once every ``EVERY`` seconds however often pages poll."""

    EVERY = 10.0

    def __init__(self, state: AppState) -> None:
        self.state = state
        self.at = -self.EVERY
        self.infos: list[dict[str, object]] = []
        self.lock = trio.Lock()

    async def get(self) -> list[dict[str, object]]:
        # Bounded: searches may hold every thread of the limiter; the page then shows
        # the indexes as last read rather than wait.
        with trio.move_on_after(self.state.cfg.server.door_timeout):
            async with self.lock:
                if trio.current_time() - self.at >= self.EVERY:
                    found = await trio.to_thread.run_sync(
                        self.state.searcher.infos, limiter=self.state.search_limiter)
                    self.infos = [dataclasses.asdict(i) for i in found]
                    self.at = trio.current_time()
        return self.infos


def _add_swap(app: QuartTrio, state: AppState) -> None:
    @app.post("/models/swap")
    async def swap() -> Response:
        if (refused := _refuse_action(state.cfg.server)) is not None:
            return refused
        return await _swap(state)


def _refuse_action(server: ServerConfig) -> Response | None:
    """The answer to an admin action its caller may not take, or None if it may: on a
    Unix socket, the socket's permissions decide; on TCP, the admin token."""
    if server.admin_listen.startswith("unix:"):
        return None
    if not server.admin_token:
        return _answer({"error": "admin actions are off on a TCP admin listener without "
                                 "server.admin_token"}, 403)
    given = request.headers.get("Authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {server.admin_token}".encode()):
        return _answer({"error": "admin actions need 'Authorization: Bearer "
                                 "<server.admin_token>'"}, 401)
    return None


class SwapRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    path: str
    model: str | None = None  # which model to replace: its id (default: [model]'s)


def _answer(body: dict[str, object], status: int = 200) -> Response:
    return Response(_json.encode(body), status=status, content_type="application/json")


async def _swap(state: AppState) -> Response:
    """``forged model swap PATH``: serve the model in PATH instead of a running one.
    200 once it serves; 409 with the reason when refused (the old model serves on)."""
    try:
        req = msgspec.json.decode(await request.get_data(), type=SwapRequest)
        # No model named: [model]'s place, whatever its role (not a chat's default).
        group = (state.models.default if req.model is None
                 else state.models.resolve(req.model, embed=None))
    except (msgspec.MsgspecError, ModelNotFound) as exc:
        return _answer({"error": str(exc)}, 400)
    if state.leaving or state.draining or state.swapper is None:
        return _answer({"error": "the server is shutting down"}, 409)
    if not req.path.startswith("/"):
        return _answer({"error": f"path must be absolute: {req.path!r}"}, 400)
    # A missing file is the load's refusal (409); a NUL byte made open() raise (a 500),
    # and a FIFO blocked the loading thread, the swap lock and a stop, forever.
    if "\0" in req.path or await trio.to_thread.run_sync(_not_a_file, req.path):
        return _answer({"error": f"not a regular file: {req.path!r}"}, 400)
    # The place's current config (its name, its aliases as the last reload left them),
    # with the new file.
    place = state.models.place_of(group)
    model = msgspec.structs.replace(state.cfg.model if place == 0 else group.model,
                                    path=req.path)
    try:
        # given: its errors name the file, not [model].path of a config that never
        # named it.
        group = await state.swapper.swap(state.cfg, place, model, given=True)
    except SwapRefused as exc:
        return _answer({"error": str(exc)}, 409)
    return _answer(_model(group))


def _not_a_file(path: str) -> bool:
    return os.path.lexists(path) and not os.path.isfile(path)


def _model(group: ModelGroup) -> dict[str, object]:
    return {"id": group.listed_id, "ids": group.ids, "status": group.status,
            "path": group.model.path, "workers": len(group.pool.workers),
            "memory_bytes": group.memory, "in_use": group.users}


def _engine(state: AppState) -> dict[str, object]:
    """The node's engine: every model's workers (each says its model), summed."""
    groups = state.models.all()
    each = [(g, g.pool.statistics()) for g in groups]
    workers = [{**w, "model": g.listed_id} for g, s in each
               for w in s["workers"]]  # type: ignore[attr-defined]
    first = each[0][1]
    return {**first, "uptime": time.time() - state.started, "workers": workers,
            "totals": state.totals(),
            "in_flight": sum(g.pool.in_flight() for g in groups),
            "parked": sum(s["parked"] for _, s in each)}  # type: ignore[misc]


def _door(state: AppState) -> dict[str, object]:
    """The CPUs the door keeps to ([]: every CPU), and why; its processes, and why."""
    cpus, why = door_placement(state.cfg.server.door_cpus)
    count, processes_why = state.cfg.door_processes
    return {"cpus": cpus, "why": why, "processes": count, "processes_why": processes_why,
            "process": [], **state.door_report()}


def _status(state: AppState) -> dict[str, object]:
    return {
        "version": __version__,
        "node": state.cfg.node_name,
        "model": state.models.default.model_id,
        "model_path": state.models.default.model.path,
        "models": [_model(g) for g in state.models.all()],
        "ready": state.ready and not (state.leaving or state.draining),
        "draining": state.leaving or state.draining,
        "agent": state.agent_reply().strip(),
        "open_streams": len(state.drain),
        "door": _door(state),
        "limits": msgspec.to_builtins(state.cfg.limits),
        "last_minute": state.metrics.last_minute(),
        "completions": state.metrics.editor_totals(),
        "engine": _engine(state),
    }


def _add_test_hooks(app: QuartTrio, state: AppState) -> None:
    """Fault injection for the test suite; absent unless ``--test-hooks`` is given."""
    _add_slowdowns(app, state)
    _add_holds(app, state)
    _add_worker_faults(app, state)


def _add_slowdowns(app: QuartTrio, state: AppState) -> None:
    """A blocked event loop, and engine steps made slower."""

    @app.post("/debug/block-loop")
    async def block_loop() -> Response:
        seconds = float(request.args.get("seconds", "1"))
        time.sleep(seconds)  # noqa: ASYNC251 (the point: a blocked event loop)
        return Response(b"{}", content_type="application/json")

    @app.post("/debug/slow-steps")
    async def slow_steps() -> Response:
        testhooks.slow_steps(state.models.default.pool, 0,
                             float(request.args.get("seconds", "0")))
        return Response(b"{}", content_type="application/json")


def _add_holds(app: QuartTrio, state: AppState) -> None:
    """Park the next request at a named point of its path, and wait until one is there
    (:class:`forged.http.state.Holds`)."""

    @app.post("/debug/hold")
    async def hold() -> Response:
        assert state.holds is not None
        try:
            state.holds.arm(request.args.get("point", ""))
        except ValueError as exc:
            return Response(_json.encode({"error": str(exc)}), status=400,
                            content_type="application/json")
        return Response(b"{}", content_type="application/json")

    @app.get("/debug/held")
    async def held() -> Response:
        """Answers once a request is parked at the armed point (504 after ``timeout``)."""
        assert state.holds is not None
        reached = state.holds.reached.get(request.args.get("point", ""))
        if reached is None:
            return Response(b'{"error": "not armed"}', status=400,
                            content_type="application/json")
        with trio.move_on_after(float(request.args.get("timeout", "20"))):
            await reached.wait()
        return Response(b"{}", status=200 if reached.is_set() else 504,
                        content_type="application/json")


def _add_worker_faults(app: QuartTrio, state: AppState) -> None:
    """A worker whose loop blocks for ``seconds``, as a stuck llama.cpp call would."""

    @app.post("/debug/hang-worker")
    async def hang_worker() -> Response:
        testhooks.hang_worker(state.models.default.pool, 0,
                              float(request.args.get("seconds", "1")))
        return Response(b"{}", content_type="application/json")
