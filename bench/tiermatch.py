"""What a match against the saved KV states costs, by how many there are (a few seconds).

    .venv/bin/python -m bench.tiermatch

Fills the tiers' index (forged/engine/kvtiers.py) with N states of one tenant that all
begin with the same 40-token chat template, then times ``longest`` (the scheduler's
match, twice a request) and ``save`` (once a save) on new prompts of that shape; then,
with the RAM tier full, a save that evicts the least recently used state (``save`` and
``sized``, as the worker does once a state's bytes are known), and the tiers' part of
the worker's statistics (``report``, with every statistics frame). With SmolLM2 the
default 4 GiB RAM tier holds about 1,800 such states. The worker runs all of them
between decode steps, so their time is time no stream decodes.
"""

from __future__ import annotations

import random
import time

from forged.engine.kvtiers import Tiers
from forged.engine.stats import WorkerStats

SIZES = (100, 1000, 3000)


def prompt(rng: random.Random, header: list[int]) -> list[int]:
    return header + [rng.randrange(49152) for _ in range(rng.randint(20, 400))]


STATE_BYTES = 1000  # every state's size here: the RAM tier holds exactly n of them


def measure(n: int, queries: int = 200) -> tuple[float, float, float, float]:
    """Microseconds per ``longest``, per ``save``, per evicting save and per
    ``report`` beside ``n`` saved states."""
    rng = random.Random(1)
    header = [rng.randrange(49152) for _ in range(40)]
    tiers = Tiers(ram_bytes=n * STATE_BYTES)
    for _ in range(n):
        entry, _ = tiers.save(prompt(rng, header), "", None)
        tiers.sized(entry.eid, STATE_BYTES)
    asked = [prompt(rng, header) for _ in range(queries)]
    t0 = time.perf_counter()
    for q in asked:
        tiers.longest("", q, len(q) - 1)
    t1 = time.perf_counter()
    for q in asked[:50]:
        tiers.save(q, "", None)
    t2 = time.perf_counter()
    for q in asked[50:100]:  # the tier is full: each save evicts the oldest state
        entry, _ = tiers.save(q, "", None)
        tiers.sized(entry.eid, STATE_BYTES)
    t3 = time.perf_counter()
    for _ in range(50):
        tiers.report(WorkerStats())
    t4 = time.perf_counter()
    return ((t1 - t0) / queries * 1e6, (t2 - t1) / 50 * 1e6, (t3 - t2) / 50 * 1e6,
            (t4 - t3) / 50 * 1e6)


def main() -> None:
    print("| saved states | `longest` µs | `save` µs | evicting `save` µs | `report` µs |\n"
          "|---|---|---|---|---|")
    for n in SIZES:
        match, save, evicting, report = measure(n)
        print(f"| {n} | {match:.0f} | {save:.0f} | {evicting:.0f} | {report:.0f} |")


if __name__ == "__main__":
    main()
