"""The one percentile definition (forged.observe.stats), and that `forged status` and
`forged bench` report the same percentiles for the same samples."""

from __future__ import annotations

import time

import msgspec
import pytest

from forged.engine.stats import COUNTERS, GAUGES, Counts, Totals
from forged.observe import loadtest, status
from forged.observe.metrics import Metrics
from forged.observe.stats import percentile

ONE_TO_TEN = [float(v) for v in range(10, 0, -1)]  # unsorted on purpose


@pytest.mark.parametrize(("q", "expected"), [
    (0, 1.0), (10, 1.0), (11, 2.0), (50, 5.0), (51, 6.0), (90, 9.0), (95, 10.0),
    (99, 10.0), (100, 10.0),
])
def test_nearest_rank_of_one_to_ten(q: float, expected: float) -> None:
    assert percentile(ONE_TO_TEN, q) == expected


def test_small_and_empty_data() -> None:
    assert percentile([], 50) is None
    assert percentile([0.7], 0) == percentile([0.7], 50) == percentile([0.7], 100) == 0.7
    assert percentile([3.0, 1.0], 50) == 1.0  # the lower of two, never their mean
    assert percentile([3.0, 1.0], 51) == 3.0
    # A whole rank stays whole: 7% of 100 values is the 7th, not the 8th.
    assert percentile(range(1, 101), 7) == 7


def test_a_percentile_is_between_0_and_100() -> None:
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    with pytest.raises(ValueError):
        percentile([1.0], -1)


def test_status_and_bench_agree_on_the_same_samples() -> None:
    # Four values: the old rounded-rank p50 of `forged status` (0.3) and the
    # nearest-rank p50 of `forged bench` (0.2) disagreed here.
    ttfts = [0.4, 0.1, 0.3, 0.2]
    gaps = [[0.05, 0.01], [0.03], [0.02, 0.04, 0.06], [0.07]]

    metrics = Metrics(lambda: [("m", Totals(), 0)])
    for ttft, itl in zip(ttfts, gaps, strict=True):
        metrics.observe_ttft(ttft)
        metrics.observe_itl(itl)
    served = metrics.last_minute()

    samples = [loadtest.Sample("short", 200, ttft=ttft, itl=itl)
               for ttft, itl in zip(ttfts, gaps, strict=True)]
    measured = loadtest.summarise(samples, wall=1.0)

    for key in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99"):
        assert served[key] == measured[key], key
    assert (measured["ttft_p50"], measured["ttft_p99"]) == (0.2, 0.4)
    assert (measured["itl_p50"], measured["itl_p99"]) == (0.04, 0.07)
    assert (measured["itl_p99_9"], measured["itl_max"]) == (0.07, 0.07)  # the worst gap

    shown = status.render({
        "version": "0", "model": "m", "ready": True, "draining": False, "open_streams": 0,
        "last_minute": served, "engine": {"uptime": 1.0, "totals": {}, "workers": []}})
    assert "TTFT        p50 0.200 s   p99 0.400 s" in shown
    assert "ITL         p50 0.040 s   p99 0.070 s" in shown


def test_status_names_each_index_and_its_age() -> None:
    now = time.time()
    shown = status.render({
        "version": "0", "model": "m", "ready": True, "draining": False, "open_streams": 0,
        "last_minute": {"tokens_per_second": 0.0, "requests": 0, "ttft_p50": None,
                        "ttft_p99": None, "itl_p50": None, "itl_p99": None},
        "engine": {"uptime": 1.0, "totals": {}, "workers": []},
        "indexes": [{"name": "backend", "files": 12, "chunks": 40, "updated_at": now - 3700},
                    {"name": "new", "files": 0, "chunks": 0, "updated_at": None}]})
    assert "index       backend: 12 files, 40 chunks, updated 1h 01m 40s ago" in shown
    assert "index       new: 0 files, 0 chunks, never updated" in shown


async def test_taking_turns_rotates_the_first_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """One caller among several servers: every prompt goes to each, the first of them
    rotating, so that a drift of the machine reaches all servers alike."""
    order: list[str] = []

    async def answered(client: object, base: str, model: object, prompt: object
                       ) -> loadtest.Sample:
        order.append(base)
        return loadtest.Sample("short", 200, e2e=1.0)

    monkeypatch.setattr(loadtest, "one_request", answered)
    prompts = loadtest.make_prompts("mixed", 3, 8, seed=1)
    got = await loadtest.run_alternating(("a", "b", "c"), prompts, duration=60)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert [s["requests"] for s in got] == [3, 3, 3]
    assert [s["wall_s"] for s in got] == [3.0, 3.0, 3.0]


def exported(t: Totals) -> dict[tuple[str, str], tuple[str, float]]:
    """Every engine sample /metrics shows for a model whose totals are ``t``, with its
    family's type (gauge or counter)."""
    metrics = Metrics(lambda: [("m", t, 0)])
    return {(s.name, str(sorted(s.labels.items()))): (family.type, s.value)
            for family in metrics.registry.collect() for s in family.samples
            if not s.name.endswith("_created")}


def test_each_count_is_a_counter_or_a_gauge_as_the_metrics_read_it() -> None:
    """A lost worker's counters are kept and its gauges dropped (forged.engine.pool):
    a count misfiled would drop a counter (a reset to Prometheus) or keep a dead
    worker's gauge forever."""
    names = [f.name for f in msgspec.structs.fields(Counts)]
    assert sorted(COUNTERS + GAUGES) == sorted(names) and len(set(COUNTERS)) == len(COUNTERS)
    zero = exported(Totals())
    for name in names:
        moved = {k: kind for k, (kind, v) in exported(Totals(**{name: 1.0})).items()
                 if v != zero[k][1]}
        want = "counter" if name in COUNTERS else "gauge"
        assert all(kind == want for kind in moved.values()), (name, moved)
