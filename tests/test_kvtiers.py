"""KV tiers without a process: the scheduler's RAM and disk index, the core that moves
the bytes (a fake backend whose "state" is its sequence's length), and the disk store
on a real folder. The real llama.cpp states are checked end to end in
test_kvtiers_daemon.py."""

from __future__ import annotations

import errno
import random
import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest

from forged.engine import kvdisk, kvtiers
from forged.engine.core import WorkerCore
from forged.engine.costmodel import CostModel
from forged.engine.events import Admitted, Delta, Done, Event
from forged.engine.kvdisk import MAGIC, DiskStore
from forged.engine.kvtiers import MIN_SAVED_TOKENS, Drop, Entry, Tier, Tiers, common_prefix
from forged.engine.plan import SeqLoad, SeqRm, SeqSave
from forged.engine.stats import WorkerStats
from tests.test_core import EOS, Clock, FakeBackend, assert_nothing_left, of, run, submit
from tests.test_scheduler import limits

LONG = MIN_SAVED_TOKENS + 8


def prompt(head: int, n: int = LONG, tail: tuple[int, ...] = ()) -> list[int]:
    """A prompt whose first token names its script (see FakeBackend)."""
    return [head, *range(100, 100 + n - 1), *tail]


def tiered(scripts: dict[int, list[int]], disk: DiskStore | None = None,
           saved: list[Entry] | None = None, **kw: float) -> tuple[WorkerCore, FakeBackend]:
    backend = FakeBackend(scripts)
    lim = limits(**{"slots": 1, "max_running": 1, "cache_ram_bytes": 1 << 20,
                    "cache_disk_bytes": 1 << 20, **kw})
    core = WorkerCore(backend, lim, CostModel(), clock=Clock(), disk=disk, saved=saved or [])
    return core, backend


def done(events: list[Event], rid: int) -> Done:
    last = of(events, rid)[-1]
    assert isinstance(last, Done), last
    return last


def text(events: list[Event], rid: int) -> str:
    return "".join(e.text for e in of(events, rid) if isinstance(e, Delta | Done))


def test_an_evicted_slot_is_saved_to_ram_and_restored_by_prefix() -> None:
    core, backend = tiered({5: [1, 2, EOS], 6: [3, EOS], 7: [4, EOS]})
    submit(core, 1, prompt(5))
    run(core)
    submit(core, 2, prompt(6))  # takes the only slot: the first prompt's state is saved
    run(core)
    assert core.statistics().kv_ram_entries == 1 and len(core.ram) == 1
    # A prompt that starts with the first one (and its answer) restores it.
    submit(core, 3, prompt(5, tail=(1, 2, 9)))
    events = run(core)
    admitted = of(events, 3)[0]
    assert isinstance(admitted, Admitted) and admitted.cached == LONG + 2
    assert done(events, 3).cached_tokens == LONG + 2
    stats = core.statistics()
    assert stats.kv_ram_restores == 1 and stats.kv_restored_tokens == LONG + 2
    # Only the new token was computed after the restore.
    assert backend.batches[-2] == [(0, 1)]
    assert_nothing_left(core, backend)


def test_a_saved_state_is_never_restored_for_another_tenant() -> None:
    core, _ = tiered({5: [1, EOS], 6: [3, EOS]})
    submit(core, 1, prompt(5), tenant="a")
    run(core)
    submit(core, 2, prompt(6), tenant="a")
    run(core)
    submit(core, 3, prompt(5, tail=(1, 9)), tenant="b")
    events = run(core)
    assert done(events, 3).cached_tokens == 0
    assert core.statistics().kv_ram_restores == 0


def test_a_short_state_and_cache_prompt_false_are_not_saved() -> None:
    core, _ = tiered({5: [1, EOS], 6: [3, EOS]})
    submit(core, 1, [5, 6, 7])
    run(core)
    submit(core, 2, prompt(6), cache=False)
    run(core)
    submit(core, 3, prompt(5))
    run(core)  # evicts nothing worth saving, and the second left nothing behind
    assert core.statistics().kv_saves == 0


def test_ram_and_disk_budgets_hold_under_churn(tmp_path: Path) -> None:
    """Forty requests of ten prompts and four sessions over two slots: RAM holds at
    most three states (four bytes each here), disk what 600 bytes hold (a file has its
    header too); the bytes the core and the disk
    store keep are exactly what the index lists, at every step."""
    disk = DiskStore(tmp_path, "model")
    core, backend = tiered({h: [1, 2, EOS] for h in range(10, 20)}, disk=disk,
                           slots=2, max_running=2, cache_ram_bytes=12, cache_disk_bytes=600)
    rng = random.Random(7)
    for rid in range(1, 41):
        head = rng.randrange(10, 20)
        session = f"s{head % 4}" if head < 14 else None
        submit(core, rid, prompt(head, LONG + rng.randrange(8)), session=session)
        for _ in range(rng.randrange(1, 6)):
            core.step(0.0)
            disk.wait_writes()  # the writer thread's: then the files are all there
            core.account_disk()
            tiers = core.sched.cache.tiers
            assert tiers.used(Tier.RAM) <= 12 and tiers.used(Tier.DISK) <= 600
            assert set(core.ram) == {e.eid for e in tiers.entries(Tier.RAM)}
            files = {p.stem for p in tmp_path.glob("*.kv")}
            assert files == {e.key for e in tiers.entries(Tier.DISK)}
        core.frame(0.0)
    run(core, 400)
    stats = core.statistics()
    assert stats.kv_saves > 10 and stats.kv_demotions > 0 and stats.kv_drops > 0
    assert_nothing_left(core, backend)


def test_interactive_work_swaps_batch_work_out_and_it_resumes_the_same() -> None:
    """One slot, a batch request decoding; an interactive one arrives. The batch one is
    swapped out to RAM, the interactive one runs, and the batch one resumes from its
    saved state (only its last token computed) with the answer it would have given."""
    script = [1, 2, 3, 4, 5, 6, 7, 8, EOS]
    alone, _ = tiered({5: script})
    submit(alone, 1, prompt(5), max_tokens=20, priority="batch")
    expected = text(run(alone), 1)

    core, backend = tiered({5: script, 6: [9, EOS]})
    submit(core, 1, prompt(5), max_tokens=20, priority="batch")
    events: list[Event] = []
    for _ in range(3):  # the batch request is decoding
        core.step(0.0)
    submit(core, 2, prompt(6), max_tokens=5)
    core.step(0.0)
    frame = core.frame(0.0)
    events += frame.events if frame is not None else []
    assert core.statistics().kv_swaps == 1
    assert core.sched.is_running(2) and not core.sched.is_running(1)
    events += run(core)
    assert text(events, 1) == expected and text(events, 2) == "i"
    assert core.statistics().kv_ram_restores == 1
    # Resumed: one token computed (the last one sampled), not the whole history again.
    assert core.sched.prompt_tokens_computed == 2 * LONG + 1
    assert_nothing_left(core, backend)


def test_no_swap_without_a_ram_tier_or_for_batch_work() -> None:
    core, _ = tiered({5: [1] * 8 + [EOS], 6: [2, EOS]}, cache_ram_bytes=0)
    submit(core, 1, prompt(5), max_tokens=20, priority="batch")
    core.step(0.0)
    submit(core, 2, prompt(6))
    core.step(0.0)
    assert core.sched.is_running(1) and not core.sched.is_running(2)
    core, _ = tiered({5: [1] * 8 + [EOS], 6: [2, EOS]})
    submit(core, 1, prompt(5), max_tokens=20, priority="batch")
    core.step(0.0)
    submit(core, 2, prompt(6), priority="batch")
    core.step(0.0)
    assert core.sched.is_running(1) and core.statistics().kv_swaps == 0


class RefusingBackend(FakeBackend):
    def seq_load(self, seq: int, state: bytes, n_tokens: int) -> bool:
        self.lengths[seq] = 0
        return False


def test_a_refused_restore_computes_the_prompt_and_reports_no_cache() -> None:
    backend = RefusingBackend({5: [1, EOS], 6: [3, EOS]})
    lim = limits(slots=1, max_running=1, cache_ram_bytes=1 << 20)
    core = WorkerCore(backend, lim, CostModel(), clock=Clock())
    submit(core, 1, prompt(5))
    run(core)
    submit(core, 2, prompt(6))
    run(core)
    submit(core, 3, prompt(5, tail=(1, 9)))
    events = run(core)
    admitted = of(events, 3)[0]
    assert isinstance(admitted, Admitted) and admitted.cached == 0
    assert done(events, 3).cached_tokens == 0 and text(events, 3) == "a"
    assert core.statistics().kv_restore_failures == 1
    assert_nothing_left(core, backend)


def test_a_refused_restore_of_a_kept_entry_is_not_tried_again() -> None:
    """A prompt sharing only the head of a long saved state restores it and keeps it
    saved (its tail serves others). If llama.cpp refuses it, it is gone: every later
    match would pay the refusal again."""
    backend = RefusingBackend({5: [1, EOS], 6: [3, EOS]})
    lim = limits(slots=1, max_running=1, cache_ram_bytes=1 << 20)
    core = WorkerCore(backend, lim, CostModel(), clock=Clock())
    submit(core, 1, prompt(5, 2 * LONG))
    run(core)
    submit(core, 2, prompt(6))
    run(core)
    submit(core, 3, prompt(5, LONG, tail=(9,)))  # shares LONG tokens of 2 * LONG + 1
    events = run(core)
    assert done(events, 3).cached_tokens == 0 and text(events, 3) == "a"
    assert core.statistics().kv_restore_failures == 1
    tiers = core.sched.cache.tiers
    assert [len(e.tokens) for e in tiers.entries(Tier.RAM)] == [LONG + 1]  # the second's
    assert set(core.ram) == {e.eid for e in tiers.entries(Tier.RAM)}
    assert_nothing_left(core, backend)


# --- disk -----------------------------------------------------------------------------


def test_sessions_persist_to_disk_and_a_new_core_restores_them(tmp_path: Path) -> None:
    core, _ = tiered({5: [1, 2, EOS], 6: [3, EOS]}, disk=DiskStore(tmp_path, "m"))
    submit(core, 1, prompt(5), session="chat")
    run(core)
    submit(core, 2, prompt(6), tenant="t")  # no session: not persisted
    run(core)
    core.persist()  # the worker stops
    assert len(list(tmp_path.glob("*.kv"))) == 1

    store = DiskStore(tmp_path, "m")
    found = store.scan()
    assert [(e.session, e.tokens) for e in found] == [("chat", [*prompt(5), 1, 2])]
    core, _ = tiered({5: [1, 2, EOS]}, disk=store, saved=found)
    submit(core, 3, prompt(5, tail=(1, 2, 9)), session="chat")
    events = run(core)
    assert done(events, 3).cached_tokens == LONG + 2
    assert core.statistics().kv_disk_restores == 1
    assert core.sched.session_resumes == 1
    assert not list(tmp_path.glob("*.kv"))  # the slot holds it now


class RecordedWrites(DiskStore):
    def __init__(self, root: Path) -> None:
        super().__init__(root, "m")
        self.sessions: list[str | None] = []

    def write(self, entry: Entry, state: bytearray) -> tuple[str, int] | None:
        self.sessions.append(entry.session)
        return super().write(entry, state)


def test_a_stop_writes_the_newest_sessions_first_and_the_next_start_keeps_their_order(
        tmp_path: Path) -> None:
    """A stop has a grace: what it cuts short must be the oldest conversations. The
    files' times are then set in the order of use, which the next start reads back."""
    disk = RecordedWrites(tmp_path)
    core, _ = tiered({h: [1, EOS] for h in (5, 6, 7)}, disk=disk)
    for rid, head in enumerate((5, 6, 7), 1):  # one slot: each evicts the one before
        submit(core, rid, prompt(head), session=f"s{head}")
        run(core)
    core.persist()
    assert disk.sessions == ["s7", "s6", "s5"]
    found = DiskStore(tmp_path, "m").scan()
    assert [e.session for e in found] == ["s5", "s6", "s7"]  # least recently used first


def test_a_stop_writes_no_file_for_a_session_the_budget_dropped_first(
        tmp_path: Path) -> None:
    """Written newest first, each file's real size (its header too) refits the disk
    budget: an older session not written yet can be dropped then. Its write came after
    all the same: a file no index held, and a stop's grace spent on it."""
    def stopped(folder: Path, disk_bytes: int) -> set[str]:
        disk = RecordedWrites(folder)
        core, _ = tiered({h: [1, EOS] for h in (5, 6, 7)}, disk=disk,
                         cache_disk_bytes=disk_bytes)
        for rid, head in enumerate((5, 6, 7), 1):
            submit(core, rid, prompt(head), session=f"s{head}")
            run(core)
        core.persist()
        files = {p.stem for p in folder.glob("*.kv")}
        assert files == {e.key for e in core.sched.cache.tiers.entries(Tier.DISK)}
        return files

    (tmp_path / "a").mkdir()
    one = max(p.stat().st_size for p in (tmp_path / "a").glob("*.kv")) \
        if stopped(tmp_path / "a", 1 << 20) else 0
    (tmp_path / "b").mkdir()
    assert len(stopped(tmp_path / "b", one + one // 2)) == 1  # the newest alone


class GatedStore(DiskStore):
    """A disk whose writes wait for the test to open the gate (at most 5 s, then the
    write fails the test where it waited)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, "m")
        self.gate = threading.Event()

    def _write_file(self, entry: Entry, state: bytearray) -> tuple[str, int] | None:
        assert self.gate.wait(5), "a step waited on the disk"
        return super()._write_file(entry, state)


def test_a_step_never_waits_on_a_disk_write(tmp_path: Path) -> None:
    """A session's state evicted to disk is written beside the decode loop: steps go on
    while the disk is stuck, the session's next turn is restored from the bytes still
    in memory, and the file written late for it is removed (the slot holds it). The
    write (and its fsync) ran inside the step."""
    store = GatedStore(tmp_path)
    core, backend = tiered({5: [1, 2, EOS], 6: [3, EOS]}, disk=store, cache_ram_bytes=1)
    submit(core, 1, prompt(5), session="chat")
    run(core)
    submit(core, 2, prompt(6))  # takes the one slot: the session's state is saved, and
    run(core)                   # RAM (1 byte) sends it to disk
    assert core.writing and not list(tmp_path.glob("*.kv"))  # handed over, not written
    submit(core, 3, prompt(5, tail=(1, 2, 9)), session="chat")
    events = run(core)
    assert done(events, 3).cached_tokens == LONG + 2
    store.gate.set()
    store.wait_writes()
    core.account_disk()
    assert not core.writing and not list(tmp_path.glob("*.kv"))
    assert_nothing_left(core, backend)


def test_a_disk_gone_read_only_costs_the_disk_tier_never_the_worker(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system remounted read-only (a disk's errors) fails every write and every
    delete, even of a missing file (EROFS): each is logged, the states are lost, and
    the worker goes on, starts and stops. (A failed write's cleanup raised: the I/O
    thread died, the evicted state it held stayed in memory forever, and a start that
    found a leftover temporary file, or a stop that saved the sessions, crashed the
    worker.)"""
    (tmp_path / "left.tmp").write_bytes(b"x")  # a write a crash cut short
    real_open = open

    def read_only_open(file: Path, mode: str = "r", *args: Any, **kw: Any) -> Any:
        if "w" in mode:
            raise OSError(errno.EROFS, "Read-only file system", str(file))
        return real_open(file, mode, *args, **kw)

    def read_only_unlink(self: Path, missing_ok: bool = False) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(kvdisk, "open", read_only_open, raising=False)
    monkeypatch.setattr(Path, "unlink", read_only_unlink)
    store = DiskStore(tmp_path, "m")
    assert store.scan() == []
    core, backend = tiered({5: [1, 2, EOS], 6: [3, EOS]}, disk=store, cache_ram_bytes=1)
    submit(core, 1, prompt(5), session="chat")
    run(core)
    submit(core, 2, prompt(6))  # takes the one slot: the session's state goes to disk
    run(core)
    store.wait_writes()
    core.account_disk()
    assert not core.writing  # the write failed and ended: nothing held for it
    submit(core, 3, prompt(5, tail=(1, 2, 9)), session="chat")
    assert text(run(core), 3)  # computed from its prompt
    core.persist()  # the worker stops: the session's state cannot be kept
    assert_nothing_left(core, backend)
    assert [p.name for p in tmp_path.iterdir()] == ["left.tmp"]


class GatedReads(DiskStore):
    """A disk whose reads wait for the test to open the gate (at most 5 s, then the
    read fails the test where it waited)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, "m")
        self.gate = threading.Event()

    def read(self, entry: Entry) -> bytearray | None:
        assert self.gate.wait(5), "a step waited on the disk"
        return super().read(entry)


def test_a_restore_from_disk_is_read_beside_the_decode_loop(tmp_path: Path) -> None:
    """A session's turn whose state is on disk waits in the queue while its file is
    read (and its hash checked) in the I/O thread; the other streams' steps go on
    meanwhile. The read (and its SHA-256) ran inside the step."""
    core, _ = tiered({5: [1, 2, EOS]}, disk=DiskStore(tmp_path, "m"))
    submit(core, 1, prompt(5), session="chat")
    run(core)
    core.persist()
    store = GatedReads(tmp_path)
    core, backend = tiered({5: [1, 2, EOS], 6: [3] * 12 + [EOS]}, disk=store,
                           saved=store.scan(), slots=2, max_running=2)
    submit(core, 2, prompt(6), max_tokens=20)
    submit(core, 3, prompt(5, tail=(1, 2, 9)), session="chat")
    events: list[Event] = []
    for _ in range(6):  # the gate is shut: rid 2 decodes, rid 3 waits for its state
        core.step(0.0)
        frame = core.frame(0.0)
        events += frame.events if frame is not None else []
    assert of(events, 2) and not of(events, 3)
    store.gate.set()
    events += run(core)
    assert done(events, 3).cached_tokens == LONG + 2
    assert core.statistics().kv_disk_restores == 1
    assert not core.staged and not list(tmp_path.glob("*.kv"))
    assert_nothing_left(core, backend)


@pytest.mark.parametrize("damage", ["garbage", "flipped", "model", "truncated"])
def test_a_corrupt_or_stale_file_is_dropped_and_never_restored(tmp_path: Path,
                                                               damage: str) -> None:
    store = DiskStore(tmp_path, "m")
    entry = Entry(1, [5, 6, 7], "", "chat", Tier.DISK)
    written = store.write(entry, bytearray(b"state-bytes" * 10))
    assert written is not None
    path = tmp_path / (written[0] + ".kv")
    data = path.read_bytes()
    if damage == "garbage":
        path.write_bytes(b"\0" * 64)
    elif damage == "flipped":
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif damage == "truncated":
        path.write_bytes(data[:-5])
    found = DiskStore(tmp_path, "other-model" if damage == "model" else "m").scan()
    if damage in ("garbage", "model"):
        assert found == [] and not path.exists()  # dropped when indexed
        return
    # The header is intact, so the file is indexed; its state is checked on restore.
    assert [e.tokens for e in found] == [[5, 6, 7]]
    assert DiskStore(tmp_path, "m").read(found[0]) is None
    assert not path.exists()


def test_a_header_claiming_a_huge_state_is_refused_without_allocating_it(
        tmp_path: Path) -> None:
    header = msgspec.msgpack.encode({"model": "m", "tenant": "", "session": "chat",
                                     "tokens": [5, 6, 7], "nbytes": 1 << 62, "sha256": ""})
    path = tmp_path / "huge.kv"
    path.write_bytes(MAGIC + len(header).to_bytes(4, "little") + header + b"x" * 40)
    (found,) = DiskStore(tmp_path, "m").scan()
    assert DiskStore(tmp_path, "m").read(found) is None and not path.exists()


def test_a_file_whose_tokens_differ_from_the_index_is_refused(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, "m")
    entry = Entry(1, [5, 6, 7], "", "chat", Tier.DISK)
    written = store.write(entry, bytearray(b"x" * 40))
    assert written is not None
    assert store.read(Entry(2, [5, 6, 8], "", "chat", Tier.DISK, key=written[0])) is None


def test_an_index_that_supersedes_prefixes_keeps_one_entry_per_conversation() -> None:
    tiers = Tiers(ram_bytes=1 << 20)
    first, _ = tiers.save([1] * 40, "", "chat")
    tiers.sized(first.eid, 10)
    second, dropped = tiers.save([1] * 40 + [2] * 5, "", "chat")
    assert [d.entry.eid for d in dropped] == [first.eid]
    other, dropped = tiers.save([1] * 40, "b", None)  # another tenant: kept apart
    assert dropped == [] and len(tiers.entries(Tier.RAM)) == 2
    assert tiers.longest("", [1] * 40 + [2] * 5 + [3], 45) == (second, 45)
    assert tiers.longest("b", [1] * 40 + [2], 40) == (other, 40)


def test_one_tenant_s_flood_evicts_its_own_entries_before_another_tenant_s() -> None:
    """Tenants share a tier fairly: "a" saves many states, "b" one, older than all of
    them. Over the budget, "a" (which holds the most) loses its least recent entries,
    and "b"'s stays. With one plain LRU, "b"'s, the oldest, went first."""
    tiers = Tiers(ram_bytes=100)
    b, _ = tiers.save([7] * 40, "b", None)
    assert tiers.sized(b.eid, 20) == []
    kept_a = []
    for i in range(10):
        a, _ = tiers.save([i] * 40, "a", None)
        ops = tiers.sized(a.eid, 20)
        assert all(op.entry.tenant == "a" for op in ops), ops
        kept_a.append(a)
    assert b in tiers.entries(Tier.RAM)
    assert tiers.used(Tier.RAM) <= 100
    assert [e.eid for e in tiers.entries(Tier.RAM) if e.tenant == "a"] == \
        [e.eid for e in kept_a[-4:]]  # "a"'s most recent, within what is left


def test_memory_ops_save_before_they_free_and_restore_before_truncating() -> None:
    core, _ = tiered({5: [1, EOS], 6: [2, EOS]})
    submit(core, 1, prompt(5))
    run(core)
    sched = core.sched
    submit(core, 2, prompt(6))
    plan = sched.plan(1.0)  # the second evicts the first's slot
    assert plan is not None and [type(op) for op in plan.ops] == [SeqSave, SeqRm]
    core.apply_memory_ops(plan.ops)
    sched.drop(2)  # it computed nothing: its slot is empty again
    submit(core, 3, prompt(5, tail=(9,)))  # shares the prompt, not the answer
    plan = sched.plan(2.0)
    assert plan is not None
    # the state is loaded whole, then cut to the shared prefix, before the decode
    assert [type(op) for op in plan.ops] == [SeqLoad, SeqRm]
    last = plan.ops[-1]
    assert isinstance(last, SeqRm) and last.p0 == LONG
    assert plan.chunks[0].pos == LONG


def test_a_save_whose_entry_a_fit_chose_before_its_bytes_came_keeps_nothing() -> None:
    """In one plan: "y"'s state B is to be saved, "y"'s older C is restored and kept
    (so B is now "y"'s least recently used), and "x"'s A is saved. A's bytes push RAM
    past its budget; the fit takes "y"'s oldest, B, whose bytes have not come yet. B's
    save that follows must not keep bytes nobody accounts or ever frees."""
    core, _ = tiered({}, cache_ram_bytes=6, cache_disk_bytes=0)
    tiers = core.sched.cache.tiers
    c, _ = tiers.save([1] * LONG, "y", None)
    core.apply_memory_ops([SeqSave(0, c.eid)])
    b, _ = tiers.save([2] * LONG, "y", None)
    tiers.take(c, keep=True)
    a, _ = tiers.save([3] * LONG, "x", None)
    core.apply_memory_ops([SeqSave(1, a.eid), SeqSave(2, b.eid)])
    assert set(core.ram) == {e.eid for e in tiers.entries(Tier.RAM)}
    assert tiers.used(Tier.RAM) == sum(len(s) for s in core.ram.values()) <= 6


def _brute_longest(tiers: Tiers, tenant: str, prompt: list[int], limit: int) -> int:
    return max((min(common_prefix(e.tokens, prompt), limit) for t in Tier
                for e in tiers.entries(t) if e.tenant == tenant), default=0)


def test_the_prefix_index_matches_what_comparing_every_entry_finds() -> None:
    """Random saves, restores, losses, drops and demotions over a small alphabet (so prompts
    share prefixes of every length, and tie): the index's match is as long as the
    best of all the tenant's entries, in RAM whenever one in RAM is as long, and a
    save drops exactly the entries it extends and those of its session."""
    rng = random.Random(5)
    tiers = Tiers(ram_bytes=40 * 30, disk_bytes=1 << 30)

    def tokens() -> list[int]:
        return [rng.randrange(3) for _ in range(rng.randint(MIN_SAVED_TOKENS, 44))]

    for _ in range(600):
        tenant, session = rng.choice("ab"), rng.choice([None, "s1", "s2"])
        new = tokens() if rng.random() < 0.7 else (
            tokens()[:4] + [1] * MIN_SAVED_TOKENS)
        before = [e for t in Tier for e in tiers.entries(t)]
        want = {e.eid for e in before if e.tenant == tenant and (
            common_prefix(e.tokens, new) == len(e.tokens)
            or (session is not None and e.session == session))}
        entry, ops = tiers.save(new, tenant, session)
        assert {op.entry.eid for op in ops if isinstance(op, Drop)} == want
        # Over budget: the biggest tenant's oldest go, sessions to disk, others drop.
        tiers.sized(entry.eid, rng.randint(10, 50))
        _assert_accounts(tiers)
        if rng.random() < 0.2 and (on_disk := tiers.entries(Tier.DISK)):
            tiers.resized(rng.choice(on_disk), rng.randint(10, 60), "file")  # a header
            _assert_accounts(tiers)
        prompt, limit = tokens(), rng.randint(1, 44)
        for who in "ab":
            found, n = tiers.longest(who, prompt, limit)
            assert n == _brute_longest(tiers, who, prompt, limit)
            if n:
                assert found is not None and found.tenant == who
                assert min(common_prefix(found.tokens, prompt), limit) == n
                in_ram = [e for e in tiers.entries(Tier.RAM) if e.tenant == who
                          and min(common_prefix(e.tokens, prompt), limit) == n]
                assert (found.tier is Tier.RAM) == bool(in_ram)
                if rng.random() < 0.3:
                    tiers.take(found, keep=rng.random() < 0.5)
                elif rng.random() < 0.1:
                    tiers.lost(found)  # a disk write or read failed
                _assert_accounts(tiers)
    indexed = sorted(eid for keys in tiers._index._sorted.values() for _, eid, _ in keys)
    assert indexed == sorted(e.eid for t in Tier for e in tiers.entries(t))


def _assert_accounts(tiers: Tiers) -> None:
    """Each tier's bytes are its entries' and within its budget; each tenant's order
    is the tier's least-recently-used order, and its bytes are its entries'."""
    for tier, budget in ((Tier.RAM, tiers.ram_bytes), (Tier.DISK, tiers.disk_bytes)):
        entries = tiers.entries(tier)
        assert tiers.used(tier) == sum(e.nbytes for e in entries) <= budget
        for tenant in {e.tenant for e in entries} | set(tiers._held[tier]):
            mine = [e.eid for e in entries if e.tenant == tenant]
            assert list(tiers._held[tier][tenant]) == mine
            assert tiers._bytes[tier][tenant] == sum(
                e.nbytes for e in entries if e.tenant == tenant)


class _CountedSize(Entry):
    """An entry that counts how often its size is read."""

    reads = 0

    def __getattribute__(self, name: str) -> object:
        if name == "nbytes":
            _CountedSize.reads += 1
        return super().__getattribute__(name)


def test_an_eviction_and_the_statistics_never_visit_every_saved_state() -> None:
    """A full tier's fit summed every entry's bytes, then scanned them all for its
    victim, once for each state it evicted; the statistics summed them with every
    frame (3,000 states: 0.9 ms a save that evicts, 0.2 ms a frame, the worker decoding
    nothing meanwhile). Now each reads the sizes of the entries it moves, not all."""
    tiers = Tiers(ram_bytes=0, disk_bytes=2000 * 100)
    found = [_CountedSize(0, [7, i], "", None, Tier.DISK, nbytes=100, key=f"k{i}")
             for i in range(2000)]
    assert tiers.adopt(found) == []
    _CountedSize.reads = 0
    tiers.report(WorkerStats())
    ops = tiers.resized(found[-1], 150, "k")  # a header: the oldest file goes
    assert [op.entry for op in ops if isinstance(op, Drop)] == [found[0]]
    assert _CountedSize.reads <= 8, _CountedSize.reads
    assert tiers.used(Tier.DISK) == 1999 * 100 + 50


def test_a_match_costs_the_same_beside_thousands_of_saved_states() -> None:
    """The default RAM tier holds about 1,800 states of SmolLM2, each beginning with
    the same chat template. A match compared the prompt with every one of them (about
    4 ms a match, twice a request, the worker decoding nothing meanwhile); with the
    index, a handful of compares whatever the count."""
    rng = random.Random(1)
    header = [rng.randrange(49152) for _ in range(40)]
    tiers = Tiers(ram_bytes=1 << 40)
    for _ in range(2000):
        tiers.save(header + [rng.randrange(49152) for _ in range(60)], "", None)
    calls = 0
    real = kvtiers.common_prefix

    def counted(a: list[int], b: list[int]) -> int:
        nonlocal calls
        calls += 1
        return real(a, b)

    kvtiers.common_prefix = counted  # type: ignore[assignment]
    try:
        prompt = header + [rng.randrange(49152) for _ in range(60)]
        found, n = tiers.longest("", prompt, len(prompt) - 1)
        assert found is not None and n >= len(header)
        tiers.save(prompt, "", None)
    finally:
        kvtiers.common_prefix = real  # type: ignore[assignment]
    assert calls <= 16, calls


def test_a_model_changed_only_in_its_middle_is_another_model(tmp_path: Path) -> None:
    """Saved states are valid for one model's weights. The identity read the file's
    size and its first and last MiB: a fine-tune of the same size that changed only
    middle layers (a merged adapter) was the same model, and its sessions resumed from
    the old weights' states."""
    rng = random.Random(3)
    body = bytearray(rng.randbytes(24 << 20))
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(body)
    for at in range(4 << 20, 20 << 20, 1 << 20):  # every MiB of the middle changed
        body[at:at + 4096] = rng.randbytes(4096)
    b.write_bytes(body)
    assert kvdisk.model_identity(str(a), "v") != kvdisk.model_identity(str(b), "v")
    assert kvdisk.model_identity(str(a), "v") == kvdisk.model_identity(str(a), "v")
