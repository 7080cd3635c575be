"""The daemon gives freed heap pages back to the kernel on its status beat: glibc kept
what a large request freed, so the soak's daemon RSS rose in high-water steps."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

from bench.run import rss_kb
from forged.daemon import lifespan


def _rss_mib() -> int:
    return rss_kb(os.getpid()) // 1024


def test_freed_small_allocations_leave_the_process() -> None:
    # 4 KB objects come from glibc's heap, not mmap; the last one kept pins the heap's
    # top, so only a trim of the free pages inside it lowers the RSS.
    chunks = [bytes(4000) + bytes([i % 256]) for i in range(20000)]
    last = chunks[-1]
    del chunks
    before = _rss_mib()
    lifespan._give_back_freed_memory()
    assert before - _rss_mib() >= 40, "80 MB freed, less than half of it given back"
    assert last


async def test_the_status_beat_gives_freed_memory_back(
        monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock) -> None:
    beats: list[int] = []
    monkeypatch.setattr(lifespan, "_give_back_freed_memory", lambda: beats.append(1))
    monkeypatch.setattr(lifespan, "_status_line", lambda *a: "ok")
    daemon: Any = SimpleNamespace(cfg=SimpleNamespace(server=SimpleNamespace(
        status_interval=5.0)), notifier=SimpleNamespace(status=lambda line: None))
    state: Any = SimpleNamespace(totals=lambda: {})
    with trio.move_on_after(6):  # one beat, at 5 s
        await lifespan.Daemon._status_loop(daemon, state)
    assert beats == [1]
