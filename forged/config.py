"""forged's configuration: strict msgspec Structs decoded from TOML.

Every key has a default here and a comment in the shipped ``etc/forged/forged.toml``.
An unknown key, a wrong type or a value out of range is a :class:`ConfigError` whose
message names the file and the key; the CLI turns it into exit status 78 (EX_CONFIG).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import socket
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

DEFAULT_CONFIG_PATH = Path("/etc/forged/forged.toml")
EX_CONFIG = 78
EX_CANTCREAT = 73

Positive = Annotated[int, msgspec.Meta(ge=1)]
Seconds = Annotated[float, msgspec.Meta(gt=0, le=86400)]
# A request's scheduling class, the one encoding everywhere (config, API keys, the API,
# the wire and the scheduler); PRIORITIES lists them in the order they are served.
Priority = Literal["interactive", "batch"]
PRIORITIES: tuple[Priority, ...] = ("interactive", "batch")


class _Section(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Shared base: unknown keys are an error, values are immutable once loaded."""


class ServerConfig(_Section, frozen=True):
    listen: str = "127.0.0.1:8080"
    admin_listen: str = "unix:/run/forged/admin.sock"
    # Origins whose web pages may call the API from a browser (CORS), such as
    # "https://tools.example.com"; "*": any. Empty: none (browsers block them).
    cors_origins: list[Annotated[str, msgspec.Meta(
        pattern=r"^(\*|https?://[A-Za-z0-9.\-\[\]:]+)$")]] = []
    # A read-only listener (HOST:PORT or unix:PATH) for Prometheus and browsers: the
    # status page at /, /metrics, /stats and /health, never an action. Empty: none
    # (all four are on the admin listener too).
    metrics_listen: str = ""
    # TLS on the API listener: a PEM certificate chain and its key. Both empty: plain
    # HTTP. A reload (SIGHUP) reads the files again, so a renewed certificate is used
    # from the next connection on.
    tls_cert: str = ""
    tls_key: str = ""
    # The token that admin actions (a model swap) need when the admin listener is on
    # TCP; empty: on TCP, actions are refused and only statistics and metrics are served.
    admin_token: str = ""
    # HAProxy's agent check (HOST:PORT, never the API's): one line per connection, the
    # node's weight or its state (docs/operations.md). Empty: no agent.
    agent_listen: str = ""
    # The node's name in metrics labels and `forged status`; empty: the host name.
    node_name: str = ""
    # Seconds between the agent reporting "drain" (and /health 503) on a stop and the
    # drain itself, so that the balancer stops sending first. Only with agent_listen.
    drain_grace: Annotated[float, msgspec.Meta(ge=0, le=600)] = 5.0
    # Seconds of queued prompt work (by the workers' cost model) at which the agent's
    # weight is halved.
    agent_queue_half: Seconds = 2.0
    drain_timeout: Seconds = 30.0
    # Seconds an idle connection, or one still sending its request headers, stays open.
    keep_alive_timeout: Seconds = 30.0
    # Seconds allowed to receive a request body.
    read_timeout: Seconds = 30.0
    max_body_bytes: Positive = 4 * 1024 * 1024
    # Threads for the door's CPU work that grows with a request (large JSON bodies,
    # tokenizing, chat templates, grammars, pieces), so the event loop never does it.
    # A request waits at most door_timeout seconds for one, then gets a 503.
    door_threads: Annotated[int, msgspec.Meta(ge=1, le=64)] = 2
    door_timeout: Seconds = 10.0
    # CPUs the daemon process (the door: HTTP, SSE, the pool) keeps to; the workers then
    # get the others unless engine.cpus places them (forged.placement). []: every CPU,
    # shared. "auto": one physical core's CPUs (the core of the lowest CPU) where forged
    # may use at least AUTO_DOOR_CORES physical cores, else shared (Config.door_cpus).
    door_cpus: list[Annotated[int, msgspec.Meta(ge=0)]] | Literal["auto"] = "auto"
    # Processes that accept the API's plain-TCP connections and answer the hot routes
    # (forged.daemon.doors), handing every other connection to the daemon. 0: the
    # daemon accepts them itself. "auto": one for each physical core of door_cpus past
    # the first, which the daemon keeps (Config.door_processes).
    door_processes: Annotated[int, msgspec.Meta(ge=0, le=64)] | Literal["auto"] = "auto"
    # GET /health, GET /v1/models and plain chat and completion POSTs answered off the
    # socket, without hypercorn and Quart (forged.http.hotdoor, hotpost), and streams'
    # frames written straight to the socket by the pool's reader (forged.http.direct):
    # the same bytes, less CPU.
    hot_door: bool = True
    # Milliseconds a streamed token may wait to share a frame from the worker and a
    # write with the next ones, when steps come faster than that (0: each step at once;
    # forged.engine.hold, generate.Pace).
    stream_coalesce_ms: Annotated[float, msgspec.Meta(ge=0, le=100)] = 5.0
    status_interval: Seconds = 5.0
    # Where forged keeps state; checked to be writable at startup (exit 73 if not).
    state_dir: str = "/var/lib/forged"


class ModelConfig(_Section, frozen=True):
    # A reload with a new path (or a new file at the same path) swaps the model under
    # live traffic (docs/operations.md, "Changing the model").
    path: str = "/usr/share/forged/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    # The id clients pass as "model"; empty means the file name without ".gguf".
    name: str = ""
    # Extra ids accepted as aliases of this model (for clients that hard-code one).
    aliases: list[str] = []
    # Override of the GGUF's chat template (a Jinja2 string); empty uses the GGUF's.
    chat_template: str = ""
    # This model's own [engine] settings (slots, context, threads, ...), over [engine]'s:
    # a small FIM model beside a large chat model is sized apart.
    engine: dict[str, Any] = {}
    # Which requests naming no model it serves: "fim" (/infill, completions with a
    # suffix), "chat" (chat and other completions) or "embed" (embeddings: an
    # embedding model, which serves nothing else). Empty: from the GGUF, "embed" if it
    # pools (an embedding model), "fim" if it has fill-in-the-middle tokens, else
    # "chat" (docs/operations.md, "Roles").
    role: Literal["", "chat", "fim", "embed"] = ""

    @property
    def model_id(self) -> str:
        return self.name or Path(self.path).name.removesuffix(".gguf")

    @property
    def ids(self) -> list[str]:
        """Every id a request may name it by: its own, then its aliases."""
        return [self.model_id, *self.aliases]


class EngineConfig(_Section, frozen=True):
    workers: Annotated[int, msgspec.Meta(ge=1, le=16)] = 1
    # llama.cpp threads per worker; 0: the physical cores of the CPUs the worker runs
    # on, shared evenly by every worker that runs on the same CPUs (Config.for_model).
    threads: Annotated[int, msgspec.Meta(ge=0, le=512)] = 0
    # Total KV cells per worker, shared by every sequence (unified KV cache).
    kv_cells: Annotated[int, msgspec.Meta(ge=256)] = 32768
    # Longest prompt + completion one request may use; 0 means the model's training context,
    # or the room of one request if that is smaller: a model brings its own (a coder
    # trained on 32k gets what kv_cells / slots gives it, up to that).
    max_context: Annotated[int, msgspec.Meta(ge=0)] = 0
    # Sequence slots per worker; idle slots keep their KV as prefix cache.
    slots: Annotated[int, msgspec.Meta(ge=1, le=255)] = 16
    # Sequences decoding at once per worker.
    max_running: Annotated[int, msgspec.Meta(ge=1, le=255)] = 16
    # The most tokens one llama_decode step carries: running sequences first, prompt
    # chunks with the rest, as far as target_step_ms allows.
    step_tokens: Annotated[int, msgspec.Meta(ge=8, le=8192)] = 256
    # The same while no sequence is decoding. 0: the same as step_tokens.
    prefill_step_tokens: Annotated[int, msgspec.Meta(ge=0, le=8192)] = 256
    # A step's predicted duration (the cost model fitted from measured steps) stays
    # within this: it bounds every stream's inter-token latency while prompts are
    # computed beside it, and how long a new short prompt waits for the step to end.
    target_step_ms: Annotated[float, msgspec.Meta(ge=5, le=60000)] = 300.0
    # The step's budget follows the work: while streams decode, a step's prompt work may
    # take the decoders' own cost x this x (requests waiting for a first token ÷ streams
    # decoding), up to target_step_ms, which is the ceiling. A step in which a prompt can
    # finish within the ceiling takes it. Higher favours first tokens, lower the gaps;
    # inf (the default): every step with prompt work runs to target_step_ms. Measured in
    # docs/benchmarks.md: 4 shortened light load's gaps and made a closed loop's longer.
    first_token_weight: Annotated[float, msgspec.Meta(ge=0)] = math.inf
    # "auto": each worker times a few steps both ways when it starts and takes flash
    # attention only where it is 10% faster (forged status says what it measured).
    # Its worth depends on the CPU: on one machine it made a step of 15 streams 1,000
    # tokens deep twice as long (237 against 120 ms, docs/engine.md); on another,
    # llama-server was faster with it at every load. true/false: fixed.
    flash_attn: bool | Literal["auto"] = "auto"
    # CPUs this model's workers (and llama.cpp's threads) run on; []: every CPU but
    # server.door_cpus.
    cpus: list[Annotated[int, msgspec.Meta(ge=0)]] = []
    # "per_slot": each slot owns kv_cells / slots cells (attention reads only its own);
    # "unified": one cache shared by all slots (prefixes shared in place, but every
    # decode step attends over all cells in use). See docs/engine.md.
    kv_layout: Literal["per_slot", "unified"] = "per_slot"
    # Cells kept free of reservations, so llama.cpp's slot search never runs dry.
    kv_headroom: Annotated[int, msgspec.Meta(ge=0)] = 64
    # Decode cells reserved per request at admission (beyond its prompt). A request
    # that outgrows it may preempt the newest batch/interactive request, which is then
    # recomputed: more concurrency for the same memory.
    decode_reservation: Positive = 256
    # Host RAM for the KV state of evicted slots, restored by prefix match instead of
    # recomputed (llama-server's --cache-ram). 0: off. Per worker.
    cache_ram_mib: Annotated[int, msgspec.Meta(ge=0)] = 4096
    # Disk (under server.state_dir/kvcache) for sessions' KV state when it leaves RAM
    # and when the daemon stops, restored after a restart or upgrade. 0: off. Per worker.
    cache_disk_mib: Annotated[int, msgspec.Meta(ge=0)] = 8192
    heartbeat_interval: Seconds = 1.0
    # A worker that sends nothing for this long is killed and restarted.
    heartbeat_timeout: Seconds = 30.0
    # Seconds before restarting a worker that died; doubled for each further death in
    # a row, up to restart_backoff_max.
    restart_backoff: Seconds = 0.5
    restart_backoff_max: Seconds = 30.0
    startup_timeout: Seconds = 300.0
    # With several workers: "cache_aware" sends a request to the worker whose caches
    # hold the longest prefix of its prompt, traded against load (forged.engine.routing);
    # "least_loaded" to the worker with the fewest open requests.
    routing: Literal["cache_aware", "least_loaded"] = "cache_aware"
    # The share of a prompt a worker must hold for the cache to decide.
    route_min_match: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.3
    # Open requests the cache holder may carry beyond the least loaded worker.
    route_imbalance: Annotated[int, msgspec.Meta(ge=0)] = 8
    # Memory (MiB) the models' weights and KV caches may take together; a model swap
    # that would pass it is refused. 0: what the kernel reports available at the swap.
    memory_mib: Annotated[int, msgspec.Meta(ge=0)] = 0

    @property
    def group_start_s(self) -> float:
        """How long a model's workers may take to start: startup_timeout is each
        worker's, and they start one after another (a swap gave the whole group one
        worker's time; systemd's TimeoutStartSec ran out first at a start)."""
        return self.startup_timeout * self.workers

    @property
    def per_slot_cells(self) -> int:
        """Cells of one slot's own stream; 0 in the unified layout."""
        return self.kv_cells // self.slots if self.kv_layout == "per_slot" else 0

    @property
    def room(self) -> int:
        """The most cells one request may use: its slot's stream, or the unified
        cache less the headroom kept for llama.cpp."""
        return self.per_slot_cells or self.kv_cells - self.kv_headroom

    @property
    def heartbeat_late(self) -> float:
        """Seconds of silence after which no new request is routed to a worker: a few
        heartbeats, or many steps, whichever is longer."""
        return max(3 * self.heartbeat_interval, 10 * self.target_step_ms / 1000)


class LimitsConfig(_Section, frozen=True):
    max_queued: Annotated[int, msgspec.Meta(ge=0)] = 256
    max_queued_tokens: Annotated[int, msgspec.Meta(ge=0)] = 262144
    queue_timeout: Seconds = 60.0
    # Shortest prompt first, with aging: a prompt of engine.max_context tokens may be
    # overtaken by shorter ones for at most this many seconds, a shorter one for its
    # share of it (a tenth of max_context: a tenth of the window). 0: arrival order.
    overtake_window: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 30.0
    # Seconds a finished turn's KV stays pinned to its `session` (the next turn then
    # computes only its new tokens); unpinned caches are evicted before pinned ones.
    session_ttl: Annotated[float, msgspec.Meta(ge=0, le=86400)] = 600.0
    # max_tokens when the caller does not set one (clipped to the context).
    default_max_tokens: Positive = 1024
    # Zed's Ollama edit predictions send 14 (every FIM marker it knows).
    max_stop: Annotated[int, msgspec.Meta(ge=0, le=64)] = 16
    max_stop_length: Positive = 256
    max_messages: Positive = 1024
    max_logit_bias: Annotated[int, msgspec.Meta(ge=0)] = 1024
    max_json_depth: Positive = 32
    default_priority: Priority = "interactive"
    # Fill-in-the-middle (/infill, and `suffix` on /v1/completions): the batch size
    # llama.cpp's /infill layout divides. The code before the cursor keeps its last
    # 3/4 of it, the code after the cursor its first 1/4, and input_extra what is left
    # of the context once room for the completion is kept.
    infill_batch: Annotated[int, msgspec.Meta(ge=16, le=65536)] = 1024
    retry_after: Annotated[int, msgspec.Meta(ge=1)] = 2


class AuthConfig(_Section, frozen=True):
    # API keys (SHA-256 hashes), written by `forged keys add`. No keys: an open API.
    keys_file: str = "/etc/forged/keys.toml"


class LogConfig(_Section, frozen=True):
    level: Literal["debug", "info", "warning", "error"] = "info"
    # Add each generation's prompt (as sent) and completion to its access-log line.
    log_content: bool = False


class RetrievalConfig(_Section, frozen=True):
    # Index searches running at once (in threads, never on the event loop nor in the
    # decode worker); more wait for a place.
    search_threads: Annotated[int, msgspec.Meta(ge=1, le=64)] = 2
    # The most chunks one /v1/retrieve call may ask for.
    max_k: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 50
    # A generation with `repo`: the most chunks inserted, and the most prompt tokens
    # they may take together (a chunk that would pass it is left out whole).
    context_chunks: Annotated[int, msgspec.Meta(ge=0, le=64)] = 4
    context_tokens: Annotated[int, msgspec.Meta(ge=0, le=65536)] = 512
    # Lines of code before the cursor (and after it) whose identifiers make the query.
    query_lines: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 8


class TelemetryConfig(_Section, frozen=True):
    # Days completions', editor events' and usage sums' records are kept
    # (server.state_dir/telemetry.sqlite3); older ones are deleted every few minutes.
    retention_days: Annotated[int, msgspec.Meta(ge=1, le=3650)] = 30
    # The most rows completions and events each keep (usage is one row per key, model
    # and day, pruned by age only), the oldest deleted first: the file
    # stops growing (about 125 bytes a row: some 500 MB at the default).
    max_rows: Annotated[int, msgspec.Meta(ge=1000, le=1_000_000_000)] = 2_000_000
    # Editor events (/v1/events) per API key: this many a second on average, and this
    # many at once after a quiet while; beyond them, 429.
    event_rate: Annotated[float, msgspec.Meta(gt=0, le=100_000)] = 10.0
    event_burst: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 100


class ResponsesConfig(_Section, frozen=True):
    # OpenAI's Responses API (/v1/responses): responses kept in memory for
    # previous_response_id and GET /v1/responses/{id}, at most this many (the oldest of
    # the key holding the most go first), each for at most `retention` seconds. Lost on
    # a restart.
    max_stored: Positive = 1000
    retention: Seconds = 3600.0


class Config(_Section, frozen=True):
    server: ServerConfig = ServerConfig()
    model: ModelConfig = ModelConfig()
    engine: EngineConfig = EngineConfig()
    limits: LimitsConfig = LimitsConfig()
    auth: AuthConfig = AuthConfig()
    log: LogConfig = LogConfig()
    retrieval: RetrievalConfig = RetrievalConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    responses: ResponsesConfig = ResponsesConfig()
    # Further models served beside [model], each by engine.workers workers of its own
    # ([[models]] tables, here and in models.d/; a request picks one by its "model").
    models: list[ModelConfig] = []

    @property
    def model_id(self) -> str:
        return self.model.model_id

    @property
    def served(self) -> list[ModelConfig]:
        """Every model served: [model] first (the default), then [[models]]."""
        return [self.model, *self.models]

    def placed(self, place: int, model: ModelConfig) -> Config:
        """This config with ``model`` served at ``place`` (0: [model]): a swap's new model
        takes its predecessor's place, so what is divided among the models served (the
        automatic threads) counts it once, not beside the model it replaces."""
        if place == 0:
            return msgspec.structs.replace(self, model=model)
        models = [*self.models]
        models[place - 1:place] = [model]  # past the end: one more
        return msgspec.structs.replace(self, models=models)

    def for_model(self, model: ModelConfig) -> Config:
        """This config as ``model``'s workers see it: [engine] with the model's own
        settings over it (checked at load: see ``_check``), its threads resolved."""
        engine = self._engine_of(model)
        if not engine.threads:
            engine = msgspec.structs.replace(engine, threads=self._auto_threads(model)[0])
        return self if engine is self.engine else msgspec.structs.replace(self, engine=engine)

    @property
    def door_cpus(self) -> list[int]:
        """The CPUs the door keeps to, ``server.door_cpus`` resolved ([]: every CPU)."""
        return door_placement(self.server.door_cpus)[0]

    @property
    def door_processes(self) -> tuple[int, str]:
        """How many door processes accept the API's connections (0: the daemon does),
        ``server.door_processes`` resolved, and why (forged status)."""
        setting = self.server.door_processes
        if self.server.tls_cert and setting:  # doors take plain TCP only
            return 0, "server.tls_cert is set: the daemon accepts TLS connections itself"
        if not self.server.hot_door and setting:  # a door would hand over every request
            return 0, "server.hot_door = false: the daemon accepts"
        if self.server.cors_origins and setting:  # the hot door answers no CORS request
            return 0, "server.cors_origins is set: the daemon accepts"
        if setting != "auto":
            return setting, "set in the config"
        cores = len(core_groups(self.door_cpus)) if self.door_cpus else 0
        if cores < 2:
            return 0, ('server.door_processes = "auto": the door has '
                       f"{'one core' if cores else 'no core of its own'}: the daemon accepts")
        return cores - 1, (f'server.door_processes = "auto": one for each of the door\'s '
                           f"{cores} physical cores but the daemon's")

    def threads_why(self, model: ModelConfig) -> str:
        """Why ``model``'s workers run the threads they do, for ``forged status``."""
        if self._engine_of(model).threads:
            return "set in the config"
        return self._auto_threads(model)[1]

    def _engine_of(self, model: ModelConfig) -> EngineConfig:
        if not model.engine:
            return self.engine
        merged = {**msgspec.to_builtins(self.engine), **model.engine}
        return msgspec.convert(merged, EngineConfig)

    def _auto_threads(self, model: ModelConfig) -> tuple[int, str]:
        """``engine.threads = 0``: the physical cores of the CPUs ``model``'s workers run
        on, divided evenly among every worker of every model served on the same CPUs
        (an embedding model's too), at least one each. llama.cpp's threads spin while
        they wait for each other, so two workers whose threads outnumber the cores
        slow each other down (docs/operations.md, "CPUs: the door and the workers")."""
        def cpus(m: ModelConfig) -> frozenset[int]:
            return frozenset(worker_cpus(self._engine_of(m).cpus, self.door_cpus)
                             ) or STARTED_ON

        mine = cpus(model)
        served = self.served if model in self.served else [*self.served, model]
        sharing = max(1, sum(self._engine_of(m).workers for m in served if cpus(m) == mine))
        cores = physical_cores(mine)
        return max(1, cores // sharing), (f"engine.threads = 0: {cores} physical cores for "
                                          f"{sharing} worker{'s' * (sharing > 1)}")

    @property
    def node_name(self) -> str:
        """This node's name in a pool: ``server.node_name``, or the host name."""
        return self.server.node_name or socket.gethostname()


class ConfigError(Exception):
    """A config that must not be used. ``str()`` is one line for the operator."""


_MSGSPEC_PATH = re.compile(r"^(?P<msg>.*?)(?: - at `\$\.?(?P<path>[^`]*)`)?$", re.S)


def _explain(path: Path, err: msgspec.MsgspecError, within: str = "") -> ConfigError:
    m = _MSGSPEC_PATH.match(str(err))
    assert m is not None  # the pattern matches any string
    msg, key = m.group("msg"), m.group("path")
    key = ".".join(k for k in (within, key) if k)
    unknown = re.match(r"Object contains unknown field `([^`]*)`", msg)
    if unknown:
        key = f"{key}.{unknown.group(1)}" if key else unknown.group(1)
        msg = "unknown key"
    where = f"{path}: {key}" if key else str(path)
    return ConfigError(f"{where}: {msg}")


def check(path: Path, cfg: Config, context: str) -> None:
    """Validate ``cfg`` as a file's config is; an error names ``context`` (what makes
    it other than the file: a reload's mix of the file and the running values)."""
    try:
        _check(path, cfg)
    except ConfigError as exc:
        raise ConfigError(f"{exc} ({context})") from exc


def _check(path: Path, cfg: Config) -> None:
    _check_engine(path, "engine", cfg.engine)
    for place, model in enumerate(cfg.served):
        check_model_engine(path, "model" if place == 0 else f"models[{place - 1}]",
                            cfg, model)
    _parse_listen(path, "server.listen", cfg.server.listen)
    _parse_listen(path, "server.admin_listen", cfg.server.admin_listen)
    if cfg.server.metrics_listen:
        _parse_listen(path, "server.metrics_listen", cfg.server.metrics_listen)
    _check_agent_listen(path, cfg.server)
    _check_listeners_apart(path, cfg.server)
    _check_model_ids(path, cfg)
    if cfg.server.door_cpus != "auto":
        _check_cpus(path, "server.door_cpus", cfg.server.door_cpus)
    if bool(cfg.server.tls_cert) != bool(cfg.server.tls_key):
        raise ConfigError(f"{path}: server.tls_cert and server.tls_key: set both (TLS) "
                          "or neither (plain HTTP)")


def check_model_engine(path: Path, key: str, cfg: Config, model: ModelConfig) -> None:
    """The model's own engine settings, over ``cfg``'s [engine], keep its rules."""
    if not model.engine:
        return
    try:
        engine = cfg.for_model(model).engine
    except msgspec.MsgspecError as exc:
        raise _explain(path, exc, f"{key}.engine") from exc
    _check_engine(path, f"{key}.engine", engine)


# The CPUs forged was started on (systemd's CPUAffinity=, taskset), read when the
# config is first imported: before the daemon keeps to server.door_cpus, so that a
# reload still checks against them, and its workers can be given the others
# (forged.placement).
STARTED_ON = frozenset(os.sched_getaffinity(0))
_SYS_CPU = Path("/sys/devices/system/cpu")


def worker_cpus(engine_cpus: list[int], door_cpus: list[int]) -> list[int]:
    """A worker's CPUs: its model's ``engine.cpus``; else, with ``server.door_cpus``,
    every CPU forged was started on but the door's (all of them, if the door took
    every one); else [], which keeps the worker where it was started."""
    if engine_cpus:
        return sorted(engine_cpus)
    if door_cpus:
        return sorted((STARTED_ON - set(door_cpus)) or STARTED_ON)
    return []


def physical_cores(cpus: Iterable[int], root: Path | None = None) -> int:
    """How many physical cores ``cpus`` (logical CPUs) belong to: hyperthreads of one
    core count once, as llama.cpp counts its default threads. A CPU whose topology
    cannot be read counts as a core of its own."""
    return len(core_groups(cpus, root))


def core_groups(cpus: Iterable[int], root: Path | None = None) -> list[list[int]]:
    """``cpus`` by the physical core each belongs to (see :func:`physical_cores`),
    each group's CPUs in order."""
    return [list(group) for group in _core_groups(frozenset(cpus), root or _SYS_CPU)]


@functools.lru_cache(maxsize=64)
def _core_groups(cpus: frozenset[int], root: Path) -> tuple[tuple[int, ...], ...]:
    """Read once: the topology does not change while forged runs, and ``forged
    status`` asks for the door's placement (door_placement) on every call."""
    cores: dict[tuple[str, str] | int, list[int]] = {}
    for cpu in sorted(cpus):
        topology = root / f"cpu{cpu}" / "topology"
        core: tuple[str, str] | int
        try:
            core = ((topology / "physical_package_id").read_text().strip(),
                    (topology / "core_id").read_text().strip())
        except OSError:
            core = cpu
        cores.setdefault(core, []).append(cpu)
    return tuple(tuple(group) for group in cores.values())


# server.door_cpus = "auto" gives the door a core of its own from this many physical
# cores up. Below it a decode thread is worth more than the isolation: on 2 cores,
# placing the door took half the threads and made quiet gaps 1.7x longer, while door
# traffic stalled streams only under a flood (docs/benchmarks.md, "The front door's
# cost"); with 8, one core is an eighth of the threads, and a batch's decode on a
# larger model is bound by memory bandwidth more than by the last core.
AUTO_DOOR_CORES = 8


def door_placement(setting: list[int] | Literal["auto"]) -> tuple[list[int], str]:
    """The CPUs the door keeps to for ``server.door_cpus`` ([]: every CPU), and why
    (forged status). "auto" takes the core of the lowest CPU forged may use, with its
    hyperthreads: CPU 0 usually takes the machine's housekeeping interrupts, which a
    door's event loop absorbs and llama.cpp's threads, spinning in step, would all wait
    for."""
    if setting != "auto":
        return sorted(setting), "set in the config"
    groups = core_groups(STARTED_ON)
    if len(groups) < AUTO_DOOR_CORES:
        return [], (f'server.door_cpus = "auto": {len(groups)} physical cores, fewer than '
                    f"{AUTO_DOOR_CORES}: the door shares them")
    first = min(groups)
    return first, (f'server.door_cpus = "auto": one of {len(groups)} physical cores')


def _check_cpus(path: Path, key: str, cpus: list[int]) -> None:
    if unknown := sorted(set(cpus) - STARTED_ON):
        raise ConfigError(f"{path}: {key}: CPU {unknown[0]} is not one forged may run on "
                          f"(this machine, or the service's CPUAffinity=, allows "
                          f"{sorted(STARTED_ON)})")


def _check_engine(path: Path, section: str, eng: EngineConfig) -> None:
    """The engine settings' rules: ``section`` names where they came from."""
    where = f"{path}: {section}"
    _check_cpus(path, f"{section}.cpus", eng.cpus)
    if eng.max_running > eng.slots:
        raise ConfigError(f"{where}.max_running: must not exceed engine.slots ({eng.slots})")
    if eng.step_tokens < eng.max_running:
        raise ConfigError(
            f"{where}.step_tokens: must be at least engine.max_running ({eng.max_running})"
            " so that every running sequence decodes each step"
        )
    if eng.step_tokens < eng.slots:
        # llama.cpp reserves one output row per sequence in a batch and aborts the
        # process if the batch size is smaller than the number of sequences.
        raise ConfigError(
            f"{where}.step_tokens: must be at least engine.slots ({eng.slots})")
    if eng.max_context > eng.room:
        raise ConfigError(
            f"{where}.max_context: must not exceed the cells one request may use "
            f"({eng.room}: " + ("kv_cells / slots" if eng.per_slot_cells
                                else "kv_cells - kv_headroom") + ")")
    if eng.heartbeat_timeout <= eng.heartbeat_late:
        # A step runs between two heartbeats: a timeout shorter than the longest step
        # the targets allow would kill healthy workers.
        raise ConfigError(
            f"{where}.heartbeat_timeout: must exceed {eng.heartbeat_late:g} s "
            "(3 x heartbeat_interval, and 10 x target_step_ms)")


def _check_model_ids(path: Path, cfg: Config) -> None:
    seen: set[str] = set()
    for i, model in enumerate(cfg.served):
        key = "model" if i == 0 else f"models[{i - 1}]"
        for model_id in model.ids:
            if model_id in seen:
                raise ConfigError(f"{path}: {key}: the model id {model_id!r} is already "
                                  "taken by another model")
            seen.add(model_id)


def _check_agent_listen(path: Path, server: ServerConfig) -> None:
    agent = server.agent_listen
    if not agent:
        return
    if agent.startswith(("unix:", "fd://")):
        raise ConfigError(f"{path}: server.agent_listen: HAProxy's agent speaks TCP: "
                          f"expected HOST:PORT, got {agent!r}")
    _parse_listen(path, "server.agent_listen", agent)


_LISTENERS = ("listen", "admin_listen", "metrics_listen", "agent_listen")
_WILDCARDS = frozenset({"0.0.0.0", "::", "[::]", "*", ""})


def _check_listeners_apart(path: Path, server: ServerConfig) -> None:
    """No two listeners on one address: the second bind failed at start ("address in
    use", a restart loop), or, on one Unix path, hypercorn deleted the first socket's
    file and took its path (the metrics app answered the admin's requests)."""
    seen: dict[str, str] = {}
    for key in _LISTENERS:
        value = getattr(server, key)
        if not value:
            continue
        for other_key, other in seen.items():
            if _same_address(value, other):
                raise ConfigError(f"{path}: server.{key}: {value!r} is server.{other_key}'s "
                                  "address too; each listener needs its own")
        seen[key] = value


def _same_address(a: str, b: str) -> bool:
    if a.startswith(("unix:", "fd://")) or b.startswith(("unix:", "fd://")):
        return a == b
    (host_a, _, port_a), (host_b, _, port_b) = a.rpartition(":"), b.rpartition(":")
    if port_a != port_b or int(port_a) == 0:  # port 0: each bind its own free port
        return False
    return host_a == host_b or host_a in _WILDCARDS or host_b in _WILDCARDS


def _parse_listen(path: Path | str, key: str, value: str) -> None:
    if value.startswith(("unix:", "fd://")):
        return
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{path}: {key}: expected HOST:PORT, unix:PATH or fd://N, got {value!r}")


def check_model(path: Path | str, cfg: Config) -> None:
    for i, served in enumerate(cfg.served):
        key = "model.path" if i == 0 else f"models[{i - 1}].path"
        model = Path(served.path)
        if not model.is_file():
            raise ConfigError(f"{path}: {key}: no such file: {model}")
        if not os.access(model, os.R_OK):
            raise ConfigError(f"{path}: {key}: not readable: {model}")


class DropIn(_Section, frozen=True):
    """A file of ``models.d/``: [[models]] tables, as the main file has them."""
    models: list[ModelConfig] = []


def drop_in_dir(path: Path) -> Path:
    """Where the drop-ins of the config file ``path`` are: ``models.d/`` beside it."""
    return path.parent / "models.d"


def load(path: Path, *, require_file: bool = True) -> Config:
    """Read and validate ``path``, then add the models of its drop-ins (``models.d/``).
    A missing file gives the defaults unless required."""
    cfg = _load_main(path, require_file=require_file)
    for drop_in in sorted(drop_in_dir(path).glob("*.toml")):
        cfg = _add_drop_in(drop_in, cfg)
    return cfg


def _load_main(path: Path, *, require_file: bool) -> Config:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        if require_file:
            raise ConfigError(f"{path}: no such file") from None
        raw = b""
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    try:
        cfg = msgspec.toml.decode(raw, type=Config)
    except msgspec.MsgspecError as exc:
        raise _explain(path, exc) from exc
    _check(path, cfg)
    return cfg


def _add_drop_in(path: Path, cfg: Config) -> Config:
    """``cfg`` with the drop-in's models after its own; errors name the drop-in. A
    table whose GGUF is not there is left out, with a warning: removing a model
    package keeps its drop-in (a conffile) until it is purged."""
    try:
        tables = msgspec.toml.decode(path.read_bytes(), type=DropIn).models
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    except msgspec.MsgspecError as exc:
        raise _explain(path, exc) from exc
    taken = {i for m in cfg.served for i in m.ids}
    kept = []
    for n, model in enumerate(tables):
        if not os.path.exists(model.path):
            logging.getLogger("forged").warning(
                "%s: models[%d]: no model file at %s (its package removed?): not served",
                path, n, model.path)
            continue
        check_model_engine(path, f"models[{n}]", cfg, model)
        clash = taken.intersection(model.ids)
        if clash:
            raise ConfigError(f"{path}: models[{n}]: the model id {sorted(clash)[0]!r} is "
                              "already taken by another model")
        taken.update(model.ids)
        kept.append(model)
    return msgspec.structs.replace(cfg, models=[*cfg.models, *kept])


def with_overrides(
    cfg: Config, *, listen: str | None = None, model: str | None = None
) -> Config:
    """Apply command-line flags, which win over the file."""
    if listen is not None:
        _parse_listen("--listen", "value", listen)
        server = msgspec.structs.replace(cfg.server, listen=listen)
        cfg = msgspec.structs.replace(cfg, server=server)
    if model is not None:
        cfg = msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, path=model))
    return cfg


# Keys whose change needs a restart: they shape the model, the listeners or the KV
# cache, or reach the workers only in their Init frame (kv_headroom, heartbeat_interval).
# Every other key is applied by a reload; lifespan.Daemon.reload says which.
RESTART_KEYS = (
    "model.name", "model.chat_template", "server.listen", "server.admin_listen",
    "server.metrics_listen", "server.tls_cert", "server.tls_key", "model.engine",
    "model.role",
    "server.agent_listen", "server.node_name", "server.state_dir",
    "engine.workers", "engine.threads", "engine.kv_cells", "engine.slots",
    "engine.max_context", "engine.step_tokens", "engine.prefill_step_tokens",
    "engine.flash_attn", "engine.max_running", "engine.cpus", "server.door_cpus",
    "server.door_processes",
    "engine.kv_layout", "engine.kv_headroom", "engine.heartbeat_interval",
    "engine.cache_disk_mib",
    "retrieval.search_threads", "server.door_threads",
)


def changed_keys(old: Config, new: Config) -> list[str]:
    """Dotted keys whose values differ between two configs."""
    out: list[str] = []
    for section in old.__struct_fields__:
        a, b = getattr(old, section), getattr(new, section)
        if not isinstance(a, _Section):  # a list of sections ([[models]]): one key
            out += [section] if a != b else []
            continue
        for field in a.__struct_fields__:
            if getattr(a, field) != getattr(b, field):
                out.append(f"{section}.{field}")
    return out
