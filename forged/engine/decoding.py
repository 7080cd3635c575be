"""What a worker's core asks of llama.cpp, below both: the :class:`Backend` protocol, a
decode's items, a request's sampler, a token's log-probability and the errors a decode
raises. :mod:`forged.engine.backend` implements it and :mod:`forged.engine.core` drives
it; neither imports the other, and this module imports neither.

Sans-IO: msgspec and forged's request types only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

import msgspec

from forged.engine.request import Request, Sampling

if TYPE_CHECKING:  # plan imports the cost model, which measures through a Backend
    from forged.engine.plan import Chunk


class TokenLogprob(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """A token's log-probability under the model's raw distribution (the log-softmax of
    its logits, before any sampler), and the ``top`` most likely tokens there, most
    likely first. Sent as a compact array: it travels once per token."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = []


class DecodeError(Exception):
    """A decode step failed; llama.cpp rolled its memory back."""

    def __init__(self, status: int) -> None:
        super().__init__(f"llama_decode returned {status}")
        self.status = status


class NoKVSpace(DecodeError):
    """llama_decode returned 1: no free KV cells for this batch. Nothing was written."""


# seq, first position, tokens, and how many of the last tokens want logits (1: the
# last only, to sample from; a scored prompt's chunk wants them all).
DecodeItem = tuple[int, int, Sequence[int], int]


class TokenSampler(Protocol):
    def sample(self, index: int) -> int:
        """The next token from the logits at batch ``index`` of the last decode;
        ValueError if no token may be taken there (the request fails, not the step)."""

    def close(self) -> None: ...


class Backend(Protocol):
    """What the core needs of llama.cpp; :class:`forged.engine.backend.Llama` has it."""

    eog_tokens: list[int]
    n_batch: int

    def piece(self, token: int, special: bool = False) -> bytes:
        """The token's text; a special token's only when ``special``."""

    def sampler(self, sampling: Sampling, prompt: list[int]) -> TokenSampler:
        """A sampler for one request; ValueError if its grammar cannot be parsed."""

    def decode(self, items: Sequence[DecodeItem]) -> list[int]:
        """Batch index of each item's last token (-1 without logits); raises
        :class:`NoKVSpace` or :class:`DecodeError`, having rolled back."""

    def logprobs(self, index: int, token: int, top: int) -> TokenLogprob:
        """``token``'s entry under the raw logits at batch ``index`` of the last decode,
        with the ``top`` most likely tokens there."""

    def seq_rm(self, seq: int, p0: int) -> None: ...

    def seq_cp(self, src: int, dst: int, n: int) -> None: ...

    def seq_cp_stream(self, src: int, dst: int, n: int) -> None: ...

    def seq_save(self, seq: int) -> bytearray:
        """``seq``'s KV state (``llama_state_seq_get_data``)."""

    def seq_load(self, seq: int, state: bytearray, n_tokens: int) -> bool:
        """Write a saved state into the empty ``seq``; False (and ``seq`` left empty)
        when llama.cpp refuses it or it does not hold ``n_tokens`` positions."""


K = TypeVar("K")  # what run_isolating's caller keys sampled tokens by


def run_isolating(chunks: list[Chunk], run: Callable[[list[Chunk]], dict[K, int]]
                  ) -> tuple[dict[K, int], dict[int, DecodeError]]:
    """Run ``chunks`` as one step. If llama.cpp fails it (rolling it back), run the
    halves apart, recursively, so that only the requests whose chunks fail alone fail
    and every other stream in the step goes on. ``NoKVSpace`` on the whole step is not
    a failure of any chunk: it propagates, for the caller to make room.

    Returns the tokens sampled (keyed as ``run`` keys them: by sequence) and the errors
    of the requests that failed, by rid.
    """
    try:
        return run(chunks), {}
    except NoKVSpace:
        raise
    except DecodeError as exc:
        if len(chunks) == 1:
            return {}, {chunks[0].rid: exc}
    return _bisect(chunks, run)


def _bisect(chunks: list[Chunk], run: Callable[[list[Chunk]], dict[K, int]]
            ) -> tuple[dict[K, int], dict[int, DecodeError]]:
    sampled: dict[K, int] = {}
    failed: dict[int, DecodeError] = {}
    half = len(chunks) // 2
    for part in (chunks[:half], chunks[half:]):
        try:
            sampled |= run(part)
        except DecodeError as exc:  # NoKVSpace too: in a retry it fails its chunks
            if len(part) == 1:
                failed[part[0].rid] = exc
            else:
                more_sampled, more_failed = _bisect(part, run)
                sampled |= more_sampled
                failed |= more_failed
    return sampled, failed


NEVER = -float("inf")  # a logit bias that bans a token


def answer_ends(req: Request, eog: frozenset[int]) -> tuple[Sampling, frozenset[int]]:
    """The request's sampling and the tokens that end its answer: the model's
    end-of-generation tokens (banned instead with ``ignore_eos``) and its stop tokens.
    With min_tokens, those cannot be drawn until that many tokens are made."""
    sampling, stops = req.sampling, frozenset(req.stop_tokens)
    if req.ignore_eos:  # the end-of-generation tokens can then never be sampled
        sampling = msgspec.structs.replace(sampling, logit_bias=[
            *sampling.logit_bias, *((t, NEVER) for t in sorted(eog - stops))])
        eog = frozenset()
    ends = eog | stops
    if sampling.min_tokens:
        sampling = msgspec.structs.replace(sampling, suppress=sorted(ends))
    return sampling, ends
