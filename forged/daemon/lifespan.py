"""The daemon's life: load, listen, report ready, serve, reload on HUP, drain on TERM.

Shutdown is built from nested nurseries, as in hypercorn: the engine pool outside,
the HTTP listeners inside. A drain stops the listeners, lets streams run until the
drain deadline, then ends what is left with a final SSE error event; only then is
the engine cancelled, which stops the worker processes.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import ssl
import time
from collections.abc import Callable, Coroutine, Iterable
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import msgspec
import trio
from hypercorn.config import Config as HyperConfig
from quart_trio import QuartTrio

from forged import config as fc
from forged.agent.listener import serve_agent
from forged.auth import KeyStore
from forged.daemon import listener
from forged.daemon.notify import Notifier, watchdog_interval
from forged.daemon.swap import Swapper, open_group, run_group
from forged.daemon.tls import TLS
from forged.engine.groups import ModelGroup, Models, Stamp, file_stamp
from forged.engine.pool import EnginePool
from forged.errors import SwapRefused, sole_fault
from forged.http.admin import create_admin_app, create_metrics_app
from forged.http.api import configure, create_app
from forged.http.state import AppState, Holds
from forged.observe.metrics import Metrics

log = logging.getLogger("forged")
# Beyond the workers' start: the listeners, the doors, the first status line.
_START_MARGIN_S = 60.0
# After the last generation of a drain (and the listeners' grace for the connections
# they had accepted), how long the final bytes get before the listeners (and their idle
# keep-alive connections) are ended.
_LAST_BYTES_S = 0.5
# A bound on a listener's stop: its doors' (forged.daemon.doors.STOP_S) and the grace of
# the connections accepted (forged.http.hotdoor.CLOSING_GRACE_S), with room.
_LISTENER_STOP_S = 10.0


def _listen_fds() -> list[int]:
    """File descriptors passed by systemd socket activation (``LISTEN_FDS``)."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        return []
    n = int(os.environ.get("LISTEN_FDS", "0") or 0)
    return list(range(3, 3 + n))


def _hyper_config(cfg: fc.Config, bind: str) -> HyperConfig:
    hc = HyperConfig()
    hc.bind = [bind]
    # Not hypercorn's read_timeout: it times every socket read, also while a response
    # streams and the client (rightly) sends nothing, and so would cut long SSE streams.
    # Slow bodies are bounded by Quart's BODY_TIMEOUT (server.read_timeout) instead.
    hc.read_timeout = None
    hc.backlog = 1024
    hc.accesslog = None
    hc.errorlog = logging.getLogger("forged.http")
    _live_server_settings(hc, cfg)
    return hc


def _live_server_settings(hc: HyperConfig, cfg: fc.Config) -> None:
    """Settings that hypercorn reads from its config object whenever it needs them (each
    idle period, the shutdown), so that a reload applies them to running listeners."""
    # Also bounds slow headers: hypercorn counts a connection as idle until a request's
    # headers are complete.
    hc.keep_alive_timeout = cfg.server.keep_alive_timeout
    # A backstop behind the drain: streams are ended at drain_timeout by forged itself.
    hc.graceful_timeout = cfg.server.drain_timeout + 5.0


def prune_kv_caches(state_dir: str, keep: set[Path]) -> None:
    """Delete the saved KV states no worker of this start reads, ``keep`` being the
    folders of those that do: a model's no longer configured (and the one-folder layout
    before models had their own), a worker's beyond a lowered ``engine.workers``, and
    every one of a model whose ``engine.cache_disk_mib`` is now 0. None could ever be
    restored, and none would count against a budget."""
    root = Path(state_dir) / "kvcache"
    if not root.is_dir():
        return
    models = {folder.parent for folder in keep}
    for child in root.iterdir():
        if child in models:
            for folder in child.iterdir():
                if folder.is_dir() and folder not in keep:
                    log.info("deleting saved KV states no worker reads: %s", folder)
                    shutil.rmtree(folder, ignore_errors=True)
        elif child.is_dir():  # a model no longer served, or with cache_disk_mib = 0
            log.info("deleting saved KV states no worker reads: %s", child)
            shutil.rmtree(child, ignore_errors=True)


def _status_line(state: AppState, tokens_per_s: float = 0.0) -> str:
    t = state.totals()
    return (f"{len(state.drain)} streams, {int(t.running)} running, "
            f"{int(t.queued_interactive + t.queued_batch)} queued, "
            f"KV {100 * t.kv_cells_used / (t.kv_cells_total or 1):.0f}%, "
            f"{tokens_per_s:.0f} tok/s")


class Daemon:
    def __init__(self, cfg: fc.Config, config_path: Path, *, test_hooks: bool = False,
                 reread: Callable[[], fc.Config] | None = None) -> None:
        self.cfg = cfg
        self.config_path = config_path
        # How a reload reads the config: the file, and forged serve's --listen and
        # --model over it, as at the start (without them a reload swapped the model to
        # the file's and called the address a change that needs a restart).
        self._reread = reread or (lambda: fc.load(config_path))
        self.test_hooks = test_hooks
        self.notifier = Notifier()
        # Made by run(), once the models' vocabularies (and training contexts) are read.
        self.models: Models
        self.swapper: Swapper
        # [model]'s file (path and stamp), and each [[models]] table (by its id) with
        # its file's stamp, as the config last named them: a reload swaps a model only
        # when they change (so a `forged model swap` is not undone by the next reload).
        self._applied_default: tuple[str, Stamp] = ("", (0, 0, 0, 0))
        self._applied: dict[str, tuple[fc.ModelConfig, Stamp]] = {}
        self._reconciling = trio.Lock()  # one reload's model changes at a time
        # Set once the last reload's model changes are done (or refused).
        self.models_applied = trio.Event()
        self.models_applied.set()
        self._shutdown = trio.Event()
        self.state: AppState | None = None
        # Kept for reloads, which change some of their settings live.
        self._api_app: QuartTrio | None = None
        self._hyper_configs: list[HyperConfig] = []
        # The nurseries of the listeners and of the tasks beside them, while serving.
        self._aux: trio.Nursery | None = None
        self._listeners: trio.Nursery | None = None
        self._settled: list[trio.Event] = []  # each listener's, once its stop is over
        self._tls: TLS | None = None  # the API listener's, when server.tls_cert is set
        self.agent_bind: str | None = None  # the agent check's address, once listening
        self.metrics_binds: list[str] = []  # the read-only listener's, once listening
        self.keys = KeyStore.load(Path(cfg.auth.keys_file))
        if not self.keys.enabled:
            log.warning("no API keys in %s: the API is open to anyone who can reach it",
                        cfg.auth.keys_file)

    @property
    def pool(self) -> EnginePool:
        """The default model's workers."""
        return self.models.default.pool

    async def run(self, *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        fix_mmap_threshold()
        # A model file llama.cpp cannot load is a config error (exit 78), not a crash.
        groups: list[ModelGroup] = []
        try:
            for place, model in enumerate(self.cfg.served):
                groups.append(await trio.to_thread.run_sync(
                    lambda p=place, m=model: open_group(  # type: ignore[misc]
                        self.config_path, self.cfg, p, m, p + 1,
                        test_hooks=self.test_hooks)))
            self.models = Models(groups)
            self._applied_default = (groups[0].model.path, groups[0].file.stamp)
            self._applied = {g.key: (g.model, g.file.stamp) for g in groups[1:]}
            await trio.to_thread.run_sync(prune_kv_caches, self.cfg.server.state_dir,
                                          self.models.disk_folders())
            await self._serve_models(task_status)
        finally:
            # Closing twice is harmless: a swap closes the vocabularies it retires.
            live = self.models.all() if hasattr(self, "models") else []
            for group in [*groups, *live]:
                group.close()

    async def _serve_models(self, task_status: trio.TaskStatus[list[str]]) -> None:
        metrics = Metrics(lambda: [(g.listed_id, g.totals(), g.restarts())
                                   for g in self.models.all()], node=self.cfg.node_name)
        state = self.state = AppState(self.cfg, self.models, metrics, keys=self.keys,
                                      holds=Holds() if self.test_hooks else None)
        async with trio.open_nursery() as engine:
            self.swapper = Swapper(self.models, engine, self.config_path,
                                   test_hooks=self.test_hooks)
            state.swapper = self.swapper
            # Every model's workers, one after another, each within its own time.
            self.notifier.extend_start(_START_MARGIN_S + sum(
                g.pool.cfg.engine.group_start_s for g in self.models.serving))
            for group in self.models.serving:
                await engine.start(run_group, group)
            async with trio.open_nursery() as aux:
                async with trio.open_nursery() as listeners:
                    self._aux, self._listeners = aux, listeners
                    binds = await self._start_listeners(listeners, state)
                    if self.cfg.server.agent_listen:
                        # In aux, not listeners: it answers "drain" until the
                        # drain is over, and must not hold the listeners open.
                        self.agent_bind = await aux.start(
                            serve_agent, self.cfg.server.agent_listen, state.agent_reply)
                    aux.start_soon(self._signals, listeners, aux)
                    aux.start_soon(self.status_loop, state)
                    aux.start_soon(state.telemetry.serve)
                    if (interval := watchdog_interval()) is not None:
                        aux.start_soon(self._watchdog_loop, interval)
                    self.notifier.ready(_status_line(state))
                    log.info("ready: model %s, API on %s",
                             ", ".join(g.model_id for g in self.models.serving),
                             ", ".join(binds))
                    task_status.started(binds)
                # The listeners have finished draining.
                aux.cancel_scope.cancel()
            engine.cancel_scope.cancel()

    async def _start_listeners(self, http: trio.Nursery, state: AppState) -> list[str]:
        fds = _listen_fds()
        api_bind = f"fd://{fds[0]}" if fds else self.cfg.server.listen
        self._api_app = create_app(state)
        server = self.cfg.server
        if server.tls_cert:
            try:
                self._tls = TLS(server.tls_cert, server.tls_key)
            except (OSError, ssl.SSLError) as exc:
                raise fc.ConfigError(f"server.tls_cert {server.tls_cert} and server.tls_key "
                                     f"{server.tls_key}: {exc}") from exc
        binds = await self._serve(http, self._api_app, api_bind, self._tls, hot=state)
        admin = self.cfg.server.admin_listen
        if admin.startswith("unix:"):
            Path(admin[5:]).parent.mkdir(parents=True, exist_ok=True)
        admin_binds = await self._serve(
            http, create_admin_app(state, test_hooks=self.test_hooks), admin)
        if admin.startswith("unix:"):
            # Connecting needs write permission: under the unit's UMask=0027 the socket
            # is 0750 and only root and forged could. Its folder keeps others out.
            os.chmod(admin[5:], 0o660)
        log.info("admin listener on %s", ", ".join(admin_binds))
        if server.metrics_listen:
            self.metrics_binds = await self._serve(http, create_metrics_app(state),
                                                   server.metrics_listen)
            if server.metrics_listen.startswith("unix:"):  # as the admin socket's
                os.chmod(server.metrics_listen[5:], 0o660)
            log.info("status page and metrics (read-only) on %s",
                     ", ".join(self.metrics_binds))
        return binds

    async def _serve(self, http: trio.Nursery, app: QuartTrio, bind: str,
                     tls: TLS | None = None, hot: AppState | None = None) -> list[str]:
        """Listen on ``bind`` for ``app``; with ``hot``, through the hot door."""
        hc = _hyper_config(self.cfg, bind)
        if tls is not None:
            tls.serve_with(hc)
        self._hyper_configs.append(hc)
        self._settled.append(settled := trio.Event())
        try:
            binds: list[str] = await http.start(partial(
                listener.serve, app, hc, hot, shutdown_trigger=self._shutdown.wait,
                settled=settled))
        except (OSError, BaseExceptionGroup) as exc:
            # hypercorn binds inside its nurseries: say which address failed, in a line.
            fault = sole_fault(exc, OSError)
            if fault is None:
                raise
            raise RuntimeError(f"cannot listen on {bind}: {fault}") from exc
        return binds

    async def _signals(self, http: trio.Nursery, aux: trio.Nursery) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
            async for sig in sigs:
                if sig == signal.SIGHUP:
                    self.reload()
                elif self.state is not None and (self.state.leaving or self.state.draining):
                    log.warning("second stop signal: stopping now")
                    http.cancel_scope.cancel()
                    return
                elif self.agent_bind is not None and self.cfg.server.drain_grace > 0:
                    aux.start_soon(self.leave_pool)
                else:
                    self.begin_drain()

    async def leave_pool(self) -> None:
        """Tell the balancer first (agent "drain", /health 503) while still serving what
        it sends meanwhile; after ``server.drain_grace`` it has stopped sending, and the
        drain proper begins."""
        assert self.state is not None
        grace = self.cfg.server.drain_grace
        self.notifier.stopping()
        self.state.leaving = True
        log.info("leaving the pool: the agent says drain; draining in %gs", grace)
        await trio.sleep(grace)
        self.begin_drain()

    def begin_drain(self) -> None:
        """Stop taking work; streams get until ``drain_timeout`` to finish."""
        assert self.state is not None
        if not self.state.leaving:
            self.notifier.stopping()
        log.info("draining: %d streams open, %ds deadline", len(self.state.drain),
                 self.cfg.server.drain_timeout)
        self.state.draining = True
        for group in self.models.all():
            group.pool.draining = True
        self.state.drain.set(trio.current_time() + self.cfg.server.drain_timeout)
        self._shutdown.set()
        if self._aux is not None:
            self._aux.start_soon(self._end_listeners_when_drained)

    async def _end_listeners_when_drained(self) -> None:
        """End the listeners once the last generation has finished (or the drain's
        deadline passed), after a moment for its last bytes. On its own, hypercorn holds
        an idle keep-alive connection open for its whole graceful timeout after the
        shutdown: a restart with nothing in flight took drain_timeout + 5 s, while the
        connections arriving meanwhile waited unanswered in the socket.

        Not before each listener's stop is over, though: the connections accepted
        without their request yet have a grace to send it, and door processes hand
        over what they read until they have gone. (Ended half a second into the
        drain, those requests got an empty reply.)"""
        assert self.state is not None and self._listeners is not None
        with trio.move_on_at(self.state.drain.deadline):
            await self.state.drain.none_open()
        with trio.move_on_after(_LISTENER_STOP_S):
            for settled in self._settled:
                await settled.wait()
        await trio.sleep(_LAST_BYTES_S)
        self._listeners.cancel_scope.cancel()

    def reload(self) -> None:
        """Re-read the config; apply what is live, keep the old one if the new is bad."""
        assert self.state is not None
        self.notifier.reloading()
        try:
            new, changed, restart = self._reread_live()
        except fc.ConfigError as exc:
            log.error("reload refused, keeping the running config: %s", exc)
            self.notifier.ready(_status_line(self.state))
            return
        if restart:
            log.warning("reload: these changes need a restart and were not applied: %s",
                        ", ".join(restart))
        if (keys := self._reload_keys(new)) is None:
            self.notifier.ready(_status_line(self.state))
            return
        self._rename_models(new)
        self.cfg = new
        self.state.cfg = new
        self.state.keys = keys
        for group in self.models.all():
            group.pool.set_limits(self._group_config(new, group))
        self.models_applied = trio.Event()
        self.swapper.engine.start_soon(self._apply_models, new, self.models_applied)
        self._reload_listeners(new)
        logging.getLogger().setLevel(new.log.level.upper())
        live = [k for k in changed if k not in restart]
        log.info("reloaded %s; applied: %s; %d API keys", self.config_path,
                 ", ".join(live) or "nothing", len(keys.by_hash))
        self.notifier.ready(_status_line(self.state))

    def _reread_live(self) -> tuple[fc.Config, list[str], list[str]]:
        """The config a reload applies: the file's, with the running values of the keys
        that need a restart; the keys changed, and those of them that need a restart.
        The mix is checked as a whole: each part passed alone, but together they may
        not (a new heartbeat_timeout against the running heartbeat_interval)."""
        new = self._reread()
        changed = fc.changed_keys(self.cfg, new)
        restart = [k for k in changed if k in fc.RESTART_KEYS]
        if restart:
            new = keep_restart_keys(self.cfg, new)
            fc.check(self.config_path, new, "with the running values of the keys that "
                     f"need a restart ({', '.join(restart)})")
        return new, changed, restart

    def _reload_keys(self, new: fc.Config) -> KeyStore | None:
        """The keys file read again; None (logged) when the reload must keep the old
        keys: a file gone while keys are in use (moved, a typo) must not open the API."""
        assert self.state is not None
        try:
            keys = KeyStore.load(Path(new.auth.keys_file), missing_ok=not self.state.keys.enabled)
        except fc.ConfigError as exc:
            log.error("reload refused, keeping the running config and keys: %s", exc)
            return None
        if self.state.keys.enabled and not keys.enabled:
            log.warning("reload: %s holds no key: the API is open to anyone",
                        new.auth.keys_file)
        return keys

    def _reload_listeners(self, new: fc.Config) -> None:
        """What the listeners read live: request limits, timeouts, the TLS files."""
        if self._api_app is not None:
            configure(self._api_app, new)
        for hc in self._hyper_configs:
            _live_server_settings(hc, new)
        if self._tls is not None:
            self._tls.reload()

    def _group_config(self, new: fc.Config, group: ModelGroup) -> fc.Config:
        """``new`` as ``group``'s workers see it. A swap's new model still loading
        takes the place it loads for, as a serving one has its own (it was counted
        beside its predecessor: half the automatic threads for the workers it started
        after the reload); a draining one runs beside the others."""
        if group in self.models.serving:
            new = new.placed(self.models.place_of(group), group.model)
        elif group.status == "loading":
            new = new.placed(group.place, group.model)
        return new.for_model(group.model)

    def _rename_models(self, new: fc.Config) -> None:
        """Aliases are live: the default group answers to the new ones (and keeps the
        ids a swap gave it), and so does a swap's new model loading for its place (its
        ids were the table's at the swap's start: an alias this reload dropped came
        back with it)."""
        dropped = [a for a in self.cfg.model.aliases if a not in new.model.aliases]
        for group in [self.models.default, *self.models.loading_for(0)]:
            kept = [i for i in group.ids if i not in dropped]
            group.ids = [*kept, *(a for a in new.model.aliases if a not in kept)]

    async def _apply_models(self, cfg: fc.Config, done: trio.Event) -> None:
        """A reload's model changes, one after another. What is refused is logged and
        tried again by the next reload; the models serving serve on."""
        try:
            async with self._reconciling:
                await self._apply_default(cfg)
                await self._apply_tables(cfg)
        finally:
            done.set()

    async def _apply_default(self, cfg: fc.Config) -> None:
        """[model] is swapped when its file changed: another path, or a new file at
        it (a package's upgrade)."""
        model = cfg.model
        if (model.path, file_stamp(model.path)) == self._applied_default:
            return
        new = await self._try("swap", model, self.swapper.swap(cfg, 0, model, wait=True))
        if new is not None:
            self._applied_default = (model.path, new.file.stamp)

    async def _apply_tables(self, cfg: fc.Config) -> None:
        """[[models]] tables (models.d/ among them), told apart by their ids: swapped
        when changed (or their file), added when new, withdrawn when gone. Withdrawn
        last, and only once every swap and addition succeeded: a table whose path was
        edited to another file name has a new id, and its old model serves (FIM
        requests naming no model, say) until the new one does; but first if the new
        ids take one of its."""
        tables = {m.model_id: m for m in cfg.models}
        extra = self.models.extra()
        gone = extra.keys() - tables.keys()
        wanted = {i for m in tables.values() for i in m.ids}
        first = {k for k in gone if wanted & set(extra[k].ids)}
        await self._withdraw(cfg, first)
        if await self._swap_and_add(cfg, tables):
            await self._withdraw(cfg, gone - first)
        elif gone - first:
            # A table whose path was edited has a new id: its old model is among those
            # gone, and was withdrawn even when the new one was refused (a FIM model
            # gone with nothing in its place). They serve on until a reload's additions
            # all succeed.
            log.warning("reload: kept %s serving until every model this reload adds "
                        "serves", ", ".join(sorted(gone - first)))

    async def _withdraw(self, cfg: fc.Config, keys: set[str]) -> None:
        for key in keys:
            await self.swapper.withdraw(cfg, key)
            self._applied.pop(key, None)

    async def _swap_and_add(self, cfg: fc.Config, tables: dict[str, fc.ModelConfig]) -> bool:
        """Each changed table swapped, each new one added; False if one was refused."""
        done = True
        for key, model in tables.items():
            group = self.models.extra().get(key)  # now: a swap may have replaced it
            if group is not None and self._applied.get(key) == (model,
                                                                file_stamp(model.path)):
                continue
            if group is None:
                new = await self._try("addition", model, self.swapper.add(cfg, model))
            else:
                place = self.models.place_of(group)
                new = await self._try("swap", model,
                                      self.swapper.swap(cfg, place, model, wait=True))
            if new is not None:
                self._applied[key] = (model, new.file.stamp)
            done = done and new is not None
        return done

    @staticmethod
    async def _try(what: str, model: fc.ModelConfig,
                   work: Coroutine[Any, Any, ModelGroup]) -> ModelGroup | None:
        try:
            return await work
        except SwapRefused as exc:
            log.error("reload: the %s of %s (%s) was refused: %s", what, model.model_id,
                      model.path, exc)
            return None

    async def status_loop(self, state: AppState) -> None:
        last_tokens, last_t = 0.0, time.monotonic()
        while True:
            await trio.sleep(self.cfg.server.status_interval)
            totals = state.totals()
            tokens, now = totals.tokens_generated, time.monotonic()
            rate = max(0.0, tokens - last_tokens) / max(now - last_t, 1e-9)
            last_tokens, last_t = tokens, now
            self.notifier.status(_status_line(state, rate))
            await trio.to_thread.run_sync(give_back_freed_memory)

    async def _watchdog_loop(self, interval: float) -> None:
        # Ping only while the event loop runs and the pools recover their workers: a
        # blocked loop, or a worker its pool failed to replace, stops the pings, and
        # systemd restarts us.
        while True:
            workers = [w for g in self.models.all() for w in g.pool.workers]
            if not workers_unrecovered(workers, time.monotonic(), interval):
                self.notifier.watchdog()
            await trio.sleep(interval)


class _Heard(Protocol):
    ready: bool
    last_heard: float
    engine: fc.EngineConfig


def workers_unrecovered(workers: Iterable[_Heard], now: float, interval: float) -> bool:
    """Whether a worker is silent past its own heartbeat_timeout (when its pool kills
    it) and a ping interval more: its pool failed to recover it. (At half the timeout,
    the pings stopped until the pool had replaced a wedged worker: a gap of at least
    WatchdogSec on the defaults, so systemd killed every model for one worker.)"""
    return any(w.ready and now - w.last_heard > w.engine.heartbeat_timeout + interval
               for w in workers)


def give_back_freed_memory() -> None:
    """Return the heap's free pages to the kernel. glibc keeps what a large request
    freed (a /tokenize answer with pieces of a megabyte's prompt is ~50 MB), so the
    daemon's RSS stayed at each high-water mark in the soak. malloc_trim(0) takes about
    0.1 ms on a 200 MB heap; a libc without it (musl) is left alone."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


def fix_mmap_threshold() -> None:
    """Serve every allocation over 128 KiB from its own mmap, returned to the kernel
    when freed. glibc's default raises that threshold to the largest block freed so
    far (up to 32 MiB), so after one large request a megabyte's body, token array or
    answer came from the heap, and the heap's free pages stayed: the soak's daemon RSS
    rose in high-water steps (135 to 182 MiB) that malloc_trim did not undo. Setting
    the threshold turns the adjustment off (mallopt(3)); 16 concurrent 1 MB /tokenize
    floods then left the RSS at 90 MiB, against 220 without."""
    mallopt = getattr(_LIBC, "mallopt", None)
    if mallopt is not None:  # glibc; musl has no mallopt
        mallopt(_M_MMAP_THRESHOLD, 128 * 1024)


# The process itself: its symbols include the C library's, with no path lookup.
_LIBC = ctypes.CDLL(None)
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def keep_restart_keys(old: fc.Config, new: fc.Config) -> fc.Config:
    parts = {}
    for section in old.__struct_fields__:
        a, b = getattr(old, section), getattr(new, section)
        if not isinstance(a, msgspec.Struct):  # [[models]]: one key, the whole list
            parts[section] = a if section in fc.RESTART_KEYS else b
            continue
        keep = {f: getattr(a, f) for f in a.__struct_fields__
                if f"{section}.{f}" in fc.RESTART_KEYS}
        parts[section] = msgspec.structs.replace(b, **keep)
    return msgspec.structs.replace(new, **parts)
