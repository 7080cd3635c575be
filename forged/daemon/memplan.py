"""``forged model plan``: will the models of a config fit in this machine's memory?

For each model: its weights (the GGUF file, mapped), one KV cache per worker
(``kv_cells`` cells at the size its layers give a cell), one RAM tier of saved KV
states per worker at its budget (``cache_ram_mib``: each worker's scheduler keeps its
own; an embedding model has none), and a worker's own overhead (the process,
llama.cpp's compute buffers: ``OVERHEAD``). Each model's figures are its own engine
settings ([[models]] engine keys over [engine]).
All of it must fit in the machine's memory less ``RESERVE`` for the system, and the
weights and KV caches in ``engine.memory_mib`` when set (what a swap is held to). A
plan that does not fit is refused with the slots and context that would.

The swap check (forged.daemon.swap) asks the narrower question of one more model
against what is free now; this one asks it of the whole config, before a start.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from forged import config as fc
from forged.daemon.startup import model_key, open_prompter
from forged.engine.groups import meminfo_bytes
from forged.engine.limits import scheduler_limits

MIB = 1 << 20
OVERHEAD = 256 * MIB  # per worker: the process and llama.cpp's compute buffers
RESERVE = 1024 * MIB  # of the machine's memory, left to the system


@dataclass(frozen=True)
class ModelPlan:
    key: str  # its table: model, models[0], ...
    model_id: str
    weights: int
    kv_per_cell: int
    workers: int
    kv_cells: int
    slots: int
    max_context: int
    ram_tier: int  # its workers' RAM tiers of saved KV states, all of them

    @property
    def kv(self) -> int:
        return self.workers * self.kv_cells * self.kv_per_cell

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.ram_tier + self.workers * OVERHEAD


@dataclass(frozen=True)
class Plan:
    models: list[ModelPlan]
    machine: int  # bytes of the machine, less RESERVE
    memory_mib: int  # engine.memory_mib: weights and KV caches together; 0: no bound

    @property
    def weights_and_kv(self) -> int:
        """What engine.memory_mib bounds, as a swap counts it."""
        return sum(m.weights + m.kv for m in self.models)

    @property
    def ram_tier(self) -> int:
        return sum(m.ram_tier for m in self.models)

    @property
    def total(self) -> int:
        return sum(m.total for m in self.models)

    def checks(self) -> list[tuple[str, int, int]]:
        """(what, bytes used, bytes allowed): each must hold."""
        out = [("everything", self.total, self.machine)]
        if self.memory_mib:
            out.append(("weights and KV caches (engine.memory_mib)", self.weights_and_kv,
                        self.memory_mib * MIB))
        return out

    @property
    def fits(self) -> bool:
        return all(used <= allowed for _, used, allowed in self.checks())

    def room_for_kv(self, m: ModelPlan) -> int:
        """Bytes ``m``'s KV caches could take, the rest staying as it is."""
        return min(allowed - (used - m.kv) for _, used, allowed in self.checks())


def plan(config_path: Path, cfg: fc.Config, memory: int | None = None) -> Plan:
    """The plan of ``cfg``; ``memory``: the machine's bytes (default: MemTotal)."""
    models = []
    for place, model in enumerate(cfg.served):
        key = model_key(place)
        own = cfg.for_model(model)
        engine = own.engine
        with open_prompter(config_path, model, key) as prompter:
            # An encoder (an embedding model) keeps no KV cache.
            per_cell = 0 if prompter.embedding else prompter.vocab.kv_bytes_per_cell()
            # The context it will serve: its own training context when max_context is 0.
            context = scheduler_limits(own, prompter.n_ctx_train,
                                       encoder=prompter.embedding).max_context
            # Every worker's scheduler has a RAM tier of its own (scheduler_limits);
            # an embedding worker keeps no KV state to save.
            ram_tier = 0 if prompter.embedding else engine.workers * engine.cache_ram_mib * MIB
        models.append(ModelPlan(key, model.model_id, Path(model.path).stat().st_size,
                                per_cell, engine.workers, engine.kv_cells, engine.slots,
                                context, ram_tier))
    # MemTotal: what the machine has, whatever runs on it now.
    machine = meminfo_bytes("MemTotal") if memory is None else memory
    return Plan(models, max(0, machine - RESERVE), cfg.engine.memory_mib)


def render(p: Plan) -> str:
    lines = [f"{'MODEL':<28} {'WEIGHTS':>9} {'KV/CELL':>8} {'WORKERS':>7} {'KV CELLS':>9} "
             f"{'KV':>9} {'RAM TIER':>9} {'OVERHEAD':>9} {'TOTAL':>9}"]
    for m in p.models:
        lines.append(f"{m.model_id[:28]:<28} {_mib(m.weights):>9} {m.kv_per_cell:>8} "
                     f"{m.workers:>7} {m.kv_cells:>9} {_mib(m.kv):>9} "
                     f"{_mib(m.ram_tier):>9} {_mib(m.workers * OVERHEAD):>9} "
                     f"{_mib(m.total):>9}")
    for what, used, allowed in p.checks():
        verdict = "fits" if used <= allowed else "does NOT fit"
        source = "the machine's memory less 1 GiB" if what == "everything" else "its bound"
        lines.append(f"{what}: {_mib(used)} of {_mib(allowed)} ({source}): {verdict}")
    if not p.fits:
        lines += suggestions(p)
    return "\n".join(lines)


def suggestions(p: Plan) -> list[str]:
    """For each model, the KV cells (and so slots at its context) that would fit if
    the others stayed as they are; or what to cut when even none would."""
    out = []
    for m in p.models:
        cells = p.room_for_kv(m) // max(1, m.workers * m.kv_per_cell)
        if cells >= m.max_context:
            out.append(f"  {m.key}: engine.kv_cells = {cells} would fit: "
                       f"{cells // m.max_context} slots of {m.max_context} tokens, or "
                       f"{m.slots} slots of {cells // m.slots} tokens")
    if not out:
        out.append("  no KV size fits beside the weights: serve fewer or smaller models, "
                   "lower engine.cache_ram_mib, or raise engine.memory_mib")
    return out


def _mib(n: int) -> str:
    return f"{n / MIB:.0f} MiB"
