"""systemd integration without PID-1 systemd: units, sd_notify, socket activation,
drain on SIGTERM, reload on SIGHUP and the watchdog, against `forged serve` processes."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import httpx
import msgspec
import pytest

from forged import config as fc
from forged.cli import LogfmtFormatter, on_journal
from forged.daemon.lifespan import workers_unrecovered
from tests.conftest import ROOT
from tests.daemonproc import DaemonProcess, free_port, write_config
from tests.tinymodel import write_tiny_llama

ENGINE = {"kv_layout": "unified", "kv_cells": 4096, "max_context": 2048, "slots": 16,
          "max_running": 16,
          "step_tokens": 64, "restart_backoff": 0.1}


class NotifySocket:
    """What systemd does for NOTIFY_SOCKET: a datagram socket that collects messages."""

    def __init__(self, tmp: Path) -> None:
        self.path = str(tmp / "notify.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.05)
        self.messages: list[tuple[float, str]] = []
        self.cursor = 0  # wait_for() looks only past the previous match

    def pump(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            for line in data.decode().splitlines():
                self.messages.append((time.monotonic(), line))

    def wait_for(self, prefix: str, timeout: float = 30.0) -> float:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for i in range(self.cursor, len(self.messages)):
                t, line = self.messages[i]
                if line.startswith(prefix):
                    self.cursor = i + 1
                    return t
            self.pump(0.05)
        raise TimeoutError(f"no {prefix} after message {self.cursor}: {self.messages[-20:]}")

    def kinds(self) -> list[str]:
        return [line.split("=", 1)[0] for _, line in self.messages]

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def notify(tmp_path: Path) -> Iterator[NotifySocket]:
    n = NotifySocket(tmp_path)
    yield n
    n.close()


def start(tmp: Path, model: Path, env: dict[str, str] | None = None,
          **sections: dict[str, Any]) -> DaemonProcess:
    port = free_port()
    sections.setdefault("engine", ENGINE)
    cfg = write_config(tmp / "forged.toml", model, port, **sections)
    d = DaemonProcess(cfg, port, env=env, extra=["--test-hooks"])
    d.wait_ready()
    return d


def wait_for_log(d: DaemonProcess, text: str, timeout: float = 30.0) -> None:
    """Until ``text`` is in the daemon's log (each line is flushed as it is logged)."""
    deadline = time.monotonic() + timeout
    while text not in d.log.read_text():
        assert time.monotonic() < deadline, f"no {text!r} in the log"
        time.sleep(0.02)


def admin(d: DaemonProcess) -> httpx.Client:
    sock = str(d.config.parent / "admin.sock")
    return httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://admin",
                        timeout=30)


# --- unit files --------------------------------------------------------------------------


def _verify(tmp_path: Path, *names: str) -> tuple[list[str], subprocess.CompletedProcess[str]]:
    """``systemd-analyze verify`` on the shipped units ``names``, pointing at this venv's
    forged; their paths in ``tmp_path``, and the result."""
    forged = shutil.which("forged", path=str(Path(sys.executable).parent))
    assert forged
    for unit in names:
        text = (ROOT / "systemd" / unit).read_text().replace("/usr/bin/forged", forged)
        (tmp_path / unit).write_text(text)
    units = [str(tmp_path / unit) for unit in names]
    return units, subprocess.run(["systemd-analyze", "verify", "--man=no", *units],
                                 capture_output=True, text=True, timeout=60)


def test_units_verify_and_score_as_hardened(tmp_path: Path) -> None:
    units, r = _verify(tmp_path, "forged.socket", "forged.service")
    assert r.returncode == 0, r.stderr
    assert "forged" not in r.stderr, r.stderr  # no warning about our units
    r = subprocess.run(["systemd-analyze", "security", "--offline=true", units[1]],
                       capture_output=True, text=True, timeout=60)
    m = re.search(r"Overall exposure level for forged.service: ([0-9.]+)", r.stdout)
    assert m, r.stdout
    assert float(m.group(1)) < 2.0


def test_the_stop_timeout_covers_the_grace_the_drain_and_the_workers_writes() -> None:
    """systemd kills what outlasts TimeoutStopSec: the agent's grace, the drain and the
    workers' time to write sessions' KV states to disk must end before it (they added
    up to exactly the 45 s it was)."""
    from forged.config import ServerConfig
    from forged.engine.supervisor import STOP_GRACE

    unit = (ROOT / "systemd" / "forged.service").read_text()
    m = re.search(r"^TimeoutStopSec=(\d+)$", unit, re.M)
    assert m
    server = ServerConfig()
    assert int(m.group(1)) > server.drain_grace + server.drain_timeout + STOP_GRACE


def test_the_index_timer_and_its_service_verify_and_score_as_hardened(tmp_path: Path) -> None:
    units, r = _verify(tmp_path, "forged-index.timer", "forged-index.service")
    assert r.returncode == 0 and "forged" not in r.stderr, r.stderr
    service = (tmp_path / "forged-index.service").read_text()
    # As the daemon's user, updating every index (the daemon only reads them).
    forged = shutil.which("forged", path=str(Path(sys.executable).parent))
    assert "User=forged\n" in service and f"ExecStart={forged} index update " in service
    assert "OnCalendar=hourly\n" in (tmp_path / "forged-index.timer").read_text()
    r = subprocess.run(["systemd-analyze", "security", "--offline=true", units[1]],
                       capture_output=True, text=True, timeout=60)
    m = re.search(r"Overall exposure level for forged-index.service: ([0-9.]+)", r.stdout)
    assert m and float(m.group(1)) < 2.0, r.stdout


# --- sd_notify ----------------------------------------------------------------------------


def test_notify_ready_status_watchdog_reload_stopping(
    tmp_path: Path, tiny_model: Path, notify: NotifySocket
) -> None:
    env = {"NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": "400000"}
    d = start(tmp_path, tiny_model, env=env, server={"status_interval": 0.2},
              engine={**ENGINE, "workers": 2, "startup_timeout": 200.0})
    try:
        notify.wait_for("READY=1")
        # Workers start one after another, each within startup_timeout: the start asks
        # systemd for their time (TimeoutStartSec=300 ran out before 2 x 200 s).
        extend = [line for _, line in notify.messages if line.startswith("EXTEND_TIMEOUT")]
        assert extend == [f"EXTEND_TIMEOUT_USEC={(2 * 200 + 60) * 10**6}"]
        notify.wait_for("STATUS=")
        notify.wait_for("WATCHDOG=1")
        status = [line for _, line in notify.messages if line.startswith("STATUS=")][-1]
        assert "streams" in status and "KV" in status and "tok/s" in status
        d.proc.send_signal(signal.SIGHUP)
        notify.wait_for("RELOADING=1")
        notify.wait_for("READY=1")
        assert any(line.startswith("MONOTONIC_USEC=") for _, line in notify.messages)
        d.proc.send_signal(signal.SIGTERM)
        notify.wait_for("STOPPING=1")
        assert d.proc.wait(30) == 0
    finally:
        d.stop()
    kinds = notify.kinds()
    order = [k for k in kinds if k in ("READY", "RELOADING", "STOPPING")]
    assert order == ["READY", "RELOADING", "READY", "STOPPING"]
    first_ready = kinds.index("READY")
    assert "STATUS" in kinds[first_ready:] and "WATCHDOG" in kinds[first_ready:]


def _watchdog_gaps(notify: NotifySocket, since: float) -> float:
    """The longest silence between pings from ``since`` on (the ping before it counts)."""
    times = [t for t, line in notify.messages if line == "WATCHDOG=1"]
    before = [t for t in times if t < since]
    times = before[-1:] + [t for t in times if t >= since]
    return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def test_watchdog_pings_stop_when_the_loop_is_stuck_not_when_a_worker_is(
    tmp_path: Path, tiny_model: Path, notify: NotifySocket
) -> None:
    env = {"NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": "400000"}  # a ping every 0.2 s
    d = start(tmp_path, tiny_model, env=env,
              engine={**ENGINE, "heartbeat_interval": 0.1, "heartbeat_timeout": 2.0,
                      # the timeout must outlast ten target steps (forged check-config)
                      "target_step_ms": 100.0})
    try:
        with admin(d) as a:
            notify.wait_for("WATCHDOG=1")
            notify.pump(1.0)
            t0 = time.monotonic()
            # Healthy: steady pings, every 0.2 s (a gap of 1 s would be four missed).
            assert _watchdog_gaps(notify, t0 - 1.0) < 1.0
            # Post from a thread: the datagrams must be read (and timed) as they arrive.
            replies: list[int] = []
            blocker = threading.Thread(target=lambda: replies.append(
                a.post("/debug/block-loop", params={"seconds": 1.5}).status_code))
            blocker.start()
            deadline = time.monotonic() + 10
            while blocker.is_alive() and time.monotonic() < deadline:
                notify.pump(0.1)
            notify.pump(0.5)
            assert replies == [200]
            assert _watchdog_gaps(notify, t0) >= 1.3  # the blocked loop sent nothing
            t1 = time.monotonic()
            a.post("/debug/hang-worker", params={"seconds": 5})
            notify.pump(3.5)
            # A wedged worker is its pool's to replace (at 2 s): the pings go on. (They
            # stopped at 1 s and resumed after the replacement: a gap past WatchdogSec,
            # and under systemd the whole daemon was killed for one worker.)
            assert _watchdog_gaps(notify, t1) < 1.0
            assert d.proc.poll() is None
            # The replacement loads the model, on a machine that may be busy.
            with httpx.Client(timeout=30) as c:
                deadline = time.monotonic() + 60
                while c.get(d.url + "/health").status_code != 200:
                    assert time.monotonic() < deadline
                    time.sleep(0.1)
            assert a.get("/stats").json()["engine"]["workers"][0]["restarts"] == 1
    finally:
        d.stop()


def test_the_watchdog_stops_only_for_a_worker_its_pool_failed_to_recover() -> None:
    """A worker silent past its heartbeat_timeout is killed and replaced by its pool;
    only one still silent a ping interval later (the pool failed) stops the pings. Each
    worker by its own model's limit."""
    engine = fc.Config().engine  # heartbeat_timeout 30 s

    def worker(silent_s: float, ready: bool = True, timeout: float = 30.0) -> Any:
        return SimpleNamespace(ready=ready, last_heard=100.0 - silent_s, engine=(
            msgspec.structs.replace(engine, heartbeat_timeout=timeout)))

    assert not workers_unrecovered([worker(16.0), worker(44.0)], 100.0, 15.0)
    assert workers_unrecovered([worker(46.0)], 100.0, 15.0)
    assert not workers_unrecovered([worker(46.0, ready=False)], 100.0, 15.0)  # replaced
    assert not workers_unrecovered([worker(46.0, timeout=60.0)], 100.0, 15.0)


# --- socket activation ------------------------------------------------------------------


def _spawn_activated(listener: socket.socket, config: Path, log: Path) -> subprocess.Popen[bytes]:
    """Start forged as systemd would: the listening socket as fd 3, LISTEN_FDS=1 and
    LISTEN_PID set to the daemon's own pid (the shell keeps its pid through exec)."""
    fd = listener.fileno()

    def as_fd3() -> None:
        os.dup2(fd, 3)  # the copy is inheritable; every other fd of ours is not (PEP 446)

    with log.open("ab") as out:
        return subprocess.Popen(
            ["/bin/sh", "-c", 'LISTEN_PID=$$ LISTEN_FDS=1 exec "$0" -m forged serve --config "$1"',
             sys.executable, str(config)],
            preexec_fn=as_fd3, close_fds=False, stdout=out, stderr=subprocess.STDOUT,
        )


def test_socket_activation_serves_the_inherited_fd_and_restarts_refuse_nothing(
    tmp_path: Path, tiny_model: Path
) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    # The config names another port: under socket activation the inherited fd wins.
    config = write_config(tmp_path / "forged.toml", tiny_model, free_port(), engine=ENGINE)
    url = f"http://127.0.0.1:{port}"
    outcomes: list[int | str] = []
    stop = threading.Event()

    def client_loop() -> None:
        with httpx.Client(timeout=30) as c:
            for _ in range(400):  # bounded: at most 400 requests, 10 per second
                if stop.is_set():
                    return
                try:
                    outcomes.append(c.get(url + "/health",
                                          headers={"Connection": "close"}).status_code)
                except httpx.ConnectError as exc:
                    outcomes.append(f"refused: {exc}")
                time.sleep(0.1)

    log = tmp_path / "forged.log"
    first = _spawn_activated(listener, config, log)
    thread = threading.Thread(target=client_loop)
    try:
        deadline = time.monotonic() + 30
        while 200 not in outcomes and time.monotonic() < deadline:
            if not thread.is_alive():
                thread.start()
            time.sleep(0.1)
        assert 200 in outcomes, log.read_text()
        first.send_signal(signal.SIGTERM)
        assert first.wait(30) == 0
        second = _spawn_activated(listener, config, log)
        n = len(outcomes)
        deadline = time.monotonic() + 30
        while (outcomes[n:].count(200) < 3) and time.monotonic() < deadline:
            time.sleep(0.1)
        stop.set()
        thread.join(30)
        second.send_signal(signal.SIGTERM)
        assert second.wait(30) == 0
    finally:
        stop.set()
        for p in (first, locals().get("second")):
            if isinstance(p, subprocess.Popen) and p.poll() is None:
                p.kill()
        listener.close()
    refused = [o for o in outcomes if isinstance(o, str)]
    assert not refused, refused
    assert outcomes.count(200) >= 4
    assert set(outcomes) <= {200, 503}


# --- drain -------------------------------------------------------------------------------


def test_sigterm_drains_streams_then_exits_zero(tmp_path: Path, tiny_model: Path) -> None:
    # Ten short streams (4 tokens) finish well within the drain even on a busy machine,
    # where a step of 20 streams took 0.4 s; ten long ones (1500 tokens, 30 s at the
    # least) are cut at its deadline.
    d = start(tmp_path, tiny_model, server={"drain_timeout": 10.0},
              engine={**ENGINE, "slots": 32, "max_running": 32})
    results: dict[int, list[str]] = {}
    statuses: dict[int, int] = {}
    opened = threading.Semaphore(0)
    try:
        with admin(d) as a:
            a.post("/debug/slow-steps", params={"seconds": 0.02})

        def stream(i: int, max_tokens: int) -> None:
            body = {"prompt": f"s{i}", "max_tokens": max_tokens, "ignore_eos": True,
                    "stream": True}
            with httpx.Client(timeout=60) as c, \
                    c.stream("POST", d.url + "/v1/completions", json=body) as r:
                opened.release()  # admitted: its response has started
                results[i] = [line for line in r.iter_lines() if line.startswith("data: ")]
                statuses[i] = r.status_code

        threads = [threading.Thread(target=stream, args=(i, 4 if i < 10 else 1500))
                   for i in range(20)]
        for t in threads:
            t.start()
        for _ in threads:  # every stream started before the drain
            assert opened.acquire(timeout=30)
        # a request whose headers arrived before the drain and its body after it
        body = json.dumps({"prompt": "late", "max_tokens": 2}).encode()
        late = socket.create_connection(("127.0.0.1", d.port))
        late.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n")
        time.sleep(1.0)  # for the server to accept it and read its headers
        t_term = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        wait_for_log(d, "draining:")
        late.sendall(body)
        late_reply = late.recv(65536).decode()
        late.close()
        for t in threads:
            t.join(30)
        assert d.proc.wait(30) == 0
        drain_took = time.monotonic() - t_term
    finally:
        d.stop()
    assert late_reply.startswith("HTTP/1.1 503"), late_reply
    assert "retry-after" in late_reply.lower()
    assert len(results) == 20
    for i, frames in results.items():
        assert frames and frames[-1] == "data: [DONE]", (i, statuses[i], frames[-3:])
        last = json.loads(frames[-2][6:])
        if i < 10:
            assert last.get("choices", [{}])[0].get("finish_reason") == "length", (i, last)
        else:
            assert last.get("error", {}).get("code") == "draining", (i, last)
    assert 9.5 < drain_took < 30


def test_second_sigterm_stops_at_once(tmp_path: Path, tiny_model: Path) -> None:
    d = start(tmp_path, tiny_model, server={"drain_timeout": 60.0})
    try:
        with admin(d) as a:
            a.post("/debug/slow-steps", params={"seconds": 0.05})
        def long_request() -> None:
            # Cut short by the second signal: a dropped connection is the expected end.
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(d.url + "/v1/completions", timeout=60, json={
                    "prompt": "x", "max_tokens": 1500, "ignore_eos": True})

        thread = threading.Thread(target=long_request)
        thread.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        # Signals of one kind that arrive together are delivered once: the second is
        # sent after the first has begun the drain.
        wait_for_log(d, "draining:")
        d.proc.send_signal(signal.SIGTERM)
        d.proc.wait(20)
        assert time.monotonic() - t0 < 10
        thread.join(30)
    finally:
        d.stop()


# --- reload ------------------------------------------------------------------------------


def test_reload_applies_good_refuses_bad_and_reports_restart_keys(
    tmp_path: Path, tiny_model: Path, notify: NotifySocket
) -> None:
    d = start(tmp_path, tiny_model, env={"NOTIFY_SOCKET": notify.path})
    cfg = d.config.read_text()
    try:
        with admin(d) as a:
            assert a.get("/stats").json()["limits"]["max_queued"] == 256
            d.config.write_text(cfg.replace("[server]", "[limits]\nmax_queued = 7\n[server]"))
            d.proc.send_signal(signal.SIGHUP)
            notify.wait_for("RELOADING=1")
            notify.wait_for("READY=1")
            assert a.get("/stats").json()["limits"]["max_queued"] == 7

            d.config.write_text(cfg + "\n[limits]\nmax_queued = 'lots'\n")
            d.proc.send_signal(signal.SIGHUP)
            notify.wait_for("RELOADING=1")
            notify.wait_for("READY=1")
            assert a.get("/stats").json()["limits"]["max_queued"] == 7
            assert httpx.get(d.url + "/health").status_code == 200

            d.config.write_text(cfg.replace("slots = 16", "slots = 32"))
            d.proc.send_signal(signal.SIGHUP)
            notify.wait_for("RELOADING=1")
            notify.wait_for("READY=1")
            # the restart-only key is not applied, and a live key went back to its default
            assert a.get("/stats").json()["limits"]["max_queued"] == 256
    finally:
        d.stop()
    log = d.log.read_text()
    assert "reload refused" in log and "max_queued" in log
    assert "need a restart" in log and "engine.slots" in log


def test_a_reload_keeps_the_command_lines_listen_and_model(
        tmp_path: Path, tiny_model: Path, notify: NotifySocket) -> None:
    """forged serve --listen and --model win over the file, and still do after a
    reload: it read the file alone, so it swapped the model to the file's and called
    the address a change that needs a restart."""
    other = write_tiny_llama(tmp_path / "other.gguf", seed=1)
    port = free_port()
    cfg = write_config(tmp_path / "forged.toml", tiny_model, free_port(),
                       engine=ENGINE)  # the file's address and model are not served
    d = DaemonProcess(cfg, port, env={"NOTIFY_SOCKET": notify.path}, extra=[
        "--test-hooks", "--listen", f"127.0.0.1:{port}", "--model", str(other)])
    try:
        d.wait_ready()
        with admin(d) as a:
            assert a.get("/stats").json()["model_path"] == str(other)
            d.proc.send_signal(signal.SIGHUP)
            notify.wait_for("RELOADING=1")
            notify.wait_for("READY=1")
            wait_for_log(d, "reloaded")
            time.sleep(0.5)  # a swap the reload started would be under way
            assert a.get("/stats").json()["model_path"] == str(other)
            assert httpx.get(d.url + "/health").status_code == 200
    finally:
        d.stop()
    log = d.log.read_text()
    assert "applied: nothing" in log and "need a restart" not in log, log


def _reload_lines(log: str) -> tuple[list[str], list[str]]:
    """The keys a reload said it applied, and those it said need a restart."""
    applied = re.search(r"reloaded .*?; applied: ([^;]*);", log)
    restart = re.search(r"need a restart and were not applied: ([^\"]*)\"", log)
    assert applied and restart, log
    return applied.group(1).split(", "), restart.group(1).split(", ")


def test_reload_applies_server_limits_live_and_names_what_needs_a_restart(
    tmp_path: Path, tiny_model: Path, notify: NotifySocket
) -> None:
    d = start(tmp_path, tiny_model, env={"NOTIFY_SOCKET": notify.path},
              server={"drain_timeout": 1.0})
    try:
        write_config(d.config, tiny_model, d.port, engine={
            **ENGINE, "kv_headroom": 32, "heartbeat_interval": 0.5}, server={
            "drain_timeout": 8.0, "keep_alive_timeout": 1.0, "read_timeout": 1.0,
            "max_body_bytes": 2000})
        d.proc.send_signal(signal.SIGHUP)
        notify.wait_for("RELOADING=1")
        notify.wait_for("READY=1")
        # server.max_body_bytes
        r = httpx.post(d.url + "/v1/completions", timeout=30,
                       json={"prompt": "x" * 3000, "max_tokens": 1})
        assert r.status_code == 413, r.text
        # server.read_timeout: a body that never arrives
        with socket.create_connection(("127.0.0.1", d.port), timeout=15) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Length: 100\r\n\r\n{")
            t0 = time.monotonic()
            assert s.recv(65536).startswith(b"HTTP/1.1 408")
            assert time.monotonic() - t0 < 10  # 1 s now; 30 s before the reload
        # server.keep_alive_timeout: a connection that sends nothing
        with socket.create_connection(("127.0.0.1", d.port), timeout=15) as s:
            t0 = time.monotonic()
            assert s.recv(65536) == b""
            assert time.monotonic() - t0 < 10
        # server.drain_timeout, and hypercorn's graceful timeout derived from it: a
        # stream runs for the new 8 s and ends with the drain's event, where the old
        # graceful timeout (1 + 5 s) would have cut its connection before
        with admin(d) as a:
            a.post("/debug/slow-steps", params={"seconds": 0.05})
        with httpx.Client(timeout=60) as c, c.stream("POST", d.url + "/v1/completions", json={
                "prompt": "x", "max_tokens": 1500, "ignore_eos": True, "stream": True}) as r:
            t0 = time.monotonic()
            d.proc.send_signal(signal.SIGTERM)
            frames = [line for line in r.iter_lines() if line.startswith("data: ")]
            took = time.monotonic() - t0
        assert d.proc.wait(30) == 0
    finally:
        d.stop()
    assert frames[-1] == "data: [DONE]"
    assert json.loads(frames[-2][6:])["error"]["code"] == "draining"
    assert took > 7
    applied, restart = _reload_lines(d.log.read_text())
    assert sorted(applied) == ["server.drain_timeout", "server.keep_alive_timeout",
                               "server.max_body_bytes", "server.read_timeout"]
    assert sorted(restart) == ["engine.heartbeat_interval", "engine.kv_headroom"]


def test_bad_config_exits_78_with_one_clear_line(tmp_path: Path, tiny_model: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(f'[model]\npath = "{tiny_model}"\n[engine]\nslotz = 3\n')
    for cmd in ("check-config", "serve"):
        r = subprocess.run([sys.executable, "-m", "forged", cmd, "--config", str(bad)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 78
        assert r.stderr.strip() == f"forged: {bad}: engine.slotz: unknown key"
    bad.write_text('[model]\npath = "/nonexistent.gguf"\n')
    r = subprocess.run([sys.executable, "-m", "forged", "check-config", "--config", str(bad)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 78 and "model.path: no such file" in r.stderr
    r = subprocess.run([sys.executable, "-m", "forged", "serve", "--config", str(bad),
                        "--model", str(tiny_model), "--listen", "nonsense"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 78 and "HOST:PORT" in r.stderr


def test_an_unreadable_tls_pair_exits_78_before_the_model_loads(tmp_path: Path,
                                                                  tiny_model: Path) -> None:
    """check-config (the unit's ExecStartPre) said OK, and serve failed only after it
    had loaded the model and started a worker, in a line that named no config file."""
    cert, key = tmp_path / "gone.crt", tmp_path / "gone.key"
    cfg = write_config(tmp_path / "forged.toml", tiny_model, free_port(), engine=ENGINE,
                       server={"tls_cert": str(cert), "tls_key": str(key)})
    for cmd in ("check-config", "serve"):
        r = subprocess.run([sys.executable, "-m", "forged", cmd, "--config", str(cfg)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 78, (cmd, r.stdout, r.stderr)
        assert r.stderr.startswith(f"forged: {cfg}: server.tls_cert {cert} and "
                                   f"server.tls_key {key}: "), (cmd, r.stderr)
        assert "worker" not in r.stdout, (cmd, r.stdout)  # nothing was started


def test_a_reader_that_leaves_early_gets_no_traceback(tmp_path: Path,
                                                      tiny_model: Path) -> None:
    """`forged status --json | head` ended in a BrokenPipeError traceback."""
    cfg = write_config(tmp_path / "forged.toml", tiny_model, free_port(), engine=ENGINE)
    r, w = os.pipe()
    os.close(r)  # the reader is gone before forged writes
    try:
        done = subprocess.run([sys.executable, "-m", "forged", "check-config", "--config",
                               str(cfg)], stdout=w, stderr=subprocess.PIPE, text=True,
                              timeout=60)
    finally:
        os.close(w)
    assert done.returncode == 1 and done.stderr == "", done.stderr


def _damage(model: bytes, how: str) -> bytes:
    if how == "random":  # 4 KiB of noise named .gguf
        return random.Random(7).randbytes(4096)
    if how == "metadata":  # a sound header, then garbage where the metadata is
        return model[:24] + b"\xff" * 276 + model[300:]
    assert how == "truncated"
    return model[: len(model) * 2 // 3]


@pytest.mark.parametrize("how", ["random", "metadata", "truncated"])
def test_a_file_that_is_no_model_exits_78_with_one_line(tmp_path: Path, tiny_model: Path,
                                                        how: str) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(_damage(tiny_model.read_bytes(), how))
    cfg = write_config(tmp_path / "forged.toml", model, free_port(), engine=ENGINE)
    for cmd in ("check-config", "serve"):
        r = subprocess.run([sys.executable, "-m", "forged", cmd, "--config", str(cfg)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 78, (cmd, r.stdout, r.stderr)
        assert r.stderr.startswith(f"forged: {cfg}: model.path: {model}: "), (cmd, r.stderr)
        assert r.stderr.count("\n") == 1, (cmd, r.stderr)
        assert "Traceback" not in r.stdout + r.stderr


def test_an_address_in_use_is_one_line_not_a_traceback(tmp_path: Path,
                                                       tiny_model: Path) -> None:
    """hypercorn binds inside nurseries, so the error arrives in exception groups."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg = write_config(tmp_path / "forged.toml", tiny_model, port, engine=ENGINE)
        r = subprocess.run([sys.executable, "-m", "forged", "serve", "--config", str(cfg)],
                           capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "Traceback" not in out
    errors = [line for line in out.splitlines() if "level=error" in line]
    assert len(errors) == 1 and f"cannot listen on 127.0.0.1:{port}: " in errors[0], out


def test_log_lines_carry_their_syslog_priority_on_the_journal_stream(tmp_path: Path) -> None:
    """On journald's stream (JOURNAL_STREAM names it), each line starts with its
    syslog priority, so `journalctl -p err` finds errors; elsewhere (a terminal, a
    file) lines stay plain logfmt. Before, no line carried one."""
    out = tmp_path / "stream"
    with out.open("w") as f:
        st = os.fstat(f.fileno())
        env = {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        assert on_journal(f) is False  # no JOURNAL_STREAM in this process
        with mock.patch.dict(os.environ, env):
            assert on_journal(f) is True
    formatter = LogfmtFormatter(priorities=True)
    lines = [formatter.format(logging.LogRecord("forged", level, "", 0, "m", None, None))
             for level in (logging.ERROR, logging.WARNING, logging.INFO, logging.DEBUG)]
    assert [line[:3] for line in lines] == ["<3>", "<4>", "<6>", "<7>"]
    plain = LogfmtFormatter().format(logging.LogRecord("forged", logging.ERROR, "", 0, "m",
                                                       None, None))
    assert plain.startswith("level=error")


def test_a_bad_config_is_an_error_on_the_journal_stream(tmp_path: Path) -> None:
    """`forged serve` with a bad config prints one line and exits 78: on journald's
    stream it is at priority err (the package test's `journalctl -p err` missed it:
    the line had no prefix, so journald filed it as info)."""
    config = tmp_path / "forged.toml"
    config.write_text("[server]\nbogus = 1\n")
    err = tmp_path / "stderr"
    with err.open("w") as f:
        st = os.fstat(f.fileno())
        env = {**os.environ, "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        r = subprocess.run([sys.executable, "-m", "forged", "serve", "--config", str(config)],
                           stderr=f, env=env, timeout=60)
    assert r.returncode == 78
    assert err.read_text().startswith("<3>forged: ") and "server.bogus: unknown key" in \
        err.read_text()
    r = subprocess.run([sys.executable, "-m", "forged", "check-config", "--config",
                        str(config)], capture_output=True, text=True, timeout=60)
    assert r.stderr.startswith("forged: ")  # a terminal or a pipe: no prefix
