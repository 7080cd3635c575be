"""Flash attention chosen by measurement (forged.engine.attention): the choice from
timings (sans-IO, fake timings), and the probe on a real llama.cpp context."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from forged.engine.attention import MARGIN, ROUNDS, Choice, Probe, choose, recall, remember
from forged.engine.backend import BackendError, Model


def timings(off: list[float], on: list[float], calls: list[bool] | None = None
            ) -> Callable[[bool], float]:
    """A measure function that gives these milliseconds, in turn, for each setting."""
    left = {False: list(off), True: list(on)}

    def measure(flash_attn: bool) -> float:
        if calls is not None:
            calls.append(flash_attn)
        return left[flash_attn].pop(0)
    return measure


def test_flash_attention_is_taken_where_it_is_clearly_faster() -> None:
    choice = choose(timings([100.0, 101.0], [70.0, 72.0]))
    assert choice.flash_attn
    assert "70.0 ms with flash attention, 100.0 ms without" in choice.why


def test_a_tie_within_the_margin_keeps_it_off() -> None:
    # 5% faster is within the noise of two starts: the choice must not flip on it,
    # since it also names the disk tier's saved states
    assert not choose(timings([100.0, 100.0], [95.0, 96.0])).flash_attn
    edge = 100.0 * (1 - MARGIN)
    assert not choose(timings([100.0, 100.0], [edge, edge])).flash_attn


def test_the_rounds_alternate_and_the_fastest_of_each_counts() -> None:
    calls: list[bool] = []
    # a slow spell hit flash attention's first round: its best round decides
    choice = choose(timings([100.0, 100.0], [400.0, 60.0], calls))
    assert choice.flash_attn
    assert calls == [False, True] * ROUNDS


def test_a_setting_llama_cpp_cannot_run_leaves_the_other() -> None:
    def measure(flash_attn: bool) -> float:
        if flash_attn:
            raise BackendError("llama.cpp could not create a context")
        return 50.0
    choice = choose(measure)
    assert not choice.flash_attn and "flash attention on failed" in choice.why


def test_the_probe_times_real_steps_on_a_context_per_setting(tiny_model: Path) -> None:
    with Model(str(tiny_model)) as model:
        probe = Probe(model, 2)
        try:
            for _ in range(2):  # the second round reuses the fill (the work is taken off)
                for on in (False, True):
                    assert 0 < probe.measure(on) < 60_000
            assert len(probe.contexts) == 2
        finally:
            probe.close()
        assert probe.contexts == {}


def test_a_kept_choice_is_recalled_for_the_same_identity_only(tmp_path: Path) -> None:
    kept = tmp_path / "worker-0" / "attention.json"  # its folder made on the way
    remember(kept, "model-a", Choice(True, "measured 70.0 ms with flash attention"))
    again = recall(kept, "model-a")
    assert again is not None and again.flash_attn
    assert again.why == "measured 70.0 ms with flash attention, at an earlier start"
    assert recall(kept, "model-b") is None  # another model, llama.cpp, CPU or threads
    kept.write_text("{not json")
    assert recall(kept, "model-a") is None  # measured again, not a crash
    assert recall(tmp_path / "none.json", "model-a") is None


def test_a_choice_that_cannot_be_kept_still_holds(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    remember(tmp_path / "file" / "attention.json", "m", Choice(False, "x"))  # no raise
