"""llama.cpp's passes over the weights per step, by where new requests are placed.

    .venv/bin/python -m bench.passes [--steps N]

The sans-IO scheduler alone (no model, no clock: each step takes 0.1 s of a fake
clock), 16 per-slot slots, closed loops of 4, 8, 12 and 16 callers sending prompts of
20 to 600 random tokens (no shared prefixes) for 32 to 128 tokens. For each step it
counts the micro-batches llama.cpp would split the batch into
(``forged.engine.costmodel.micro_batches``), once with this tree's slot placement
(``SlotCache.free_slot``) and once with plain LRU (an empty slot first, else the least
recently used idle one: the placement before issue 34's item 3). Deterministic: the
same seed gives the same figures on any machine.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable

from forged.engine.limits import SchedulerLimits
from forged.engine.request import Request
from forged.engine.scheduler import Scheduler
from forged.engine.slotcache import SlotCache

LIMITS = SchedulerLimits(kv_cells=16 * 1024, slots=16, max_running=16, step_tokens=256,
                         room=1024, max_context=1024, per_slot_cells=1024,
                         target_step_ms=300)


def lru_slot(cache: SlotCache, *keep: int | None) -> int | None:
    """The placement before: an empty slot, else the least recently used idle one."""
    idle = [s for s in cache.slots if s.rid is None and s.sid not in keep]
    if not idle:
        return None
    empty = [s for s in idle if not s.tokens]
    return (empty[0] if empty else min(idle, key=cache.eviction_order)).sid


def passes_per_step(callers: int, steps: int, seed: int,
                    place: Callable[..., int | None] | None) -> float:
    s = Scheduler(LIMITS)
    if place is not None:
        cache = s.cache
        cache.free_slot = lambda *keep: place(cache, *keep)  # type: ignore[method-assign]
    rng = random.Random(seed)
    rid = 0

    def submit(now: float) -> None:
        nonlocal rid
        rid += 1
        n = rng.choice([20, 40, 150, 300, 600])
        s.submit(rid, Request(prompt=[rng.randrange(1000, 40000) for _ in range(n)],
                              max_tokens=rng.choice([32, 64, 128])), now)

    passes = planned = 0
    for step in range(steps):
        now = 0.1 * step
        while s.n_running + s.n_queued < callers:
            submit(now)
        plan = s.plan(now)
        if plan is None or not plan.chunks:
            continue
        passes += plan.shape.chunks + 1
        planned += 1
        sampled = {(c.rid, i): 7 for c in plan.chunks for i in c.choices}
        s.commit(plan, sampled, now)
        for key in sampled:
            run = s.sequence(key)
            if run is not None and run.generated >= run.req.max_tokens:
                s.complete(*key)
    return round(passes / max(1, planned), 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rows = {c: {"beside_running": passes_per_step(c, args.steps, args.seed, None),
                "lru": passes_per_step(c, args.steps, args.seed, lru_slot)}
            for c in (4, 8, 12, 16)}
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
