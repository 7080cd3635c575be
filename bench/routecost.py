"""What the daemon's routing costs a request, beside full digests (a second).

    .venv/bin/python -m bench.routecost

The pool routes every generation request (forged/engine/routing.py): it hashes the
prompt's blocks and looks them up in what each worker reported (up to MAX_DIGESTS
hashes) and in the prompts it sent there lately (up to 4,096). Here each worker has
reported a full set of digests and 1,000 prompts of 240-640 tokens were routed before
the 1,000 timed ones: the door's state on a busy node.
"""

from __future__ import annotations

import random
import time

from forged.engine.routing import MAX_DIGESTS, Router


def measure(workers: int, routes: int = 1000) -> float:
    """Microseconds a route, with ``workers`` workers."""
    rng = random.Random(1)
    router = Router(workers)
    for i in range(workers):
        router.reported(i, [rng.getrandbits(63) for _ in range(MAX_DIGESTS)])
    head = [rng.randrange(49152) for _ in range(40)]
    prompts = [head + [rng.randrange(49152) for _ in range(rng.randint(200, 600))]
               for _ in range(2 * routes)]
    loads = dict.fromkeys(range(workers), 0)
    for p in prompts[:routes]:
        router.route("", p, None, loads, now=1.0)
    t0 = time.perf_counter()
    for p in prompts[routes:]:
        router.route("", p, None, loads, now=2.0)
    return (time.perf_counter() - t0) / routes * 1e6


def main() -> None:
    print("| workers | µs a route |\n|---|---|")
    for workers in (1, 2, 4):
        print(f"| {workers} | {measure(workers):.0f} |")


if __name__ == "__main__":
    main()
