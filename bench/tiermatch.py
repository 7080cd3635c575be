"""What a match against the saved KV states costs, by how many there are (a few seconds).

    .venv/bin/python -m bench.tiermatch

Fills the tiers' index (forged/engine/kvtiers.py) with N states of one tenant that all
begin with the same 40-token chat template, then times ``longest`` (the scheduler's
match, twice a request) and ``save`` (once a save) on new prompts of that shape. With
SmolLM2 the default 4 GiB RAM tier holds about 1,800 such states. The worker runs
both between decode steps, so their time is time no stream decodes.
"""

from __future__ import annotations

import random
import time

from forged.engine.kvtiers import Tiers

SIZES = (100, 1000, 3000)


def prompt(rng: random.Random, header: list[int]) -> list[int]:
    return header + [rng.randrange(49152) for _ in range(rng.randint(20, 400))]


def measure(n: int, queries: int = 200) -> tuple[float, float]:
    """Microseconds per ``longest`` and per ``save`` beside ``n`` saved states."""
    rng = random.Random(1)
    header = [rng.randrange(49152) for _ in range(40)]
    tiers = Tiers(ram_bytes=1 << 60)
    for _ in range(n):
        tiers.save(prompt(rng, header), "", None)
    asked = [prompt(rng, header) for _ in range(queries)]
    t0 = time.perf_counter()
    for q in asked:
        tiers.longest("", q, len(q) - 1)
    t1 = time.perf_counter()
    for q in asked[:50]:
        tiers.save(q, "", None)
    t2 = time.perf_counter()
    return (t1 - t0) / queries * 1e6, (t2 - t1) / 50 * 1e6


def main() -> None:
    print("| saved states | `longest` µs | `save` µs |\n|---|---|---|")
    for n in SIZES:
        match, save = measure(n)
        print(f"| {n} | {match:.0f} | {save:.0f} |")


if __name__ == "__main__":
    main()
