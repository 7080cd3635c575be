"""Progress lines at a terminal, nothing elsewhere (forged.progress), and the index
update's count of files done."""

from __future__ import annotations

import io
import threading
from pathlib import Path

from forged.progress import EVERY, Progress
from forged.retrieval.store import Index


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_one_line_rewritten_at_most_every_interval() -> None:
    now = [0.0]
    out = Terminal()
    p = Progress(out, clock=lambda: now[0])
    count = p.counter("indexing 'x': files")
    for done in range(1, 101):
        count(done, 100)
        now[0] += EVERY / 10  # ten files per interval: one redraw each
    p.clear()
    frames = out.getvalue().split("\r\x1b[K")
    assert frames[1] == "indexing 'x': files: 1/100"
    assert 9 <= len([f for f in frames if f]) <= 11  # 100 files, 10 intervals
    assert frames[-1] == ""  # cleared for the command's last message


def test_a_pipe_gets_nothing() -> None:
    out = io.StringIO()
    p = Progress(out)
    p.counter("x")(1, 2)
    with p.waiting("loading"):
        pass
    p.clear()
    assert out.getvalue() == ""


def test_waiting_counts_seconds_while_the_call_runs() -> None:
    out = Terminal()
    p = Progress(out)
    with p.waiting("loading m.gguf", every=0.001):
        # The long call the admin waits on: until the thread has shown the line once.
        for _ in range(5000):
            if "loading m.gguf... 0 s" in out.getvalue():
                break
            threading.Event().wait(0.001)
    assert "loading m.gguf... 0 s" in out.getvalue()
    assert out.getvalue().endswith("\r\x1b[K")


def test_index_update_reports_each_file(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(5):
        (src / f"f{i}.py").write_text(f"def f{i}():\n    return {i}\n")
    seen: list[tuple[int, int]] = []
    with Index.create(tmp_path / "index", "demo", src) as idx:
        idx.update(progress=lambda done, total: seen.append((done, total)))
        assert seen == [(i, 5) for i in range(1, 6)]
        seen.clear()
        (src / "f0.py").write_text("def g():\n    return 0\n")
        idx.update(progress=lambda done, total: seen.append((done, total)))
    assert seen == [(1, 1)]
