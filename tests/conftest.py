from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

from forged import config as fc
from forged.daemon.lifespan import Daemon
from forged.engine.stats import Totals
from forged.http.hotdoor import Head
from forged.http.hotpost import HotPosts
from forged.http.lifetime import Call
from tests.tinymodel import write_tiny_bert, write_tiny_llama

ROOT = Path(__file__).resolve().parent.parent
REAL_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny.gguf")


@pytest.fixture(scope="session")
def fim_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with fill-in-the-middle tokens in its vocabulary."""
    return write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-fim.gguf", fim=True)


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny BERT embedding model (random weights, mean pooling)."""
    return write_tiny_bert(tmp_path_factory.mktemp("models") / "tiny-bert.gguf")


@pytest.fixture(scope="session")
def real_model() -> Path:
    if not REAL_MODEL.is_file():
        pytest.fail(f"{REAL_MODEL} is missing: run `make model` (make test does it)")
    return REAL_MODEL


def make_config(model: Path, tmp: Path, /, **sections: Any) -> fc.Config:
    """A config on loopback with ephemeral ports; ``sections`` override keys."""
    raw: dict[str, Any] = {
        "server": {"listen": "127.0.0.1:0", "admin_listen": f"unix:{tmp}/admin.sock",
                   "drain_timeout": 5.0, "state_dir": str(tmp / "state")},
        "auth": {"keys_file": str(tmp / "keys.toml")},
        "model": {"path": str(model)},
        # The unified layout: tiny-model tests use long generations on few cells.
        "engine": {"kv_cells": 4096, "max_context": 2048, "slots": 16, "max_running": 8,
                   "kv_layout": "unified",
                   "step_tokens": 64, "heartbeat_timeout": 10.0, "restart_backoff": 0.1},
    }
    for name, values in sections.items():
        if isinstance(values, list):  # [[models]]
            raw[name] = values
        else:
            raw.setdefault(name, {}).update(values)
    return msgspec.convert(raw, fc.Config)


class RunningDaemon:
    def __init__(self, daemon: Daemon, url: str, admin_sock: str) -> None:
        self.daemon = daemon
        self.url = url
        self.admin_sock = admin_sock

    def stats(self) -> Totals:
        assert self.daemon.state is not None
        return self.daemon.pool.totals()


DaemonFactory = Callable[..., AbstractAsyncContextManager[RunningDaemon]]


@pytest.fixture
def start_daemon(tmp_path: Path) -> DaemonFactory:
    @asynccontextmanager
    async def start(model_path: Path, /, **sections: Any) -> AsyncIterator[RunningDaemon]:
        cfg = make_config(model_path, tmp_path, **sections)
        daemon = Daemon(cfg, tmp_path / "forged.toml", test_hooks=True)
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(daemon.run)
            url = binds[0].replace("http://", "http://", 1)
            yield RunningDaemon(daemon, url, cfg.server.admin_listen[5:])
            nursery.cancel_scope.cancel()

    return start


@pytest.fixture
def posted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The generation routes the daemon's hot door answered (forged.http.hotpost), not
    hypercorn."""
    paths: list[str] = []
    answer = HotPosts.__call__

    async def counted(posts: HotPosts, call: Call, head: Head, *args: Any) -> bool:
        paths.append(head.path)
        return await answer(posts, call, head, *args)

    monkeypatch.setattr(HotPosts, "__call__", counted)
    return paths
