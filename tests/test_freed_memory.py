"""The daemon gives freed memory back to the kernel: glibc kept what a large request
freed, so the soak's daemon RSS rose in high-water steps."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

from bench.run import rss_kb
from forged.daemon import lifespan
from forged.engine.stats import Totals


def _rss_mib() -> int:
    return rss_kb(os.getpid()) // 1024


def test_freed_small_allocations_leave_the_process() -> None:
    # 4 KB objects come from glibc's heap, not mmap; the last one kept pins the heap's
    # top, so only a trim of the free pages inside it lowers the RSS.
    chunks = [bytes(4000) + bytes([i % 256]) for i in range(20000)]
    last = chunks[-1]
    del chunks
    before = _rss_mib()
    lifespan.give_back_freed_memory()
    assert before - _rss_mib() >= 40, "80 MB freed, less than half of it given back"
    assert last


async def test_the_status_beat_gives_freed_memory_back(
        monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock) -> None:
    beats: list[int] = []
    monkeypatch.setattr(lifespan, "give_back_freed_memory", lambda: beats.append(1))
    monkeypatch.setattr(lifespan, "_status_line", lambda *a: "ok")
    daemon: Any = SimpleNamespace(cfg=SimpleNamespace(server=SimpleNamespace(
        status_interval=5.0)), notifier=SimpleNamespace(status=lambda line: None))
    state: Any = SimpleNamespace(totals=Totals)
    with trio.move_on_after(6):  # one beat, at 5 s
        await lifespan.Daemon.status_loop(daemon, state)
    assert beats == [1]


# In a fresh interpreter: the threshold is process-wide and this one's has moved.
_MMAPPED_AFTER_A_LARGER_FREE = textwrap.dedent("""
    import ctypes, sys
    from forged.daemon import lifespan

    class Info(ctypes.Structure):  # glibc's struct mallinfo2
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks "
            "keepcost").split()]

    info = lifespan._LIBC.mallinfo2
    info.restype = Info
    lifespan.fix_mmap_threshold()  # without it, this prints False
    big = bytearray(8 << 20)  # freed: glibc's default raises the threshold to 8 MiB
    del big
    before = info().hblkhd
    body = bytearray(1 << 20)  # a megabyte's request body
    print(info().hblkhd - before >= 1 << 20)
""")


def test_a_large_block_is_mapped_even_after_a_larger_one_was_freed() -> None:
    # Mapped, it goes back to the kernel when freed; from the heap, its pages stayed.
    out = subprocess.run([sys.executable, "-c", _MMAPPED_AFTER_A_LARGER_FREE],
                         capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "True"
