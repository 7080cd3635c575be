"""The knobs of one worker's scheduler, taken from the config in one place.

:func:`scheduler_limits` is the only code that turns the config into the numbers the
scheduler uses: the KV geometry (cells per slot and the room of one request, which
``EngineConfig`` derives, since its checks need them; the largest request, which needs
the model) and the reloadable limits. The pool sends its result to each worker whole,
in ``Init`` and again in ``SetLimits`` after a reload, so nothing is copied field by
field on the way.

Sans-IO: this module imports msgspec and forged's config schema only.
"""

from __future__ import annotations

import math

import msgspec

from forged.config import Config


class SchedulerLimits(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Geometry (fixed while a worker lives) and limits (a reload may change them)."""

    kv_cells: int
    slots: int
    max_running: int
    # The most tokens one step carries (llama.cpp's n_batch must hold them).
    step_tokens: int
    # The cells one request may ever use: its slot's stream, or the unified cache less
    # the headroom kept for llama.cpp.
    room: int
    # The largest request (prompt + max_tokens) a slot takes: at most ``room``.
    max_context: int
    # The same as step_tokens while no sequence is decoding. 0: step_tokens.
    prefill_step_tokens: int = 0
    # A step's predicted duration stays within this (inf: tokens bound it alone).
    target_step_ms: float = math.inf
    # How a request waiting for its first token weighs against a stream waiting for its
    # next, in the step's budget (forged.engine.layout.prompt_room_ms); inf: every step
    # with prompt work runs to target_step_ms.
    first_token_weight: float = math.inf
    kv_headroom: int = 0
    # Decode cells reserved at admission beyond the prompt; growth past it may preempt.
    decode_reservation: int = 1 << 30
    max_queued: int = 256
    max_queued_tokens: int = 1 << 20
    # 0: one unified KV cache (prefixes shared in place). N > 0: every slot owns a
    # stream of N cells (llama.cpp's kv_unified=false); a prefix is reused by copying
    # the source slot's whole stream, which beats recomputing it past a few tokens.
    per_slot_cells: int = 0
    min_copy_tokens: int = 16
    max_prefill_chunks: int = 4  # per-slot layout: prompt chunks in one step
    # How long shorter prompts may overtake one of ``max_context`` tokens; a shorter
    # prompt is overtaken for proportionally less (forged.engine.layout.virtual_start).
    overtake_window: float = 30.0
    # A finished request's KV stays pinned to its ``session`` for this long: idle
    # caches without a live session are evicted first.
    session_ttl: float = 600.0
    # Evicted slots' states kept in host RAM (0: none), and sessions' states on disk.
    cache_ram_bytes: int = 0
    cache_disk_bytes: int = 0
    # Milliseconds a streamed token may wait to go with the next step's in one frame,
    # when steps are that fast (server.stream_coalesce_ms; forged.engine.hold); 0: none.
    hold_ms: float = 0.0

    @property
    def per_slot(self) -> bool:
        return self.per_slot_cells > 0

    @property
    def batch_tokens(self) -> int:
        """llama.cpp's n_batch and n_ubatch: the most tokens of any step."""
        return max(self.step_tokens, self.prefill_step_tokens)

    def max_choices(self, prompt: int, max_tokens: int) -> int:
        """The most sequences (``n``) one request of this shape can ever run at once:
        each takes a slot, and in the unified layout the decode cells reserved for
        each beside the one shared prompt must fit the room."""
        most = self.max_running
        if self.per_slot:
            return most
        each = max(1, min(max_tokens, self.decode_reservation))
        return min(most, (self.room - prompt) // each)

    @property
    def embed_batch(self) -> int:
        """The most tokens one embedding batch computes: llama.cpp's n_batch and n_ubatch,
        since an encoder computes a sequence in one micro-batch; at least one whole
        input."""
        return max(self.step_tokens, self.prefill_step_tokens, self.max_context)

    @property
    def geometry(self) -> tuple[int, int, int]:
        """What a running worker's llama.cpp context fixes: a reload cannot change it."""
        return self.kv_cells, self.slots, self.per_slot_cells


def scheduler_limits(cfg: Config, n_ctx_train: int, *,
                     encoder: bool = False) -> SchedulerLimits:
    """The scheduler's limits under ``cfg``, for a model trained on ``n_ctx_train``.
    An ``encoder`` (an embedding model) has no KV cache to bound a request, but its
    position embeddings end at ``n_ctx_train``: no input may be longer."""
    e, lim = cfg.engine, cfg.limits
    room = n_ctx_train if encoder else e.room
    return SchedulerLimits(
        kv_cells=e.kv_cells, slots=e.slots, max_running=e.max_running,
        step_tokens=e.step_tokens, prefill_step_tokens=e.prefill_step_tokens,
        room=e.room, max_context=min(room, e.max_context or n_ctx_train),
        target_step_ms=e.target_step_ms, first_token_weight=e.first_token_weight,
        kv_headroom=e.kv_headroom,
        decode_reservation=e.decode_reservation, per_slot_cells=e.per_slot_cells,
        max_queued=lim.max_queued, max_queued_tokens=lim.max_queued_tokens,
        overtake_window=lim.overtake_window, session_ttl=lim.session_ttl,
        cache_ram_bytes=e.cache_ram_mib << 20, cache_disk_bytes=e.cache_disk_mib << 20,
        hold_ms=cfg.server.stream_coalesce_ms,
    )
