"""The embedding worker's core (forged.engine.embedcore), sans-IO, on a fake backend:
how it batches, answers, refuses, cancels and expires."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from forged.engine import frames as fr
from forged.engine.decoding import DecodeError
from forged.engine.embedcore import EmbedCore
from forged.engine.events import Done, Event, Failed
from forged.engine.limits import SchedulerLimits
from forged.engine.request import Request

DIMS = 4


class FakeEmbedder:
    """A vector per input that says which input it was: its first token and length."""

    n_embd = DIMS

    def __init__(self) -> None:
        self.batches: list[list[list[int]]] = []
        self.fail_on: int | None = None

    def embed(self, inputs: Sequence[Sequence[int]]) -> bytes:
        self.batches.append([list(x) for x in inputs])
        if any(self.fail_on in x for x in inputs):
            raise DecodeError(-3)
        rows = np.array([[x[0], len(x), 0, 0] for x in inputs], dtype="<f4")
        return rows.tobytes()


def limits(**kw: int) -> SchedulerLimits:
    base = {"kv_cells": 1024, "slots": 4, "max_running": 4, "step_tokens": 16, "room": 64,
            "max_context": 16, "max_queued": 8}
    return SchedulerLimits(**{**base, **kw})  # type: ignore[arg-type]


def request(*inputs: list[int], timeout: float = 30.0) -> Request:
    return Request(prompt=[t for x in inputs for t in x], max_tokens=0,
                   inputs=[len(x) for x in inputs], queue_timeout=timeout)


def vectors(done: Done) -> list[list[float]]:
    return np.frombuffer(done.embeddings, dtype="<f4").reshape(-1, DIMS).tolist()


def run(core: EmbedCore, now: float = 0.0) -> list[Event]:
    core.step(now)
    step = core.frame(now)
    return step.events if step is not None else []


def test_inputs_of_several_callers_share_a_batch_within_its_tokens_and_slots() -> None:
    backend = FakeEmbedder()
    core = EmbedCore(backend, limits())  # 16 tokens, 4 sequences a batch
    core.handle(fr.Submit(rid=1, request=request([1] * 6, [2] * 6)), 0.0)
    core.handle(fr.Submit(rid=2, request=request([3] * 3, [4] * 3, [5])), 0.0)
    events = run(core)
    # One input of each in turn: 6 + 3 + 6 tokens; the next (3 more) would pass 16.
    assert [[x[0] for x in b] for b in backend.batches] == [[1, 3, 2]]
    assert [type(ev).__name__ for ev in events] == ["Admitted", "Admitted", "Done"]
    done = events[2]
    assert isinstance(done, Done) and done.rid == 1 and done.prompt_tokens == 12
    assert vectors(done) == [[1, 6, 0, 0], [2, 6, 0, 0]]
    events = run(core)
    assert [x[0] for x in backend.batches[1]] == [4, 5]
    (done,) = events
    assert isinstance(done, Done) and done.rid == 2
    assert vectors(done) == [[3, 3, 0, 0], [4, 3, 0, 0], [5, 1, 0, 0]]
    assert not core.busy


def test_a_batch_holds_at_most_slots_inputs() -> None:
    backend = FakeEmbedder()
    core = EmbedCore(backend, limits(slots=2))
    core.handle(fr.Submit(rid=1, request=request([1], [2], [3])), 0.0)
    run(core)
    assert len(backend.batches[0]) == 2


@pytest.mark.parametrize(("req", "why"), [
    (Request(prompt=[1, 2], max_tokens=0), "not an embedding request"),
    (Request(prompt=[1, 2], max_tokens=0, inputs=[3]), "do not add up"),
    (request([1] * 17), "over the model's 16"),
])
def test_a_request_it_cannot_run_fails_alone(req: Request, why: str) -> None:
    core = EmbedCore(FakeEmbedder(), limits())
    core.handle(fr.Submit(rid=1, request=req), 0.0)
    (failed,) = run(core)
    assert isinstance(failed, Failed) and failed.code == "bad_request"
    assert why in failed.message


def test_a_full_queue_refuses_with_its_wait() -> None:
    core = EmbedCore(FakeEmbedder(), limits(max_queued=1))
    core.handle(fr.Submit(rid=1, request=request([1])), 0.0)
    core.handle(fr.Submit(rid=2, request=request([2])), 0.0)
    step = core.frame(0.0)
    assert step is not None
    (failed,) = step.events
    assert isinstance(failed, Failed) and failed.code == "overloaded"
    assert failed.rid == 2 and failed.retry_after is not None


def test_a_cancelled_request_is_not_computed() -> None:
    backend = FakeEmbedder()
    core = EmbedCore(backend, limits())
    core.handle(fr.Submit(rid=1, request=request([1])), 0.0)
    core.handle(fr.Submit(rid=2, request=request([2])), 0.0)
    core.handle(fr.Cancel(rid=1), 0.0)
    _admitted, done = run(core)
    assert isinstance(done, Done) and done.rid == 2
    assert backend.batches == [[[2]]]


def test_a_request_that_waited_past_its_timeout_expires() -> None:
    backend = FakeEmbedder()
    core = EmbedCore(backend, limits())
    core.handle(fr.Submit(rid=1, request=request([1], timeout=2.0)), 0.0)
    (failed,) = run(core, now=3.0)
    assert isinstance(failed, Failed) and failed.code == "queue_timeout"
    assert backend.batches == []


def test_a_failed_batch_fails_its_requests_and_the_next_batch_runs() -> None:
    backend = FakeEmbedder()
    backend.fail_on = 9
    core = EmbedCore(backend, limits(slots=1))
    core.handle(fr.Submit(rid=1, request=request([9])), 0.0)
    core.handle(fr.Submit(rid=2, request=request([2])), 0.0)
    _admitted, failed = run(core)
    assert isinstance(failed, Failed) and failed.code == "engine_error"
    assert failed.rid == 1
    events = run(core)
    assert isinstance(events[-1], Done) and events[-1].rid == 2


def test_the_batch_holds_one_whole_input_of_the_longest_kind() -> None:
    # An encoder computes a sequence in one micro-batch: the batch is at least the
    # longest input, whatever step_tokens says.
    assert limits(step_tokens=8, max_context=512).embed_batch == 512


def test_statistics_count_what_it_embedded_and_estimate_the_wait() -> None:
    core = EmbedCore(FakeEmbedder(), limits())
    core.handle(fr.Submit(rid=1, request=request([1] * 4, [2] * 4)), 0.0)
    assert core.statistics().wait_estimate_s > 0
    run(core)
    stats = core.statistics()
    assert (stats.embed_requests, stats.embed_inputs, stats.embed_tokens) == (1, 2, 8)
    assert stats.wait_estimate_s == 0


def test_a_reload_cannot_grow_the_batch_past_the_workers_context() -> None:
    # The worker's llama.cpp context was made for the first limits' batch: a reload
    # with a larger step_tokens must not send it a batch it would abort on.
    backend = FakeEmbedder()
    core = EmbedCore(backend, limits())
    core.handle(fr.SetLimits(limits=limits(step_tokens=64, max_context=64)), 0.0)
    core.handle(fr.Submit(rid=1, request=request([1] * 10, [2] * 10)), 0.0)
    run(core)
    assert [len(b) for b in backend.batches] == [1]  # 16 tokens a batch, as before


def test_a_batch_the_backend_refuses_fails_its_requests_not_the_worker() -> None:
    class Refusing(FakeEmbedder):
        def embed(self, inputs: Sequence[Sequence[int]]) -> bytes:
            raise ValueError("an embedding batch of 99 tokens")

    core = EmbedCore(Refusing(), limits())
    core.handle(fr.Submit(rid=1, request=request([1])), 0.0)
    _admitted, failed = run(core)
    assert isinstance(failed, Failed) and failed.code == "engine_error"


def test_a_long_call_shares_every_batch_with_the_short_ones_behind_it() -> None:
    backend = FakeEmbedder()
    core = EmbedCore(backend, limits())  # 4 sequences a batch
    core.handle(fr.Submit(rid=1, request=request(*([[1]] * 40))), 0.0)
    run(core)  # the long call alone: its first four
    core.handle(fr.Submit(rid=2, request=request([2])), 1.0)
    events = run(core, now=1.0)
    # The short call's text is in the next batch, not after the long call's 36 others.
    assert [x[0] for x in backend.batches[1]] == [1, 2, 1, 1]
    assert any(isinstance(ev, Done) and ev.rid == 2 for ev in events)
