"""Progress for a person at a terminal: one line, rewritten in place.

``forged index add`` on a large repository and ``forged model swap`` take minutes; at
a terminal they say how far they are. Anywhere else (a pipe, a log, a systemd unit such
as the hourly index update) they print nothing until their last line, so logs hold no
carriage returns.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

EVERY = 0.2  # seconds between two redraws at most: a terminal need not see each file


class Progress:
    def __init__(self, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.on = self.stream.isatty()
        self.clock = clock
        self.last = -EVERY
        self.shown = False

    def show(self, text: str) -> None:
        """Rewrite the line with ``text``, unless it was rewritten under EVERY ago."""
        now = self.clock()
        if not self.on or now - self.last < EVERY:
            return
        self.last = now
        self.stream.write("\r\x1b[K" + text)
        self.stream.flush()
        self.shown = True

    def clear(self) -> None:
        """Erase the line, so that the command's last message starts on a clean one."""
        if self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.shown = False

    def counter(self, what: str) -> Callable[[int, int], None]:
        """A callback for work done in counted steps: ``what: done/total``."""
        return lambda done, total: self.show(f"{what}: {done}/{total}")

    @contextmanager
    def waiting(self, what: str, every: float = 0.5) -> Iterator[None]:
        """While the block runs (one long call), ``what... N s`` from a thread."""
        if not self.on:
            yield
            return
        stop = threading.Event()
        start = self.clock()

        def tick() -> None:
            while not stop.wait(every):
                self.show(f"{what}... {self.clock() - start:.0f} s")

        thread = threading.Thread(target=tick, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(5)
            self.clear()
