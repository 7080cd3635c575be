"""The sans-IO scheduler, driven step by step with a fake clock (plain floats)."""

from __future__ import annotations

import math
import random

import pytest

from forged.engine.costmodel import (
    TILE_ROWS,
    CostModel,
    StepShape,
    decode_shape,
    micro_batches,
)
from forged.engine.kvtiers import common_prefix
from forged.engine.layout import (
    MIN_PREFILL_TOKENS,
    TILED_FLOOR_GAIN,
    decoders_shape,
    virtual_start,
)
from forged.engine.limits import SchedulerLimits
from forged.engine.plan import Admission, Expired, Preempted, QueueFull, SeqCp, SeqRm, StepPlan
from forged.engine.request import Request
from forged.engine.scheduler import Scheduler
from forged.engine.seqstate import Running


def geometry(**kw: float) -> SchedulerLimits:
    """Limits with the room and largest request that ``scheduler_limits`` derives."""
    room = int(kw.get("per_slot_cells", 0) or kw["kv_cells"] - kw.get("kv_headroom", 0))
    return SchedulerLimits(**{"room": room, "max_context": room, **kw})  # type: ignore[arg-type]


def limits(**kw: float) -> SchedulerLimits:
    return geometry(**{"kv_cells": 4096, "slots": 8, "max_running": 4, "step_tokens": 32,
                       **kw})


def seq(rid: int, prompt: list[int], max_tokens: int, **kw: object) -> tuple[int, Request]:
    """A submission: the routing id and the request."""
    return rid, Request(prompt=prompt, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


def req(rid: int, n: int = 10, max_tokens: int = 5, start: int = 0, **kw: object
        ) -> tuple[int, Request]:
    return seq(rid, list(range(start, start + n)), max_tokens, **kw)


def run_step(s: Scheduler, now: float, token: int = 7) -> StepPlan | None:
    """Plan and commit one step, sampling ``token`` everywhere; finish at max_tokens."""
    plan = s.plan(now)
    if plan is None:
        return None
    sampled = {(c.rid, i): token for c in plan.chunks for i in c.choices}
    s.commit(plan, sampled, now)
    for key in sampled:
        r = s.sequence(key)
        assert r is not None
        if r.generated >= r.req.max_tokens:
            s.complete(*key)
    return plan


def running(s: Scheduler, key: tuple[int, int]) -> Running:
    r = s.sequence(key)
    assert r is not None, f"{key} is not running"
    return r


def test_no_batching_window_first_request_runs_in_the_next_step() -> None:
    s = Scheduler(limits())
    assert s.plan(0.0) is None
    s.submit(*req(1), 0.0)
    plan = s.plan(0.0)
    assert plan is not None and [c.rid for c in plan.chunks] == [1]
    assert plan.chunks[0].tokens == list(range(10)) and plan.chunks[0].sample


def test_decode_tokens_come_first_and_prefill_is_chunked_to_the_budget() -> None:
    s = Scheduler(limits(step_tokens=16))
    for rid in (1, 2, 3):
        s.submit(*req(rid, n=4, max_tokens=50, start=100 * rid), 0.0)
    run_step(s, 0.0)  # three 4-token prompts fit in one step
    s.submit(*req(9, n=40, max_tokens=5), 0.0)
    plan = run_step(s, 1.0)
    assert plan is not None
    decode = [c for c in plan.chunks if len(c.tokens) == 1]
    assert [c.rid for c in decode] == [1, 2, 3]
    assert plan.n_tokens == 16  # 3 decode tokens + 13 prompt tokens of request 9
    chunk9 = next(c for c in plan.chunks if c.rid == 9)
    assert len(chunk9.tokens) == 13 and not chunk9.sample
    # the long prompt keeps going in bounded chunks while the others decode every step
    while running(s, (9, 0)).phase.value == "prefill":
        plan = run_step(s, 2.0)
        assert plan is not None and plan.n_tokens <= 16
        assert {1, 2, 3} <= {c.rid for c in plan.chunks}


def test_short_prompt_is_prefilled_before_a_long_one() -> None:
    s = Scheduler(limits(step_tokens=16))
    s.submit(*req(1, n=100), 0.0)
    s.submit(*req(2, n=5, start=500), 0.1)
    plan = s.plan(0.2)
    assert plan is not None
    assert plan.chunks[0].rid == 2 and len(plan.chunks[0].tokens) == 5
    assert plan.chunks[1].rid == 1 and len(plan.chunks[1].tokens) == 11


def test_admission_waits_for_kv_cells_and_resumes_when_freed() -> None:
    s = Scheduler(limits(kv_cells=100, max_running=8))
    s.submit(*req(1, n=40, max_tokens=30), 0.0)
    s.submit(*req(2, n=40, max_tokens=30, start=1000), 0.0)
    s.plan(0.0)
    assert s.n_running == 1 and s.n_queued == 1  # 70 + 70 cells > 100
    while s.is_running(1):
        run_step(s, 1.0)
    # request 1 left 40+29 cached cells; they are evicted to make room for request 2
    run_step(s, 2.0)
    assert s.is_running(2)
    assert s.cache.ledger.used <= 100


def test_queue_is_bounded_in_requests_and_tokens() -> None:
    s = Scheduler(limits(max_running=1, max_queued=2, max_queued_tokens=25))
    s.submit(*req(1), 0.0)
    s.submit(*req(2), 0.0)
    with pytest.raises(QueueFull):
        s.submit(*req(3), 0.0)
    s2 = Scheduler(limits(max_running=1, max_queued=10, max_queued_tokens=25))
    s2.submit(*req(1, n=20), 0.0)
    with pytest.raises(QueueFull):
        s2.submit(*req(2, n=10), 0.0)


def test_queued_request_times_out() -> None:
    s = Scheduler(limits(max_running=1))
    s.submit(*req(1, max_tokens=100), 0.0)
    s.submit(*req(2, queue_timeout=5.0), 0.0)
    run_step(s, 0.0)
    assert s.expire(4.9) == []
    assert s.expire(5.0) == [2]
    assert Expired(2) in s.drain_events()
    assert s.n_queued == 0


def test_cancel_frees_the_slot_and_keeps_the_kv_as_cache() -> None:
    s = Scheduler(limits())
    s.submit(*req(1, n=10, max_tokens=100), 0.0)
    run_step(s, 0.0)
    run_step(s, 1.0)
    assert s.statistics().kv_cells_active == 11
    assert s.drop(1)
    st = s.statistics()
    assert st.running == 0 and st.kv_cells_active == 0
    assert st.kv_cells_cached == st.kv_cells_used == 11


def test_cancel_without_cache_removes_the_cells() -> None:
    s = Scheduler(limits())
    s.submit(*req(1, n=10, max_tokens=100, cache=False), 0.0)
    run_step(s, 0.0)
    s.drop(1)
    plan = s.plan(1.0)
    assert plan is not None and plan.ops == [SeqRm(0, 0)]
    assert s.cache.ledger.used == 0


def test_prefix_hit_skips_prefill_of_the_shared_prefix() -> None:
    s = Scheduler(limits())
    shared = list(range(50))
    s.submit(*seq(1, [*shared, 900, 901], 3), 0.0)
    while s.is_running(1) or s.n_queued:
        run_step(s, 0.0)
    s.submit(*seq(2, [*shared, 950, 951, 952], 3), 1.0)
    plan = s.plan(1.0)
    assert plan is not None
    # the idle slot is reused in place: its tail is dropped, the prefix kept
    assert plan.ops == [SeqRm(0, 50)]
    assert plan.chunks[0].pos == 50 and plan.chunks[0].tokens == [950, 951, 952]
    ev = s.drain_events()
    assert Admission(2, 50, 0.0) in ev
    st = s.statistics()
    assert st.prefix_cache_hits == 1 and st.prefix_cache_tokens_saved == 50


def test_concurrent_requests_share_a_prefix_through_seq_cp() -> None:
    s = Scheduler(limits(step_tokens=64))
    shared = list(range(40))
    s.submit(*seq(1, [*shared, 900], 50), 0.0)
    run_step(s, 0.0)  # request 1 is running with 41 cells
    s.submit(*seq(2, [*shared, 950], 50), 1.0)
    plan = s.plan(1.0)
    assert plan is not None
    assert SeqCp(src=0, dst=1, n=40) in plan.ops
    chunk = next(c for c in plan.chunks if c.rid == 2)
    assert chunk.pos == 40 and chunk.tokens == [950]
    # the shared 40 cells are counted once
    s.commit(plan, {c.key: 7 for c in plan.chunks if c.sample}, 1.0)
    assert s.cache.ledger.used == 41 + 1 + 1


def test_interactive_is_admitted_before_batch_and_prefilled_first() -> None:
    s = Scheduler(limits(max_running=1, step_tokens=8))
    s.submit(*req(1, n=4, max_tokens=2), 0.0)
    s.submit(*req(2, n=4, max_tokens=2, start=100, priority="batch"), 0.1)
    s.submit(*req(3, n=4, max_tokens=2, start=200, priority="interactive"), 0.2)
    order = []
    for step in range(20):
        plan = run_step(s, float(step))
        if plan:
            order += [c.rid for c in plan.chunks if c.rid not in order]
    assert order == [1, 3, 2]

    s = Scheduler(limits(step_tokens=8))
    s.submit(*req(1, n=30, priority="batch"), 0.0)
    s.submit(*req(2, n=30, start=100), 0.0)
    plan = s.plan(0.0)
    assert plan is not None and plan.chunks[0].rid == 2 and len(plan.chunks[0].tokens) == 8


def test_growth_past_the_reservation_preempts_the_newest_and_resumes_it() -> None:
    s = Scheduler(limits(kv_cells=60, decode_reservation=4, step_tokens=16))
    s.submit(*req(1, n=20, max_tokens=30, session="s"), 0.0)
    s.submit(*req(2, n=20, max_tokens=30, start=500), 1.0)
    run_step(s, 1.0)
    assert s.n_running == 2
    preempted = False
    for step in range(200):
        run_step(s, 2.0 + step)
        preempted |= Preempted(1) in s.drain_events()
        assert s.cache.ledger.used <= 60
        if not s.n_running and not s.n_queued:
            break
    assert preempted
    assert not s.n_running and not s.n_queued
    # the recomputed request kept its session: its final KV is pinned to it
    assert [sl.session for sl in s.cache.slots].count("s") == 1


def test_batches_never_exceed_the_step_budget() -> None:
    s = Scheduler(limits(step_tokens=24, max_running=6, slots=8))
    for rid in range(12):
        s.submit(*req(rid, n=7 + rid * 5, max_tokens=6, start=rid * 1000), 0.0)
    for step in range(300):
        plan = run_step(s, float(step))
        if plan is None and not s.n_queued:
            break
        assert plan is None or plan.n_tokens <= 24
    assert s.n_running == 0 and s.n_queued == 0


def test_common_prefix() -> None:
    a = list(range(1000))
    assert common_prefix(a, a) == 1000
    assert common_prefix(a, [*a[:700], -1]) == 700
    assert common_prefix([], a) == 0
    assert common_prefix([1, 2], [1, 3]) == 1
    rng = random.Random(17)
    for _ in range(500):  # against the definition, around the slice boundaries
        x = [rng.randrange(3) for _ in range(rng.randrange(700))]
        y = x[: rng.randrange(len(x) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(300))]
        pairs = enumerate(zip(x, y, strict=False))
        naive = next((i for i, (p, q) in pairs if p != q), min(len(x), len(y)))
        assert common_prefix(x, y) == common_prefix(y, x) == naive


# --- per-slot streams (kv_layout = "per_slot") -------------------------------------------


def per_slot(**kw: int) -> SchedulerLimits:
    base = dict(kv_cells=8 * 256, slots=8, max_running=4, step_tokens=64, per_slot_cells=256)
    base.update(kw)
    return geometry(**base)  # type: ignore[arg-type]


def test_per_slot_requests_must_fit_their_own_stream() -> None:
    s = Scheduler(per_slot())
    with pytest.raises(ValueError):
        s.submit(*req(1, n=200, max_tokens=100), 0.0)
    s.submit(*req(2, n=200, max_tokens=56), 0.0)  # exactly 256


def test_per_slot_prefix_is_copied_as_a_whole_stream_then_trimmed() -> None:
    s = Scheduler(per_slot())
    shared = list(range(40))
    s.submit(*seq(1, [*shared, 900], 50), 0.0)
    run_step(s, 0.0)
    s.submit(*seq(2, [*shared, 950], 50), 1.0)
    plan = s.plan(1.0)
    assert plan is not None
    assert SeqCp(src=0, dst=1, n=40, whole=True) in plan.ops
    chunk = next(c for c in plan.chunks if c.rid == 2)
    assert chunk.pos == 40 and chunk.tokens == [950]
    # a copy is new cells in the destination's stream
    s.commit(plan, {c.key: 7 for c in plan.chunks if c.sample}, 1.0)
    assert s.cache.ledger.used == 42 + 41


def test_per_slot_short_prefixes_are_recomputed_not_copied() -> None:
    s = Scheduler(per_slot(min_copy_tokens=16))
    s.submit(*seq(1, [*range(10), 900], 50), 0.0)
    run_step(s, 0.0)
    s.submit(*seq(2, [*range(10), 950], 50), 1.0)
    plan = s.plan(1.0)
    assert plan is not None and not [op for op in plan.ops if isinstance(op, SeqCp)]
    chunk = next(c for c in plan.chunks if c.rid == 2)
    assert chunk.pos == 0 and len(chunk.tokens) == 11


def test_per_slot_idle_slot_is_reused_in_place() -> None:
    s = Scheduler(per_slot())
    shared = list(range(60))
    s.submit(*seq(1, [*shared, 900, 901], 2), 0.0)
    while s.is_running(1) or s.n_queued:
        run_step(s, 0.0)
    s.submit(*seq(2, [*shared, 950], 2), 1.0)
    plan = s.plan(1.0)
    assert plan is not None and plan.ops == [SeqRm(0, 60)]


def test_queued_prompts_go_shortest_first_with_aging() -> None:
    # A prompt is served as if it arrived overtake_window x (its share of max_context)
    # later: a 700-token prompt here by 7 s, a 30-token one by 0.3 s.
    s = Scheduler(limits(max_running=1, overtake_window=10, max_context=1000))
    s.submit(*req(1, n=5, max_tokens=1), 0.0)
    s.plan(0.0)  # request 1 holds the only running place
    s.submit(*req(2, n=700, start=100), 0.1)  # counts from 7.1
    s.submit(*req(3, n=30, start=2000), 0.2)  # 0.5
    s.submit(*req(4, n=10, start=3000), 0.3)  # 0.4
    s.complete(1)
    s.plan(1.0)
    assert s.is_running(4)  # the shortest goes first
    s.complete(4)
    s.submit(*req(5, n=30, start=4000), 6.5)  # 6.8: still before request 2
    s.submit(*req(6, n=30, start=5000), 7.0)  # 7.3: after it
    order = []
    for now in (8.0, 8.1, 8.2, 8.3):
        s.plan(now)
        (rid,) = (r for r in (2, 3, 5, 6) if s.is_running(r))
        order.append(rid)
        s.complete(rid)
    assert order == [3, 5, 2, 6]


def test_same_length_prompts_are_first_come_first_served() -> None:
    s = Scheduler(limits(max_running=1, max_context=1000))
    s.submit(*req(1, n=5, max_tokens=1), 0.0)
    s.plan(0.0)
    for rid, t in ((2, 0.1), (3, 0.2), (4, 0.3)):
        s.submit(*req(rid, n=40, start=100 * rid), t)
    s.complete(1)
    order = []
    for now in (1.0, 1.1, 1.2):
        s.plan(now)
        (rid,) = (r for r in (2, 3, 4) if s.is_running(r))
        order.append(rid)
        s.complete(rid)
    assert order == [2, 3, 4]


def test_per_slot_steps_fill_the_budget_with_a_few_prompt_chunks() -> None:
    s = Scheduler(per_slot(step_tokens=64, max_prefill_chunks=2))
    s.submit(*req(1, n=5, max_tokens=50), 0.0)
    s.submit(*req(2, n=9, max_tokens=50, start=100), 0.0)
    s.submit(*req(3, n=40, max_tokens=50, start=200), 0.0)
    plan = s.plan(0.0)
    assert plan is not None
    # shortest first, and at most two chunks: each distinct length costs llama.cpp a pass
    assert [(c.rid, len(c.tokens)) for c in plan.chunks] == [(1, 5), (2, 9)]
    s.commit(plan, {(1, 0): 7, (2, 0): 7}, 0.0)
    plan = s.plan(1.0)
    assert plan is not None
    assert [(c.rid, len(c.tokens)) for c in plan.chunks] == [(1, 1), (2, 1), (3, 40)]


# --- sessions -------------------------------------------------------------------------


def finish_all(s: Scheduler, now: float) -> None:
    while s.n_running or s.n_queued:
        run_step(s, now)


def turn(history: list[int], new: list[int]) -> list[int]:
    """The next turn's prompt: everything so far (prompt + the 2 tokens produced)."""
    return [*history, 7, new[0], *new[1:]]


@pytest.mark.parametrize("layout", [limits, per_slot])
def test_session_resumes_computing_only_the_new_tokens(layout: type) -> None:
    s = Scheduler(layout(slots=2, max_running=2))
    first = list(range(100, 140))
    s.submit(*seq(1, first, 2, session="alice"), 0.0)
    finish_all(s, 0.0)
    # anonymous traffic with other prompts fills the other slot and would reuse Alice's
    for rid in (2, 3):
        s.submit(*seq(rid, list(range(1000 * rid, 1000 * rid + 30)), 2), 1.0)
        finish_all(s, 1.0)
    second = turn(first, [500, 501, 502])
    before = s.prompt_tokens_computed
    s.submit(*seq(4, second, 2, session="alice"), 2.0)
    finish_all(s, 2.0)
    # the prompt and the one token fed back were kept: only the 3 new tokens ran
    assert s.prompt_tokens_computed - before == len(second) - 41
    st = s.statistics()
    assert st.session_resumes == 1 and st.sessions_pinned == 1


def test_anonymous_requests_do_not_take_over_a_pinned_session_slot() -> None:
    s = Scheduler(per_slot(slots=2, max_running=2))
    system = list(range(100, 160))
    s.submit(*seq(1, [*system, 1, 2], 2, session="alice"), 0.0)
    finish_all(s, 0.0)
    # shares Alice's 60-token system prompt: it copies it instead of truncating her turn
    s.submit(*seq(2, [*system, 3], 2), 1.0)
    plan = s.plan(1.0)
    assert plan is not None and SeqCp(src=0, dst=1, n=60, whole=True) in plan.ops
    finish_all(s, 1.0)
    assert s.cache.slots[0].session == "alice"
    assert len(s.cache.slots[0].tokens) == 63


def test_sessions_go_last_and_least_recently_used_first_under_pressure() -> None:
    s = Scheduler(per_slot(slots=3, max_running=3))
    for rid, (name, t) in enumerate([("a", 0.0), ("b", 1.0)], start=1):
        s.submit(*seq(rid, list(range(100 * rid, 100 * rid + 20)), 2, session=name), t)
        finish_all(s, t)
    s.submit(*seq(3, list(range(900, 920)), 2), 2.0)  # anonymous cache, newest
    finish_all(s, 2.0)
    # a new prompt needs a slot: the anonymous cache goes although it is the newest
    s.submit(*seq(4, list(range(5000, 5020)), 2), 3.0)
    finish_all(s, 3.0)
    assert {sl.session for sl in s.cache.slots} == {"a", "b", None}
    # two more need slots while slot of request 4 is running: then session "a" (LRU) goes
    s.submit(*seq(5, list(range(6000, 6020)), 50), 4.0)
    s.submit(*seq(6, list(range(7000, 7020)), 50), 4.0)
    run_step(s, 4.0)
    assert {sl.session for sl in s.cache.slots} == {"b", None}


def test_a_session_unpins_after_its_ttl() -> None:
    s = Scheduler(per_slot(slots=2, max_running=2, session_ttl=60))
    s.submit(*seq(1, list(range(100, 120)), 2, session="a"), 0.0)
    finish_all(s, 0.0)
    s.submit(*seq(2, list(range(200, 220)), 2), 10.0)
    finish_all(s, 10.0)
    assert s.statistics().sessions_pinned == 1
    s.plan(100.0)
    assert s.statistics().sessions_pinned == 0
    # now the older session slot is an ordinary LRU victim
    s.submit(*seq(3, list(range(300, 320)), 2), 100.0)
    finish_all(s, 100.0)
    assert all(sl.session is None for sl in s.cache.slots)


def test_an_unpinned_session_is_an_ordinary_cache_at_once() -> None:
    """A conversation gone (its stored responses deleted) unpins its slot before its
    ttl: the next new prompt evicts it, not the newer anonymous cache."""
    s = Scheduler(per_slot(slots=2, max_running=2, session_ttl=600))
    s.submit(*seq(1, list(range(100, 120)), 2, session="a"), 0.0)
    finish_all(s, 0.0)
    s.submit(*seq(2, list(range(200, 220)), 2), 10.0)
    finish_all(s, 10.0)
    s.cache.unpin("b")  # another session's: nothing changes
    assert s.statistics().sessions_pinned == 1
    s.cache.unpin("a")
    assert s.statistics().sessions_pinned == 0
    s.submit(*seq(3, list(range(300, 320)), 2), 20.0)
    finish_all(s, 20.0)
    assert sorted(sl.tokens[0] for sl in s.cache.slots) == [200, 300]


def test_only_a_sessions_latest_turn_is_pinned() -> None:
    s = Scheduler(per_slot(slots=3, max_running=3))
    s.submit(*seq(1, list(range(100, 120)), 50, session="a"), 0.0)
    s.submit(*seq(2, list(range(200, 220)), 2, session="a"), 0.0)
    finish_all(s, 0.0)
    assert [sl.session for sl in s.cache.slots].count("a") == 1


def test_a_step_without_decoders_takes_the_bigger_prefill_budget() -> None:
    s = Scheduler(per_slot(step_tokens=16, prefill_step_tokens=64))
    s.submit(*req(1, n=150, max_tokens=5), 0.0)
    plan = run_step(s, 0.0)
    assert plan is not None and plan.n_tokens == 64  # nobody decodes: nothing to stall
    run_step(s, 0.0)
    run_step(s, 0.0)  # 150 = 64 + 64 + 22: decoding now
    s.submit(*req(2, n=150, max_tokens=5, start=1000), 0.0)
    plan = run_step(s, 0.0)
    assert plan is not None and plan.n_tokens == 16  # request 1 decodes: the ITL bound


def test_a_long_prefill_is_not_starved_by_a_stream_of_short_prompts() -> None:
    s = Scheduler(per_slot(step_tokens=16, prefill_step_tokens=16, overtake_window=10,
                           max_context=250))
    s.submit(*req(1, n=200, max_tokens=50), 0.0)
    s.submit(*req(2, n=5, max_tokens=200, start=1000), 0.0)  # keeps a decoder running
    now, rid = 0.0, 10
    while s.is_running(1) and running(s, (1, 0)).phase.value == "prefill":
        # a new short prompt every step, each shorter than what is left of request 1
        s.submit(*req(rid, n=5, max_tokens=1, start=2000 + 10 * rid), now)
        run_step(s, now)
        now, rid = now + 0.5, rid + 1
        assert now < 60, "request 1's prefill starved"
    # it gave way for at most the overtake window, then took the prompt chunk every step
    assert now <= 10.0 + 0.5 * (200 // 15 + 2)


# --- steps bounded by time (engine.target_step_ms) ------------------------------------


def costed(flash_attn: bool = False, **kw: float) -> tuple[Scheduler, CostModel]:
    """A per-slot scheduler whose cost model is the seed exactly (no observations):
    fixed 8 ms, 2.6 ms per decoder, 3 ms per prompt token, 3 ms per chunk, and per
    thousand query-key pairs 3.4 ms for decoders, 1.2 ms for chunks (with flash
    attention: 12 ms for decoders and chunks of 64 tokens or fewer, 1.1 ms for longer)."""
    base: dict[str, float] = dict(kv_cells=16 * 1024, slots=16, max_running=16,
                                  step_tokens=512, per_slot_cells=1024, target_step_ms=150)
    base.update(kw)
    cost = CostModel(flash_attn=flash_attn)
    return Scheduler(geometry(**base), cost), cost  # type: ignore[arg-type]


def decoding(s: Scheduler, n: int, now: float = 0.0) -> None:
    """Start ``n`` short requests and run them to their decode phase."""
    for rid in range(100, 100 + n):
        s.submit(*req(rid, n=4, max_tokens=990, start=10 * rid), now)
    while s.n_queued or s.statistics().prefilling:
        run_step(s, now)


def prompt_tokens(plan: StepPlan | None) -> int:
    assert plan is not None
    return sum(len(c.tokens) for c in plan.chunks if not c.sample or len(c.tokens) > 1)


@pytest.mark.parametrize("decoders", [0, 2, 8, 15])
def test_the_step_budget_follows_the_cost_model(decoders: int) -> None:
    s, cost = costed()
    decoding(s, decoders)
    s.submit(*req(1, n=900, max_tokens=5), 1.0)
    plan = s.plan(1.0)
    assert plan is not None
    # never over the target in the model's own estimate, and not far under it either
    predicted = cost.predict(plan.shape)
    assert predicted <= 150
    one_more = plan.shape.plus(StepShape(prompt_tokens=1, kpairs=1.0))
    assert cost.predict(one_more) > 150


def test_fewer_decoders_leave_bigger_prompt_chunks() -> None:
    taken = []
    for decoders in (0, 4, 12):
        s, _ = costed()
        decoding(s, decoders)
        s.submit(*req(1, n=900, max_tokens=5), 1.0)
        taken.append(prompt_tokens(s.plan(1.0)))
    assert taken[0] > taken[1] > taken[2] > 0


def test_decoders_over_the_target_still_leave_minimum_prompt_progress() -> None:
    s, _ = costed(target_step_ms=20)  # 8 decoders alone are predicted at ~29 ms
    decoding(s, 8)
    s.submit(*req(1, n=200, max_tokens=5), 1.0)
    assert prompt_tokens(s.plan(1.0)) == MIN_PREFILL_TOKENS


def test_decoders_over_the_target_leave_prompts_a_quarter_of_the_step() -> None:
    cost = CostModel((8.0, 20.0, 3.0, 3.0, 3.0, 1.1))  # a slow machine: 20 ms per decoder
    s = Scheduler(geometry(kv_cells=16 * 1024, slots=16, max_running=16,
                                  step_tokens=512, per_slot_cells=1024, target_step_ms=100),
                  cost)
    decoding(s, 8)  # 168 ms of decoding alone, past the 100 ms target
    s.submit(*req(1, n=900, max_tokens=5), 1.0)
    plan = s.plan(1.0)
    assert plan is not None
    decode = cost.predict(decode_shape([c.pos for c in plan.chunks if c.rid != 1]))
    prompt = cost.predict(plan.shape) - decode
    assert decode > 100 and prompt_tokens(plan) > MIN_PREFILL_TOKENS
    assert 0.2 * cost.predict(plan.shape) <= prompt <= 0.25 * cost.predict(plan.shape) + 1


def test_a_step_without_prompt_work_is_decode_only() -> None:
    s, _ = costed()
    decoding(s, 6)
    plan = s.plan(1.0)
    assert plan is not None and plan.n_tokens == 6 and plan.shape.prompt_tokens == 0


def random_shape(rng: random.Random) -> StepShape:
    return StepShape(decoders=rng.randint(0, 16), prompt_tokens=rng.choice(
        [0, rng.randint(1, 300)]), chunks=rng.randint(0, 4), kpairs=rng.uniform(0, 60),
        tiled_kpairs=rng.choice([0, rng.uniform(0, 200)]))


@pytest.mark.parametrize("noise", [0.0, 0.05])
def test_the_cost_model_fit_converges_on_synthetic_steps(noise: float) -> None:
    rng = random.Random(7)
    true = CostModel((11.0, 1.7, 2.2, 4.5, 9.5, 1.2))
    model = CostModel()  # seeded with other values
    for _ in range(400):
        shape = random_shape(rng)
        model.observe(shape, true.predict(shape) * rng.uniform(1 - noise, 1 + noise))
    if not noise:  # the coefficients themselves, up to the seed's faint pull
        for fitted, want in zip(model.coef, true.coef, strict=True):
            assert fitted == pytest.approx(want, rel=0.1)
    for _ in range(50):  # with noisy steps, what the planner uses: the predictions
        shape = random_shape(rng)
        assert model.predict(shape) == pytest.approx(true.predict(shape), rel=0.05, abs=2)


def test_the_fit_follows_a_machine_that_slows_down() -> None:
    model = CostModel()
    shapes = [StepShape(decoders=d, prompt_tokens=p, chunks=int(p > 0), kpairs=p / 10)
              for d in (1, 4, 8, 16) for p in (0, 16, 64)]
    for speed in (1.0, 2.0):
        for _ in range(40):
            for sh in shapes:
                model.observe(sh, speed * (5 + 2 * sh.decoders + 3 * sh.prompt_tokens))
    assert model.predict(StepShape(decoders=8)) == pytest.approx(2 * (5 + 16), rel=0.1)


def short_beside_an_aged_long_prefill(short: int) -> tuple[Scheduler, CostModel]:
    """Four streams decode and a 900-token prompt prefills; 10 s later, when it has
    aged past any new arrival, a ``short``-token prompt (rid 2) arrives."""
    s, cost = costed(overtake_window=1.0, max_context=1000)
    decoding(s, 4)
    s.submit(*req(1, n=900, max_tokens=5), 0.0)
    run_step(s, 0.5)
    s.submit(*req(2, n=short, max_tokens=5, start=5000), 10.0)
    return s, cost


def test_a_short_prompt_arriving_during_a_long_prefill_runs_in_the_next_step() -> None:
    # the long prompt aged past any new arrival long ago: a short one still goes first
    s, _ = short_beside_an_aged_long_prefill(20)
    plan = s.plan(10.0)
    assert plan is not None
    short = next(c for c in plan.chunks if c.rid == 2)
    assert len(short.tokens) == 20 and short.sample  # its whole prompt, first token next
    # and the long prompt kept its share of the step
    assert any(c.rid == 1 and len(c.tokens) >= MIN_PREFILL_TOKENS for c in plan.chunks)


def test_a_short_prompt_longer_than_half_the_room_still_overtakes_an_aged_long_one(
        ) -> None:
    """Seen in bench.trace at half of capacity on 2 cores: a 40-token question could
    not finish within half of a step's room (30-odd tokens beside 10 decoders), so it
    waited in aging order behind a 632-token prompt for 21 steps (6 s). It now takes
    half of every step's room until it is done; the long one keeps the other half."""
    s, cost = short_beside_an_aged_long_prefill(60)
    first = s.plan(10.0)
    assert first is not None
    room = 150 - cost.predict(decode_shape([c.pos for c in first.chunks if c.rid >= 100]))
    assert cost.predict_extra(cost.chunk(0, 60)) > room / 2  # not a quick one
    steps, long_done = 0, 0
    while True:
        plan = run_step(s, 10.0)
        assert plan is not None
        steps += 1
        long_chunk = next(c for c in plan.chunks if c.rid == 1)
        long_done += len(long_chunk.tokens)
        assert cost.predict_extra(cost.chunk(long_chunk.pos, len(long_chunk.tokens))
                                  ) >= room / 2 - 2 * cost.predict_extra(cost.chunk(0, 1))
        if any(c.rid == 2 and c.sample for c in plan.chunks):
            break
        assert steps < 10, "the short prompt waited behind the long one"
    # about 60 tokens at half a room each step: three or four steps, not the long one's 20
    assert steps <= math.ceil(60 / (room / 2 / 3.0)) + 1


def test_a_long_prefill_keeps_half_the_room_against_a_flood_of_short_prompts() -> None:
    s, cost = costed(overtake_window=1.0, max_context=1000)
    decoding(s, 2)
    s.submit(*req(1, n=900, max_tokens=5), 0.0)
    now = 10.0
    for rid in range(10, 14):  # short prompts that would fill more than the room
        s.submit(*req(rid, n=12, max_tokens=5, start=1000 * rid), now)
    plan = s.plan(now)
    assert plan is not None
    room = 150 - cost.predict(decode_shape([c.pos for c in plan.chunks if len(c.tokens) == 1
                                            and c.rid >= 100]))
    long_chunk = next(c for c in plan.chunks if c.rid == 1)
    assert cost.predict_extra(cost.chunk(long_chunk.pos, len(long_chunk.tokens))
                              ) >= room / 2 - cost.predict_extra(cost.chunk(0, 12))


def test_the_aged_long_prefill_keeps_a_chunk_when_short_prompts_could_take_them_all(
        ) -> None:
    s, _ = costed(overtake_window=1.0, max_context=1000, max_prefill_chunks=4)
    s.submit(*req(1, n=900, max_tokens=5), 0.0)
    run_step(s, 0.0)
    for rid in range(10, 16):  # six 2-token prompts, each far below half the room
        s.submit(*req(rid, n=2, max_tokens=5, start=1000 * rid), 10.0)
    plan = s.plan(10.0)
    assert plan is not None and len(plan.chunks) == 4
    # three quick ones and the long one (the batch is in slot order, not this order)
    assert sorted(c.rid for c in plan.chunks) == [1, 10, 11, 12]


def test_an_overload_is_refused_at_once_with_the_estimated_wait() -> None:
    s, _ = costed(max_running=2, slots=2, kv_cells=2048)
    for rid in range(2):  # two long generations hold both slots
        s.submit(*req(rid, n=10, max_tokens=1000, start=100 * rid), 0.0)
    run_step(s, 0.0)
    # as observed: while requests waited, slots freed once a second
    s.queue.finished_at.extend([0.0, 1.0, 2.0, 3.0])
    s.queue.waiting_clock = 4.0
    now, rid = 4.0, 10
    with pytest.raises(QueueFull) as refused:
        while rid < 200:
            s.submit(*req(rid, n=600, max_tokens=5, start=1000 * rid, queue_timeout=30), now)
            rid += 1
    # the refusal came with the estimate, and the estimate is what a queued request sees
    wait = s.wait_estimate(0, virtual_start(s.limits, now, 600))
    assert wait > 30
    assert refused.value.retry_after == pytest.approx(wait - 30, abs=1.0)
    assert s.early_rejections == 1 and s.n_queued == rid - 10
    # slots turn over at 1 s each: the thirty-first would have waited 31 s for one (the
    # prompt work ahead, ~2.2 s a request, is done meanwhile and counts no more: added
    # to the slots it refused the eleventh, as the longer of the two the fifteenth)
    assert rid - 10 == 30
    assert s.statistics().wait_estimate_s > 0


def test_a_closed_loop_of_twice_the_slots_is_not_refused() -> None:
    """bench.ceiling's closed loop of 32 callers on 16 slots: each caller waits for one
    request to end (about 16 slot turnovers, 29 s here), well inside a 40 s timeout.
    The slot wait and the prompt work of the 16 ahead were summed (42 s) and the last
    callers refused, thousands of times a minute; the longer of the two counts."""
    s, _ = costed()
    for rid in range(16):  # every slot decodes a long answer
        s.submit(*req(rid, n=8, max_tokens=1000, start=100 * rid), 0.0)
    run_step(s, 0.0)
    s.queue.finished_at.extend([1.8 * i for i in range(17)])  # a slot every 1.8 s
    s.queue.waiting_clock = 1.8 * 16
    now = s.queue.waiting_clock
    for rid in range(100, 116):  # the other 16 callers' 200-token prompts
        s.submit(*req(rid, n=200, max_tokens=64, start=1000 * rid, queue_timeout=40), now)
    last = s.wait_estimate(0, virtual_start(s.limits, now, 200))
    assert 25 < last < 40  # about the 16 slot turnovers ahead of it
    assert s.early_rejections == 0 and s.n_queued == 16


def test_the_door_does_not_refuse_a_question_for_long_prompts_prefilling() -> None:
    """The door refuses when even a one-token question would wait past the timeout
    (the published ``wait_estimate_s``). Long prompts prefilling with a slot free are
    no such wait: the question is admitted at once and passes them (a short prompt
    takes half of each step's room). Taken as a bound (max with the slot wait), their
    ~8 s of work refused every request at the door of a closed loop whose callers
    waited 30 s at most."""
    s, _ = costed()
    decoding(s, 4)
    for rid in range(1, 4):
        s.submit(*req(rid, n=900, max_tokens=5, start=1000 * rid), 0.0)
    run_step(s, 0.0)
    run_step(s, 60.0)  # they aged past any new arrival: ahead of it in aging order
    assert s.statistics().prefilling == 3 and s.n_queued == 0
    assert s.statistics().wait_estimate_s == 0.0


def test_a_lone_long_prompt_is_not_refused_for_its_own_prefill() -> None:
    s, _ = costed(target_step_ms=20)  # a 900-token prefill takes minutes at this pace
    decoding(s, 8)
    s.submit(*req(1, n=900, max_tokens=5, queue_timeout=1), 1.0)
    assert s.n_queued == 1


def test_slot_pace_is_measured_only_while_requests_wait() -> None:
    s, _ = costed(max_running=1, slots=1, kv_cells=1024)
    for k in range(5):  # sparse traffic: a request every 10 s, nobody waits
        s.submit(*req(k, n=10, max_tokens=1, start=100 * k), 10.0 * k)
        finish_all(s, 10.0 * k)
    s.submit(*req(10, n=10, max_tokens=1000, start=2000), 50.0)
    run_step(s, 50.0)
    s.submit(*req(11, n=10, max_tokens=5, start=3000, queue_timeout=5), 50.0)
    assert s.n_queued == 1  # the idle-time pace (one per 10 s) did not refuse it


def test_no_refusal_while_the_pace_of_slots_is_unknown() -> None:
    s, _ = costed(max_running=1, slots=1, kv_cells=1024)
    s.submit(*req(1, n=10, max_tokens=1000), 0.0)
    run_step(s, 0.0)
    for rid in range(2, 12):
        s.submit(*req(rid, n=10, max_tokens=5, start=100 * rid, queue_timeout=1), 0.0)
    assert s.n_queued == 10


# --- review findings (issue 13) ---------------------------------------------------------


def test_a_preempted_request_keeps_its_queue_timeout_and_its_place() -> None:
    s = Scheduler(limits(kv_cells=60, decode_reservation=4, step_tokens=16, max_running=2,
                         overtake_window=10, max_context=60))
    s.submit(*req(1, n=20, max_tokens=30), 0.0)
    s.submit(*req(2, n=20, max_tokens=30, start=500, priority="batch", queue_timeout=5.0), 0.0)
    for step in range(100):
        run_step(s, 1.0 + step * 0.01)
        if Preempted(2) in s.drain_events():
            break
    else:
        pytest.fail("request 2 was never preempted")
    queued = s.queue.classes[1][0]
    assert queued.rid == 2 and queued.vstart == virtual_start(s.limits, 0.0, 20)
    assert queued.deadline < math.inf  # before the fix it could wait forever
    # request 1 keeps running for a long time: request 2 times out instead of waiting on
    expired: list[int] = []
    now = 1.0 + step * 0.01
    while not expired and now < 20:
        now += 0.5
        expired = s.expire(now)
        run_step(s, now)
    assert expired == [2] and now <= queued.deadline + 0.5


def test_room_making_evicts_nothing_when_the_request_still_would_not_fit() -> None:
    s = Scheduler(limits(kv_cells=200, kv_headroom=0, decode_reservation=1000, slots=4,
                         max_running=4))
    for rid in (1, 2):  # two idle caches of 30 cells, one of them a pinned session
        s.submit(*req(rid, n=30, max_tokens=1, start=100 * rid, session=f"s{rid}"), 0.0)
        finish_all(s, 0.0)
    s.submit(*req(3, n=20, max_tokens=100, start=900), 1.0)  # reserves 120 cells
    run_step(s, 1.0)
    s.drain_events()
    used = s.cache.ledger.used
    # needs 100 + 40 cells: even evicting both caches leaves only 200 - 120 - ... too few
    s.submit(*req(4, n=40, max_tokens=100, start=5000), 2.0)
    for now in (2.0, 3.0, 4.0):
        plan = s.plan(now)
        assert plan is not None and not [op for op in plan.ops if isinstance(op, SeqRm)]
        s.commit(plan, {c.key: 7 for c in plan.chunks if c.sample}, now)
    assert s.statistics().sessions_pinned == 2 and s.cache.ledger.used >= used
    assert not s.is_running(4)


def test_room_making_evicts_only_what_admits_the_request() -> None:
    s = Scheduler(limits(kv_cells=200, kv_headroom=0, decode_reservation=10, slots=4,
                         max_running=4))
    for rid in (1, 2):  # idle caches of 60 cells each, request 2's the newer
        s.submit(*req(rid, n=60, max_tokens=1, start=1000 * rid), float(rid))
        finish_all(s, float(rid))
    s.submit(*req(3, n=90, max_tokens=10, start=9000), 5.0)  # 100 cells: one eviction
    plan = s.plan(5.0)
    assert plan is not None and s.is_running(3)
    removed = [op.seq for op in plan.ops if isinstance(op, SeqRm)]
    assert removed == [0]  # only the least recently used cache went


def test_prefix_caches_are_not_shared_across_tenants() -> None:
    s = Scheduler(per_slot())
    shared = list(range(50))
    s.submit(*seq(1, [*shared, 900], 3, tenant="a"), 0.0)
    finish_all(s, 0.0)
    s.submit(*seq(2, [*shared, 950], 3, tenant="b"), 1.0)
    finish_all(s, 1.0)
    s.submit(*seq(3, [*shared, 960], 3, tenant="a"), 2.0)
    finish_all(s, 2.0)
    admitted = {e.rid: e.cached for e in s.drain_events() if isinstance(e, Admission)}
    assert admitted == {1: 0, 2: 0, 3: 50}


def test_a_request_sharing_only_a_header_does_not_truncate_anothers_cache() -> None:
    """Two editors on one repository: their prompts share a header, then differ. The
    second must not cut the first's cached context down to the header."""
    s = Scheduler(limits(slots=4, max_running=2, step_tokens=256))
    header = list(range(1000, 1016))
    s.submit(*seq(1, [*header, *range(100, 300)], 1), 0.0)
    while s.is_running(1) or s.n_queued:
        run_step(s, 1.0)
    slot_a = next(sl for sl in s.cache.slots if sl.tokens)
    s.submit(*seq(2, [*header, *range(500, 700)], 1), 2.0)
    plan = s.plan(2.0)
    assert plan is not None and plan.chunks[0].seq != slot_a.sid
    assert len(slot_a.tokens) == 216  # still whole: editor A's next request reuses it
    assert any(isinstance(op, SeqCp) and op.n == 16 for op in plan.ops)  # header shared


def test_a_continuation_reuses_its_slot_in_place() -> None:
    s = Scheduler(limits(slots=4, max_running=2, step_tokens=256))
    first = list(range(100, 300))
    s.submit(*seq(1, first, 1), 0.0)
    while s.is_running(1) or s.n_queued:
        run_step(s, 1.0)
    slot = next(sl for sl in s.cache.slots if sl.tokens)
    # the same file a keystroke later: the last 20 tokens differ
    s.submit(*seq(2, [*first[:180], *range(900, 930)], 1), 2.0)
    plan = s.plan(2.0)
    assert plan is not None and plan.chunks[0].seq == slot.sid
    assert not any(isinstance(op, SeqCp) for op in plan.ops)


# --- n > 1: one prompt, n choices --------------------------------------------------------


def computed_for(n: int, lim: SchedulerLimits) -> tuple[int, list[StepPlan]]:
    """Prompt tokens computed, and the plans, for one 40-token request with ``n``."""
    s = Scheduler(lim)
    s.submit(*seq(1, list(range(100, 140)), 5, n=n), 0.0)
    plans = []
    while s.n_running or s.n_queued:
        plan = run_step(s, 1.0)
        assert plan is not None
        plans.append(plan)
    return s.prompt_tokens_computed, plans


@pytest.mark.parametrize("lim", [limits(), per_slot()], ids=["unified", "per_slot"])
def test_n_choices_compute_the_prompt_once_then_fork(lim: SchedulerLimits) -> None:
    once, _ = computed_for(1, lim)
    computed, plans = computed_for(4, lim)
    assert computed == once == 40
    # the chunk that ends the prompt samples all four choices from the leader's logits
    at, last = next((i, c) for i, p in enumerate(plans) for c in p.chunks if c.sample)
    assert last.choices == (0, 1, 2, 3) and last.tokens[-1] == 139
    # then the prompt's KV is copied to the three others before their first decode
    copies = [op for op in plans[at + 1].ops if isinstance(op, SeqCp)]
    assert [(op.src, op.n, op.whole) for op in copies] == [(last.seq, 40, lim.per_slot)] * 3
    assert len({op.dst for op in copies} | {last.seq}) == 4
    decode = plans[at + 1].chunks
    assert sorted(c.index for c in decode) == [0, 1, 2, 3]
    assert all(c.pos == 40 and c.choices == (c.index,) for c in decode)


def test_n_choices_share_the_prompts_cells_in_the_unified_cache() -> None:
    s = Scheduler(limits(step_tokens=64))
    s.submit(*seq(1, list(range(100, 140)), 5, n=4), 0.0)
    run_step(s, 0.0)
    run_step(s, 1.0)
    assert s.cache.ledger.used == 40 + 4  # one prompt, and one token written by each choice


def test_n_choices_each_free_their_sequence_as_they_finish() -> None:
    s = Scheduler(limits(step_tokens=64))
    s.submit(*seq(1, list(range(100, 140)), 50, n=3), 0.0)
    run_step(s, 0.0)
    assert s.n_running == 3
    s.complete(1, 1)  # choice 1 ended (EOS): the others go on
    assert s.n_running == 2 and s.is_running(1)
    plan = run_step(s, 1.0)
    assert plan is not None and sorted(c.index for c in plan.chunks) == [0, 2]
    s.complete(1, 0)
    s.complete(1, 2)
    assert s.n_running == 0 and s.statistics().kv_cells_active == 0


@pytest.mark.parametrize("steps", [0, 1, 3], ids=["queued", "prefilling", "decoding"])
def test_dropping_a_request_frees_all_its_choices(steps: int) -> None:
    s = Scheduler(limits(step_tokens=16))
    s.submit(*seq(1, list(range(100, 140)), 50, n=4), 0.0)
    for _ in range(steps):
        run_step(s, 0.0)
    assert s.drop(1)
    assert s.n_running == 0 and s.n_queued == 0 and not s.drop(1)
    plan = s.plan(1.0)
    assert plan is None or not plan.chunks
    st = s.statistics()
    assert st.kv_cells_active == 0 and st.kv_cells_reserved == 0


def test_admission_counts_all_n_sequences() -> None:
    s = Scheduler(limits(max_running=4))
    s.submit(*seq(1, list(range(100, 110)), 3), 0.0)
    s.submit(*seq(2, list(range(200, 210)), 3, n=4), 0.0)
    run_step(s, 0.0)
    assert s.is_running(1) and not s.is_running(2)  # 1 + 4 sequences > max_running
    finish_all(s, 1.0)
    events = [e.rid for e in s.drain_events() if isinstance(e, Admission)]
    assert events == [1, 2]  # one admission per request, however many choices


def test_admission_reserves_decode_cells_for_every_choice() -> None:
    # 40 + 4 * 50 = 240 cells: it waits while another request holds 40 + 50 of 300
    s = Scheduler(limits(kv_cells=300, kv_headroom=0, max_running=8))
    s.submit(*seq(1, list(range(100, 140)), 50), 0.0)
    s.submit(*seq(2, list(range(200, 240)), 50, n=4), 0.0)
    run_step(s, 0.0)
    assert not s.is_running(2)
    finish_all(s, 1.0)
    assert not s.n_running and s.cache.ledger.used <= 300


@pytest.mark.parametrize(("lim", "n", "max_tokens"), [
    (limits(max_running=4), 5, 5),  # more sequences than may ever run at once
    (limits(kv_cells=300, kv_headroom=0), 4, 80),  # 40 + 4 * 80 cells > 300, ever
])
def test_n_that_can_never_run_at_once_is_refused(lim: SchedulerLimits, n: int,
                                                 max_tokens: int) -> None:
    s = Scheduler(lim)
    with pytest.raises(ValueError, match=r"^n: at most"):
        s.submit(*seq(1, list(range(100, 140)), max_tokens, n=n), 0.0)
    assert s.n_queued == 0


def test_a_preempted_choice_resumes_alone_where_it_stopped() -> None:
    s = Scheduler(limits(kv_cells=4096, max_running=4, step_tokens=64))
    s.submit(*seq(1, list(range(100, 140)), 50, n=3), 0.0)
    run_step(s, 0.0)
    run_step(s, 1.0)
    assert s.preempt_one()
    assert s.n_running == 2 and s.sequence((1, 2)) is None
    (queued,) = s.queue.classes[0]
    assert (queued.index, queued.req.n) == (2, 1)
    assert queued.req.prompt == [*range(100, 140), 7, 7]  # its prompt, its two tokens
    plan = s.plan(2.0)
    assert plan is not None and running(s, (1, 2)).cached == 41
    assert {c.key for c in plan.chunks} == {(1, 0), (1, 1), (1, 2)}


def test_a_prefilling_leader_is_preempted_with_the_choices_waiting_for_it() -> None:
    s = Scheduler(limits(kv_cells=4096, max_running=4, step_tokens=16))
    s.submit(*seq(1, list(range(100, 110)), 50), 0.0)
    run_step(s, 0.0)
    s.submit(*seq(2, list(range(200, 240)), 50, n=3), 0.0)
    run_step(s, 1.0)  # request 2's leader has part of its prompt
    assert running(s, (2, 1)).phase.value == "fork"
    assert s.preempt_one()
    assert not s.is_running(2)
    (queued,) = s.queue.classes[0]
    assert (queued.index, queued.req.n) == (0, 3)
    finish_all(s, 2.0)
    assert s.statistics().kv_cells_active == 0
def test_a_fit_that_finds_prompt_work_free_estimates_no_wait() -> None:
    """On a tiny model the clamped fit can put every prompt coefficient at zero; the
    wait estimate (in every statistics frame) must not divide by that (it killed a
    worker in tests/test_logprobs.py)."""
    s = Scheduler(limits(), CostModel((1.0, 1.0, 0.0, 0.0, 0.0, 0.0)))
    s.submit(1, Request(prompt=[1] * 40, max_tokens=4), 0.0)
    s.plan(0.0)
    s.submit(2, Request(prompt=[2] * 40, max_tokens=4), 0.0)
    assert s.statistics().wait_estimate_s == 0.0


# --- caches in the wait estimate; a shared cold prefix computed once (issue 17) ----------

HEAD = list(range(1000, 2000))  # a long context: a repository, a document


def admissions(s: Scheduler) -> dict[int, int]:
    """The requests admitted since the last call, with their cached tokens."""
    return {ev.rid: ev.cached for ev in s.drain_events() if isinstance(ev, Admission)}


@pytest.mark.parametrize("where", ["slot", "ram"])
def test_questions_about_a_cached_context_are_not_refused_and_served_from_it(where: str
                                                                           ) -> None:
    """Twenty questions about one cached 1,000-token context queue behind each other.
    When the estimate counted the prompt work ahead, counting whole prompts refused
    the fifth (four 1,001-token prefills ahead, ~4.9 s each at the seed's pace, against
    a 20 s queue timeout); it now counts slots only (issue 34)."""
    s = Scheduler(limits(kv_cells=8192, slots=1, max_running=1, step_tokens=256,
                         cache_ram_bytes=1 << 30))
    s.submit(*seq(1, HEAD, 1), 0.0)
    finish_all(s, 0.0)
    if where == "ram":  # another context takes the only slot: HEAD's state goes to RAM
        s.submit(*seq(2, list(range(5000, 5100)), 1), 0.0)
        finish_all(s, 0.0)
        assert [len(e.tokens) for e in s.cache.tiers.recent_first()] == [len(HEAD)]
    admissions(s)
    for rid in range(10, 30):
        s.submit(*seq(rid, [*HEAD, rid], 1, queue_timeout=20.0), 1.0)
    assert s.early_rejections == 0 and s.n_queued == 20
    assert s.wait_estimate(0, 2.0) < 5.0  # for one more, placed behind all twenty
    # and the estimate was right: every one of them is served from the cache
    finish_all(s, 1.0)
    assert admissions(s) == {rid: len(HEAD) for rid in range(10, 30)}


def test_questions_about_a_cold_shared_prefix_are_not_refused_and_it_is_computed_once(
        ) -> None:
    """Four questions about one cold context, queued together: the first computes the
    context and the others copy it (held in the queue). When the estimate counted
    the prompt work ahead, counting the context each time refused the fourth (three
    1,001-token prefills ahead, ~14.6 s > 10 s)."""
    s = Scheduler(limits(kv_cells=8192, step_tokens=256))
    for rid in range(1, 5):
        s.submit(*seq(rid, [*HEAD, rid], 1, queue_timeout=10.0), 0.0)
    assert s.early_rejections == 0 and s.n_queued == 4
    finish_all(s, 0.0)
    assert s.prompt_tokens_computed == len(HEAD) + 4


@pytest.mark.parametrize("lim", [limits(kv_cells=8192, step_tokens=64),
                                 per_slot(per_slot_cells=2048, kv_cells=8 * 2048)],
                         ids=["unified", "per_slot"])
def test_a_cold_prefix_shared_by_two_requests_is_computed_once(lim: SchedulerLimits) -> None:
    """Two questions about one cold 1,000-token context, submitted together: the second
    waits while the first computes the context, then copies it. It does not expire
    meanwhile, though the wait (16 steps of 1 s: a slow machine) is past its queue
    timeout: it waits for work done for it, not for capacity. Before the fix both
    computed the context at once."""
    s = Scheduler(lim)
    s.submit(*seq(1, [*HEAD, 1, 2, 3], 2), 0.0)
    s.submit(*seq(2, [*HEAD, 4, 5, 6], 2, queue_timeout=10.0), 0.0)
    admitted: dict[int, int] = {}
    now = 0.0
    while s.n_running or s.n_queued:
        assert s.expire(now) == []
        run_step(s, now)
        admitted.update(admissions(s))
        now += 1.0
    # admitted once the first had computed the whole context, which it copied
    assert admitted == {1: 0, 2: len(HEAD)}
    assert s.prompt_tokens_computed == len(HEAD) + 3 + 3
    assert s.statistics().prefix_holds == 1


def test_cancelling_the_request_computing_a_shared_prefix_releases_the_one_waiting() -> None:
    s = Scheduler(limits(kv_cells=8192, step_tokens=64))
    s.submit(*seq(1, [*HEAD, 1], 2), 0.0)
    s.submit(*seq(2, [*HEAD, 2], 2), 0.0)
    run_step(s, 0.0)
    assert admissions(s) == {1: 0} and s.n_queued == 1  # 2 waits for 1's context
    s.drop(1)
    run_step(s, 0.1)
    # admitted at once, on what 1 had computed (kept as cache); it computes the rest
    assert admissions(s) == {2: 64}
    finish_all(s, 0.2)
    assert s.prompt_tokens_computed == 64 + len(HEAD) + 1 - 64


def test_an_interactive_request_does_not_wait_for_a_batch_prefill() -> None:
    """A batch prefill yields every step to interactive prompts, so an interactive
    request held behind it could wait as long as they keep coming: it computes the
    rest of the prefix itself. The other way round, batch waits for interactive."""
    s = Scheduler(limits(kv_cells=8192, step_tokens=64))
    s.submit(*seq(1, [*HEAD, 1], 2, priority="batch"), 0.0)
    run_step(s, 0.0)
    s.submit(*seq(2, [*HEAD, 2], 2), 0.1)
    s.submit(*seq(3, [*HEAD, 3], 2, priority="batch"), 0.1)
    run_step(s, 0.1)
    assert admissions(s) == {1: 0, 2: 64}  # 2 copies what 1 has so far; 3 waits
    assert s.n_queued == 1


def test_a_request_waiting_for_a_shared_prefix_lets_others_pass() -> None:
    s = Scheduler(limits(kv_cells=8192, step_tokens=64, max_running=4))
    s.submit(*seq(1, [*HEAD, 1], 2), 0.0)
    s.submit(*seq(2, [*HEAD, 2], 2), 0.0)
    s.submit(*seq(3, list(range(5000, 6000)), 2), 0.1)  # as long, and later
    run_step(s, 0.1)
    assert admissions(s) == {1: 0, 3: 0} and s.n_queued == 1


def test_a_preempted_holder_releases_the_one_waiting_and_nothing_deadlocks() -> None:
    s = Scheduler(limits(kv_cells=8192, step_tokens=64, max_running=4))
    s.submit(*seq(9, list(range(5000, 5004)), 50), 0.0)  # decoding beside them
    run_step(s, 0.0)
    s.submit(*seq(1, [*HEAD, 1], 2), 0.1)
    s.submit(*seq(2, [*HEAD, 2], 2), 0.1)
    run_step(s, 0.1)
    assert set(admissions(s)) == {9, 1} and s.n_queued == 1
    assert s.preempt_one()  # the newest, 1, goes back to the queue (no RAM: recomputed)
    assert s.drain_events() == [Preempted(1)]
    # 1 keeps its place ahead of 2, runs again, and 2 waits for it again
    run_step(s, 0.2)
    assert admissions(s) == {1: 0} and s.n_queued == 1
    finish_all(s, 0.3)
    assert admissions(s) == {2: len(HEAD)}


def test_the_batch_is_in_slot_order_whatever_the_admission_order() -> None:
    # llama.cpp runs one micro-batch per run of consecutive sequence ids in batch order,
    # so a batch out of slot order costs a pass over the weights per sequence.
    s = Scheduler(limits(max_running=3, slots=3))
    for rid in (1, 2):
        s.submit(*req(rid, n=8, max_tokens=1, start=100 * rid), 0.0)
    run_step(s, 0.0)  # 1 and 2 finish in slots 0 and 1, and keep their caches
    s.submit(*req(3, n=8, max_tokens=50, start=300), 1.0)  # the empty slot 2
    run_step(s, 1.0)
    s.submit(*req(4, n=12, max_tokens=50, start=200), 2.0)  # extends slot 1's cache
    run_step(s, 2.0)
    s.submit(*req(5, n=12, max_tokens=50, start=100), 3.0)  # extends slot 0's cache
    plan = run_step(s, 3.0)
    assert plan is not None
    assert [c.rid for c in plan.chunks] == [5, 4, 3]
    assert [c.seq for c in plan.chunks] == [0, 1, 2]


def test_the_cost_model_takes_a_tiled_chunk_where_a_shorter_one_costs_more() -> None:
    cost = CostModel(flash_attn=True)
    # Far into a context one-query-at-a-time attention (the short chunk's) dominates.
    assert cost.predict_extra(cost.chunk(1000, TILE_ROWS + 1)) < cost.predict_extra(
        cost.chunk(1000, TILE_ROWS))
    take = cost.max_prompt_tokens(1000, 300.0, 500)
    assert take > TILE_ROWS and cost.predict_extra(cost.chunk(1000, take)) <= 300.0
    assert cost.predict_extra(cost.chunk(1000, take + 1)) > 300.0
    # Near the start the two paths cost about the same, and the search is plain.
    assert cost.max_prompt_tokens(0, 30.0, 500) == 8  # 27 ms; 9 tokens would take 30.5
    # In the unified layout a step's rows share one stream, tiled together: chunks are
    # priced as matrices whatever their length.
    assert CostModel(flash_attn=True, per_slot=False).chunk(1000, 16).tiled_kpairs > 0
    # Without flash attention every chunk of two tokens or more is a matrix product.
    assert CostModel().chunk(1000, 16).tiled_kpairs > 0 == CostModel().chunk(1000, 1).tiled_kpairs


def test_a_floor_chunk_far_into_a_context_is_long_enough_for_tiled_attention() -> None:
    s, cost = costed(per_slot_cells=2048, max_context=2048, flash_attn=True)
    s.submit(*req(1, n=1000, max_tokens=1), 0.0)  # leaves its slot 1,000 cached tokens
    finish_all(s, 0.0)
    decoding(s, 15)  # 15 short streams: the step's room fits neither path's chunk at 1,000
    s.submit(*req(2, n=1300, max_tokens=5), 1.0)  # continues that cache
    plan = s.plan(1.0)
    assert plan is not None
    chunk = next(c for c in plan.chunks if c.rid == 2)
    assert chunk.pos == 1000 and len(chunk.tokens) == TILE_ROWS + 1
    # near the start, the floor stays MIN_PREFILL_TOKENS (test above): a tiled chunk
    # there costs four times as much for about the same price per token
    per_token = [cost.predict_extra(cost.chunk(0, n)) / n
                 for n in (MIN_PREFILL_TOKENS, TILE_ROWS + 1)]
    assert per_token[1] > per_token[0] / TILED_FLOOR_GAIN


# --- a step budget that follows the work (engine.first_token_weight, issue 34) ---------


def _prefill_steps(s: Scheduler, cost: CostModel, rid: int) -> list[tuple[float, int]]:
    """The predicted duration and the prompt tokens of each step that carries ``rid``'s
    prompt, to its end."""
    out = []
    for _ in range(400):
        plan = run_step(s, 1.0)
        assert plan is not None
        mine = [c for c in plan.chunks if c.rid == rid]
        if mine:
            out.append((cost.predict(plan.shape), len(mine[0].tokens)))
        if any(c.sample for c in mine):
            return out
    raise AssertionError("the prompt never finished")


def _floor_step_ms(cost: CostModel, decoders: int, pos: int) -> float:
    """A step of ``decoders`` streams and the least prompt chunk the head always takes."""
    return cost.predict(decode_shape([0] * decoders).plus(cost.chunk(pos, MIN_PREFILL_TOKENS)))


def test_one_long_prompt_beside_many_streams_lengthens_their_gaps_a_little() -> None:
    """A 600-token prompt (about 1.8 s of work in the seed model) beside 8 streams: with
    every step run to the 1,000 ms ceiling it makes two or three gaps of up to a second; with the
    budget following the work (one waiting, eight decoding) each gap grows only by the
    least chunk a prompt always gets, until the step in which it can finish."""
    steps = {}
    for weight in (math.inf, 1.0):
        s, cost = costed(target_step_ms=1000, first_token_weight=weight)
        decoding(s, 8)
        s.submit(*req(1, n=600, max_tokens=5), 1.0)
        steps[weight] = _prefill_steps(s, cost, 1)
    assert len(steps[math.inf]) <= 3 and steps[math.inf][0][0] > 950
    *before_last, last = steps[1.0]
    assert len(before_last) >= 10
    for ms, tokens in before_last:
        assert tokens >= MIN_PREFILL_TOKENS  # the prompt moves every step
        assert ms <= _floor_step_ms(cost, 8, 600) + 1e-6  # and the gaps stay short
    assert last[0] <= 1000 + 1e-6  # the step in which it can finish takes the ceiling


def test_a_prompt_that_can_finish_within_the_ceiling_takes_one_step() -> None:
    s, cost = costed(target_step_ms=1000, first_token_weight=1.0)
    decoding(s, 8)
    s.submit(*req(1, n=60, max_tokens=5), 1.0)  # ~190 ms of work: the ceiling holds it
    assert len(_prefill_steps(s, cost, 1)) == 1


def test_without_streams_a_prompt_takes_the_ceiling() -> None:
    s, cost = costed(target_step_ms=400, first_token_weight=1.0)
    s.submit(*req(1, n=600, max_tokens=5), 1.0)
    first, *_ = _prefill_steps(s, cost, 1)
    assert first[0] > 350  # nobody pays for the gap


def test_a_backlog_grows_the_budget_to_the_ceiling_and_never_past_it() -> None:
    """The room is the decoders' cost x weight x waiting / decoding: one waiting prompt
    gets the floor, forty (eight prefilling, thirty-two queued) the 400 ms ceiling."""
    predicted: dict[int, list[float]] = {}
    for waiting in (1, 40):
        s, cost = costed(target_step_ms=400, first_token_weight=4.0)
        decoding(s, 8)
        for rid in range(1, waiting + 1):  # 200 tokens each: ~600 ms, none can finish
            s.submit(*req(rid, n=200, max_tokens=5, start=1000 * rid), 1.0)
        predicted[waiting] = []
        for _ in range(5):
            plan = run_step(s, 1.0)
            assert plan is not None
            predicted[waiting].append(cost.predict(plan.shape))
    decode = cost.predict(decode_shape([0] * 8))
    assert max(predicted[1]) <= max(_floor_step_ms(cost, 8, 200), decode * (1 + 4)) + 1e-6
    assert max(predicted[40]) <= 400 + 1e-6  # the target stays the ceiling
    assert min(predicted[40]) > 350  # and the backlog fills it


@pytest.mark.parametrize(("weight", "waiting"), [(1.0, 30), (4.0, 6), (4.0, 40)])
def test_the_estimate_stays_within_the_chosen_budget(weight: float, waiting: int) -> None:
    """The cost model's estimate of a step is within the budget chosen for it: the
    decoders' own cost plus the room, which is that cost x weight x waiting / decoding
    up to the ceiling."""
    s, cost = costed(target_step_ms=400, first_token_weight=weight)
    decoding(s, 4)
    for rid in range(1, waiting + 1):  # 900 tokens each: none can finish in a step
        s.submit(*req(rid, n=900, max_tokens=5, start=1000 * rid), 1.0)
    room = s.statistics().step_prompt_room_ms
    plan = s.plan(1.0)
    assert plan is not None
    decode = cost.predict(decoders_shape(s.limits, [c for c in plan.chunks if c.rid >= 100]))
    assert room == pytest.approx(min(400 - decode, decode * weight * waiting / 4))
    assert decode + MIN_PREFILL_TOKENS * 3 < cost.predict(plan.shape) <= decode + room + 1e-6


# --- micro-batches: llama.cpp's split of a per-slot batch ------------------------------


@pytest.mark.parametrize(("runs", "n_ubatch", "passes"), [
    ([(s, 1) for s in range(16)], 256, 1),  # decoders in consecutive slots: one pass
    ([(s, 1) for s in (0, 1, 2, 5, 6, 7)], 256, 2),  # a gap in the slots: two
    ([(s, 1) for s in (0, 2, 4, 6)], 256, 4),  # scattered: one pass each
    # a chunk among decoders lends its first row to their pass, then runs alone
    ([*((s, 1) for s in range(16) if s != 5), (5, 30)], 256, 2),
    # two chunks of one length next to each other share their passes
    ([(0, 1), (1, 1), (2, 1), (3, 30), (4, 30), (5, 1)], 256, 2),
    # of two lengths: one more pass for the longer one's rest
    ([(0, 1), (1, 1), (2, 1), (3, 30), (4, 10), (5, 1)], 256, 3),
    # a spent sequence between two with rows left breaks the run
    ([(3, 30), (4, 1), (5, 30)], 256, 3),
    ([(3, 300)], 256, 2),  # longer than a micro-batch
    ([(s, 20) for s in range(16)], 256, 2),  # 16 rows each fill one; 4 each are left
])
def test_micro_batches_follow_llama_cpps_split(runs: list[tuple[int, int]], n_ubatch: int,
                                               passes: int) -> None:
    assert micro_batches(runs, n_ubatch) == passes


def test_a_step_prices_its_extra_passes() -> None:
    """Two requests in slots 0 and 2 (slot 1 held by a pinned session) decode in two
    passes: the step's shape counts one extra, which the cost model prices."""
    s = Scheduler(per_slot(slots=4, max_running=4))
    s.submit(*seq(1, list(range(100, 120)), 50), 0.0)
    s.submit(*seq(2, list(range(200, 220)), 2, session="x"), 0.0)
    s.submit(*seq(3, list(range(300, 320)), 50), 0.0)
    while (s.sequence((2, 0)) is not None or s.n_queued) and run_step(s, 0.0):
        pass
    slots = {s.sequence((rid, 0)).slot for rid in (1, 3)}  # type: ignore[union-attr]
    assert slots == {0, 2}
    before = s.statistics().micro_batches
    plan = s.plan(0.0)
    assert plan is not None and len(plan.chunks) == 2
    assert plan.shape.chunks == 1  # one extra pass
    assert s.statistics().micro_batches == before + 2


def test_a_new_request_takes_an_idle_slot_beside_the_running_ones() -> None:
    """With no cache to reuse, a new request takes the idle slot next to a running one
    rather than the least recently used elsewhere, so the decoders stay in one pass."""
    s = Scheduler(per_slot(slots=4, max_running=4))
    prompts = [list(range(100 * (k + 1), 100 * (k + 1) + 20)) for k in range(4)]
    for rid, p in enumerate(prompts):  # slots 0-3 each cache one prompt
        s.submit(*seq(rid + 1, p, 2), float(rid))
        finish_all(s, float(rid))
    # used again in this order: slot 1 is then the least recent, then 3, 2 and 0
    for rid, k in enumerate((1, 3, 2, 0), start=10):
        s.submit(*seq(rid, prompts[k], 2), 10.0 + rid)
        finish_all(s, 10.0 + rid)
    s.submit(*seq(20, list(range(5000, 5020)), 50), 30.0)
    run_step(s, 30.0)
    assert s.sequence((20, 0)).slot == 1  # type: ignore[union-attr]  # all alone: LRU
    s.submit(*seq(21, list(range(6000, 6020)), 50), 30.0)
    run_step(s, 30.0)
    # the least recent left is slot 3, away from slot 1; slot 2 is beside it
    assert s.sequence((21, 0)).slot == 2  # type: ignore[union-attr]
    plan = s.plan(30.0)
    assert plan is not None and plan.shape.chunks == 0
