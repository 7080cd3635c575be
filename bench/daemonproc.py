"""Run ``forged serve`` as a child process on loopback, for end-to-end tests."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import tomllib  # noqa: F401  (documents that configs are TOML)
import urllib.request
from pathlib import Path
from typing import Any


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def write_config(path: Path, model: Path, port: int, /, **sections: Any) -> Path:
    """A config on loopback; each of ``sections`` a table's keys over the defaults, or a
    list of tables (``models=[{...}]`` for ``[[models]]``)."""
    tables: dict[str, list[dict[str, Any]]] = {
        name: values for name, values in sections.items() if isinstance(values, list)}
    raw: dict[str, dict[str, Any]] = {
        "server": {"listen": f"127.0.0.1:{port}", "admin_listen": f"unix:{path.parent}/admin.sock",
                   "drain_timeout": 10.0, "state_dir": str(path.parent / "state")},
        "auth": {"keys_file": str(path.parent / "keys.toml")},
        "model": {"path": str(model)},
    }
    for name, values in sections.items():
        if name not in tables:
            raw.setdefault(name, {}).update(values)
    lines = []
    for name, values in raw.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    for name, listed in tables.items():
        for values in listed:
            lines.append(f"[[{name}]]")
            lines += [f"{k} = {_toml(v)}" for k, v in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def _toml(value: Any) -> str:
    # JSON is TOML for strings, numbers, booleans and lists; a table is inline.
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def health_ok(url: str, timeout: float = 1.0) -> bool:
    """Whether ``url``/health answers 200 now."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as r:
            return bool(r.status == 200)
    except OSError:
        return False


class DaemonProcess:
    def __init__(self, config: Path, port: int, env: dict[str, str] | None = None,
                 extra: list[str] | None = None, host: str = "127.0.0.1") -> None:
        self.config = config
        self.port = port
        self.url = f"http://{host}:{port}"
        self.log = config.with_suffix(".log")
        self._log_f = open(self.log, "wb")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "forged", "serve", "--config", str(config), *(extra or [])],
            stdout=self._log_f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
        )

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"forged exited {self.proc.returncode}: {self.log.read_text()}")
            if health_ok(self.url):
                return
            time.sleep(0.1)
        raise TimeoutError(f"forged not ready: {self.log.read_text()}")

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_f.close()
        return self.proc.returncode
