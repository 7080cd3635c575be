"""Completion telemetry: /v1/events and finished infills round-trip into ``forged report``
by API key name, the Prometheus counters count them, and the database holds no text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from forged.auth import add_key
from forged.cli import main
from forged.observe.telemetry import telemetry_path
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
    # The daemon has stopped: its writer has flushed what was queued.
    config = tmp_path / "report.toml"
    config.write_text(f'[server]\nstate_dir = "{tmp_path / "state"}"\n')
    assert main(["report", "--json", "--config", str(config)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 1
    row = rows[0]
    assert (row["key"], row["completions"], row["shown"], row["accepted"],
            row["dismissed"]) == ("team-a", 3, 3, 1, 1)
    assert row["acceptance"] == pytest.approx(1 / 3)
    assert 0 < row["infill_p50_ms"] <= row["infill_p95_ms"]
    assert main(["report", "--since", "2999-01-01", "--json", "--config", str(config)]) == 0
    assert json.loads(capsys.readouterr().out) == []
    assert main(["report", "--config", str(config)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["DAY", "KEY", "COMPLETIONS"]
    assert table[1].split()[1:6] == ["team-a", "3", "3", "1", "33%"]
    data = b"".join(p.read_bytes() for p in telemetry_path(tmp_path / "state").parent.glob(
        "telemetry.sqlite3*"))
    assert MARKER.encode() not in data and b"return" not in data
    for text in texts:
        if len(text.strip()) >= 8:
            assert text.encode() not in data
