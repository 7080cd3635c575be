"""Boot a real systemd in a container (systemd-nspawn) and run commands inside it.

The container gets a private network namespace: only its own loopback exists, so
nothing it serves is reachable from outside, and it reaches nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path


class BootedContainer:
    def __init__(self, pristine: Path, workdir: Path) -> None:
        self.root = workdir / "root"
        # A private copy: the test installs, breaks and purges things in it.
        subprocess.run(["cp", "-a", "--reflink=auto", str(pristine), str(self.root)],
                       check=True, timeout=300)
        self.log = workdir / "console.log"
        self._log_f = self.log.open("wb")
        self.proc = subprocess.Popen(
            ["systemd-nspawn", "--register=no", "--keep-unit", "--private-network",
             "--quiet", "-D", str(self.root), "-b", "--console=pipe"],
            stdin=subprocess.DEVNULL, stdout=self._log_f, stderr=subprocess.STDOUT,
        )
        self.leader = 0

    def wait_booted(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the container exited: {self.log.read_text()[-3000:]}")
            self.leader = self.leader or self._find_leader()
            if self.leader:
                r = self.run("systemctl is-system-running", check=False, timeout=10)
                if r.stdout.strip() in ("running", "degraded"):
                    return
            time.sleep(0.3)
        raise TimeoutError(f"the container did not boot: {self.log.read_text()[-3000:]}")

    def _find_leader(self) -> int:
        """The container's PID 1: systemd-nspawn's child."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        try:
            pids = children.read_text().split()
        except OSError:
            return 0
        return int(pids[0]) if pids else 0

    def run(self, script: str, *, check: bool = True, timeout: float = 60.0
            ) -> subprocess.CompletedProcess[str]:
        """Run a shell script inside the container, in all of its namespaces."""
        r = subprocess.run(
            ["nsenter", "-t", str(self.leader), "-a", "/bin/sh", "-c", script],
            capture_output=True, text=True, timeout=timeout,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
        )
        if check and r.returncode != 0:
            raise AssertionError(f"{script!r} exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
        return r

    def copy_in(self, src: Path, dest: str) -> None:
        target = self.root / dest.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, target)

    def close(self) -> None:
        if self.proc.poll() is None:
            if self.leader:
                # SIGRTMIN+4 asks systemd (PID 1) for a clean poweroff.
                os.kill(self.leader, 38)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log_f.close()
        shutil.rmtree(self.root, ignore_errors=True)
