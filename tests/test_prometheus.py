"""The shipped Prometheus rules and Grafana dashboard, on Debian's Prometheus: the rules
pass `promtool check rules`; a real Prometheus scrapes a running forged on its
read-only listener, every recorded series and every dashboard expression returns
data, and a worker killed makes the restart alert fire."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ROOT
from tests.daemonproc import DaemonProcess, free_port, write_config

RULES = ROOT / "packaging" / "prometheus" / "forged-rules.yml"
DASHBOARD = ROOT / "packaging" / "grafana" / "forged-dashboard.json"
PROMETHEUS = "/usr/bin/prometheus"  # Debian's (scripts/system-deps.sh)


def test_promtool_checks_the_shipped_rules() -> None:
    r = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def recorded() -> list[str]:
    return re.findall(r"^\s*- record: (\S+)$", RULES.read_text(), re.M)


def test_every_alert_reads_a_recorded_series_or_up() -> None:
    """So that querying the recorded series checks what every alert reads."""
    alerts = re.findall(r"^\s*expr: (\S+) ", RULES.read_text().split("forged-alerts")[1],
                        re.M)
    assert len(alerts) == 7
    assert all(a in recorded() or a.startswith("up{") for a in alerts), alerts


def dashboard_exprs() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    return [t["expr"].replace("$node", ".*") for p in board["panels"] for t in p["targets"]]


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[
        tuple[DaemonProcess, str]]:
    """forged with a read-only listener, and Prometheus scraping it every second with
    the shipped rules evaluated every second."""
    tmp = tmp_path_factory.mktemp("prom")
    port, metrics, prom = free_port(), free_port(), free_port()
    d = DaemonProcess(write_config(tmp / "forged.toml", tiny_model, port,
                                   server={"metrics_listen": f"127.0.0.1:{metrics}"},
                                   engine={"workers": 2, "kv_layout": "unified",
                                           "kv_cells": 2048, "max_context": 1024,
                                           "slots": 4, "max_running": 4}), port)
    (tmp / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: [{json.dumps(str(RULES))}]\n"
        "scrape_configs:\n  - job_name: forged\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{metrics}']}}]\n")
    with (tmp / "prometheus.log").open("w") as log:
        server = subprocess.Popen(
            [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom}"],
            stdout=subprocess.DEVNULL, stderr=log)
    try:
        d.wait_ready(180)
        traffic(d.url)
        yield d, f"http://127.0.0.1:{prom}"
    finally:
        server.terminate()
        server.wait(30)
        assert d.stop() == 0


def traffic(url: str) -> None:
    """What every panel shows: completions streamed and not, a refusal, an editor's
    events on a completion."""
    with httpx.Client(base_url=url, timeout=60) as c:
        for stream in (False, True, False):
            r = c.post("/v1/completions", json={"prompt": "def f():", "max_tokens": 8,
                                                "stream": stream})
            assert r.status_code == 200
        served = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 4}).json()
        for kind in ("view", "select"):
            assert c.post("/v1/events", json={"type": kind, "completion_id": served["id"]}
                          ).status_code == 200
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 0,
                                               "temperature": -1}).status_code == 400


def query(prom: str, expr: str) -> list[dict[str, Any]]:
    r = httpx.get(prom + "/api/v1/query", params={"query": expr}, timeout=30)
    assert r.status_code == 200, (expr, r.text)
    result: list[dict[str, Any]] = r.json()["data"]["result"]
    return result


def wait_for(what: str, check: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(1)


def test_every_recorded_series_and_dashboard_expression_returns_data(
        scraped: tuple[DaemonProcess, str]) -> None:
    _, prom = scraped
    for expr in [*recorded(), *dashboard_exprs()]:
        # The first scrapes and evaluations take a few seconds; then a result each.
        wait_for(expr, lambda e=expr: query(prom, e) != [])
    node = query(prom, "forged_build_info")[0]["metric"]["node"]
    per_key = query(prom, "node_model_key:forged_generation_tokens:rate5m")
    assert {(s["metric"]["node"], s["metric"]["key"]) for s in per_key} == {(node, "-")}


def test_a_killed_worker_fires_the_restart_alert(scraped: tuple[DaemonProcess, str]) -> None:
    d, prom = scraped
    stats = admin_stats(d)
    os.kill(int(stats["engine"]["workers"][0]["pid"]), signal.SIGKILL)

    def firing() -> bool:
        alerts = httpx.get(prom + "/api/v1/alerts", timeout=30).json()["data"]["alerts"]
        return any(a["labels"]["alertname"] == "ForgedWorkerRestarting"
                   and a["state"] == "firing" for a in alerts)

    wait_for("ForgedWorkerRestarting to fire", firing)


def admin_stats(d: DaemonProcess) -> dict[str, Any]:
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(d.config.parent / "admin.sock")),
                      base_url="http://admin", timeout=30) as a:
        stats: dict[str, Any] = a.get("/stats").json()
        return stats
