"""Which CPUs the door and each model's workers run on.

On one machine the door (the daemon process: HTTP, SSE, the pool) and the workers
(llama.cpp's threads) share the cores. llama.cpp's threads spin while they wait for
each other, so a door that takes one of their cores for a moment stalls the whole
step, and every stream's next token with it. With ``server.door_cpus`` the daemon
keeps to its own cores and the workers, unless ``engine.cpus`` places them, get the
rest (``forged.config.worker_cpus``), and ``engine.threads = 0`` (the default) gives
each worker its share of their physical cores (``Config.for_model``).

Linux keeps a CPU mask per thread, so each is applied to every thread of the process
(as ``renice`` does for nice values): new threads inherit their creator's mask.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def keep_to(cpus: list[int]) -> None:
    """Every thread of this process to ``cpus`` ([]: left as it is)."""
    if not cpus:
        return
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task.name), cpus)
