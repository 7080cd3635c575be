"""A pool of ``forged serve`` nodes on loopback behind Debian's HAProxy, run with the
configuration forged ships (packaging/haproxy/forged.cfg), for the multi-node test and
benchmark.

The nodes' APIs listen on 127.0.0.2-4 (the "API network"), their agent checks on
127.0.1.2-4 (the "admin network"), HAProxy's frontend on 127.0.0.1 and its stats page
on 127.0.1.1: loopback aliases need no set-up on Linux. Which node served what is read
from HAProxy's own statistics (its stats page as CSV).
"""

from __future__ import annotations

import contextlib
import csv
import io
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.daemonproc import DaemonProcess, free_port, write_config

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "packaging" / "haproxy" / "forged.cfg"
HAPROXY = shutil.which("haproxy") or ("/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists()
                                     else None)
NODES = ("node1", "node2", "node3")
BACKENDS = ("forged_keyed", "forged_anonymous")
# HAProxy's statistics: (backend, server) -> its row of the CSV.
Rows = dict[tuple[str, str], dict[str, str]]


@dataclass
class Node:
    name: str
    api_host: str
    agent_host: str
    config: Path
    port: int
    proc: DaemonProcess | None = None

    def start(self) -> DaemonProcess:
        self.proc = DaemonProcess(self.config, self.port, host=self.api_host,
                                  extra=["--test-hooks"])
        return self.proc

    def admin(self) -> httpx.Client:
        sock = str(self.config.parent / "admin.sock")
        return httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://admin",
                            timeout=10)


def render(shipped: str, nodes: list[Node], *, front: str, stats: str, agent_port: int,
           sock: Path) -> str:
    """The shipped file with the test's addresses, and run in the foreground as this
    user (its chroot, user, group and daemon lines dropped): nothing else changes."""
    subs = {"10.0.0.10:8080": front, "10.1.0.10:8404": stats,
            "agent-port 8082": f"agent-port {agent_port}",
            "/run/haproxy/admin.sock": str(sock), "log /dev/log local0": "log stderr local0"}
    for i, n in enumerate(nodes, 1):
        subs[f"10.0.0.1{i}:8080"] = f"{n.api_host}:{n.port}"
        subs[f"agent-addr 10.1.0.1{i}"] = f"agent-addr {n.agent_host}"
    text = shipped
    for old, new in subs.items():
        assert old in text, f"the configuration has no {old!r}"
        text = text.replace(old, new)
    dropped = ("chroot ", "user ", "group ", "daemon")
    return "\n".join(line for line in text.splitlines()
                     if not line.strip().startswith(dropped)) + "\n"


class HAProxy:
    def __init__(self, cfg: Path, front: str, stats: str) -> None:
        assert HAPROXY is not None
        self.front = f"http://{front}"
        self.stats_url = f"http://{stats}/;csv"
        self.log = cfg.with_suffix(".log")
        self._log_f = open(self.log, "wb")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen([HAPROXY, "-db", "-f", str(cfg)], stdout=self._log_f,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while not _listening(stats):
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, "HAProxy's stats page never listened"
            time.sleep(0.05)

    def servers(self) -> Rows:
        """Each (backend, server)'s row of HAProxy's statistics."""
        text = httpx.get(self.stats_url, timeout=5).text.removeprefix("# ")
        return {(r["pxname"], r["svname"]): r for r in csv.DictReader(io.StringIO(text))
                if r["pxname"] in BACKENDS and r["svname"] in NODES}

    def served(self, backend: str) -> dict[str, int]:
        return {s: int(r["stot"]) for (b, s), r in self.servers().items() if b == backend}

    def wait(self, what: str, ok: Callable[[Rows], bool],
             timeout: float = 30.0) -> float:
        """Until ``ok(servers())``; the seconds it took."""
        t0 = time.monotonic()
        while not ok(rows := self.servers()):
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"HAProxy: not {what} after {timeout} s: "
                                   + str({k: (r["status"], r["weight"]) for k, r in rows.items()}))
            time.sleep(0.1)
        return time.monotonic() - t0

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log_f.close()


def _listening(addr: str) -> bool:
    host, _, port = addr.rpartition(":")
    try:
        socket.create_connection((host, int(port)), 1).close()
        return True
    except OSError:
        return False


def all_up(rows: Rows) -> bool:
    """Every node up in both backends, at the full weight of an idle node."""
    return len(rows) == 6 and all(r["status"] == "UP" and r["weight"] == "100"
                                  for r in rows.values())


def in_rotation(node: str) -> Callable[[Rows], bool]:
    """``node`` up in both backends and taking requests (not drained)."""
    return lambda rows: all(rows[(b, node)]["status"] == "UP"
                            and int(rows[(b, node)]["weight"]) > 0 for b in BACKENDS)


def loopback_ok() -> bool:
    try:
        with socket.socket() as s:
            s.bind(("127.0.1.4", 0))
        return True
    except OSError:
        return False


class held_streams:
    """Streamed completions to ``addr``, one per key (None: anonymous), sent one at a
    time over raw sockets and never read: each stays in flight (running or queued) until
    the block ends and closes it."""

    def __init__(self, addr: tuple[str, int], keys: list[str | None]) -> None:
        self.addr = addr
        self.keys = keys
        self.socks: list[socket.socket] = []

    def __enter__(self) -> held_streams:
        body = (b'{"prompt": "' + b"tell me more " * 8 + b'", "max_tokens": 600,'
                b' "ignore_eos": true, "stream": true}')
        for key in self.keys:
            auth = b"" if key is None else f"Authorization: Bearer {key}\r\n".encode()
            s = socket.create_connection(self.addr, timeout=10)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: forged\r\n" + auth
                      + b"Content-Type: application/json\r\nContent-Length: "
                      + str(len(body)).encode() + b"\r\n\r\n" + body)
            self.socks.append(s)
            time.sleep(0.1)  # in order: each is routed knowing the ones before
        return self

    def __exit__(self, *exc: object) -> None:
        for s in self.socks:
            s.close()


@contextlib.contextmanager
def running_pool(tmp: Path, model: Path, *, engine: dict[str, Any],
                 server: dict[str, Any], config: str | None = None,
                 slow: dict[str, float] | None = None) -> Iterator[tuple[list[Node], HAProxy]]:
    """Three nodes (``server`` and ``engine`` settings each, test hooks on) and HAProxy
    with ``config`` (default: the shipped file), until the block ends; yielded once every
    node is up at full weight."""
    assert loopback_ok(), "loopback aliases 127.0.0.2-127.0.1.4 must be bindable"
    port, agent_port = free_port("127.0.0.2"), free_port("127.0.1.2")
    nodes = []
    for i, name in enumerate(NODES, 2):
        (tmp / name).mkdir(exist_ok=True)
        cfg = write_config(tmp / name / "forged.toml", model, port, engine=engine, server={
            "listen": f"127.0.0.{i}:{port}", "agent_listen": f"127.0.1.{i}:{agent_port}",
            "node_name": name, **server})
        nodes.append(Node(name, f"127.0.0.{i}", f"127.0.1.{i}", cfg, port))
    for n in nodes:
        n.start()
    front, stats = f"127.0.0.1:{free_port()}", f"127.0.1.1:{free_port('127.0.1.1')}"
    (tmp / "haproxy.cfg").write_text(render(
        SHIPPED.read_text() if config is None else config, nodes, front=front, stats=stats,
        agent_port=agent_port, sock=tmp / "haproxy.sock"))
    ha = None
    try:
        for n in nodes:
            assert n.proc is not None
            n.proc.wait_ready(120)
        ha = HAProxy(tmp / "haproxy.cfg", front, stats)
        ha.wait("every node up at full weight", all_up)
        yield nodes, ha
    finally:
        if ha is not None:
            ha.stop()
        for n in nodes:
            if n.proc is not None:
                n.proc.stop()
