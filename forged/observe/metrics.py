"""Prometheus metrics (prometheus-client) and the rolling window behind `forged status`.

Each daemon owns its own registry, so several daemons can live in one test process.
Engine-side numbers (KV cells, queues, prefix cache) are read from the workers'
statistics at scrape time by a custom collector; request-side numbers (TTFT,
inter-token latency, durations, statuses) are observed by the HTTP layer.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import cast

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from forged import __version__
from forged.engine.stats import Totals
from forged.observe.stats import percentile

# Interactive use: from 5 ms (a decode step) to a minute (a long queue wait).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                   1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0)
WINDOW_SECONDS = 60.0
# prometheus-client's own formatting of a bucket's bound (its ``le`` label); untyped there.
_le = cast(Callable[[float], str], floatToGoString)
_WINDOW_SAMPLES = 50_000  # bound on the rolling window, whatever the load


# Each model's engine, when Prometheus scrapes: its id (as /v1/models lists it), its
# workers' statistics summed, and its worker restarts.
GroupStats = tuple[str, Totals, int]


class _EngineCollector(Collector):
    """Gauges and counters that live in the workers, read when Prometheus scrapes; each
    sample is labelled with its ``model`` (a swap shows both models' workers)."""

    def __init__(self, groups: Callable[[], list[GroupStats]]) -> None:
        self._groups = groups

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for model, totals, restarts in self._groups():
            for metric in _engine_metrics(totals, restarts):
                samples = [s._replace(labels={**s.labels, "model": model})
                           for s in metric.samples]
                if metric.name in merged:
                    merged[metric.name].samples += samples
                else:
                    metric.samples = samples
                    merged[metric.name] = metric
        yield from merged.values()


def _labelled(cls: type[GaugeMetricFamily | CounterMetricFamily], name: str, doc: str,
              label: str, values: dict[str, float]) -> Metric:
    family = cls(name, doc, labels=[label])
    for value, v in values.items():
        family.add_metric([value], v)
    return family


def _engine_metrics(t: Totals, restarts: int) -> Iterator[Metric]:
    """One model's engine metrics."""
    gauge, counter = GaugeMetricFamily, CounterMetricFamily
    yield gauge("forged_running_sequences", "Sequences decoding or prefilling.", value=t.running)
    yield _labelled(gauge, "forged_queued_requests", "Requests waiting for a slot.",
                    "priority", {"interactive": t.queued_interactive, "batch": t.queued_batch})
    yield gauge("forged_queued_prompt_tokens", "Prompt tokens waiting.", value=t.queued_tokens)
    yield gauge("forged_kv_cells_used", "KV cells in use (running and cached).",
                value=t.kv_cells_used)
    yield gauge("forged_kv_cells_cached", "KV cells only the prefix cache holds.",
                value=t.kv_cells_cached)
    yield gauge("forged_kv_cells_total", "KV cells of all workers.", value=t.kv_cells_total)
    yield counter("forged_prefix_cache_queries", "Admissions that looked up the cache.",
                  value=t.prefix_cache_queries)
    yield counter("forged_prefix_cache_hits", "Admissions that reused a cached prefix.",
                  value=t.prefix_cache_hits)
    yield counter("forged_prefix_cache_tokens_saved",
                  "Prompt tokens served from the prefix cache.", value=t.prefix_cache_tokens_saved)
    yield counter("forged_prefix_holds", "Queued requests held while another computed the "
                  "long prefix they share (then copied instead of computed).",
                  value=t.prefix_holds)
    yield gauge("forged_sessions_pinned", "Idle conversations whose KV is pinned.",
                value=t.sessions_pinned)
    yield counter("forged_session_resumes",
                  "Turns that resumed their session's cached KV.", value=t.session_resumes)
    yield from _tier_metrics(t)
    yield counter("forged_early_rejections",
                  "Requests refused at once because the estimated wait passed "
                  "limits.queue_timeout.", value=t.early_rejections)
    yield counter("forged_worker_restarts", "Worker processes restarted.", value=restarts)
    yield counter("forged_steps", "Decode steps (llama_decode calls) of generation workers "
                  "and embedding batches.", value=t.steps)
    yield counter("forged_micro_batches", "llama.cpp's passes over the weights in generation "
                  "steps: above one a step, running slots are scattered or prompt chunks "
                  "differ in length (per-slot layout).", value=t.micro_batches)
    yield from _step_mix_metrics(t)
    yield from _routing_metrics(t)


def _step_mix_metrics(t: Totals) -> Iterator[Metric]:
    """Generation steps that carried prompt work beside the decoders, against those
    that decoded alone: a stream's gap is its step's time, so once half of the tokens
    come from prompt steps, the median gap is a prompt step's."""
    yield CounterMetricFamily("forged_prompt_steps", "Generation steps that carried "
                              "prompt work.", value=t.prompt_steps)
    split = {"prompt": (t.prompt_step_seconds, t.prompt_step_tokens),
             "decode": (t.step_seconds - t.prompt_step_seconds,
                        t.tokens_generated - t.prompt_step_tokens)}
    yield _labelled(CounterMetricFamily, "forged_step_seconds", "Time in generation "
                    "steps, by what they carried: prompt work, or decoding alone.", "kind",
                    {k: v[0] for k, v in split.items()})
    yield _labelled(CounterMetricFamily, "forged_step_tokens", "Tokens generated, by the "
                    "kind of step that generated them.", "kind",
                    {k: v[1] for k, v in split.items()})


def _routing_metrics(t: Totals) -> Iterator[Metric]:
    """The pool's: what decided each route, and what it saved from a lost worker; then
    what an embedding model's workers embedded (0 for a generation model)."""
    yield _labelled(CounterMetricFamily, "forged_routed_requests", "Requests routed to a "
                    "worker, by what decided: its cache, its session, or load.", "by",
                    {"cache": t.routed_by_cache, "session": t.routed_by_session,
                     "load": t.routed_by_load})
    yield CounterMetricFamily(
        "forged_resubmitted_requests", "Requests submitted again because their worker "
        "was lost before admitting them.", value=t.resubmitted)
    yield CounterMetricFamily("forged_embedding_inputs", "Texts embedded.",
                              value=t.embed_inputs)
    yield CounterMetricFamily("forged_embedding_tokens", "Tokens of the texts embedded.",
                              value=t.embed_tokens)


def _tier_metrics(t: Totals) -> Iterator[Metric]:
    """The KV tiers beyond the slots (RAM, disk): use, and what moved through them."""
    gauge, counter = GaugeMetricFamily, CounterMetricFamily
    yield _labelled(gauge, "forged_kv_tier_bytes", "Bytes of saved KV states held, by tier.",
                    "tier", {"ram": t.kv_ram_bytes, "disk": t.kv_disk_bytes})
    yield _labelled(gauge, "forged_kv_tier_budget_bytes", "Bytes each tier may hold.",
                    "tier", {"ram": t.kv_ram_budget_bytes, "disk": t.kv_disk_budget_bytes})
    yield _labelled(gauge, "forged_kv_tier_entries", "Saved KV states held, by tier.",
                    "tier", {"ram": t.kv_ram_entries, "disk": t.kv_disk_entries})
    yield _labelled(counter, "forged_kv_tier_restores",
                    "Saved states restored into a slot, by tier.",
                    "tier", {"ram": t.kv_ram_restores, "disk": t.kv_disk_restores})
    for name, doc, value in (
        ("saves", "Slot states saved to the RAM tier.", t.kv_saves),
        ("restored_tokens", "Prompt tokens restored from a tier instead of computed.",
         t.kv_restored_tokens),
        ("restore_failures", "Saved states refused at restore (then recomputed).",
         t.kv_restore_failures),
        ("demotions", "Session states moved from RAM to disk.", t.kv_demotions),
        ("drops", "Saved states dropped (budget, or superseded by a longer one).", t.kv_drops),
        ("swaps", "Batch requests swapped out to RAM for interactive work.", t.kv_swaps),
    ):
        yield counter(f"forged_kv_{name}", doc, value=value)


@dataclass
class _Window:
    """Timestamped samples of the last minute, bounded in count."""

    samples: deque[tuple[float, float]]

    def add(self, value: float, now: float) -> None:
        self.samples.append((now, value))

    def add_many(self, values: list[float], now: float) -> None:
        self.samples.extend((now, v) for v in values)

    def recent(self, now: float) -> list[float]:
        cutoff = now - WINDOW_SECONDS
        while self.samples and self.samples[0][0] < cutoff:
            self.samples.popleft()
        return [v for _, v in self.samples]


class _Gaps(Collector):
    """A histogram fed a stream's gaps all at once, when its request ends.
    prometheus-client's Histogram takes two locks and walks its bounds in Python per
    observation: for the gaps of a 256-token stream, 7% of the door's CPU at 16
    streams (docs/benchmarks.md). Here a request's gaps cost a C ``bisect`` each and
    one lock. The same series as that Histogram's (``_bucket``, ``_count``, ``_sum``),
    without ``_created``."""

    def __init__(self, name: str, documentation: str, bounds: tuple[float, ...],
                 registry: CollectorRegistry) -> None:
        self._name, self._doc = name, documentation
        self._bounds = sorted(bounds)
        self._counts = [0] * (len(self._bounds) + 1)  # the last: above every bound
        self._sum = 0.0
        self._lock = threading.Lock()  # a scrape may run in another thread
        registry.register(self)

    def observe_many(self, values: list[float]) -> None:
        # bisect_left: the first bound >= value, as a bucket's ``le`` means
        slots = collections.Counter(bisect.bisect_left(self._bounds, v) for v in values)
        total = math.fsum(values)
        with self._lock:
            for slot, n in slots.items():
                self._counts[slot] += n
            self._sum += total

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative = list(itertools.accumulate(counts))
        buckets = [(_le(b), float(c))
                   for b, c in zip(self._bounds, cumulative, strict=False)]
        yield HistogramMetricFamily(self._name, self._doc,
                                    buckets=[*buckets, ("+Inf", float(cumulative[-1]))],
                                    sum_value=total)


class _NodeLabelled(Collector):
    """Every sample of ``registry`` with a ``node`` label added, so that the metrics of
    a pool's nodes can be told apart and summed in Prometheus whatever its scrape
    configuration calls its targets."""

    def __init__(self, registry: CollectorRegistry, node: str) -> None:
        self._registry = registry
        self._node = node

    def collect(self) -> Iterator[Metric]:
        for metric in self._registry.collect():
            metric.samples = [s._replace(labels={**s.labels, "node": self._node})
                              for s in metric.samples]
            yield metric


class _BuildInfo(Collector):
    """forged_build_info: the version, and each model served (a swap shows two)."""

    def __init__(self, groups: Callable[[], list[GroupStats]]) -> None:
        self._groups = groups

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily("forged_build_info", "Version and model (always 1).",
                                 labels=["version", "model"])
        for model, _, _ in self._groups():
            info.add_metric([__version__, model], 1.0)
        yield info


class Metrics:
    def __init__(self, groups: Callable[[], list[GroupStats]], node: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # What /metrics exposes: the registry, each sample labelled with the node.
        self.exposed = CollectorRegistry(auto_describe=False)
        self.exposed.register(_NodeLabelled(self.registry, node))
        r = self.registry
        # key: the API key's name ("-" with no keys); model: the id of the model that
        # served it ("-" for requests no model served). Both come from the config, never
        # from what a caller sent, so their number is bounded by the keys file and the
        # [[models]] tables.
        self.requests = Counter("forged_requests", "Requests answered.",
                                ["endpoint", "status", "priority", "key", "model"],
                                registry=r)
        self.ttft = Histogram("forged_time_to_first_token_seconds",
                              "From request arrival to the first generated text.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = _Gaps("forged_inter_token_latency_seconds",
                         "Between consecutive pieces of streamed text.", LATENCY_BUCKETS, r)
        self.e2e = Histogram("forged_request_duration_seconds",
                             "From request arrival to the last byte.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("forged_queue_time_seconds",
                                    "Time waiting for admission.", ["priority"],
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("forged_prompt_tokens", "Prompt tokens of requests.",
                                     ["key", "model"], registry=r)
        self.generation_tokens = Counter("forged_generation_tokens", "Tokens generated.",
                                         ["key", "model"], registry=r)
        self.cancellations = Counter("forged_cancellations", "Requests ended early.",
                                     ["reason"], registry=r)
        self.door_restarts = Counter("forged_door_restarts",
                                     "Door processes restarted (server.door_processes).",
                                     registry=r)
        self._telemetry(r)
        r.register(_BuildInfo(groups))
        r.register(_EngineCollector(groups))
        self._ttft_window = _Window(deque(maxlen=_WINDOW_SAMPLES))
        self._itl_window = _Window(deque(maxlen=_WINDOW_SAMPLES))
        self._tokens_window = _Window(deque(maxlen=_WINDOW_SAMPLES))

    def _telemetry(self, r: CollectorRegistry) -> None:
        """Telemetry (forged.observe.telemetry): by API key name, never by content; and
        what retrieval gave up."""
        self.completions = Counter("forged_completions", "Generations answered, by API "
                                   "key name and route.", ["key", "route"], registry=r)
        self.completion_events = Counter(
            "forged_completion_events", "Editors' events on completions (view: shown, "
            "select: accepted, dismiss), by API key name.", ["key", "type"], registry=r)
        self.telemetry_dropped = Counter(
            "forged_telemetry_dropped", "Telemetry records dropped: the writer's queue was "
            "full.", registry=r)
        # timeout: the embedding model was busy past server.door_timeout; error: it
        # refused (overloaded, a lost worker).
        self.bm25_alone = Counter(
            "forged_retrieval_bm25_alone", "Searches by meaning that fell back to BM25 "
            "alone: the embedding model did not answer.", ["reason"], registry=r)

    def editor_totals(self) -> dict[str, float]:
        """Generations answered in full, and editors' events on them, since the start:
        what the status page shows of completions shown and accepted."""
        out = {"served": 0.0, "view": 0.0, "select": 0.0, "dismiss": 0.0}
        for metric in (self.completions, self.completion_events):
            for sample in (s for family in metric.collect() for s in family.samples):
                if sample.name.endswith("_total"):
                    kind = sample.labels.get("type", "served")
                    out[kind] = out.get(kind, 0.0) + sample.value
        return out

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        self._ttft_window.add(seconds, time.monotonic())

    def observe_itl(self, gaps: list[float]) -> None:
        self.itl.observe_many(gaps)
        self._itl_window.add_many(gaps, time.monotonic())

    def observe_tokens(self, n: int, key: str, model: str) -> None:
        self.generation_tokens.labels(key, model).inc(n)
        self._tokens_window.add(float(n), time.monotonic())

    def last_minute(self) -> dict[str, float | None]:
        now = time.monotonic()
        ttft, itl = self._ttft_window.recent(now), self._itl_window.recent(now)
        tokens = self._tokens_window.recent(now)
        return {
            "window_seconds": WINDOW_SECONDS,
            "tokens_per_second": sum(tokens) / WINDOW_SECONDS,
            "requests": float(len(ttft)),
            "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "itl_p50": percentile(itl, 50), "itl_p99": percentile(itl, 99),
        }
