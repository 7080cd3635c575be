"""The worker's sans-IO core around a fake backend: no process, no llama.cpp.

Each test drives frames in and steps, then reads the events out, and checks that
nothing is left behind: every sampler closed, no request running or queued.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from forged.engine import frames as fr
from forged.engine.core import WorkerCore
from forged.engine.costmodel import CostModel
from forged.engine.decoding import DecodeError, DecodeItem, NoKVSpace
from forged.engine.events import Admitted, Delta, Done, Event, Failed
from forged.engine.request import Request, Sampling
from forged.engine.routing import BLOCK, block_hashes
from tests.test_scheduler import limits

EOS = 0


NO_TOKEN = -1  # in a script: the draw finds no token to take


class FakeSampler:
    """Draws its script; a token the sampling suppresses (min_tokens) is skipped, as
    the real sampler never draws a banned token."""

    def __init__(self, backend: FakeBackend, script: list[int], sampling: Sampling) -> None:
        self.backend, self.script, self.sampling = backend, list(script), sampling
        self.draws = 0
        backend.open_samplers += 1

    def sample(self, index: int) -> int:
        assert index >= 0, "sampled a run that asked for no logits"
        self.draws += 1
        while self.draws <= self.sampling.min_tokens and self.script and \
                self.script[0] in self.sampling.suppress:
            self.script.pop(0)
        token = self.script.pop(0) if self.script else 1
        if token == NO_TOKEN:  # as the real sampler when a grammar leaves no token
            raise ValueError("no token can continue the answer within the grammar")
        return token

    def close(self) -> None:
        self.backend.open_samplers -= 1


class FakeBackend:
    """Tokens 1..26 are the letters a..z; token 0 ends the sequence. A request samples
    the script named by its prompt's first token. Decodes can be made to fail."""

    eog_tokens = [EOS]
    n_batch = 64

    def __init__(self, scripts: dict[int, list[int]]) -> None:
        self.scripts = scripts
        self.open_samplers = 0
        self.batches: list[list[tuple[int, int]]] = []  # (seq, tokens) per decode
        self.failing_seqs: set[int] = set()
        self.full_steps = 0  # the next decodes that find no KV cells
        self.lengths: dict[int, int] = {}

    def piece(self, token: int, special: bool = False) -> bytes:
        return bytes([ord("a") + token - 1])

    def sampler(self, sampling: Sampling, prompt: list[int]) -> FakeSampler:
        # With a seed, the script named by the prompt's first token plus the seed: how
        # the choices of one request (seed + index) sample different tokens here.
        return FakeSampler(self, self.scripts.get(prompt[0] + (sampling.seed or 0), []),
                           sampling)

    def decode(self, items: Sequence[DecodeItem]) -> list[int]:
        if self.full_steps:
            self.full_steps -= 1
            raise NoKVSpace(1)
        if self.failing_seqs & {seq for seq, _, _, _ in items}:
            raise DecodeError(-3)
        self.batches.append([(seq, len(toks)) for seq, _, toks, _ in items])
        out, n = [], 0
        for seq, pos, toks, logits in items:
            assert pos == self.lengths.get(seq, 0), "a chunk out of place"
            self.lengths[seq] = pos + len(toks)
            n += len(toks)
            out.append(n - 1 if logits else -1)
        return out

    def seq_rm(self, seq: int, p0: int) -> None:
        self.lengths[seq] = min(self.lengths.get(seq, 0), p0)

    def seq_cp(self, src: int, dst: int, n: int) -> None:
        self.lengths[dst] = n

    def seq_cp_stream(self, src: int, dst: int, n: int) -> None:
        self.lengths[dst] = n

    def seq_save(self, seq: int) -> bytearray:
        return bytearray(self.lengths.get(seq, 0).to_bytes(4, "little"))

    def seq_load(self, seq: int, state: bytearray, n_tokens: int) -> bool:
        if int.from_bytes(state, "little") != n_tokens:
            return False
        self.lengths[seq] = n_tokens
        return True


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def core_with(scripts: dict[int, list[int]], **kw: float) -> tuple[WorkerCore, FakeBackend]:
    backend = FakeBackend(scripts)
    core = WorkerCore(backend, limits(**kw), CostModel(), clock=Clock())
    return core, backend


def submit(core: WorkerCore, rid: int, prompt: list[int], max_tokens: int = 10,
           **kw: object) -> None:
    request = Request(prompt=prompt, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]
    core.handle(fr.Submit(rid=rid, request=request), 0.0)


def run(core: WorkerCore, steps: int = 50) -> list[Event]:
    events: list[Event] = []
    for _ in range(steps):
        core.step(0.0)
        frame = core.frame(0.0)
        events += frame.events if frame is not None else []
        if not core.busy:
            break
    return events


def of(events: list[Event], rid: int) -> list[Event]:
    return [e for e in events if e.rid == rid]


def assert_nothing_left(core: WorkerCore, backend: FakeBackend) -> None:
    assert backend.open_samplers == 0 and not core.streams
    assert core.sched.n_running == 0 and core.sched.n_queued == 0


def test_text_held_for_a_stop_string_is_released_at_the_end_of_sequence() -> None:
    core, backend = core_with({5: [24, 24, EOS]})  # "x", "x", end
    submit(core, 1, [5, 6], stop=["xxy"])
    events = run(core)
    # "xx" could begin "xxy": held back, then released by the end of the sequence
    assert not [e for e in events if isinstance(e, Delta)]
    done = events[-1]
    assert isinstance(done, Done) and done.text == "xx" and done.finish_reason == "stop"
    assert done.completion_tokens == 2
    assert_nothing_left(core, backend)


def test_min_tokens_suppresses_the_end_and_stop_strings_until_reached() -> None:
    core, backend = core_with({5: [1, EOS, 2, 3, 4, EOS]})  # a (end) b c d (end)
    submit(core, 1, [5], stop=["b"], sampling=Sampling(min_tokens=3))
    done = run(core)[-1]
    # the early end was never drawn, and "b" came before the third token
    assert isinstance(done, Done) and done.stop_type == "eos"
    assert done.completion_tokens == 4 and done.stop_reason is None
    assert_nothing_left(core, backend)
    # A stop string counts only after the first min_tokens tokens, as the end does
    # (vLLM's rule): "b" as the second of min_tokens=2 ended the answer at "a".
    core, backend = core_with({5: [1, 2, 3, 4, 2, 5]})  # a b c d b e
    submit(core, 2, [5], max_tokens=6, stop=["b"], sampling=Sampling(min_tokens=2))
    events = run(core)
    assert "".join(e.text for e in events if isinstance(e, Delta | Done)) == "abcd"
    assert isinstance(events[-1], Done) and events[-1].completion_tokens == 5


@pytest.mark.parametrize(("include", "text"), [(False, "ab"), (True, "abc")])
def test_a_stop_token_ends_the_answer_and_is_its_stop_reason(include: bool,
                                                              text: str) -> None:
    core, backend = core_with({5: [1, 2, 3, 4]})
    submit(core, 1, [5], stop_tokens=[3], include_stop=include)
    events = run(core)
    done = events[-1]
    assert isinstance(done, Done) and done.stop_reason == 3
    assert done.finish_reason == "stop" and done.completion_tokens == 2
    assert "".join(e.text for e in events if isinstance(e, Delta | Done)) == text
    # min_tokens holds a stop token back as it does the end of sequence
    core, backend = core_with({5: [1, 3, 2, 3]})
    submit(core, 2, [5], stop_tokens=[3], sampling=Sampling(min_tokens=2))
    done = run(core)[-1]
    assert isinstance(done, Done) and done.completion_tokens == 2
    assert_nothing_left(core, backend)


@pytest.mark.parametrize(("include", "text"), [(False, "a"), (True, "abc")])
def test_a_stop_string_is_the_stop_reason_and_kept_when_asked(include: bool,
                                                               text: str) -> None:
    core, backend = core_with({5: [1, 2, 3, 4]})  # a b c d
    submit(core, 1, [5], stop=["zz", "bc"], include_stop=include)
    events = run(core)
    done = events[-1]
    assert isinstance(done, Done) and done.stop_reason == "bc"
    assert "".join(e.text for e in events if isinstance(e, Delta | Done)) == text
    assert_nothing_left(core, backend)


def test_a_stop_string_ends_the_request_and_drops_what_follows() -> None:
    core, backend = core_with({5: [1, 2, 3, 4]})  # a b c d
    submit(core, 1, [5], stop=["bc"])
    done = run(core)[-1]
    assert isinstance(done, Done) and done.finish_reason == "stop"
    assert_nothing_left(core, backend)


def test_a_failed_step_fails_only_the_request_whose_chunk_fails() -> None:
    core, backend = core_with({5: [1] * 20, 6: [2] * 20})
    submit(core, 1, [5, 1, 1], max_tokens=4)
    submit(core, 2, [6, 2, 2], max_tokens=4)
    core.step(0.0)  # both prefilled, one token each
    slot_of_1 = next(seq for seq, n in backend.batches[0] if n == 3)
    backend.failing_seqs = {slot_of_1}
    events = run(core)
    failed = [e for e in events if isinstance(e, Failed)]
    assert len(failed) == 1 and failed[0].code == "engine_error"
    done = [e for e in events if isinstance(e, Done)]
    assert len(done) == 1 and done[0].rid != failed[0].rid and done[0].completion_tokens == 4
    assert_nothing_left(core, backend)


def test_no_kv_space_preempts_the_newest_request_which_resumes_where_it_stopped() -> None:
    core, backend = core_with({5: [1] * 20, 6: [2] * 20})
    submit(core, 1, [5, 1, 1], max_tokens=6)
    submit(core, 2, [6, 2, 2], max_tokens=6)
    core.step(0.0)
    core.step(0.0)
    backend.full_steps = 1  # llama.cpp finds no cells although the ledger said it fits
    events = run(core)
    done = {e.rid: e for e in events if isinstance(e, Done)}
    assert set(done) == {1, 2}
    assert all(d.completion_tokens == 6 for d in done.values())
    # the preempted request's text has every token once: it resumed, it did not restart
    text = {rid: "".join(e.text for e in of(events, rid)
                         if isinstance(e, Delta | Done)) for rid in (1, 2)}
    assert text == {1: "a" * 6, 2: "b" * 6}
    # it was admitted (as callers see it) once, and its prompt was computed again
    assert [type(e) for e in events].count(Admitted) == 2
    assert any(n > 3 for batch in backend.batches for _, n in batch)
    assert_nothing_left(core, backend)


def test_no_kv_space_for_a_lone_request_fails_it_with_a_clear_error() -> None:
    core, backend = core_with({5: [1] * 20})
    submit(core, 1, [5, 1, 1], max_tokens=6)
    backend.full_steps = 1
    events = run(core)
    assert len(events) == 2 and isinstance(events[0], Admitted)
    failed = events[1]
    assert isinstance(failed, Failed) and "KV cache is full" in failed.message
    assert_nothing_left(core, backend)


def test_a_cancel_during_prefill_stops_the_prompt_and_frees_the_request() -> None:
    core, backend = core_with({5: [1] * 20}, step_tokens=16, prefill_step_tokens=16)
    submit(core, 1, [5] + [1] * 99, max_tokens=5)
    core.step(0.0)
    assert backend.batches == [[(0, 16)]]  # one chunk of the prompt, no token yet
    core.handle(fr.Cancel(rid=1), 0.0)
    run(core)
    assert backend.batches == [[(0, 16)]]  # nothing more was computed for it
    assert_nothing_left(core, backend)
    # what was computed stays as prefix cache: a new request shares it
    submit(core, 2, [5] + [1] * 20, max_tokens=1)
    admitted = [e for e in run(core) if isinstance(e, Admitted)]
    assert admitted[0].cached == 16


def test_a_request_that_can_never_fit_is_refused_without_a_stream() -> None:
    core, backend = core_with({}, kv_cells=256)
    submit(core, 1, [5] * 300)
    frame = core.frame(0.0)
    assert frame is not None
    assert [type(e) for e in frame.events] == [Failed]
    assert isinstance(frame.events[0], Failed) and frame.events[0].code == "bad_request"
    assert_nothing_left(core, backend)


def test_ignore_eos_bans_the_end_of_sequence_tokens() -> None:
    core, backend = core_with({5: [1, EOS, 2]})
    seen: list[Sampling] = []
    make = backend.sampler
    backend.sampler = lambda s, p: (seen.append(s), make(s, p))[1]  # type: ignore[method-assign]
    submit(core, 1, [5], max_tokens=3, ignore_eos=True)
    done = run(core)[-1]
    assert seen[0].logit_bias == [(EOS, -float("inf"))]
    # the fake samples token 0 regardless: with ignore_eos it is text, not an end
    assert isinstance(done, Done) and done.finish_reason == "length"


@pytest.mark.parametrize("interval_passed", [False, True])
def test_statistics_ride_with_tokens_at_most_every_interval(interval_passed: bool) -> None:
    core, _ = core_with({5: [1] * 20})
    submit(core, 1, [5], max_tokens=10)
    core.step(0.0)
    first = core.frame(0.0)
    assert first is not None and first.stats  # admission: statistics at once
    core.step(0.0)
    now = 0.06 if interval_passed else 0.01
    second = core.frame(now)
    assert second is not None and [type(e) for e in second.events] == [Delta]
    assert bool(second.stats) is interval_passed


def test_statistics_tell_the_steps_with_prompt_work_from_decode_only_ones() -> None:
    """Each step's time and tokens count for its kind: the share of the tokens made in
    steps with prompt work is what decides whether a stream's median gap is one."""
    backend = FakeBackend({5: [1] * 40, 6: [2] * 5})
    ticks = iter(range(10_000))
    core = WorkerCore(backend, limits(), CostModel(), clock=lambda: next(ticks) / 1000)
    submit(core, 1, [5], max_tokens=30)
    run(core, 3)  # a prompt step, then two decode-only ones
    submit(core, 2, [6] + [7] * 99, max_tokens=2)  # several prompt steps beside request 1
    run(core)
    first = backend.batches[0][0][0]
    with_2 = [b for b in backend.batches if any(seq != first for seq, _ in b)]
    s = core.statistics()
    assert s.steps == len(backend.batches) and s.tokens_generated == 30 + 2
    # request 1's prompt, and request 2's but for its last step (a decode)
    assert s.prompt_steps == 1 + len(with_2) - 1 >= 3
    # request 1's first token, one of its tokens beside each of request 2's prompt
    # chunks, and request 2's first token
    assert s.prompt_step_tokens == 1 + (len(with_2) - 1) + 1
    assert 0 < s.prompt_step_seconds < s.step_seconds


SPACE, NL, X = ord(" ") - ord("a") + 1, ord("\n") - ord("a") + 1, 24  # the fake's pieces


@pytest.mark.parametrize(("script", "sent"), [
    # the cursor's line is never cut; a line indented by 2 < 4 is cut before its text
    ([X, NL, SPACE, SPACE, SPACE, SPACE, X, NL, SPACE, SPACE, X, X], "x\n    x\n  "),
    # blank lines do not count; a line at indent 4 goes on
    ([NL, NL, SPACE, SPACE, SPACE, SPACE, X, NL, X], "\n\n    x\n"),
])
def test_n_indent_stops_before_a_line_that_dedents_past_it(script: list[int], sent: str
                                                          ) -> None:
    core, backend = core_with({5: script})
    submit(core, 1, [5], max_tokens=20, n_indent=4)
    events = run(core)
    text = "".join(e.text for e in events if isinstance(e, Delta | Done))
    done = events[-1]
    assert text == sent and isinstance(done, Done) and done.stop_type == "limit"
    assert_nothing_left(core, backend)


def test_the_time_limit_ends_at_the_first_newline_past_it() -> None:
    core, backend = core_with({5: [X, NL, X, X, NL, X, NL]})
    clock = core.clock
    assert isinstance(clock, Clock)
    submit(core, 1, [5], max_tokens=20, max_predict_ms=250)
    text = ""
    for _ in range(10):
        core.step(0.0)
        clock.t += 0.1  # each token takes 100 ms
        frame = core.frame(0.0)
        text += "".join(e.text for e in frame.events if isinstance(e, Delta | Done)
                        ) if frame else ""
        if not core.busy:
            break
    # the first newline came at 100 ms (before the limit), the second at 400 ms
    assert text == "x\nxx\n"
    assert_nothing_left(core, backend)


def test_a_warm_up_computes_the_prompt_and_says_nothing() -> None:
    core, backend = core_with({5: [X, X]})
    submit(core, 1, [5, 1, 2], max_tokens=0)
    events = run(core)
    done = events[-1]
    assert isinstance(done, Done) and done.text == "" and done.completion_tokens == 0
    assert backend.batches == [[(0, 3)]]  # the prompt, once, and nothing after it
    assert_nothing_left(core, backend)


# --- n > 1 ---------------------------------------------------------------------------------


def texts(events: list[Event]) -> dict[int, str]:
    out: dict[int, str] = {}
    for e in events:
        if isinstance(e, Delta | Done):
            out[e.index] = out.get(e.index, "") + e.text
    return out


def test_each_choice_samples_with_its_own_seed_and_ends_on_its_own() -> None:
    # choice i samples with seed 10 + i: scripts 15, 16 and 17 here
    core, backend = core_with({15: [1, 2, EOS], 16: [3, EOS], 17: [4, 5, 6, 7]},
                              step_tokens=64)
    submit(core, 1, [5, 1, 1, 1], max_tokens=3, n=3, sampling=Sampling(seed=10))
    events = run(core)
    assert texts(events) == {0: "ab", 1: "c", 2: "def"}
    done = {e.index: e for e in events if isinstance(e, Done)}
    assert {i: (d.stop_type, d.completion_tokens, d.prompt_tokens) for i, d in done.items()
            } == {0: ("eos", 2, 4), 1: ("eos", 1, 4), 2: ("limit", 3, 4)}
    # the prompt was decoded once, by one sequence; the others only decoded their tokens
    assert [n for batch in backend.batches for _, n in batch if n > 1] == [4]
    assert [type(e) for e in events].count(Admitted) == 1
    assert_nothing_left(core, backend)


@pytest.mark.parametrize("steps", [0, 1, 3], ids=["queued", "prefilling", "decoding"])
def test_a_cancel_frees_every_choice(steps: int) -> None:
    core, backend = core_with({5: [1] * 50}, step_tokens=16, prefill_step_tokens=16)
    submit(core, 1, [5] + [1] * 20, max_tokens=40, n=4)
    for _ in range(steps):
        core.step(0.0)
    assert backend.open_samplers == 4
    core.handle(fr.Cancel(rid=1), 0.0)
    run(core)
    assert_nothing_left(core, backend)
    assert core.statistics().kv_cells_active == 0


def test_a_draw_with_no_token_fails_its_request_and_the_step_goes_on() -> None:
    """A grammar that leaves no token (asking for a surrogate, say): before, the
    ValueError left the step and took the worker with it."""
    core, backend = core_with({5: [1, 2, NO_TOKEN, 3], 6: [2] * 20})
    submit(core, 1, [5, 1, 1], max_tokens=4)
    submit(core, 2, [6, 2, 2], max_tokens=4)
    events = run(core)
    assert [(e.code, e.message) for e in of(events, 1) if isinstance(e, Failed)] == [
        ("bad_request", "no token can continue the answer within the grammar")]
    assert "".join(e.text for e in of(events, 1) if isinstance(e, Delta)) == "ab"
    done = [e for e in events if isinstance(e, Done)]
    assert [(d.rid, d.completion_tokens) for d in done] == [(2, 4)]
    assert_nothing_left(core, backend)


def test_a_slot_whose_last_draw_failed_holds_only_what_it_recorded() -> None:
    """The failed draw's chunk was decoded (its cells written) but not recorded: its
    cells are removed, so a next prompt that extends what the slot recorded is
    computed in place. (They stayed: llama.cpp refused every such prompt's decode,
    positions out of order, until the slot was evicted; a retry hit it first.)"""
    core, backend = core_with({5: [1, 2, NO_TOKEN, 3], 9: [4, EOS]}, slots=1, max_running=1)
    submit(core, 1, [5, 1, 1], max_tokens=4)
    assert [e.code for e in of(run(core), 1) if isinstance(e, Failed)] == ["bad_request"]
    submit(core, 2, [5, 1, 1, 1, 2, 9], max_tokens=4, sampling=Sampling(seed=4))  # script 9
    events = run(core)
    assert not [e for e in events if isinstance(e, Failed)]
    assert of(events, 2)[0] == Admitted(rid=2, cached=4, queue_time=0.0)
    assert_nothing_left(core, backend)


def test_a_failed_step_fails_a_request_of_n_choices_once() -> None:
    core, backend = core_with({5: [1] * 20}, step_tokens=64)
    submit(core, 1, [5, 1, 1], max_tokens=8, n=3)
    core.step(0.0)
    core.step(0.0)  # every choice has decoded
    backend.failing_seqs = {seq for seq, _ in backend.batches[-1]}
    events = run(core)
    assert [type(e) for e in events if not isinstance(e, Admitted | Delta)
            ] == [Failed]
    assert_nothing_left(core, backend)


def test_a_grammar_refused_for_one_choice_closes_the_samplers_made() -> None:
    core, backend = core_with({})
    make = backend.sampler

    def refuse_third(s: Sampling, p: list[int]) -> FakeSampler:
        if backend.open_samplers == 2:
            raise ValueError("llama.cpp could not parse the grammar")
        return make(s, p)

    backend.sampler = refuse_third  # type: ignore[method-assign]
    submit(core, 1, [5], max_tokens=3, n=3)
    events = run(core)
    assert [e.code for e in events if isinstance(e, Failed)] == ["bad_request"]
    assert_nothing_left(core, backend)


def test_an_admission_is_sent_before_the_decode_that_computes_its_prompt() -> None:
    """If that decode kills the process, the daemon knows the request was running (a
    crash suspect, not resubmitted elsewhere)."""
    core, backend = core_with({5: [1, 1]})
    sent: list[tuple[list[type], int]] = []

    def flush() -> None:
        frame = core.frame(0.0)
        assert frame is not None
        sent.append(([type(e) for e in frame.events], len(backend.batches)))

    submit(core, 1, [5, 6, 7])
    core.step(0.0, flush=flush)
    assert sent == [([Admitted], 0)]  # before the first decode
    core.step(0.0, flush=flush)
    assert len(sent) == 1  # nothing newly admitted: no extra frame


def test_digests_of_what_the_slots_hold_ride_with_the_statistics_when_changed() -> None:
    core, _ = core_with({5: [1] * 3})
    prompt = [5, *range(100, 100 + BLOCK)]
    first = core.frame(0.0, force=True)
    assert first is not None and first.digests == []  # an empty cache, said once
    submit(core, 1, prompt, max_tokens=2)
    run(core)
    later = core.frame(1.0, force=True)
    assert later is not None and later.digests == block_hashes("", prompt[:BLOCK])
    again = core.frame(2.0, force=True)
    assert again is not None and again.digests is None  # unchanged


def _held(step_ms: float, steps: int, hold_ms: float = 5.0) -> list[tuple[float, list[Event]]]:
    """One request streaming with decode steps ``step_ms`` apart: each frame sent, with
    when, as the worker's loop asks after every step (``hold``)."""
    core, _ = core_with({5: [1] * (steps + 5)}, hold_ms=hold_ms)
    submit(core, 1, [5], max_tokens=steps)
    sent: list[tuple[float, list[Event]]] = []
    now = 0.0
    for _ in range(steps + 2):
        core.step(now)
        frame = core.frame(now, hold=True)
        if frame is not None:
            sent.append((now, frame.events))
        now += step_ms / 1000
    return sent


def _made_at(sent: list[tuple[float, list[Event]]], step_ms: float) -> list[float]:
    """How long each text event waited in the worker: its frame's time less its step's."""
    waits, step = [], 0
    for at, events in sent:
        for ev in events:
            if isinstance(ev, (Delta, Done)):
                step += 1
                waits.append(at - (step - 1) * step_ms / 1000)
    return waits


def test_tokens_wait_for_the_next_steps_within_the_budget_and_first_tokens_never_do() -> None:
    """server.stream_coalesce_ms (hold_ms): at 1 ms steps a frame carries the tokens of
    about five steps, none older than the budget; the first token and the end go at
    once; steps slower than the budget, or no budget, send every step."""
    sent = _held(1.0, 40)
    kinds = [[type(e) for e in events] for _, events in sent]
    assert kinds[0] == [Admitted, Delta]  # the first token at once
    assert kinds[-1][-1] is Done and sent[-1][0] == pytest.approx(0.039)  # the end at once
    assert len(sent) <= 1 + 40 / 4  # about five tokens a frame
    waits = _made_at(sent, 1.0)
    assert len(waits) == 40 and max(waits) <= 0.005 + 1e-9  # none past the budget
    # 3 ms steps: two steps a frame at most (3 + 3 > 5)
    assert max(len(events) for _, events in _held(3.0, 20)[1:]) <= 2
    for step_ms, hold_ms in ((6.0, 5.0), (1.0, 0.0)):
        every = _held(step_ms, 10, hold_ms)
        assert [len(events) for _, events in every] == [2] + [1] * 9


def test_held_tokens_go_before_a_step_that_computes_a_prompt() -> None:
    """A step with prompt work may take the whole step target: what is held is sent
    before its decode, not after it."""
    core, backend = core_with({5: [1] * 30, 6: [2] * 5}, hold_ms=5.0)
    submit(core, 1, [5], max_tokens=30)
    submit(core, 2, [6] + [7] * 99, max_tokens=5)  # its prompt takes several steps
    flushed: list[tuple[list[type], int, int]] = []
    now = 0.0
    for _ in range(8):
        before = len(backend.batches)

        def flush(before: int = before, now: float = now) -> None:
            frame = core.frame(now)
            assert frame is not None
            flushed.append(([type(e) for e in frame.events], before, len(backend.batches)))

        core.step(now, flush=flush)
        core.frame(now, hold=True)
        now += 0.001
    tokens_only = [f for f in flushed if set(f[0]) == {Delta}]
    assert tokens_only  # held tokens, flushed by a prompt step (no admission in it)
    assert all(before == at for _, before, at in tokens_only)  # before its decode


def test_held_tokens_go_before_a_steps_memory_operations() -> None:
    """An admission may first copy a state out of its slot or into it (a save, a
    restore from disk): held tokens go before those, not after, so none waits past its
    budget for them. (They went after.)"""
    core, backend = core_with({5: [1] * 30, 6: [2, EOS], 7: [3, EOS], 8: [4] * 5},
                              hold_ms=5.0, slots=2, max_running=2)
    submit(core, 1, [6])
    submit(core, 2, [7])
    run(core)  # both slots now hold a finished request's cache
    held_at_ops: list[int] = []
    seq_rm = backend.seq_rm

    def recorded(seq: int, p0: int) -> None:
        held_at_ops.append(sum(isinstance(e, Delta) for e in core.events))
        seq_rm(seq, p0)

    backend.seq_rm = recorded  # type: ignore[method-assign]
    submit(core, 3, [5], max_tokens=30)
    now = 0.0
    for step in range(12):
        if step == 6:
            submit(core, 4, [8], max_tokens=5)  # evicts the other slot's cache
        core.step(now, flush=lambda at=now: core.frame(at))
        core.frame(now, hold=True)
        now += 0.001
    assert len(held_at_ops) == 2 and held_at_ops == [0, 0]


def test_held_tokens_go_before_a_decode_priced_past_their_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The hold predicts the next step from the last one. A step the cost model prices
    longer (more decoders, a bigger batch) would keep what is held past its budget, so
    what is held goes before that step's decode: no token waits past the budget."""
    core, _ = core_with({5: [1] * 40}, hold_ms=5.0)
    submit(core, 1, [5], max_tokens=30)
    step = 0
    priced = {12: 10.0}  # one step of 10 ms among 1 ms ones
    monkeypatch.setattr(core.sched.cost, "predict", lambda shape: priced.get(step, 1.0))
    sent: list[tuple[float, int]] = []  # (when, text events)
    made: list[float] = []  # each step's end: when its one text event was made
    now = 0.0

    def send(at: float, frame: fr.Step | None) -> None:
        if frame is not None:
            sent.append((at, sum(isinstance(e, (Delta, Done)) for e in frame.events)))

    for step in range(30):
        core.step(now, flush=lambda at=now: send(at, core.frame(at)))
        now += priced.get(step, 1.0) / 1000
        made.append(now)
        send(now, core.frame(now, hold=True))
    sent_at = [at for at, texts in sent for _ in range(texts)]
    assert len(sent_at) == 30  # a text event a step
    waits = [at - at_made for at, at_made in zip(sent_at, made, strict=True)]
    assert max(waits) <= 0.005 + 1e-9


def test_a_failed_choice_of_a_request_ends_it_whole_and_leaves_its_slots_as_recorded() -> None:
    """A decode that fails is retried in halves; an n > 1 request's choices may land in
    different halves. The failed half's request was failed, and its other choice's token
    (from the half that decoded) then reached a stream already closed: a KeyError that
    killed the worker, with every request on it. That choice's cells were also written
    but not recorded, so the next prompt extending its slot was out of place."""
    core, backend = core_with({5: [1] * 20}, step_tokens=64)
    submit(core, 1, [5, 1, 1], max_tokens=8, n=2)
    submit(core, 2, [5, 1, 2], max_tokens=8)
    core.step(0.0)
    core.step(0.0)
    slots = [core.sched._running[(1, i)].slot for i in (0, 1)]
    backend.failing_seqs = {slots[1]}
    events = run(core)
    assert [type(e) for e in of(events, 1)].count(Failed) == 1
    assert isinstance(of(events, 2)[-1], Done)
    backend.failing_seqs = set()
    for slot in slots:
        assert backend.lengths.get(slot, 0) == len(core.sched.cache.slots[slot].tokens)
    held = core.sched.cache.slots[slots[0]].tokens
    submit(core, 3, [*held, 2, 3], max_tokens=2)  # extends what the slot recorded
    assert isinstance(run(core)[-1], Done)
    assert_nothing_left(core, backend)


def test_the_hold_forgets_every_choice_that_ended() -> None:
    """The hold keeps the choices already streaming (their text may wait). A choice's
    end was forgotten during the step, then its last text's frame added it back: one
    entry per finished choice, for the worker's life."""
    core, _ = core_with({5: [1] * 50}, hold_ms=5.0)
    now = 0.0
    for rid in range(1, 51):
        submit(core, rid, [5], max_tokens=4, n=1 + rid % 2)
        while core.busy:
            core.step(now)
            core.frame(now, hold=True)
            now += 0.001
        core.frame(now, force=True)
    assert not core._hold._announced and not core.streams


def _as_llama_cpp(backend: FakeBackend) -> None:
    """llama.cpp's ways the fake lacks: a copy takes the cells the source holds, and a
    batch whose positions do not follow a sequence's cells is refused."""
    backend.seq_cp = lambda s, d, n: backend.lengths.__setitem__(  # type: ignore[method-assign]
        d, min(n, backend.lengths.get(s, 0)))
    decode = backend.decode

    def refusing(items: Sequence[DecodeItem]) -> list[int]:
        if any(pos != backend.lengths.get(seq, 0) for seq, pos, _, _ in items):
            raise DecodeError(-1)
        return decode(items)

    backend.decode = refusing  # type: ignore[method-assign]


def _conversation_then_its_next_turns(core: WorkerCore) -> list[Event]:
    """A conversation ends in a slot, two others fill the rest; then one step admits a
    short request (which evicts the conversation's slot to the RAM tier), the
    conversation's next turn (restored from there) and a retry of that turn (which
    copies its prefix from the restored slot)."""
    conv = [5, *range(1, 27), *range(1, 15)]
    for rid, prompt in ((1, conv), (2, [6] + [2] * 40), (9, [6] + [4] * 40)):
        submit(core, rid, prompt, max_tokens=5)
        run(core)
    submit(core, 3, [7, 3, 3], max_tokens=2)
    for rid, tail in ((4, [9] * 25), (5, [8] * 25)):
        submit(core, rid, [*conv, 1, 1, 1, *tail], max_tokens=3, sampling=Sampling(seed=3))
    return run(core)


def test_a_state_saved_and_restored_in_one_step_is_restored() -> None:
    """The eviction's save and the restore came in one plan: the entry left the index
    when the restore was planned, so the save was skipped and the restore always
    failed (the whole conversation computed again)."""
    core, backend = core_with({5: [1] * 3 + [0], 6: [2] * 3 + [0], 7: [3, 0], 8: [4] * 3},
                              slots=3, max_running=3, cache_ram_bytes=1 << 20, step_tokens=128)
    _as_llama_cpp(backend)
    events = _conversation_then_its_next_turns(core)
    assert [e.cached for e in of(events, 4) if isinstance(e, Admitted)] == [44]
    assert core.sched.cache.tiers.stats.restore_failures == 0


def test_a_copy_from_a_slot_whose_restore_failed_is_computed_instead() -> None:
    """A request copying its prefix from a slot whose restore was refused (a corrupt or
    stale file) in the same step decoded after cells llama.cpp did not hold: a silently
    wrong answer, and a slot that then served that hole as a cached prefix."""
    core, backend = core_with({5: [1] * 3 + [0], 6: [2] * 3 + [0], 7: [3, 0], 8: [4] * 3},
                              slots=3, max_running=3, cache_ram_bytes=1 << 20, step_tokens=128)
    _as_llama_cpp(backend)
    backend.seq_load = lambda seq, state, n: False  # type: ignore[method-assign]
    events = _conversation_then_its_next_turns(core)
    for rid in (3, 4, 5):
        assert isinstance(of(events, rid)[-1], Done), of(events, rid)[-1]
    for slot in core.sched.cache.slots:
        assert backend.lengths.get(slot.sid, 0) == len(slot.tokens)
    assert_nothing_left(core, backend)


def test_a_prompt_sharing_a_prefix_with_another_sessions_idle_slot_is_admitted() -> None:
    """The only idle slot holds another live session's conversation, with the same
    system prompt: the request waited for that session's pin to end (session_ttl, 600 s),
    with everything queued behind it, where one sharing nothing took the slot at once
    (saving the session's state first)."""
    system = list(range(1, 27)) * 2
    core, backend = core_with({5: [1, 0], 6: [2, 0]}, slots=1, max_running=1,
                              cache_ram_bytes=1 << 20)
    submit(core, 1, [*system, 5], max_tokens=3, session="k/a")
    run(core)
    submit(core, 2, [*system, 6], max_tokens=3, session="k/b")
    core.step(1.0)
    frame = core.frame(1.0)
    assert frame is not None and [e.rid for e in frame.events if isinstance(e, Admitted)] == [2]
    assert isinstance(run(core)[-1], Done)
    assert core.sched.cache.tiers.stats.saves >= 1  # session a's state kept
    assert_nothing_left(core, backend)


def test_a_slot_taken_over_in_place_is_no_longer_the_old_sessions() -> None:
    """A session's pin expired and a request without one took its slot over in place:
    the slot stayed the session's, pinned again for session_ttl (evicted last, its
    save made in that session's name, dropping the session's real saved states)."""
    system = list(range(1, 27)) * 2
    core, _ = core_with({5: [1, 0], 6: [2, 0]}, slots=2, max_running=2)
    submit(core, 1, [*system, 5], max_tokens=3, session="k/a")
    run(core)
    for t in (700.0, 701.0):  # the pin expires
        core.clock.t = t
        core.step(t)
    submit(core, 2, [*system, 6, 6], max_tokens=3)  # no session, the same prefix
    for t in (703.0, 704.0, 705.0, 706.0):
        core.clock.t = t
        core.step(t)
        core.frame(t)
    assert not core.busy
    taken = [s for s in core.sched.cache.slots if s.tokens]
    assert taken and all(s.session is None for s in taken)


def test_a_preempted_request_that_opted_out_of_caching_leaves_no_saved_state() -> None:
    """cache_prompt false: a preempted request's state was saved to the RAM tier all the
    same, never restored (it restores nothing) and left for others of its tenant."""
    core, backend = core_with({5: [1] * 60, 6: [2] * 60, 7: [3] * 60}, slots=2,
                              max_running=2, cache_ram_bytes=1 << 20, step_tokens=64)
    for rid, first in ((1, 5), (2, 6)):
        submit(core, rid, [first] + [first - 4] * 39, max_tokens=50, priority="batch",
               cache=False)
    for _ in range(5):
        core.step(0.0)
        core.frame(0.0)
    submit(core, 3, [7, 3, 3], max_tokens=2)  # interactive: preempts a batch request
    events = run(core, 300)
    assert all(isinstance(of(events, rid)[-1], Done) for rid in (1, 2, 3))
    stats = core.sched.cache.tiers.stats
    assert stats.swaps == 1 and stats.saves == 0  # swapped out, nothing saved
    assert not list(core.sched.cache.tiers.recent_first())
    assert_nothing_left(core, backend)
