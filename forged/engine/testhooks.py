"""The test seam: fault injection into worker processes, for the test suite only.

A daemon started with ``--test-hooks`` (never in production: the packaged unit does
not pass it) starts its workers with ``Init.test_hooks``, and only then do workers
honour these frames:

* :class:`~forged.engine.frames.Hang`: the worker's loop blocks for a while (a wedged
  worker: its heartbeats stop);
* :class:`~forged.engine.frames.SlowSteps`: every decode takes longer (a slow spell);
* :class:`~forged.engine.frames.CrashOn`: the process aborts, as llama.cpp does on a
  failed assertion, in the decode of a batch holding a token (for a short prompt,
  the very step that admitted it, as a real culprit may).

Daemon side: :func:`hang_worker`, :func:`slow_steps` and :func:`crash_on_token` send
them. Worker side: the shell blocks on ``Hang`` itself and wraps its backend in
:class:`HookedBackend` for the other two. Production classes carry no hook.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from forged.engine import frames as fr
from forged.engine.decoding import Backend, DecodeItem, TokenLogprob, TokenSampler
from forged.engine.request import Sampling

if TYPE_CHECKING:
    from forged.engine.pool import EnginePool


# --- daemon side -----------------------------------------------------------------------


def hang_worker(pool: EnginePool, index: int, seconds: float) -> None:
    """Make worker ``index``'s loop block for ``seconds``."""
    pool.supervisor(index).send(fr.Hang(seconds=seconds))


def slow_steps(pool: EnginePool, index: int, seconds: float) -> None:
    """Make every step of worker ``index`` take at least ``seconds`` longer."""
    pool.supervisor(index).send(fr.SlowSteps(seconds=seconds))


def crash_on_token(pool: EnginePool, index: int, token: int) -> None:
    """Make worker ``index`` abort once a running request's prompt held ``token``."""
    pool.supervisor(index).send(fr.CrashOn(token=token))


# --- worker side -----------------------------------------------------------------------


class HookedBackend:
    """A backend with slow steps and a crash on a token, for the frames above."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.eog_tokens = inner.eog_tokens
        self.n_batch = inner.n_batch
        self.step_delay = 0.0
        self.crash_token: int | None = None

    def apply(self, frame: fr.SlowSteps | fr.CrashOn) -> None:
        match frame:
            case fr.SlowSteps(seconds=s):
                self.step_delay = s
            case fr.CrashOn(token=t):
                self.crash_token = t

    def decode(self, items: Sequence[DecodeItem]) -> list[int]:
        # In the decode itself, as llama.cpp's abort() is: possibly the very step that
        # admitted the request.
        if self.crash_token is not None and any(self.crash_token in toks
                                                for _, _, toks, _ in items):
            os.abort()
        out = self.inner.decode(items)
        if self.step_delay:
            time.sleep(self.step_delay)
        return out

    def seq_rm(self, seq: int, p0: int) -> None:
        self.inner.seq_rm(seq, p0)

    def piece(self, token: int, special: bool = False) -> bytes:
        return self.inner.piece(token, special)

    def logprobs(self, index: int, token: int, top: int) -> TokenLogprob:
        return self.inner.logprobs(index, token, top)

    def sampler(self, sampling: Sampling, prompt: list[int]) -> TokenSampler:
        return self.inner.sampler(sampling, prompt)

    def seq_cp(self, src: int, dst: int, n: int) -> None:
        self.inner.seq_cp(src, dst, n)

    def seq_cp_stream(self, src: int, dst: int, n: int) -> None:
        self.inner.seq_cp_stream(src, dst, n)

    def seq_save(self, seq: int) -> bytearray:
        return self.inner.seq_save(seq)

    def seq_load(self, seq: int, state: bytearray, n_tokens: int) -> bool:
        return self.inner.seq_load(seq, state, n_tokens)
