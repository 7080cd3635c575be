"""Two workers, through the API: a conversation and a shared prefix go to the worker
that holds them, and requests a killed worker had not admitted are answered anyway."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import httpx
import trio

from forged.engine import testhooks
from forged.engine.routing import BLOCK
from tests.conftest import DaemonFactory
from tests.test_api import until

TWO = {"workers": 2, "restart_backoff": 0.1}
SHARED = [10 + i % 200 for i in range(2 * BLOCK)]  # a team's system prompt


def cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    n = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert isinstance(n, int)
    return n


async def hold_a_stream(c: httpx.AsyncClient, started: list[bool]) -> None:
    """A long stream, until cancelled: the load on the worker it lands on."""
    body = {"prompt": [5, 6], "max_tokens": 2000, "ignore_eos": True, "stream": True}
    async with c.stream("POST", "/v1/completions", json=body) as r:
        async for _ in r.aiter_lines():
            started.append(True)


async def test_a_session_and_a_shared_prefix_go_where_their_cache_is(
        tiny_model: Path, start_daemon: DaemonFactory) -> None:
    with trio.fail_after(90):
        async with start_daemon(tiny_model, engine=TWO) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            pool = d.daemon.pool
            turn: list[int] = [*SHARED, 201, 202]
            body: dict[str, Any] = {"max_tokens": 4, "temperature": 0, "session": "chat"}
            assert cached(await c.post("/v1/completions", json={**body, "prompt": turn})) == 0
            # Worker 0 served it (both were idle); now it gets a long stream too, so that
            # least-loaded routing would send everything else to worker 1.
            testhooks.slow_steps(pool, 0, 0.01)
            started: list[bool] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(hold_a_stream, c, started)
                await until(lambda: bool(started))
                assert [len(p) for p in pool.pending] == [1, 0]
                for i in range(3):  # the conversation's next turns
                    turn = [*turn, 203 + i, 204 + i]
                    r = await c.post("/v1/completions", json={**body, "prompt": turn})
                    assert cached(r) >= len(SHARED), i
                # another conversation of the same team: its shared prefix is there
                other = {"max_tokens": 4, "prompt": [*SHARED, 150, 151, 152]}
                assert cached(await c.post("/v1/completions", json=other)) >= len(SHARED)
                nursery.cancel_scope.cancel()
            assert pool.workers[1].stats.prefix_cache_queries == 0  # unused
            assert pool.router.routed["session"] == 3 and pool.router.routed["cache"] >= 1
            # the digests came: worker 0 reported what it holds
            await until(lambda: pool.router.held(0) >= 2)


async def test_requests_a_killed_worker_had_not_admitted_are_answered(
        tiny_model: Path, start_daemon: DaemonFactory) -> None:
    # One running place per worker: the second request on worker 0 queues there.
    engine = {**TWO, "max_running": 1}
    with trio.fail_after(90):
        async with start_daemon(tiny_model, engine=engine) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            pool = d.daemon.pool
            testhooks.slow_steps(pool, 0, 0.01)
            testhooks.slow_steps(pool, 1, 0.01)
            results: dict[int, httpx.Response] = {}

            async def one(i: int) -> None:
                body = {"prompt": [20 + i, 21], "max_tokens": 300 if i < 2 else 5,
                        "ignore_eos": True}
                results[i] = await c.post("/v1/completions", json=body)

            async with trio.open_nursery() as nursery:
                # Least loaded, one at a time: 0 and 1 run, 2 and 3 queue behind them.
                for i in range(4):
                    nursery.start_soon(one, i)
                    await until(lambda n=i + 1: pool.in_flight() == n)
                await until(lambda: d.stats().running == 2)
                queued = [rs.rid for rs in pool.pending[0].values() if not rs.admitted]
                assert len(queued) == 1
                old = pool.workers[0].pid
                assert old is not None
                os.kill(old, signal.SIGKILL)
            assert results[0].status_code == 503
            assert results[0].json()["error"]["code"] == "worker_lost"  # it was running
            for i in (1, 2, 3):
                assert results[i].status_code == 200, (i, results[i].text)
            assert pool.resubmitted == 1


async def test_with_one_worker_the_restarted_process_answers_what_was_queued(
        tiny_model: Path, start_daemon: DaemonFactory) -> None:
    engine = {"restart_backoff": 0.1, "max_running": 1}
    with trio.fail_after(90):
        async with start_daemon(tiny_model, engine=engine) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            pool = d.daemon.pool
            testhooks.slow_steps(pool, 0, 0.01)
            results: dict[int, httpx.Response] = {}

            async def one(i: int, max_tokens: int) -> None:
                body = {"prompt": [30 + i, 31], "max_tokens": max_tokens, "ignore_eos": True}
                results[i] = await c.post("/v1/completions", json=body)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, 0, 300)
                await until(lambda: d.stats().running == 1)
                nursery.start_soon(one, 1, 5)
                await until(lambda: d.stats().queued_interactive == 1)
                old = pool.workers[0].pid
                assert old is not None
                os.kill(old, signal.SIGKILL)
            assert results[0].json()["error"]["code"] == "worker_lost"
            assert results[1].status_code == 200, results[1].text
            assert pool.workers[0].pid != old and pool.resubmitted == 1
