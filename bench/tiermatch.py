"""What a match against the saved KV states costs, by how many there are (a few seconds).

    .venv/bin/python -m bench.tiermatch

Fills the tiers' index (forged/engine/kvtiers.py) with N states of one tenant that all
begin with the same 40-token chat template, then times ``longest`` (the scheduler's
match, twice a request) and ``save`` (once a save) on new prompts of that shape; then,
with the RAM tier full, a save that evicts the least recently used state (``save`` and
``sized``, as the worker does once a state's bytes are known), and the tiers' part of
the worker's statistics (``report``, with every statistics frame), and the routing
digests the worker builds every 250 ms (``DigestBuilder.build`` over 16 slots and the
tiers, warm: each state's hashes kept from the build before). With SmolLM2 the
default 4 GiB RAM tier holds about 1,800 such states. The worker runs all of them
between decode steps, so their time is time no stream decodes.
"""

from __future__ import annotations

import random
import time

from forged.engine.kvtiers import Tiers
from forged.engine.routing import DigestBuilder
from forged.engine.stats import WorkerStats

SIZES = (100, 1000, 3000)


def prompt(rng: random.Random, header: list[int]) -> list[int]:
    return header + [rng.randrange(49152) for _ in range(rng.randint(20, 400))]


STATE_BYTES = 1000  # every state's size here: the RAM tier holds exactly n of them


def measure(n: int, queries: int = 200) -> tuple[float, ...]:
    """Microseconds per ``longest``, per ``save``, per evicting save, per ``report``
    and per digest build beside ``n`` saved states."""
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
    slots = [("", prompt(rng, header)) for _ in range(16)]
    digests = DigestBuilder()
    for i in range(21):  # the first build hashes; the next 20 are timed
        if i == 1:
            t5 = time.perf_counter()
        slots[i % 16] = ("", slots[i % 16][1] + [i] * 64)  # a slot grew by a block
        digests.build(slots, ((e.eid, e.tenant, e.tokens) for e in tiers.recent_first()))
    t6 = time.perf_counter()
    return ((t1 - t0) / queries * 1e6, (t2 - t1) / 50 * 1e6, (t3 - t2) / 50 * 1e6,
            (t4 - t3) / 50 * 1e6, (t6 - t5) / 20 * 1e6)


def main() -> None:
    print("| saved states | `longest` µs | `save` µs | evicting `save` µs | `report` µs "
          "| digests µs |\n|---|---|---|---|---|---|")
    for n in SIZES:
        print(f"| {n} | " + " | ".join(f"{v:.0f}" for v in measure(n)) + " |")


if __name__ == "__main__":
    main()
