"""`forged model plan` and check-config's memory plan: each model's weights, KV caches
(from its GGUF's hyperparameters), workers and the RAM tier, against the machine and
engine.memory_mib; a plan that does not fit is refused with sizes that would."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from forged import cli
from forged import config as fc
from forged.daemon.memplan import MIB, OVERHEAD, RESERVE, plan, render
from forged.engine.backend import Model


def config(tmp: Path, model: Path, **engine: int) -> tuple[Path, fc.Config]:
    path = tmp / "forged.toml"
    lines = [f'[model]\npath = "{model}"', "[engine]",
             *(f"{k} = {v}" for k, v in engine.items())]
    path.write_text("\n".join(lines) + "\n")
    return path, fc.load(path)


def test_the_plan_adds_weights_kv_workers_and_the_ram_tier(tmp_path: Path,
                                                          tiny_model: Path) -> None:
    path, cfg = config(tmp_path, tiny_model, workers=2, kv_cells=4096, max_context=256,
                       cache_ram_mib=64)
    with Model(str(tiny_model), vocab_only=True) as m:
        per_cell = m.kv_bytes_per_cell()
    p = plan(path, cfg, memory=64 << 30)
    [m] = p.models
    assert (m.weights, m.kv_per_cell, m.kv) == (tiny_model.stat().st_size, per_cell,
                                                2 * 4096 * per_cell)
    assert p.total == m.weights + m.kv + 2 * OVERHEAD + 2 * 64 * MIB
    assert p.fits and "fits" in render(p)


def test_every_worker_s_ram_tier_counts_at_its_own_model_s_budget(
        tmp_path: Path, tiny_model: Path, fim_model: Path, tiny_bert: Path) -> None:
    """engine.cache_ram_mib is each worker's (its scheduler's Tiers): 4 workers at 64 MiB
    take 256 MiB. A [[models]] table's own cache_ram_mib sizes its workers' tiers; an
    embedding worker keeps none."""
    path = tmp_path / "forged.toml"
    path.write_text(f'[model]\npath = "{tiny_model}"\n'
                    "[engine]\nworkers = 4\ncache_ram_mib = 64\n"
                    f'[[models]]\npath = "{fim_model}"\nname = "fim"\n'
                    "engine = { workers = 3, cache_ram_mib = 16 }\n"
                    f'[[models]]\npath = "{tiny_bert}"\nname = "bert"\nrole = "embed"\n')
    p = plan(path, fc.load(path), memory=64 << 30)
    assert [m.ram_tier for m in p.models] == [4 * 64 * MIB, 3 * 16 * MIB, 0]
    assert p.ram_tier == (4 * 64 + 3 * 16) * MIB
    assert p.total == sum(m.weights + m.kv + m.workers * OVERHEAD for m in p.models) \
        + p.ram_tier
    assert "256 MiB" in render(p).splitlines()[1]  # the first model's row


def test_a_plan_past_the_machine_is_refused_with_sizes_that_fit(tmp_path: Path,
                                                               tiny_model: Path) -> None:
    path, cfg = config(tmp_path, tiny_model, kv_cells=4_000_000, max_context=512,
                       slots=4, max_running=4, cache_ram_mib=0)
    p = plan(path, cfg, memory=RESERVE + 2 * OVERHEAD)
    assert not p.fits
    text = render(p)
    assert "does NOT fit" in text and "engine.kv_cells = " in text
    cells = int(text.split("engine.kv_cells = ")[1].split()[0])
    smaller = msgspec.structs.replace(cfg, engine=msgspec.structs.replace(
        cfg.engine, kv_cells=cells))
    assert plan(path, smaller, memory=RESERVE + 2 * OVERHEAD).fits  # the suggestion fits
    bigger = msgspec.structs.replace(cfg, engine=msgspec.structs.replace(
        cfg.engine, kv_cells=cells + 1024))
    assert not plan(path, bigger, memory=RESERVE + 2 * OVERHEAD).fits


def test_memory_mib_bounds_weights_and_kv_as_a_swap_does(
        tmp_path: Path, tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = config(tmp_path, tiny_model, kv_cells=1_000_000, max_context=512, slots=4,
                     max_running=4, memory_mib=1)
    assert cli.main(["check-config", "--config", str(path)]) == fc.EX_CONFIG
    err = capsys.readouterr().err
    assert "do not fit in memory" in err and "engine.memory_mib" in err
    assert cli.main(["model", "plan", "--config", str(path), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is False
    assert [c["what"] for c in out["checks"]] == [
        "everything", "weights and KV caches (engine.memory_mib)"]
    path, _ = config(tmp_path, tiny_model)
    assert cli.main(["model", "plan", "--config", str(path)]) == 0
    assert cli.main(["check-config", "--config", str(path)]) == 0


def test_a_model_s_context_defaults_to_its_training_context_within_its_room(
        tmp_path: Path, tiny_model: Path) -> None:
    """max_context = 0 (the default): the GGUF's training context (the tiny model's
    4,096), bounded by the cells one request may use: a fixed 2,048 cut a 32k coder
    short whatever its cells. The plan shows, and suggests with, the resolved one."""
    with Model(str(tiny_model), vocab_only=True) as m:
        trained = m.n_ctx_train
    assert fc.EngineConfig().max_context == 0 and trained == 4096
    path, cfg = config(tmp_path, tiny_model, kv_cells=65536, slots=8, max_running=8)
    assert plan(path, cfg, memory=64 << 30).models[0].max_context == trained
    path, cfg = config(tmp_path, tiny_model, kv_cells=8192, slots=8, max_running=8)
    assert plan(path, cfg, memory=64 << 30).models[0].max_context == 1024  # its room
    path, cfg = config(tmp_path, tiny_model, kv_cells=4_000_000, slots=4, max_running=4,
                       cache_ram_mib=0)
    assert "4 slots of" in render(plan(path, cfg, memory=RESERVE + 2 * OVERHEAD))
