"""The status page, in a real browser: Debian's Chromium, driven by Playwright (the
system browser; Playwright downloads none). It loads from the read-only listener with
no console error and no request elsewhere, shows each worker, the indexes and a pool's
other node, and its figures change while a load runs. The listener serves no action."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright import sync_api

from tests.daemonproc import DaemonProcess, free_port, write_config

CHROMIUM = "/usr/bin/chromium"  # Debian's (scripts/system-deps.sh)
# As the machine's own checks start it: headless, as root, nothing fetched from Google.
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[
        tuple[DaemonProcess, int]]:
    tmp = tmp_path_factory.mktemp("page")
    port, metrics = free_port(), free_port()
    config = write_config(tmp / "forged.toml", tiny_model, port,
                          server={"metrics_listen": f"127.0.0.1:{metrics}"},
                          engine={"workers": 2, "kv_cells": 2048, "max_context": 1024,
                                  "slots": 4, "max_running": 4, "kv_layout": "unified"})
    src = tmp / "src"
    src.mkdir()
    (src / "a.py").write_text("def alpha():\n    return 1\n")
    subprocess.run([sys.executable, "-m", "forged", "index", "add", "demo", str(src),
                    "--config", str(config)], check=True, timeout=120, capture_output=True)
    # With the test hooks, the admin listener has a debug action the read-only one
    # must not serve.
    d = DaemonProcess(config, port, extra=["--test-hooks"])
    try:
        d.wait_ready(180)
        yield d, metrics
    finally:
        assert d.stop() == 0


def test_the_listener_is_read_only(node: tuple[DaemonProcess, int]) -> None:
    d, metrics = node
    with httpx.Client(base_url=f"http://127.0.0.1:{metrics}", timeout=30) as c:
        page = c.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "default-src 'none'" in page.headers["content-security-policy"]
        assert re.search(r"(src|href)\s*=", page.text) is None  # no asset to fetch
        assert c.get("/metrics").text.count("forged_requests_total") >= 1
        stats = c.get("/stats")
        assert stats.headers["access-control-allow-origin"] == "*"
        assert [i["name"] for i in stats.json()["indexes"]] == ["demo"]
        assert c.get("/health").status_code == 200
        for method, path in (("POST", "/models/swap"), ("POST", "/debug/slow-steps")):
            assert c.request(method, path, json={"path": "/x"}).status_code in (404, 405)
    # ... which the admin listener does serve: the check above is not vacuous.
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(d.config.parent / "admin.sock")),
                      base_url="http://admin", timeout=30) as a:
        assert a.post("/debug/slow-steps", params={"seconds": 0}).status_code == 200
        assert "access-control-allow-origin" not in a.get("/stats").headers


def load(url: str, stop: threading.Event) -> None:
    """Streams one after another until ``stop``: what the page must show moving."""
    with httpx.Client(base_url=url, timeout=60) as c:
        for _ in range(200):  # bounded: about 2 s each at most
            if stop.is_set():
                return
            c.post("/v1/completions", json={"prompt": "count", "max_tokens": 48,
                                            "ignore_eos": True, "stream": True})


def test_the_page_shows_workers_and_moves_with_load(node: tuple[DaemonProcess, int]) -> None:
    d, metrics = node
    base = f"http://127.0.0.1:{metrics}"
    errors: list[str] = []
    elsewhere: list[str] = []
    pids = {str(w["pid"]) for w in httpx.get(base + "/stats").json()["engine"]["workers"]}
    stop = threading.Event()
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        try:
            # A phone's screen: the page must fit it without scrolling sideways.
            page = browser.new_page(viewport={"width": 390, "height": 844})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("request", lambda r: None if r.url.startswith(
                (base, f"http://localhost:{metrics}")) else elsewhere.append(r.url))
            # The pool: this node again under another name (another origin: the peer's
            # statistics are read across origins).
            page.goto(f"{base}/?peers=localhost:{metrics}")
            wait_until(page, "() => document.querySelectorAll('#workers tr').length === 3", 20)
            shown = page.inner_text("#workers")
            assert all(pid in shown for pid in pids), shown
            assert "demo" in page.inner_text("#indexes")
            wait_until(page, "() => document.querySelectorAll('#pool tr').length === 3", 20)
            assert page.inner_text("#pool").count("ready") == 2
            before = tile(page, "tokens/s (1 min)")
            worker = threading.Thread(target=load, args=(d.url, stop))
            worker.start()
            try:
                wait_until(page, "t => document.querySelector("
                           "`[data-name='tokens/s (1 min)'] .value`).textContent !== t",
                           30, before)
            finally:
                stop.set()
                worker.join(60)
            width = page.evaluate("document.documentElement.scrollWidth")
            assert width <= 390, width
        finally:
            browser.close()
    assert errors == [] and elsewhere == []


def wait_until(page: Any, predicate: str, seconds: float, arg: object = None) -> None:
    """Polls ``predicate`` from here rather than with ``page.wait_for_function``: that one
    re-runs an ``eval`` of the predicate in the page once the first try is false, which
    the page's own CSP (no 'unsafe-eval') refuses, so it failed whenever the page had not
    drawn yet (seen in CI). ``evaluate`` is one DevTools evaluation, which CSP allows."""
    deadline = time.monotonic() + seconds
    while not page.evaluate(predicate, arg):
        assert time.monotonic() < deadline, f"not true within {seconds} s: {predicate}"
        time.sleep(0.1)


def tile(page: Any, name: str) -> str:
    text: str = page.inner_text(f"[data-name='{name}'] .value")
    return text
