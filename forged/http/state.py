"""What the HTTP layer shares with the daemon: config, engine, prompter, drain state."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

import trio

from forged.agent.weight import Worker, agent_reply, node_load
from forged.auth import KeyStore
from forged.config import Config
from forged.engine.groups import Models
from forged.engine.stats import Totals, added
from forged.errors import ForgedError
from forged.http.door import in_thread
from forged.http.keylimits import KeyUsage
from forged.observe.metrics import Metrics
from forged.observe.telemetry import Recorder, telemetry_path
from forged.retrieval.query import Searcher

if TYPE_CHECKING:
    from forged.config import ModelConfig
    from forged.engine.groups import ModelGroup
    from forged.http.editor_telemetry import TokenBucket

T = TypeVar("T")


class Swapper(Protocol):
    """What the admin listener asks of the daemon's swapper (forged.daemon.swap): http
    never imports the daemon, which imports it."""

    async def swap(self, cfg: Config, place: int, model: ModelConfig, *,
                   wait: bool = False, given: bool = False) -> ModelGroup: ...


@dataclass
class DrainDeadlines:
    """The drain's deadline, put on every wait on the engine at once, and the count of
    open generations (streamed or not) that the drain waits for.

    ``len()`` counts generations: each request that generates holds ``generation()``
    for its whole life. Each wait on the engine (for admission, for the next events)
    runs in a cancel scope from ``wait_scope()``, given back with ``end_wait()``;
    ``set()``, when a drain begins, puts the deadline on the scopes open and on every
    one opened after."""

    deadline: float = math.inf
    _scopes: set[trio.CancelScope] = field(default_factory=set)
    _generations: int = 0
    _none_open: trio.Event | None = None  # set when the last open generation ends

    @contextmanager
    def generation(self) -> Iterator[None]:
        self._generations += 1
        try:
            yield
        finally:
            self._generations -= 1
            if self._generations == 0 and self._none_open is not None:
                self._none_open.set()

    async def none_open(self) -> None:
        """Until no generation is open (the caller bounds the wait)."""
        while self._generations:
            self._none_open = trio.Event()
            await self._none_open.wait()

    def wait_scope(self) -> trio.CancelScope:
        scope = trio.CancelScope(deadline=self.deadline)
        self._scopes.add(scope)
        return scope

    def end_wait(self, scope: trio.CancelScope) -> None:
        self._scopes.discard(scope)

    def set(self, deadline: float) -> None:
        self.deadline = deadline
        for scope in self._scopes:
            scope.deadline = min(scope.deadline, deadline)

    def __len__(self) -> int:
        return self._generations


@dataclass
class Holds:
    """Test hook (``--test-hooks`` only): park the next request that reaches a named
    point of its path, so that a test can act (drop the client) while it is there.

    Points: ``submitted`` (the engine has the request, not yet admitted), ``admitted``
    (admitted, no response made yet), ``responding`` (the response exists, nothing is
    sent), ``streaming`` (the SSE body has started, nothing is yielded)."""

    POINTS = ("submitted", "admitted", "responding", "streaming")

    armed: set[str] = field(default_factory=set)
    reached: dict[str, trio.Event] = field(default_factory=dict)

    def arm(self, point: str) -> trio.Event:
        if point not in self.POINTS:
            raise ValueError(f"no hold point {point!r}")
        self.armed.add(point)
        self.reached[point] = trio.Event()
        return self.reached[point]

    async def at(self, point: str) -> None:
        if point in self.armed:
            self.armed.discard(point)
            self.reached[point].set()
            await trio.sleep_forever()  # until the client leaves and the handler is cancelled


@dataclass
class AppState:
    cfg: Config
    models: Models
    metrics: Metrics
    started: float = field(default_factory=time.time)
    # A stop has begun and the balancer is being told (agent "drain", /health 503);
    # requests are still served until `draining`, when the drain proper starts.
    leaving: bool = False
    draining: bool = False
    drain: DrainDeadlines = field(default_factory=DrainDeadlines)
    keys: KeyStore = field(default_factory=KeyStore)
    key_usage: dict[str, KeyUsage] = field(default_factory=dict)
    holds: Holds | None = None  # test hooks only
    # The repository indexes, searched in threads, at most retrieval.search_threads at
    # once (forged.http.retrieve).
    searcher: Searcher = field(init=False)
    search_limiter: trio.CapacityLimiter = field(init=False)
    # The door's threads (forged.http.door): CPU work that grows with a request.
    door_limiter: trio.CapacityLimiter = field(init=False)
    # Completion telemetry; its writer task runs in the daemon's nursery.
    telemetry: Recorder = field(init=False)
    # Editor events each key may still send (forged.http.editor_telemetry).
    event_buckets: dict[str, TokenBucket] = field(default_factory=dict)
    # Model swaps, once the engine runs.
    swapper: Swapper | None = None
    # The door processes as /stats shows them (forged.daemon.doors), once they run.
    door_report: Callable[[], dict[str, object]] = dict

    def __post_init__(self) -> None:
        self.telemetry = Recorder(telemetry_path(self.cfg.server.state_dir), self.metrics,
                                  lambda: self.cfg.telemetry)
        self.searcher = Searcher(Path(self.cfg.server.state_dir) / "index")
        self.search_limiter = trio.CapacityLimiter(self.cfg.retrieval.search_threads)
        self.door_limiter = trio.CapacityLimiter(self.cfg.server.door_threads)

    async def off_loop(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` in one of the door's threads (forged.http.door)."""
        return await in_thread(self.door_limiter, self.cfg.server.door_timeout,
                               self.cfg.limits.retry_after, fn, *args)

    @property
    def ready(self) -> bool:
        """Every model has a worker ready (one without would fail its requests)."""
        return all(g.pool.ready for g in self.models.serving)

    def health(self) -> tuple[int, dict[str, str]]:
        """``/health``'s status and body: 503 while leaving the pool or draining (the
        balancer stops sending) and until every model has a worker."""
        if self.leaving or self.draining:
            return 503, {"status": "draining"}
        if not self.ready:
            return 503, {"status": "unavailable"}
        return 200, {"status": "ok"}

    def totals(self) -> Totals:
        """Every model's totals added, and the counters of those gone: the node's."""
        return functools.reduce(added, (g.pool.totals() for g in self.models.all()),
                                self.models.retired)

    def check_capacity(self) -> None:
        """Before a body is read: refuse at once what no model could take now."""
        errors = []
        for group in self.models.serving:
            try:
                group.pool.check_capacity()
                return
            except ForgedError as exc:
                errors.append(exc)
        raise errors[0]

    def agent_reply(self) -> str:
        """The line HAProxy's agent check gets now (forged.agent.weight): over the
        workers of every model serving or draining (a swap's two share the node)."""
        # Not a swap's group still loading: its workers are no capacity yet.
        pools = [g.pool for g in self.models.all() if g.status != "loading"]
        # Each worker against its own model's limits (a swap's two may differ).
        load = node_load([Worker(w.stats if w.ready else None, p.limits.kv_cells,
                                 p.limits.max_running, generates=not p.embedding)
                          for p in pools for w in p.workers])
        return agent_reply(leaving=self.leaving or self.draining, load=load,
                           queue_half=self.cfg.server.agent_queue_half)
