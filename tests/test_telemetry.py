"""Completion telemetry: /v1/events and finished infills round-trip into ``forged report``
by API key name, the Prometheus counters count them, and the database holds no text;
events are accepted only for a key's own completions and at its rate, and the file is
pruned by age and by size."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from forged.auth import add_key
from forged.cli import main
from forged.config import TelemetryConfig
from forged.http.editor_telemetry import TokenBucket
from forged.observe.metrics import Metrics
from forged.observe.telemetry import (
    DAY,
    PRUNE_INTERVAL,
    WRITE_INTERVAL,
    Completion,
    Event,
    Recorder,
    Usage,
    open_db,
    prune,
    report,
    telemetry_path,
    write,
)
from tests.conftest import DaemonFactory

MARKER = "zebra_quokka_marker"  # in every prompt; must never reach the database


async def test_events_round_trip_into_the_report_without_text(
        fim_model: Path, tmp_path: Path, start_daemon: DaemonFactory,
        capsys: pytest.CaptureFixture[str]) -> None:
    key = add_key(tmp_path / "keys.toml", "team-a", max_streams=4, max_queued=4,
                  priority="interactive")
    auth = {"Authorization": f"Bearer {key}"}
    texts: list[str] = []
    with trio.fail_after(60):
        async with start_daemon(fim_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30, headers=auth) as c:
            ids = []
            for i in range(3):
                r = await c.post("/infill", json={
                    "input_prefix": f"def {MARKER}_{i}():\n    return ",
                    "input_suffix": f"\n# {MARKER}\n", "n_predict": 6, "temperature": 0})
                assert r.status_code == 200, r.text
                ids.append(r.json()["id"])
                texts.append(r.json()["content"])

            async def send(type_: str, cid: str, **extra: Any) -> httpx.Response:
                return await c.post("/v1/events", json={"type": type_,
                                                        "completion_id": cid, **extra})

            for cid in ids:
                assert (await send("view", cid)).status_code == 200
            # Tabby's other fields are accepted and not kept.
            assert (await send("select", ids[0], choice_index=0, prompt=MARKER)
                    ).status_code == 200
            assert (await send("dismiss", ids[1])).status_code == 200
            assert (await send("view", ids[0])).status_code == 200  # shown once still
            bad = await send("like", ids[0])
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "type"
            bad = await send("view", f"{MARKER} with spaces")
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "completion_id"
            assert d.daemon.state is not None
            sample = d.daemon.state.metrics.registry.get_sample_value
            assert sample("forged_completion_events_total",
                          {"key": "team-a", "type": "view"}) == 4
            assert sample("forged_completion_events_total",
                          {"key": "team-a", "type": "select"}) == 1
            assert sample("forged_completions_total",
                          {"key": "team-a", "route": "/infill"}) == 3
            model = (await c.get("/v1/models")).json()["data"][0]["id"]
            usage = {"key": "team-a", "model": model}
            registry = d.daemon.state.metrics.registry
            assert summed(registry, "forged_requests_total",
                          {**usage, "endpoint": "/infill", "status": "200"}) == 3
            prompt_tokens = sample("forged_prompt_tokens_total", usage)
            generated = sample("forged_generation_tokens_total", usage)
            assert prompt_tokens and generated
    # The daemon has stopped: its writer has flushed what was queued.
    config = tmp_path / "report.toml"
    config.write_text(f'[server]\nstate_dir = "{tmp_path / "state"}"\n')
    assert main(["report", "--json", "--config", str(config)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 1
    row = rows[0]
    assert (row["key"], row["completions"], row["shown"], row["accepted"],
            row["dismissed"]) == ("team-a", 3, 3, 1, 1)
    # usage per key: the same sums as the metrics' key and model labels
    assert (row["requests"], row["prompt_tokens"], row["completion_tokens"]) == \
        (3, prompt_tokens, generated)
    assert row["acceptance"] == pytest.approx(1 / 3)
    assert 0 < row["infill_p50_ms"] <= row["infill_p95_ms"]
    assert main(["report", "--since", "2999-01-01", "--json", "--config", str(config)]) == 0
    assert json.loads(capsys.readouterr().out) == []
    assert main(["report", "--config", str(config)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["DAY", "KEY", "REQUESTS"]
    cells = table[1].split()
    assert cells[1:3] == ["team-a", "3"] and cells[5:9] == ["3", "3", "1", "33%"]
    data = b"".join(p.read_bytes() for p in telemetry_path(tmp_path / "state").parent.glob(
        "telemetry.sqlite3*"))
    assert MARKER.encode() not in data and b"return" not in data
    for text in texts:
        if len(text.strip()) >= 8:
            assert text.encode() not in data


def summed(registry: Any, name: str, labels: dict[str, str]) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(s.value for metric in registry.collect() for s in metric.samples
               if s.name == name and labels.items() <= s.labels.items())


async def test_events_are_accepted_only_for_the_keys_own_completions(
        fim_model: Path, tmp_path: Path, start_daemon: DaemonFactory) -> None:
    keys = {name: add_key(tmp_path / "keys.toml", name, max_streams=4, max_queued=4,
                          priority="interactive") for name in ("team-a", "team-b")}
    with trio.fail_after(60):
        async with start_daemon(fim_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:

            async def send(name: str, cid: str) -> httpx.Response:
                return await c.post("/v1/events", json={"type": "view", "completion_id": cid},
                                    headers={"Authorization": f"Bearer {keys[name]}"})

            ids = []
            for stream in (False, True):
                r = await c.post("/v1/completions", json={
                    "prompt": "def f():", "max_tokens": 4, "stream": stream},
                    headers={"Authorization": f"Bearer {keys['team-a']}"})
                assert r.status_code == 200, r.text
                first = r.json() if not stream else json.loads(
                    r.text.split("\n")[0].removeprefix("data: "))
                ids.append(first["id"])
            for cid in (*ids, "cmpl-never-served"):
                r = await send("team-b", cid)  # another key's, or nobody's: not found
                assert r.status_code == 404, r.text
                assert r.json()["error"]["param"] == "completion_id"
                assert r.json()["error"]["code"] == "completion_not_found"
            assert (await send("team-a", "cmpl-never-served")).status_code == 404
            for cid in ids:  # whole and streamed alike
                assert (await send("team-a", cid)).status_code == 200
            assert d.daemon.state is not None
            sample = d.daemon.state.metrics.registry.get_sample_value
            assert sample("forged_completion_events_total",
                          {"key": "team-a", "type": "view"}) == 2
            assert sample("forged_completion_events_total",
                          {"key": "team-b", "type": "view"}) is None


async def test_events_beyond_a_keys_rate_are_429_and_other_keys_go_on(
        fim_model: Path, tmp_path: Path, start_daemon: DaemonFactory) -> None:
    keys = {name: add_key(tmp_path / "keys.toml", name, max_streams=4, max_queued=4,
                          priority="interactive") for name in ("team-a", "team-b")}
    with trio.fail_after(60):
        async with start_daemon(fim_model, telemetry={"event_rate": 0.01,
                                                      "event_burst": 3}) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            ids = {}
            for name, key in keys.items():
                r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2},
                                 headers={"Authorization": f"Bearer {key}"})
                ids[name] = r.json()["id"]

            async def send(name: str) -> httpx.Response:
                return await c.post(
                    "/v1/events", json={"type": "view", "completion_id": ids[name]},
                    headers={"Authorization": f"Bearer {keys[name]}"})

            assert [(await send("team-a")).status_code for _ in range(3)] == [200] * 3
            over = await send("team-a")
            assert over.status_code == 429, over.text
            assert over.json()["error"]["code"] == "rate_limit_exceeded"
            assert 1 <= int(over.headers["Retry-After"]) <= 100  # a token in 1 / 0.01 s
            assert (await send("team-b")).status_code == 200
            assert d.daemon.state is not None
            assert d.daemon.state.metrics.registry.get_sample_value(
                "forged_completion_events_total", {"key": "team-a", "type": "view"}) == 3


async def test_a_token_bucket_refills_at_its_rate_up_to_its_burst(
        autojump_clock: trio.testing.MockClock) -> None:
    rate, burst = 2.0, 3
    with trio.fail_after(120):
        bucket = TokenBucket(burst, trio.current_time())

        def take() -> float:
            return bucket.take(trio.current_time(), rate, burst)

        assert [take() for _ in range(burst)] == [0.0] * burst
        assert take() == pytest.approx(1 / rate)
        await trio.sleep(1 / rate)
        assert take() == 0.0
        assert take() > 0
        await trio.sleep(60)  # a quiet minute refills the burst, no more
        assert [take() for _ in range(burst)] == [0.0] * burst
        assert take() == pytest.approx(1 / rate)


def rows(path: Path, table: str) -> list[float]:
    db = sqlite3.connect(path)
    try:
        return [at for (at,) in db.execute(f"SELECT at FROM {table} ORDER BY at")]
    finally:
        db.close()


def test_prune_drops_the_old_then_the_oldest_beyond_max_rows(tmp_path: Path) -> None:
    path = tmp_path / "telemetry.sqlite3"
    db = open_db(path)
    write(db, [*(Completion(f"c{i}", "k", "/infill", float(i), 1.0) for i in range(50)),
               *(Event(f"c{i}", "k", "view", float(i)) for i in range(50))])
    assert prune(db, before=10.0, max_rows=1000) == 20  # 0-9 of each: too old
    assert prune(db, before=10.0, max_rows=15) == 50  # 10-34 of each: beyond 15
    db.close()
    assert rows(path, "completions") == rows(path, "events") == [float(i) for i in
                                                                   range(35, 50)]


def test_usage_is_one_row_per_key_model_and_day_pruned_by_day(tmp_path: Path) -> None:
    path = tmp_path / "telemetry.sqlite3"
    db = open_db(path)
    day0 = 1.9e9 - 1.9e9 % DAY  # a UTC midnight
    write(db, [Usage("a", "m", day0 + i, 10, 2) for i in range(100)])
    write(db, [Usage("a", "m", day0 + 5, 1, 1), Usage("a", "m2", day0, 7, 0),
               Usage("b", "m", day0 + DAY, 3, 4)])
    table = sorted(db.execute("SELECT * FROM usage"))
    assert [r[:2] + r[3:] for r in table] == [
        ("a", "m", 101, 1001, 201), ("a", "m2", 1, 7, 0), ("b", "m", 1, 3, 4)]
    [a, b] = report(db)
    assert (a.key, a.requests, a.prompt_tokens, a.completion_tokens) == ("a", 102, 1008, 201)
    assert (b.key, b.day > a.day, b.requests) == ("b", True, 1)
    assert prune(db, before=day0 + DAY + 1, max_rows=1000) == 2  # day0's rows
    assert [r[0] for r in db.execute("SELECT key FROM usage")] == ["b"]
    db.close()


def test_a_selected_completion_counts_as_shown(tmp_path: Path) -> None:
    db = open_db(tmp_path / "telemetry.sqlite3")
    day0 = 1.9e9 - 1.9e9 % DAY
    write(db, [Event("c1", "k", "view", day0), Event("c1", "k", "select", day0 + 1),
               Event("c2", "k", "select", day0 + 2), Event("c3", "k", "select", day0 + 3),
               Event("c3", "k", "select", day0 + 4), Event("c4", "k", "dismiss", day0 + 5),
               Event("c4", "k", "view", day0 + 5)])
    [r] = report(db)
    db.close()
    assert (r.shown, r.accepted, r.dismissed, r.acceptance) == (4, 3, 1, 0.75)


def test_a_report_of_a_file_that_is_not_a_database_says_so(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "state").mkdir()
    telemetry_path(tmp_path / "state").write_bytes(b"\x07" * 4096)
    config = tmp_path / "report.toml"
    config.write_text(f'[server]\nstate_dir = "{tmp_path / "state"}"\n')
    assert main(["report", "--config", str(config)]) == 1
    assert "telemetry.sqlite3: file is not a database" in capsys.readouterr().err


async def inline(func: Any, *args: Any) -> Any:
    """The writer's database work, run in the task: no thread for the clock to wait on."""
    return func(*args)


async def test_records_past_retention_are_pruned_every_interval(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    path = tmp_path / "telemetry.sqlite3"
    start = 1.9e9  # Unix time when the virtual clock reads 0

    def wall() -> float:
        return start + trio.current_time()

    recorder = Recorder(path, Metrics(list), lambda: TelemetryConfig(retention_days=1),
                        wall=wall, run_sync=inline)
    with trio.fail_after(3 * DAY):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(recorder.serve)
            await trio.sleep(1)  # after the first prune, at the start
            recorder.record(Event("old", "k", "view", wall() - 2 * DAY))
            recorder.record(Event("new", "k", "view", wall()))
            await trio.sleep(PRUNE_INTERVAL - 2)
            assert len(rows(path, "events")) == 2  # written, not pruned yet
            await trio.sleep(2)
            assert rows(path, "events") == [start + 1]  # the next prune, on time
            await trio.sleep(DAY)
            assert rows(path, "events") == []
            nursery.cancel_scope.cancel()


async def test_records_are_gathered_into_one_transaction_and_none_is_lost_at_a_stop(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    """A transaction for each request's records cost the door about 0.5 ms of CPU a
    request. Records arriving within WRITE_INTERVAL of a first one share its
    transaction, which is written by then; what was gathered when the daemon stops
    is written once, not lost and not twice."""
    path = tmp_path / "telemetry.sqlite3"
    batches: list[int] = []

    async def counted(func: Any, *args: Any) -> Any:
        if func is write:
            batches.append(len(args[1]))
        return func(*args)

    recorder = Recorder(path, Metrics(list), TelemetryConfig, run_sync=counted)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(recorder.serve)
            await trio.sleep(1)
            for i in range(3):  # three requests' records, a tenth of a second apart
                recorder.record(Event(f"c{i}", "k", "view", 1.9e9))
                await trio.sleep(0.1)
            await trio.sleep(WRITE_INTERVAL - 0.25)
            assert batches == [3] and len(rows(path, "events")) == 3
            recorder.record(Event("last", "k", "view", 1.9e9))
            await trio.sleep(WRITE_INTERVAL / 2)  # gathering when the daemon stops
            nursery.cancel_scope.cancel()
    assert batches == [3, 1] and len(rows(path, "events")) == 4
