"""Routing across workers (sans-IO): prefix digests, the cache-aware choice, the
router's memory; and the pool submitting again what a lost worker had not admitted."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import trio
import trio.testing

from forged import config as fc
from forged.engine import frames as fr
from forged.engine.channel import Outbox
from forged.engine.events import Admitted
from forged.engine.pool import RESUBMITS, EnginePool, RequestStream
from forged.engine.request import Request
from forged.engine.routing import (
    BLOCK,
    MAX_DIGESTS,
    RECENT_SECONDS,
    Candidate,
    DigestBuilder,
    Policy,
    Router,
    block_hashes,
    choose,
    matched_tokens,
)
from forged.engine.stats import Counts, WorkerStats
from forged.engine.supervisor import WorkerSupervisor
from forged.errors import BadRequest, Unavailable, WorkerLost
from forged.observe.metrics import Metrics

SYSTEM = list(range(1000, 1000 + 2 * BLOCK))  # a shared prefix of two whole blocks


def test_a_prefix_hash_names_the_whole_prefix_and_its_tenant() -> None:
    a = block_hashes("t", [*SYSTEM, 1, 2, 3])
    assert len(a) == 2  # the partial block after them counts for nothing
    assert block_hashes("t", [*SYSTEM[:BLOCK], 7, *SYSTEM[BLOCK + 1:]])[0] == a[0]
    assert block_hashes("t", [*SYSTEM[:BLOCK], 7, *SYSTEM[BLOCK + 1:]])[1] != a[1]
    assert block_hashes("u", SYSTEM) != a  # another tenant's cache never matches
    # the first block differs: so does every later hash, though its own block is equal
    assert block_hashes("t", [0, *SYSTEM[1:]])[1] != a[1]
    assert block_hashes("t", SYSTEM[:BLOCK - 1]) == []


def test_a_match_is_the_longest_block_prefix_held() -> None:
    hashes = block_hashes("t", [*SYSTEM, *range(BLOCK)])
    assert matched_tokens(hashes, frozenset(hashes[:2])) == 2 * BLOCK
    assert matched_tokens(hashes, frozenset(hashes)) == 3 * BLOCK
    assert matched_tokens(hashes, frozenset()) == 0


@pytest.mark.parametrize(("loads", "matched", "expected"), [
    ((0, 0), (0, 0), 0),  # nothing cached: least loaded, the first on a tie
    ((3, 0), (0, 0), 1),
    ((5, 0), (512, 0), 0),  # the cache holder, though busier
    ((9, 0), (512, 0), 1),  # ... unless more than 8 requests busier
    ((12, 4), (512, 0), 0),  # 8 more, and not 1.5 times as many: still the cache
    ((14, 5), (512, 0), 1),  # 9 more and 2.8 times as many: the load
    ((2, 0), (512, 576), 1),  # the longest match
    ((2, 1), (512, 512), 1),  # equal matches: the less loaded
    ((1, 0), (64, 0), 1),  # a match under a third of the 512-token prompt: load decides
])
def test_the_cache_holder_wins_unless_it_is_overloaded(
        loads: tuple[int, int], matched: tuple[int, int], expected: int) -> None:
    cands = [Candidate(i, load, m) for i, (load, m) in enumerate(zip(loads, matched,
                                                                     strict=True))]
    assert choose(cands, 512, Policy()) == expected
    assert choose(cands, 512, Policy(cache_aware=False)) == min(
        range(2), key=lambda i: (loads[i], i))


def test_the_router_remembers_what_it_sent_where_until_reports_take_over() -> None:
    r = Router(2)
    prompt = [*SYSTEM, 5, 6, 7]
    assert r.route("t", prompt, None, {0: 1, 1: 0}, now=0.0) == 1  # load: nothing cached
    # the report has not come yet: the router's memory sends the next one there too
    assert r.route("t", [*SYSTEM, 8], None, {0: 0, 1: 1}, now=1.0) == 1
    assert r.routed == {"cache": 1, "session": 0, "load": 1}
    # that memory fades; a worker's report is what counts then
    later = 1.0 + RECENT_SECONDS + 0.1
    r.reported(1, block_hashes("t", SYSTEM))
    assert r.route("t", [*SYSTEM, 10], None, {0: 0, 1: 1}, now=later) == 1
    r.reported(1, [])  # evicted there
    assert r.route("t", [*SYSTEM, 9], None, {0: 0, 1: 1}, now=later + RECENT_SECONDS + 1) == 0
    # another tenant with the same tokens: no match
    assert r.route("u", [*SYSTEM, 10], None, {0: 0, 1: 1}, now=later) == 0


def test_a_session_sticks_to_its_worker_while_that_worker_lives() -> None:
    r = Router(2)
    turn = [1, 2, 3]  # too short to digest: only the session keeps it in place
    assert r.route("t", turn, "chat", {0: 0, 1: 0}, now=0.0) == 0
    assert r.route("t", [*turn, 4, 5], "chat", {0: 3, 1: 0}, now=1.0) == 0
    assert r.routed["session"] == 1
    assert r.route("t", [*turn, 4, 5], "other", {0: 3, 1: 0}, now=1.0) == 1
    assert r.route("u", [*turn, 4, 5], "chat", {0: 3, 1: 0}, now=1.0) == 1  # not theirs
    r.lost(0)
    assert r.route("t", [*turn, 4, 5, 6], "chat", {0: 0, 1: 3}, now=2.0) == 0  # load
    assert r.routed["session"] == 1
    r.policy = Policy(cache_aware=False)  # least loaded: no stickiness either
    assert r.route("t", [*turn, 4, 5, 6, 7], "chat", {0: 1, 1: 0}, now=3.0) == 1
    assert r.routed["session"] == 1


def test_digests_are_sent_when_they_change_most_recent_first_and_bounded() -> None:
    b = DigestBuilder()
    first = b.build([("t", SYSTEM)], [])
    assert first == block_hashes("t", SYSTEM)
    assert b.build([("t", SYSTEM)], []) is None  # unchanged: not sent again
    entries = [(eid, "t", [eid] * (32 * BLOCK)) for eid in range(1, 200)]
    many = b.build([("t", SYSTEM)], entries)
    assert many is not None and len(many) == MAX_DIGESTS
    assert many[:2] == first  # the slot first; the least recent entries fell off
    assert block_hashes("t", entries[0][2])[0] in many
    assert block_hashes("t", entries[-1][2])[0] not in many


def test_digests_never_look_past_their_bound() -> None:
    """A full RAM tier holds thousands of states; the worker built the digests of every
    one of them each DIGEST_INTERVAL (6 ms at 3,000, no stream decoding meanwhile),
    though only the most recent MAX_DIGESTS hashes are sent. The entries past the
    bound are now never read (nor hashed), and the digests are the same."""
    entries = [(eid, "t", [eid] * (2 * BLOCK)) for eid in range(1, 3001)]
    read = 0

    def counted() -> Iterator[tuple[int, str, list[int]]]:
        nonlocal read
        for e in entries:
            read += 1
            yield e

    got = DigestBuilder().build([("t", SYSTEM)], counted())
    want = [h for tenant, tokens in [("t", SYSTEM)] + [(t, k) for _, t, k in entries]
            for h in block_hashes(tenant, tokens)][:MAX_DIGESTS]
    assert got == want
    assert read <= MAX_DIGESTS // 2 + 1, read


# --- the pool: a lost worker's requests ------------------------------------------------


def pool_of(workers: int) -> EnginePool:
    cfg = msgspec.structs.replace(fc.Config(), engine=msgspec.structs.replace(
        fc.Config().engine, workers=workers))
    pool = EnginePool(cfg, cfg.model, 8192, cache_dir=Path("/nonexistent"))
    for w in pool.workers:
        up(w)
    return pool


def up(w: WorkerSupervisor) -> None:
    w.ready, w.last_heard, w.outbox = True, time.monotonic(), Outbox(limit=64)


def submits(pool: EnginePool, index: int) -> list[int]:
    outbox = pool.workers[index].outbox
    assert outbox is not None
    return [f.rid for f in outbox.unsent if isinstance(f, fr.Submit)]


def request(*prompt: int) -> Request:
    return Request(prompt=list(prompt), max_tokens=4)


async def admit(rs: RequestStream) -> None:
    rs.push(Admitted(rid=rs.rid, cached=0, queue_time=0.0))
    assert rs.admitted and len(await rs.receive()) == 1


def lose(pool: EnginePool, index: int) -> None:
    """What the supervisor does when a process is gone."""
    w = pool.workers[index]
    w.ready, w.outbox = False, None
    pool.lose_worker(index, "the worker exited (killed by SIGKILL)")


async def lose_until_it_fails(pool: EnginePool, rs: RequestStream, restarts: int) -> None:
    """Worker 0 lost ``restarts`` times, each time restarted and given the parked
    requests; then lost once more, which fails ``rs``."""
    for _ in range(restarts):
        lose(pool, 0)
        up(pool.workers[0])
        pool.unpark()
    lose(pool, 0)
    with pytest.raises(WorkerLost):
        await rs.receive()


async def test_a_lost_worker_s_unadmitted_requests_go_to_another_worker() -> None:
    pool = pool_of(2)
    async with pool.open_request(request(1, 2)) as running, \
            pool.open_request(request(3, 4)) as elsewhere, \
            pool.open_request(request(5, 6)) as queued:
        assert (running.worker, elsewhere.worker, queued.worker) == (0, 1, 0)
        await admit(running)
        lose(pool, 0)
        with pytest.raises(WorkerLost):
            await running.receive()  # its stream had begun
        assert queued.worker == 1 and submits(pool, 1) == [elsewhere.rid, queued.rid]
        assert pool.resubmitted == 1 and pool.suspects == {running.fingerprint: 1}
    # leaving cancels it where it is now
    outbox = pool.workers[1].outbox
    assert outbox is not None
    assert {f.rid for f in outbox.unsent if isinstance(f, fr.Cancel)} == {elsewhere.rid,
                                                                       queued.rid}


async def test_a_worker_whose_process_is_being_stopped_takes_no_request() -> None:
    """Between a process's loss (its outbox gone) and the supervisor's noting it, after
    stopping the process (which may take seconds), the worker is not routable: a new
    request goes elsewhere, and another worker's lost requests wait for a worker
    rather than go to it. (It was: the submit failed its assertion, a 500 for a new
    request, and for a resubmission the end of the model's pool.)"""
    pool = pool_of(2)
    stopping = pool.workers[0]
    stopping.outbox = None  # as WorkerSupervisor._run_process leaves it, still ready
    assert not stopping.routable(time.monotonic())
    async with pool.open_request(request(1, 2)) as rs:
        assert rs.worker == 1
        lose(pool, 1)  # no worker to take it: it waits
        assert pool._parked and rs.worker is None
        up(stopping)
        pool.unpark()
        assert rs.worker == 0 and submits(pool, 0) == [rs.rid]


async def test_a_lost_workers_requests_go_to_a_late_worker_once_it_is_heard() -> None:
    """A lost worker's requests wait while the other worker is late (a long step), and
    go to it as soon as it is heard again. (They waited for the lost worker's restart,
    a model load away, and failed if that took longer than the queue timeout.)"""
    pool = pool_of(2)
    async with pool.open_request(request(1, 2)) as first, \
            pool.open_request(request(3, 4)) as rs:
        assert (first.worker, rs.worker) == (0, 1)
        late = pool.workers[0]
        late.last_heard = time.monotonic() - 3600
        lose(pool, 1)
        assert rs.rid in pool._parked
        late.last_heard = time.monotonic()
        pool._deliver(0, fr.Step(events=[], stats=None))
        assert rs.worker == 0 and submits(pool, 0) == [first.rid, rs.rid]


def test_a_reload_raises_the_running_processes_outbox_limit() -> None:
    """The frames a worker may leave unread follow the admission limits; a reload that
    raises them raises the running process's bound too. (Only the next process got it:
    a burst within the new limits killed a healthy worker as one that stopped
    reading.)"""
    pool = pool_of(1)
    cfg = pool.cfg
    raised = msgspec.structs.replace(cfg, limits=msgspec.structs.replace(
        cfg.limits, max_queued=cfg.limits.max_queued * 4))
    pool.set_limits(raised)
    outbox = pool.workers[0].outbox
    assert outbox is not None and outbox.limit == pool._outbox_limit() > 64


async def test_with_no_worker_left_a_request_waits_for_the_restarted_one() -> None:
    pool = pool_of(1)
    async with pool.open_request(request(1, 2)) as rs:
        lose(pool, 0)
        assert rs.worker is None and pool.in_flight() == 1
        up(pool.workers[0])
        pool.unpark()  # the supervisor's on_ready
        assert rs.worker == 0 and submits(pool, 0) == [rs.rid]
        # a second and third loss: resubmitted RESUBMITS times, then it fails
        await lose_until_it_fails(pool, rs, RESUBMITS - 1)
    assert pool.in_flight() == 0


async def test_a_parked_request_fails_when_no_worker_comes_back_in_time(
        autojump_clock: trio.testing.MockClock) -> None:
    pool = pool_of(1)
    with trio.fail_after(pool.cfg.limits.queue_timeout + 5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pool.expire_parked)
            async with pool.open_request(request(1, 2)) as rs:
                lose(pool, 0)
                t0 = trio.current_time()
                with pytest.raises(WorkerLost, match="no worker was ready in time"):
                    await rs.receive()
                assert trio.current_time() - t0 == pytest.approx(
                    pool.cfg.limits.queue_timeout)
            nursery.cancel_scope.cancel()


async def test_a_crash_suspect_is_not_resubmitted() -> None:
    pool = pool_of(2)
    async with pool.open_request(request(7, 7)) as culprit, \
            pool.open_request(request(8)) as other, \
            pool.open_request(request(7, 7)) as twin:
        await admit(culprit)
        assert (culprit.worker, twin.worker) == (0, 0)
        lose(pool, 0)
        for rs in (culprit, twin):  # the same prompt as the one that was running
            with pytest.raises(WorkerLost):
                await rs.receive()
        assert other.worker == 1 and not other.finished
        assert pool.suspects == {culprit.fingerprint: 1}  # one count: one crash


async def test_a_request_in_every_crash_before_admission_becomes_a_suspect() -> None:
    """A frame that kills each worker as it is read is never admitted: it was
    resubmitted to each new worker and never counted, so a client's retry killed as
    many again. Now, lost unadmitted RESUBMITS + 1 times, it is refused from then on."""
    pool = pool_of(1)
    async with pool.open_request(request(9, 9)) as rs:
        await lose_until_it_fails(pool, rs, RESUBMITS)
    up(pool.workers[0])
    with pytest.raises(BadRequest, match="crashed"):
        async with pool.open_request(request(9, 9)):
            pass


async def test_crash_suspects_are_per_tenant() -> None:
    """Two crashes refuse a prompt to its tenant; the same prompt from another tenant
    still runs (one tenant cannot get another's prompts refused)."""
    pool = pool_of(1)
    for _ in range(2):
        async with pool.open_request(tenant_request("a", 4, 4)) as rs:
            await admit(rs)
            lose(pool, 0)
            up(pool.workers[0])
    with pytest.raises(BadRequest, match="crashed"):
        async with pool.open_request(tenant_request("a", 4, 4)):
            pass
    async with pool.open_request(tenant_request("b", 4, 4)) as rs:
        assert rs.worker == 0


def tenant_request(tenant: str, *prompt: int) -> Request:
    return Request(prompt=list(prompt), max_tokens=4, tenant=tenant)


async def test_a_heartbeat_turning_late_during_the_door_check_changes_nothing() -> None:
    """The door and the route see the same workers: before, the route looked again,
    and a worker whose heartbeat turned late in between left it none (a 500)."""
    pool = pool_of(1)
    looks = [pool.routable_workers(), []]
    pool.routable_workers = lambda: looks.pop(0)  # type: ignore[method-assign]
    async with pool.open_request(request(1, 2)) as rs:
        assert rs.worker == 0


def test_a_pool_ended_by_a_swap_tells_latecomers_why() -> None:
    """A request that held a swap's old model past its drain deadline, and only then
    asks its pool for a place, hears that the model was replaced, not that the server
    is shutting down."""
    pool = pool_of(1)
    pool.fail_all(Unavailable("the model was replaced", 1))
    with pytest.raises(Unavailable, match="the model was replaced"):
        pool.check_capacity()


# --- the pool: counters across a lost worker --------------------------------------------


def exported_counters(pool: EnginePool) -> dict[tuple[str, str], float]:
    """What Prometheus would read of the pool's counters (forged_kv_cells_total is a
    gauge, whatever its name says)."""
    metrics = Metrics(lambda: [("m", pool.totals(), pool.restarts())])
    return {(s.name, str(sorted(s.labels.items()))): s.value
            for family in metrics.registry.collect() if family.type == "counter"
            for s in family.samples if s.name.endswith("_total")}


async def test_no_counter_goes_down_when_a_worker_is_lost_and_restarted(
        autojump_clock: trio.testing.MockClock) -> None:
    """Prometheus reads a counter that went down as a reset (rate() then counts all of
    it again, and ForgedKVTierFailing fired): a lost worker's counts stay in its model's,
    and its next process counts on from them. Its gauges (what it held) are gone."""
    pool = pool_of(2)
    for w in pool.workers:
        w.stats = WorkerStats(**{f.name: 7.0 for f in msgspec.structs.fields(Counts)})
    seen = [exported_counters(pool)]
    lost = pool.workers[1]
    await lost._after_loss("the worker exited (killed by SIGKILL)", lived=0.0)
    seen.append(exported_counters(pool))
    assert pool.totals().running == 7.0  # worker 0's alone
    up(lost)
    lost.stats = WorkerStats(steps=1.0, kv_restore_failures=1.0)  # its new process's first
    seen.append(exported_counters(pool))
    for earlier, later in itertools.pairwise(seen):
        assert not {k: (v, later.get(k)) for k, v in earlier.items() if later.get(k, 0.0) < v}
    t = pool.totals()
    assert (t.steps, t.kv_restore_failures, t.kv_saves, t.running) == (15.0, 15.0, 14.0, 7.0)
