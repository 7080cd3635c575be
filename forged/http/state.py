"""What the HTTP layer shares with the daemon: config, engine, prompter, drain state."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import trio

from forged.auth import KeyStore
from forged.config import Config
from forged.engine.pool import EnginePool
from forged.engine.prompts import Prompter
from forged.metrics import Metrics


@dataclass
class StreamDeadlines:
    """Lets a drain put a deadline on every open stream at once."""

    deadline: float = math.inf
    _scopes: set[trio.CancelScope] = field(default_factory=set)

    def open(self) -> trio.CancelScope:
        scope = trio.CancelScope(deadline=self.deadline)
        self._scopes.add(scope)
        return scope

    def close(self, scope: trio.CancelScope) -> None:
        self._scopes.discard(scope)

    def set(self, deadline: float) -> None:
        self.deadline = deadline
        for scope in self._scopes:
            scope.deadline = min(scope.deadline, deadline)

    def __len__(self) -> int:
        return len(self._scopes)


@dataclass
class KeyUsage:
    """What one API key has in flight: generating and waiting for a slot."""

    open: int = 0
    queued: int = 0


@dataclass
class AppState:
    cfg: Config
    pool: EnginePool
    prompter: Prompter
    metrics: Metrics
    started: float = field(default_factory=time.time)
    draining: bool = False
    streams: StreamDeadlines = field(default_factory=StreamDeadlines)
    keys: KeyStore = field(default_factory=KeyStore)
    key_usage: dict[str, KeyUsage] = field(default_factory=dict)

    @property
    def model_ids(self) -> list[str]:
        return [self.cfg.model_id, *self.cfg.model.aliases]

    @property
    def max_context(self) -> int:
        e = self.cfg.engine
        room = e.kv_cells // e.slots if e.kv_layout == "per_slot" else e.kv_cells
        return e.max_context or min(room, self.prompter.n_ctx_train)
