"""Three forged nodes behind Debian's HAProxy, configured by the file forged ships
(packaging/haproxy/forged.cfg, only its addresses and process lines replaced).

The pool's addresses and helpers are bench/pool.py's (the benchmark runs the same
pool). Every load loop is bounded in requests and in time.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from bench.pool import (
    BACKENDS,
    HAPROXY,
    NODES,
    SHIPPED,
    HAProxy,
    Node,
    all_up,
    held_streams,
    in_rotation,
    running_pool,
)

# CI runs as root and installs haproxy (scripts/system-deps.sh): there it must run.
pytestmark = pytest.mark.skipif(HAPROXY is None and os.geteuid() != 0,
                                reason="Debian's haproxy is not installed and this user "
                                "cannot install it (sudo scripts/system-deps.sh)")

GRACE = 2.0  # server.drain_grace: above the shipped agent-inter (1 s)
# One thread each: three nodes' llama.cpp threads spinning on 2 shared cores would
# slow every step many times over.
ENGINE = {"kv_layout": "unified", "kv_cells": 4096, "max_context": 1024, "slots": 16,
          "max_running": 16, "step_tokens": 64, "restart_backoff": 0.1, "threads": 1}
# Shipped check timings, read back from the file: the node-failure test's bound.
INTER, FALL, CHECK_TIMEOUT = 1.0, 2, 2.0
PROMPT = "def fibonacci(n):\n    " + "# compute the numbers one by one\n    " * 12


@dataclass
class Pool:
    nodes: list[Node]
    haproxy: HAProxy
    client: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.client = httpx.Client(base_url=self.haproxy.front, timeout=60)

    def complete(self, key: str | None = None, prompt: str = "Hello", max_tokens: int = 4,
                 session: str | None = None) -> httpx.Response:
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        if session is not None:
            headers["X-Session-Id"] = session
        return self.client.post("/v1/completions", headers=headers, json={
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Pool]:
    assert HAPROXY is not None, "haproxy is missing: run scripts/system-deps.sh"
    with running_pool(tmp_path_factory.mktemp("pool"), tiny_model, engine=ENGINE,
                      server={"drain_grace": GRACE, "drain_timeout": 10.0}) as (nodes, ha):
        p = Pool(nodes, ha)
        yield p
        p.client.close()


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {s: after[s] - before[s] for s in NODES}


# --- routing ----------------------------------------------------------------------------


def test_shipped_config_is_what_runs() -> None:
    text = SHIPPED.read_text()
    # The checks' timings the tests below assume.
    assert f"inter {INTER:g}s fall {FALL}" in text and f"timeout check {CHECK_TIMEOUT:g}s" in text
    assert f"agent-inter {INTER:g}s" in text and GRACE > INTER
    r = subprocess.run([str(HAPROXY), "-c", "-f", str(SHIPPED)], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr


def test_requests_spread_across_the_nodes(pool: Pool) -> None:
    for backend, key in (("forged_anonymous", lambda i: None),
                         ("forged_keyed", lambda i: f"fgd-user-{i}")):
        before = pool.haproxy.served(backend)
        for i in range(15):
            assert pool.complete(key(i)).status_code == 200
        got = delta(before, pool.haproxy.served(backend))
        assert sum(got.values()) == 15
        assert all(n >= 3 for n in got.values()), (backend, got)


def test_one_key_sticks_to_its_cache_until_its_node_is_past_its_share(pool: Pool) -> None:
    before = pool.haproxy.served("forged_keyed")
    cached = []
    for _ in range(4):
        r = pool.complete("fgd-alice", prompt=PROMPT)
        assert r.status_code == 200
        cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    got = delta(before, pool.haproxy.served("forged_keyed"))
    assert sorted(got.values()) == [0, 0, 4], got
    assert all(c > 0 for c in cached[1:]), cached
    home = max(got, key=lambda s: got[s])
    # An X-Session-Id names a conversation: it wins over the key, wherever it hashes.
    r = pool.complete("fgd-alice", prompt=PROMPT + "x", session="conv-1")
    assert r.status_code == 200

    # Six of alice's requests at once: bounded load (hash-balance-factor 150) keeps at
    # most 1.5 times the average (2) on her node, and spills the rest along the ring.
    with slowed(pool.nodes), held_requests(pool, ["fgd-alice"] * 6):
        pool.haproxy.wait("six held", lambda rows: sum(
            int(r["scur"]) for (b, _), r in rows.items() if b == "forged_keyed") == 6)
        scur = {s: int(r["scur"]) for (b, s), r in pool.haproxy.servers().items()
                if b == "forged_keyed"}
    assert scur[home] == 3 and sum(1 for n in scur.values() if n) >= 2, scur


def test_an_anthropic_client_s_x_api_key_sticks_to_one_node(pool: Pool) -> None:
    """Anthropic's SDKs send their key as x-api-key, never Authorization (forged takes
    both): their calls are keyed too, to their cache's node."""
    # An earlier test's streams, still ending, would count against the bounded load.
    pool.haproxy.wait("no request in flight", lambda rows: all(
        int(r["scur"]) == 0 for r in rows.values()))
    before = {b: pool.haproxy.served(b) for b in BACKENDS}
    for _ in range(4):
        r = pool.client.post("/v1/completions", headers={"x-api-key": "fgd-carol"}, json={
            "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200
    keyed = delta(before["forged_keyed"], pool.haproxy.served("forged_keyed"))
    assert sorted(keyed.values()) == [0, 0, 4], keyed
    anon = delta(before["forged_anonymous"], pool.haproxy.served("forged_anonymous"))
    assert sum(anon.values()) == 0, anon


@contextlib.contextmanager
def slowed(nodes: list[Node], seconds: float = 0.3) -> Iterator[None]:
    """Every step of these nodes made ``seconds`` longer (a test hook), so that streams
    stay in flight while the test looks."""
    admins = [n.admin() for n in nodes]
    try:
        for a in admins:
            a.post("/debug/slow-steps", params={"seconds": str(seconds)})
        yield
    finally:
        for a in admins:
            a.post("/debug/slow-steps", params={"seconds": "0"})
            a.close()


def held_requests(pool: Pool, keys: list[str | None],
                  to: tuple[str, int] | None = None) -> held_streams:
    """:class:`bench.pool.held_streams` sent to HAProxy, or straight ``to`` a node."""
    host, port = to or pool.haproxy.front.removeprefix("http://").split(":")
    return held_streams((str(host), int(port)), keys)


def test_a_node_with_a_long_queue_gets_fewer_new_requests(pool: Pool) -> None:
    slow = pool.nodes[2]
    # Every step slowed, so that what is sent stays in flight; node3 loaded straight,
    # past HAProxy, which sees that load only through node3's agent.
    with slowed(pool.nodes), held_requests(pool, [None] * 20, to=(slow.api_host, slow.port)):
        pool.haproxy.wait("node3's weight lowered", lambda rows: all(
            int(rows[(b, "node3")]["weight"]) <= 50 for b in BACKENDS))
        with slow.admin() as admin:
            stats = admin.get("/stats").json()
        assert stats["node"] == "node3" and stats["agent"].startswith("up ready "), stats
        before = {b: pool.haproxy.served(b) for b in BACKENDS}
        with held_requests(pool, [None] * 9 + [f"fgd-weights-{i}" for i in range(15)]):
            anon = delta(before["forged_anonymous"], pool.haproxy.served("forged_anonymous"))
            keyed = delta(before["forged_keyed"], pool.haproxy.served("forged_keyed"))
    # leastconn divides each node's requests in flight by its weight; bounded-load
    # hashing gives each node slots in proportion to its weight.
    assert sum(anon.values()) == 9 and sum(keyed.values()) == 15
    assert anon["node3"] < min(anon["node1"], anon["node2"]), anon
    assert keyed["node3"] < min(keyed["node1"], keyed["node2"]), keyed
    pool.haproxy.wait("node3 back at full weight", all_up)


def test_admin_ports_are_not_reachable_through_the_api(pool: Pool) -> None:
    for path in ("/", "/;csv", "/haproxy?stats", "/stats", "/metrics", "/debug/slow-steps"):
        r = pool.client.get(path)
        assert r.status_code == 404, (path, r.status_code)
        assert "pxname" not in r.text and "forged_" not in r.text
    front_host = pool.haproxy.front.removeprefix("http://").split(":")[0]
    stats_port = int(pool.haproxy.stats_url.split(":")[2].split("/")[0])
    agent_port = int(pool.nodes[0].config.read_text().split('agent_listen = "')[1]
                     .split(":")[1].split('"')[0])
    for host, port in [(front_host, stats_port)] + [(n.api_host, agent_port)
                                                     for n in pool.nodes]:
        with pytest.raises(ConnectionRefusedError), socket.create_connection((host, port), 2):
            pass
    with socket.create_connection((pool.nodes[0].agent_host, agent_port), 2) as s:
        assert s.recv(64).startswith(b"up ready ")


# --- restarts and failures ---------------------------------------------------------------


@dataclass
class Outcome:
    started: float
    ended: float
    ok: bool
    why: str = ""


class ClosedLoop:
    """``callers`` threads, each sending its next request when the last has ended,
    streamed and not, with and without keys, until stopped or ``max_requests``."""

    def __init__(self, pool: Pool, callers: int = 4, max_requests: int = 2000,
                 max_tokens: int = 24) -> None:
        self.pool, self.max_tokens = pool, max_tokens
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._count = itertools.count()
        self._max = max_requests
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(callers)]

    def __enter__(self) -> ClosedLoop:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _run(self, caller: int) -> None:
        with httpx.Client(base_url=self.pool.haproxy.front, timeout=30) as c:
            while not self._stop.is_set() and next(self._count) < self._max:
                i = len(self.outcomes)
                headers = {"Authorization": f"Bearer fgd-loop-{i % 7}"} if caller % 2 else {}
                t0 = time.monotonic()
                ok, why = self._one(c, headers, stream=i % 2 == 0)
                self.outcomes.append(Outcome(t0, time.monotonic(), ok, why))

    def _one(self, c: httpx.Client, headers: dict[str, str], *, stream: bool
             ) -> tuple[bool, str]:
        body = {"prompt": "Write a haiku about load balancers.",
                "max_tokens": self.max_tokens, "stream": stream, "ignore_eos": True}
        try:
            if not stream:
                r = c.post("/v1/completions", headers=headers, json=body)
                return r.status_code == 200, f"{r.status_code} {r.text[:200]}"
            with c.stream("POST", "/v1/completions", headers=headers, json=body) as r:
                text = "".join(r.iter_text())
            good = r.status_code == 200 and text.rstrip().endswith("data: [DONE]") \
                and '"error"' not in text
            return good, f"{r.status_code} {text[-200:]}"
        except httpx.HTTPError as exc:
            return False, repr(exc)

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]


def test_rolling_restart_under_load_fails_no_request(pool: Pool) -> None:
    # The loop must outlast three restarts: on a quiet machine the tiny model answers
    # 2,000 requests before the third node is back (a clean-clone run ran out).
    with ClosedLoop(pool, max_requests=20000) as loop:
        time.sleep(1)
        for node in pool.nodes:
            assert node.proc is not None
            served = len(loop.outcomes)
            assert node.proc.stop(timeout=GRACE + 20) == 0  # SIGTERM: grace, then drain
            node.start().wait_ready(60)
            pool.haproxy.wait(f"{node.name} back", in_rotation(node.name))
            assert len(loop.outcomes) > served  # the pool served on meanwhile
    assert len(loop.outcomes) >= 20
    assert not loop.failures(), loop.failures()[:3]


def test_a_dead_node_costs_only_its_streams(pool: Pool) -> None:
    victim = pool.nodes[1]
    assert victim.proc is not None
    try:
        with ClosedLoop(pool, max_tokens=32) as loop:
            # Killed while it carries a stream.
            pool.haproxy.wait("node2 serving", lambda rows: any(
                int(rows[(b, "node2")]["scur"]) for b in BACKENDS))
            killed = time.monotonic()
            victim.proc.proc.send_signal(signal.SIGKILL)
            # It dies over a few milliseconds; a request it accepted meanwhile was in
            # its hands too (a clean-clone run saw one sent 2 ms after the signal).
            victim.proc.proc.wait(10)
            dead = time.monotonic()
            took = pool.haproxy.wait("node2 down", lambda rows: all(
                rows[(b, "node2")]["status"].startswith("DOWN") for b in BACKENDS))
            down = killed + took
            deadline = time.monotonic() + 90
            while sum(o.started > down for o in loop.outcomes) < 6:
                assert time.monotonic() < deadline, "the pool stopped serving"
                time.sleep(0.1)
        # Within the configured checks: fall failures, inter apart, each bounded by
        # the check timeout, plus one interval for where the cycle stood.
        assert took <= (FALL + 1) * INTER + CHECK_TIMEOUT, took
        failed = loop.failures()
        # Only requests in flight at the kill failed, no more than one per caller...
        assert all(o.started < dead and killed < o.ended for o in failed), failed
        assert len(failed) <= 4
        # ... and none sent after HAProxy took the node out.
        after = [o for o in loop.outcomes if o.started > down]
        assert after and all(o.ok for o in after)
    finally:
        victim.proc.stop()
        victim.start().wait_ready(60)
        pool.haproxy.wait("node2 back", all_up)
