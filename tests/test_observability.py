"""Metrics, access logs, `forged status` and `forged bench` against a running daemon."""

from __future__ import annotations

import json
import random
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from forged.cli import logfmt_value
from forged.observe.metrics import LATENCY_BUCKETS, _Gaps
from tests.daemonproc import DaemonProcess, free_port, write_config

ENGINE = {"kv_layout": "unified", "kv_cells": 4096, "max_context": 2048, "slots": 16,
          "max_running": 8,
          "step_tokens": 64}


@pytest.fixture
def daemon(tmp_path: Path, tiny_model: Path) -> Iterator[DaemonProcess]:
    port = free_port()
    d = DaemonProcess(write_config(tmp_path / "forged.toml", tiny_model, port, engine=ENGINE),
                      port, extra=["--test-hooks"])
    try:
        d.wait_ready()
        yield d
    finally:
        d.stop()


def admin(d: DaemonProcess) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(d.config.parent / "admin.sock")),
                        base_url="http://admin", timeout=30)


def scrape(d: DaemonProcess) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    with admin(d) as a:
        text = a.get("/metrics").text
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            # Every sample names its node (server.node_name, by default the host name),
            # so that Prometheus can sum a pool whatever its scrape configuration calls
            # the targets; the tests index by the other labels.
            assert s.labels.pop("node") == socket.gethostname(), s
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def types(d: DaemonProcess) -> dict[str, str]:
    with admin(d) as a:
        return {f.name: f.type for f in text_string_to_metric_families(a.get("/metrics").text)}


def total(m: dict[str, dict[tuple[tuple[str, str], ...], float]], name: str) -> float:
    return sum(m.get(name, {}).values())


def test_metric_names_types_and_labels(daemon: DaemonProcess) -> None:
    t = types(daemon)
    expected = {
        "forged_requests": "counter", "forged_time_to_first_token_seconds": "histogram",
        "forged_inter_token_latency_seconds": "histogram",
        "forged_request_duration_seconds": "histogram", "forged_queue_time_seconds": "histogram",
        "forged_prompt_tokens": "counter", "forged_generation_tokens": "counter",
        "forged_running_sequences": "gauge", "forged_queued_requests": "gauge",
        "forged_queued_prompt_tokens": "gauge", "forged_kv_cells_used": "gauge",
        "forged_kv_cells_total": "gauge", "forged_prefix_cache_queries": "counter",
        "forged_prefix_cache_hits": "counter", "forged_prefix_holds": "counter",
        "forged_prefix_cache_tokens_saved": "counter",
        "forged_cancellations": "counter", "forged_worker_restarts": "counter",
        "forged_early_rejections": "counter",
        "forged_build_info": "gauge",
        "forged_kv_tier_bytes": "gauge", "forged_kv_tier_budget_bytes": "gauge",
        "forged_kv_tier_entries": "gauge", "forged_kv_tier_restores": "counter",
        "forged_kv_saves": "counter", "forged_kv_restored_tokens": "counter",
        "forged_kv_restore_failures": "counter", "forged_kv_demotions": "counter",
        "forged_kv_drops": "counter", "forged_kv_swaps": "counter",
        "forged_routed_requests": "counter", "forged_resubmitted_requests": "counter",
        "forged_steps": "counter", "forged_micro_batches": "counter",
        "forged_prompt_steps": "counter", "forged_step_seconds": "counter",
        "forged_step_tokens": "counter",
    }
    for name, kind in expected.items():
        assert t.get(name) == kind, (name, t.get(name))
    m = scrape(daemon)
    assert total(m, "forged_kv_cells_total") == 4096
    budgets = m["forged_kv_tier_budget_bytes"]
    # The engine's samples name their model (a swap shows two).
    assert budgets[(("model", "tiny"), ("tier", "ram"))] == 4096 << 20
    assert budgets[(("model", "tiny"), ("tier", "disk"))] == 8192 << 20
    info = next(iter(m["forged_build_info"]))
    assert dict(info)["model"] == "tiny"
    # the API port serves none of it
    assert httpx.get(daemon.url + "/metrics").status_code == 404


def test_counters_move_and_kv_returns_to_zero_after_a_disconnect(daemon: DaemonProcess) -> None:
    with httpx.Client(base_url=daemon.url, timeout=30) as c:
        for _ in range(3):
            assert c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 5,
                                                   "ignore_eos": True}).status_code == 200
        assert c.post("/v1/completions", json={"prompt": 1}).status_code == 400
        with admin(daemon) as a:  # the stream lasts 10 s: the client surely leaves first
            a.post("/debug/slow-steps", params={"seconds": 0.01})
        with c.stream("POST", "/v1/completions", json={
                "prompt": "go", "max_tokens": 1000, "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # leave mid-stream: the connection closes here
    m = scrape(daemon)
    req = m["forged_requests_total"]
    # by key and model: "-" for no key, and for a request no model served
    assert req[(("endpoint", "/v1/completions"), ("key", "-"), ("model", "tiny"),
                ("priority", "interactive"), ("status", "200"))] == 4
    assert req[(("endpoint", "/v1/completions"), ("key", "-"), ("model", "-"),
                ("priority", "none"), ("status", "400"))] == 1
    assert m["forged_generation_tokens_total"][(("key", "-"), ("model", "tiny"))] >= 15
    assert m["forged_prompt_tokens_total"][(("key", "-"), ("model", "tiny"))] >= 4
    assert m["forged_time_to_first_token_seconds_count"][()] >= 3
    # (the tiny model's text often holds back partial UTF-8, so fewer pieces than tokens)
    assert m["forged_inter_token_latency_seconds_count"][()] >= 6
    deadline = time.monotonic() + 20
    while True:
        m = scrape(daemon)
        if total(m, "forged_running_sequences") == 0 and \
                total(m, "forged_cancellations_total") == 1:
            break
        assert time.monotonic() < deadline, m.get("forged_cancellations_total")
        time.sleep(0.05)
    assert m["forged_cancellations_total"][(("reason", "client_gone"),)] == 1
    assert total(m, "forged_kv_cells_used") == total(m, "forged_kv_cells_cached")
    assert total(m, "forged_prefix_cache_hits_total") >= 2  # the repeated "hello"
    # the unified layout computes every step in one pass over the weights
    assert total(m, "forged_micro_batches_total") == total(m, "forged_steps_total") >= 15
    # one after another, each completion's first token came from its prompt's step and
    # the other four from steps that decoded alone
    tokens = m["forged_step_tokens_total"]
    assert tokens[(("kind", "prompt"), ("model", "tiny"))] >= 3
    assert tokens[(("kind", "decode"), ("model", "tiny"))] >= 12
    assert total(m, "forged_prompt_steps_total") >= 3
    assert all(v > 0 for v in m["forged_step_seconds_total"].values())
    log = daemon.log.read_text()
    assert "logger=forged.access" in log and "completion_tokens=5" in log
    assert "hello" not in log  # prompts are never logged


def test_forged_status_shows_the_load(daemon: DaemonProcess) -> None:
    with httpx.Client(base_url=daemon.url, timeout=30) as c:
        for i in range(4):
            c.post("/v1/completions", json={"prompt": "x", "max_tokens": 6, "ignore_eos": True,
                                             "session": f"s{i % 2}"})
    admin_addr = f"unix:{daemon.config.parent / 'admin.sock'}"
    out = subprocess.run([sys.executable, "-m", "forged", "status", "--admin", admin_addr],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    assert "model tiny" in out and "ready" in out
    assert "(4 requests)" in out
    assert "TTFT        p50" in out and "worker 0" in out
    # engine.threads = 0 (the default): the workers' share of their physical cores
    assert re.search(r"\n  threads   \d+ \(engine.threads = 0: \d+ physical cores for 1 "
                     r"worker\)\n", out), out
    # server.door_cpus = "auto" (the default): a core of its own from 8 cores up
    assert re.search(r"\ndoor        (every CPU|[\d, ]+) \(server.door_cpus = \"auto\": ", out), out
    assert re.search(r"\n            door processes 0 \(server.door_processes = \"auto\": ",
                     out), out
    # flash_attn = "auto" (the default): the worker timed both and says what it found
    assert re.search(r"attention flash attention (on|off): measured [\d.]+ ms with flash "
                     r"attention, [\d.]+ ms without", out), out
    assert "in 4 requests" in out and "sessions 2 pinned" in out  # s0 and s1
    assert re.search(r"\n  with prompt work \d+% of steps, \d+% of their time, \d+% of the "
                     r"tokens generated\n", out), out
    assert "KV RAM      0 of 4096 MiB, 0 states, 0 restores" in out
    assert "KV disk     0 of 8192 MiB" in out and "KV moves    0 saved" in out
    raw = json.loads(subprocess.run(
        [sys.executable, "-m", "forged", "status", "--admin", admin_addr, "--json"],
        capture_output=True, text=True, timeout=30, check=True).stdout)
    assert raw["last_minute"]["requests"] == 4
    assert raw["last_minute"]["tokens_per_second"] == pytest.approx(24 / 60)


def test_forged_bench_smoke(daemon: DaemonProcess, tmp_path: Path) -> None:
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    r = subprocess.run(
        [sys.executable, "-m", "forged", "bench", "--url", daemon.url, "--mix", "mixed",
         "--concurrency", "1,4", "--requests", "8", "--max-tokens", "8", "--duration", "60",
         "--out", str(out), "--plot", str(png)],
        capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert [run["concurrency"] for run in result["runs"]] == [1, 4]
    for run in result["runs"]:
        s = run["summary"]
        assert s["ok"] == 8 and s["errors"] == {}
        assert 0 < s["ttft_p50"] <= s["ttft_p99"] < 60
        assert s["out_tok_per_s"] > 0 and s["itl_p50"] is not None
    import matplotlib.image

    image = matplotlib.image.imread(png)
    assert image.shape[0] > 100 and image.shape[1] > 100
    assert "ttft" in r.stdout


def test_forged_bench_compare_takes_turns_at_one_caller(daemon: DaemonProcess,
                                                        tmp_path: Path) -> None:
    out = tmp_path / "compare.json"
    r = subprocess.run(
        [sys.executable, "-m", "forged", "bench", "--url", daemon.url, "--compare",
         daemon.url + "/", "--concurrency", "1", "--requests", "3", "--max-tokens", "4",
         "--duration", "60", "--out", str(out)],
        capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    runs = json.loads(out.read_text())["runs"]
    assert [run["url"] for run in runs] == [daemon.url, daemon.url]
    for run in runs:
        assert run["summary"]["ok"] == 3 and run["summary"]["errors"] == {}
        # Rates are over each server's own answering time, not the shared wall clock.
        assert run["summary"]["wall_s"] < 60
    assert runs[0]["ratio_vs_compare"]["req_per_s"] is not None


def test_log_content_puts_prompt_and_completion_on_the_access_line(
    tmp_path: Path, tiny_model: Path
) -> None:
    port = free_port()
    d = DaemonProcess(write_config(tmp_path / "forged.toml", tiny_model, port, engine=ENGINE,
                                   log={"log_content": True}), port)
    prompt = 'say "hi"\nplease'
    try:
        d.wait_ready()
        with httpx.Client(base_url=d.url, timeout=30) as c:
            whole = c.post("/v1/completions", json={
                "prompt": prompt, "max_tokens": 6, "ignore_eos": True}).json()
            with c.stream("POST", "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "a secret"}], "max_tokens": 6,
                    "ignore_eos": True, "stream": True}) as r:
                deltas = [json.loads(line[6:])["choices"][0]["delta"].get("content", "")
                          for line in r.iter_lines()
                          if line.startswith("data: {") and '"choices":[{' in line]
    finally:
        d.stop()
    access = [line for line in d.log.read_text().splitlines() if "logger=forged.access" in line]
    completion = next(line for line in access if "/v1/completions" in line)
    assert f" prompt={logfmt_value(prompt)} " in completion
    assert completion.endswith(f" completion={logfmt_value(whole['choices'][0]['text'])}")
    chat = next(line for line in access if "/v1/chat/completions" in line)
    assert "a secret" in chat and chat.endswith(f" completion={logfmt_value(''.join(deltas))}")


def test_gaps_fed_at_once_expose_what_prometheus_clients_histogram_would() -> None:
    """The inter-token histogram takes a request's gaps at once (metrics._Gaps): its
    series are prometheus-client's Histogram's, value for value (but ``_created``;
    the sum up to its order of addition), bounds and values above the last included."""
    rng = random.Random(7)
    gaps = [rng.choice(LATENCY_BUCKETS) for _ in range(100)] + [
        rng.expovariate(4.0) for _ in range(1000)] + [0.0, 1e9]
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    histogram = Histogram("g_seconds", "Gaps.", buckets=LATENCY_BUCKETS, registry=theirs)
    for gap in gaps:
        histogram.observe(gap)
    fed = _Gaps("g_seconds", "Gaps.", LATENCY_BUCKETS, ours)
    fed.observe_many(gaps[:500])
    fed.observe_many(gaps[500:])

    def series(registry: CollectorRegistry) -> dict[str, float]:
        text = generate_latest(registry).decode()
        return {f"{s.name}{sorted(s.labels.items())}": s.value
                for family in text_string_to_metric_families(text) for s in family.samples
                if not s.name.endswith("_created")}

    expected, got = series(theirs), series(ours)
    assert got.keys() == expected.keys()
    assert all(got[k] == pytest.approx(v, rel=1e-12) for k, v in expected.items())
