"""systemd's notification protocol, through the sdnotify package.

Every call is a no-op when ``NOTIFY_SOCKET`` is unset (not started by systemd).
"""

from __future__ import annotations

import os
import time

import sdnotify


class Notifier:
    def __init__(self) -> None:
        self.enabled = bool(os.environ.get("NOTIFY_SOCKET"))
        self._n = sdnotify.SystemdNotifier() if self.enabled else None

    def send(self, *lines: str) -> None:
        if self._n is not None:
            self._n.notify("\n".join(lines))

    def ready(self, status: str = "") -> None:
        self.send("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> None:
        self.send(f"STATUS={text}")

    def reloading(self) -> None:
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self.send("RELOADING=1", f"MONOTONIC_USEC={usec}")

    def extend_start(self, seconds: float) -> None:
        """Ask systemd for ``seconds`` more from now before READY=1 must come (the
        unit's TimeoutStartSec is only the default)."""
        self.send(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")

    def stopping(self) -> None:
        self.send("STOPPING=1")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")


def watchdog_interval() -> float | None:
    """Half of systemd's ``WATCHDOG_USEC`` when it is meant for this process, else None."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or not usec.isdigit() or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 2e6
