"""HAProxy's agent check: the weight formula (plain arithmetic), the listener's answers,
and a stop that tells the balancer before it drains."""

from __future__ import annotations

import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import msgspec
import pytest
import trio

from forged import cli
from forged import config as fc
from forged.agent.weight import NodeLoad, Worker, agent_reply, node_load, weight_percent
from forged.engine.pool import EnginePool
from forged.engine.stats import WorkerStats
from forged.http.state import AppState
from forged.observe.status import render_pool
from tests.conftest import DaemonFactory
from tests.daemonproc import DaemonProcess, free_port, write_config

IDLE = NodeLoad(kv_free=1.0, running_free=1.0, queue_seconds=0.0)


def load(kv: float = 1.0, running: float = 1.0, queue: float = 0.0) -> NodeLoad:
    return NodeLoad(kv_free=kv, running_free=running, queue_seconds=queue)


@pytest.mark.parametrize(("node", "weight"), [
    (IDLE, 100),
    (load(running=0.0), 50),  # every running place taken: new work queues
    (load(kv=0.0), 50),  # every cell held or promised
    (load(kv=0.5, running=0.9), 80),  # the scarcer of the two counts: 0.75
    (load(queue=2.0), 50),  # a queue of agent_queue_half seconds halves it
    (load(queue=8.0), 20),  # ... of four times that, a fifth
    (load(running=0.0, queue=2.0), 20),  # both: 0.5 * 0.5 = 25, in steps of 10
    (load(running=0.0, queue=1000.0), 1),  # never 0 while serving: that is drain's
    (load(running=15 / 16), 100),  # one busy place of 16 moves nothing on the ring
])
def test_weight_formula(node: NodeLoad, weight: int) -> None:
    assert weight_percent(node, queue_half=2.0) == weight


def test_node_load_from_worker_statistics() -> None:
    busy = WorkerStats(kv_cells_total=1000.0, kv_cells_active=300.0, kv_cells_reserved=100.0,
                       kv_cells_cached=500.0, running=4.0, queued_tokens=1500.0,
                       cost_prompt_token_ms=2.0)
    one = node_load([Worker(busy, 1000, 8)])
    # Cached cells are free for the taking: only what running sequences hold counts.
    assert one == NodeLoad(kv_free=0.6, running_free=0.5, queue_seconds=3.0)
    # Of two workers, one restarting: its capacity counts as taken.
    two = node_load([Worker(busy, 1000, 8), Worker(None, 1000, 8)])
    assert two == NodeLoad(kv_free=0.3, running_free=0.25, queue_seconds=3.0)
    assert node_load([Worker(None, 1000, 8)] * 2) is None


FULL_CHAT = WorkerStats(kv_cells_total=1000.0, kv_cells_active=1000.0, running=8.0)
IDLE_EMBED = WorkerStats(running=0.0)  # an encoder reports no KV cells


def test_an_idle_embedding_worker_does_not_hide_a_full_chat_worker() -> None:
    """It reported 0 KV cells (counted as a whole free cache) and its running places as
    the chat model's: a node whose chat worker was full weighed 80%, not 50%."""
    chat = Worker(FULL_CHAT, 1000, 8)
    alone = node_load([chat])
    assert alone is not None and weight_percent(alone, queue_half=2.0) == 50
    assert node_load([chat, Worker(IDLE_EMBED, 512, 4, generates=False)]) == alone
    # Each generation worker at its own model's limits: a FIM model's 4 running places
    # of 4 are full, whatever the chat model's.
    fim = Worker(WorkerStats(kv_cells_total=200.0, kv_cells_active=200.0, running=4.0), 200, 4)
    both = node_load([chat, fim])
    assert both == NodeLoad(kv_free=0.0, running_free=0.0, queue_seconds=0.0)
    # A node of embedding models only is weighed by their running places.
    embed = node_load([Worker(WorkerStats(running=3.0), 512, 4, generates=False)])
    assert embed == NodeLoad(kv_free=1.0, running_free=0.25, queue_seconds=0.0)


def test_the_agent_weighs_each_model_s_workers_against_its_own_limits() -> None:
    """What the agent answers (AppState.agent_reply) over a chat model's full worker and
    an embedding model's idle one: the chat worker's weight alone."""
    cfg = fc.Config()
    e = cfg.engine
    chat = EnginePool(cfg, cfg.model, 8192, cache_dir=Path("/nonexistent"))
    embed = EnginePool(msgspec.structs.replace(cfg, engine=msgspec.structs.replace(
        e, max_running=2 * e.max_running)), cfg.model, 512, cache_dir=Path("/nonexistent"),
        embedding=True)
    chat.workers[0].stats = WorkerStats(kv_cells_total=e.kv_cells, kv_cells_active=e.kv_cells,
                                        running=e.max_running)
    groups = [SimpleNamespace(pool=p, status="serving") for p in (chat, embed)]
    for p in (chat, embed):
        p.workers[0].ready = True
    state = SimpleNamespace(models=SimpleNamespace(all=lambda: groups, default=groups[0]),
                            leaving=False, draining=False, cfg=cfg)
    assert AppState.agent_reply(state) == "up ready 50%\n"  # type: ignore[arg-type]


def test_replies() -> None:
    assert agent_reply(leaving=False, load=IDLE, queue_half=2.0) == "up ready 100%\n"
    assert agent_reply(leaving=False, load=None, queue_half=2.0).startswith("down #")
    # A stop wins over everything: the balancer must stop sending, ready or not.
    assert agent_reply(leaving=True, load=IDLE, queue_half=2.0) == "drain\n"
    assert agent_reply(leaving=True, load=None, queue_half=2.0) == "drain\n"


def test_agent_listen_must_be_tcp_and_its_own(tmp_path: Path) -> None:
    path = tmp_path / "forged.toml"
    for value, why in [("unix:/run/a.sock", "HAProxy's agent speaks TCP"),
                       ("127.0.0.1:8080", "server.listen's address too"),
                       ("nohost", "expected HOST:PORT")]:
        path.write_text(f'[server]\nlisten = "127.0.0.1:8080"\nagent_listen = "{value}"\n')
        with pytest.raises(fc.ConfigError, match=why):
            fc.load(path)
    path.write_text('[server]\nagent_listen = "10.1.0.11:8082"\n')
    assert fc.load(path).server.agent_listen == "10.1.0.11:8082"


@pytest.mark.parametrize(("listeners", "taken"), [
    ({"listen": "127.0.0.1:8080", "metrics_listen": "127.0.0.1:8080"}, "listen"),
    ({"listen": "0.0.0.0:8080", "metrics_listen": "127.0.0.1:8080"}, "listen"),
    ({"admin_listen": "unix:/run/forged/a.sock", "metrics_listen": "unix:/run/forged/a.sock"},
     "admin_listen"),
])
def test_no_two_listeners_share_an_address(tmp_path: Path, listeners: dict[str, str],
                                           taken: str) -> None:
    """The second bind failed at start (a restart loop under Restart=on-failure), or on
    one Unix path hypercorn deleted the admin socket's file and took its path."""
    path = tmp_path / "forged.toml"
    path.write_text("[server]\n" + "".join(f'{k} = "{v}"\n' for k, v in listeners.items()))
    with pytest.raises(fc.ConfigError, match=f"server.{taken}'s address too"):
        fc.load(path)
    path.write_text('[server]\nlisten = "127.0.0.1:0"\nmetrics_listen = "127.0.0.1:0"\n')
    assert fc.load(path).server.metrics_listen == "127.0.0.1:0"  # each its own free port


def test_pool_status_sums_nodes_and_names_the_unreachable() -> None:
    def node(name: str, running: float) -> dict[str, object]:
        return {"node": name, "ready": True, "draining": False, "agent": "up ready 90%",
                "open_streams": int(running), "last_minute": {"tokens_per_second": 10.0},
                "engine": {"totals": {"running": running, "queued_interactive": 1.0,
                                      "kv_cells_used": 10.0, "kv_cells_total": 100.0}}}
    text = render_pool([("http://a:8081", node("a", 3.0)), ("http://b:8081", node("b", 2.0)),
                        ("http://c:8081", "connection refused")])
    rows = {line.split()[0]: line.split() for line in text.splitlines()[1:]}
    assert rows["a"][1:5] == ["ready", "up", "ready", "90%"]
    assert rows["pool"][1:5] == ["5", "5", "2", "20.0"]  # open, running, queued, tok/s
    assert "unreachable" in rows["?"] and "connection refused" in text


def status(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "forged", "status", *args], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout


def ask_agent(bind: str) -> str:
    host, _, port = bind.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        data = b""
        while chunk := s.recv(256):
            data += chunk
    return data.decode()


def test_stop_tells_the_balancer_first_then_drains(tmp_path: Path, tiny_model: Path) -> None:
    """SIGTERM: the agent says drain and /health 503 at once, while requests that still
    arrive are served for server.drain_grace; only then does the drain begin."""
    port, agent = free_port(), f"127.0.0.1:{free_port()}"
    admin = f"http://127.0.0.1:{free_port()}"
    cfg = write_config(tmp_path / "forged.toml", tiny_model, port,
                       server={"agent_listen": agent, "drain_grace": 3.0,
                               "node_name": "node-a", "admin_listen": admin[7:]},
                       engine={"kv_layout": "unified", "kv_cells": 4096, "step_tokens": 64})
    d = DaemonProcess(cfg, port)
    try:
        d.wait_ready()
        assert ask_agent(agent) == "up ready 100%\n"
        assert 'forged_build_info{model="tiny",node="node-a"' in \
            httpx.get(admin + "/metrics").text.replace(',version="0.1.0"', "")
        # forged status reads a remote admin listener; twice, as a pool of two lines.
        one = status("--url", admin)
        assert one.startswith("forged 0.1.0  node node-a  model tiny  ready"), one
        assert "agent       up ready 100%" in one
        two = status("--url", admin, "--url", admin).splitlines()
        assert two[1].split()[:4] == ["node-a", "ready", "up", "ready"] and \
            two[-1].startswith("pool"), two
        with httpx.Client(base_url=d.url, timeout=30) as c:
            t0 = time.monotonic()
            d.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 2
            while ask_agent(agent) != "drain\n":
                assert time.monotonic() < deadline
                time.sleep(0.02)
            assert c.get("/health").status_code == 503
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
            assert r.status_code == 200, r.text  # still served: the balancer may lag
            assert time.monotonic() - t0 < 3.0  # (all of this within the grace)
        assert d.proc.wait(30) == 0
        assert time.monotonic() - t0 >= 3.0
        log = d.log.read_text()
        assert log.index("leaving the pool") < log.index("draining:")
    finally:
        d.stop()


def test_a_second_sigterm_in_the_grace_stops_at_once(tmp_path: Path, tiny_model: Path) -> None:
    port, agent = free_port(), f"127.0.0.1:{free_port()}"
    cfg = write_config(tmp_path / "forged.toml", tiny_model, port,
                       server={"agent_listen": agent, "drain_grace": 60.0},
                       engine={"kv_layout": "unified", "kv_cells": 4096, "step_tokens": 64})
    d = DaemonProcess(cfg, port)
    try:
        d.wait_ready()
        d.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while "leaving the pool" not in d.log.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        d.proc.wait(20)
        assert time.monotonic() - t0 < 20  # not the 60 s grace
        assert "second stop signal: stopping now" in d.log.read_text()
    finally:
        d.stop()


@pytest.mark.trio
async def test_the_agent_says_down_while_no_worker_is_ready(
        tiny_model: Path, start_daemon: DaemonFactory) -> None:
    """A worker that dies: "down" until its replacement is ready, then "up" again (only
    the agent can undo its own "down" in HAProxy)."""
    with trio.fail_after(60):
        async with start_daemon(tiny_model, server={"agent_listen": "127.0.0.1:0"}) as d:
            bind = d.daemon.agent_bind
            assert bind is not None
            assert await trio.to_thread.run_sync(ask_agent, bind) == "up ready 100%\n"
            worker = d.daemon.pool.workers[0]
            assert worker.pid is not None
            os.kill(worker.pid, signal.SIGKILL)
            # Polled, as HAProxy does: the answer follows another process's life.
            while (line := await trio.to_thread.run_sync(ask_agent, bind)).startswith("up"):  # noqa: ASYNC110
                await trio.sleep(0.01)
            assert line == "down #no model worker ready\n"
            while not (line := await trio.to_thread.run_sync(ask_agent, bind)).startswith("up"):  # noqa: ASYNC110
                await trio.sleep(0.05)
            assert line == "up ready 100%\n"


class _NotAdmin(http.server.BaseHTTPRequestHandler):
    """The API port's answer to /stats: a 404 in OpenAI's body."""

    def do_GET(self) -> None:
        body = b'{"error": {"message": "not found", "type": "invalid_request_error"}}'
        self.send_response(404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_forged_status_at_no_admin_listener_is_a_clear_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The API's port given for the admin's (a 404 read as stats), a port that is no
    number: tracebacks (KeyError, ValueError), and a pool listing lost whole."""
    server = http.server.HTTPServer(("127.0.0.1", 0), _NotAdmin)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        api = f"127.0.0.1:{server.server_address[1]}"
        for admin in (api, "127.0.0.1:abc", "http://127.0.0.1:99999"):
            assert cli.main(["status", "--admin", admin]) == 1
            err = capsys.readouterr().err
            assert "Traceback" not in err and admin in err, err
        assert cli.main(["status", "--url", api, "--url", "127.0.0.1:abc"]) == 1
        assert "unreachable" in capsys.readouterr().out
    finally:
        server.shutdown()
        server.server_close()


def test_forged_status_runs_without_the_default_config_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon may run on the defaults alone (no /etc/forged/forged.toml): forged
    status then read the defaults' admin socket, as forged serve does; it said the file
    was missing (exit 78)."""
    absent = tmp_path / "forged.toml"
    monkeypatch.setattr(fc, "DEFAULT_CONFIG_PATH", absent)
    assert cli.main(["status"]) == 1  # no daemon here: the defaults' socket is absent
    assert "cannot read the admin listener at unix:/run/forged/admin.sock" in \
        capsys.readouterr().err
