"""Where a request is batched: the layout of one step, as pure functions.

What goes in: the running sequences (the decoders' next tokens, the prompts still
being computed), the limits and the cost model. What comes out: the chunks of one
``llama_decode`` call. Nothing here changes a record; the scheduler
(:mod:`forged.engine.scheduler`) calls :func:`lay_out` every step and decides what to
admit, evict or preempt around it.

Each step, every decoding sequence gets its next token first. The rest of the step
goes to prompt chunks (chunked prefill), bounded by *time*: the step's predicted
duration (:class:`~forged.engine.costmodel.CostModel`, refitted from every step the
worker measures) stays within a budget that follows the work (:func:`prompt_room_ms`:
the decoders' cost weighed by how many requests wait for a first token against how
many streams decode, up to ``target_step_ms``), and its tokens within
``step_tokens``. A step with no prompt work is as fast as decoding alone.
Prompt chunks go interactive before batch, then shortest remaining prompt first with
aging (:func:`virtual_start`); prompts shorter than an aged long one take up to half
of the step's prompt room before it (:func:`prefill_sequence`), so a one-line
question arriving during a long prefill gets its first token in the next step (or
the next few, on a slow machine), while the long prompt keeps at least half of every
step.

Sans-IO: plain values in, plain values out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from forged.engine.costmodel import CostModel, StepShape, decode_shape, with_passes
from forged.engine.kvledger import KVLedger
from forged.engine.limits import SchedulerLimits
from forged.engine.plan import Chunk, Key
from forged.engine.seqstate import Phase, Running

# When the decoders alone fill the time target (a slow spell, a big model, many
# streams), prompts that wait still get this share of every step: a step is then at
# most 4/3 of a decode-only one, and new requests keep starting at a pace that follows
# the machine's. And a step always makes at least MIN_PREFILL_TOKENS of prompt progress.
MIN_PROMPT_SHARE = 0.25
MIN_PREFILL_TOKENS = 16
# A floor chunk long enough for tiled attention takes four times as long as one of
# MIN_PREFILL_TOKENS; it replaces it only where it at least halves the cost per token.
TILED_FLOOR_GAIN = 2.0
# A scored prompt (echo with logprobs) wants logits for every position; llama.cpp keeps
# a row of n_vocab floats for each (49,152 for SmolLM2: 192 KiB), so a step carries at
# most this many scored prompt tokens, which bounds that buffer at about 12 MiB.
MAX_SCORED_TOKENS = 64


def virtual_start(limits: SchedulerLimits, submitted_at: float, prompt_tokens: int) -> float:
    """When a request counts as submitted, for ordering within its class.

    Shortest first with continuous aging: a prompt is served as if it had arrived
    ``overtake_window`` times its share of ``max_context`` later. A one-line completion
    thus goes before a 700-token file that arrived a little earlier, prompts of one
    length stay first come, first served, and no prompt waits more than
    ``overtake_window`` longer than it would in arrival order: every later arrival
    starts later. A hard window (overtake until N seconds, then first) fell back to
    arrival order exactly when the queue was long, because then everyone was old.
    """
    share = prompt_tokens / max(1, limits.max_context)
    return submitted_at + limits.overtake_window * min(1.0, share)


def prefill_order(limits: SchedulerLimits, run: Running) -> tuple[int, float]:
    """Interactive first; then by virtual start on what is left of the prompt, so the
    same aging that orders the queue keeps a steady trickle of short prompts from
    holding a long prefill back forever."""
    return run.req.rank, virtual_start(limits, run.submitted_at, run.prompt_left)


def decode_chunks(running: Iterable[Running], ledger: KVLedger) -> list[Chunk]:
    """Each decoding sequence's next token, at the end of what its sequence holds."""
    return [Chunk(run.rid, run.slot, ledger.length(run.slot), [run.last_token],
                  sample=True, index=run.index)
            for run in running if run.phase is Phase.DECODE]


def lay_out(limits: SchedulerLimits, cost: CostModel, decoders: list[Chunk],
            prefilling: list[Running], running: int, queued: int) -> list[Chunk]:
    """The step's chunks: ``decoders`` (from :func:`decode_chunks`), then prompt chunks
    of ``prefilling`` within the time and token room they leave. ``running``: how many
    sequences run (the most chunks of the unified layout); ``queued``: how many
    requests wait for a slot (:func:`prompt_room_ms`)."""
    chunks = list(decoders)
    cap = (limits.step_tokens if chunks else limits.batch_tokens) - len(chunks)
    room = prompt_room_ms(limits, cost, chunks, prefilling, queued)
    # Per-slot streams: llama.cpp splits such a batch into micro-batches that take
    # the same number of tokens from every sequence still in it, so each distinct
    # chunk length costs one more pass over the weights (~5 ms here, measured in
    # docs/engine.md). A few chunks per step fill the room when prompts are short.
    max_chunks = limits.max_prefill_chunks if limits.per_slot else running
    floor, scored = True, MAX_SCORED_TOKENS
    for run, share in prefill_sequence(limits, cost, prefilling, room, max_chunks)[:max_chunks]:
        most = min(cap, run.prompt_left)
        if run.req.prompt_logprobs:
            most = min(most, scored)
            if most <= 0:
                continue  # the step's logits are spent; unscored prompts may go on
        take = cost.max_prompt_tokens(run.next_prompt, min(room, share), most)
        if floor and share == math.inf:  # the aging order's head always progresses
            take, floor = max(take, floor_tokens(cost, run.next_prompt, most)), False
        if take <= 0:
            if share < math.inf:
                continue  # its half of the room fits no token; the head's does
            break
        if run.req.prompt_logprobs:
            scored -= take
        chunks.append(_prompt_chunk(run, take))
        room -= cost.predict_extra(cost.chunk(run.next_prompt, take))
        cap -= take
    return chunks


def _prompt_chunk(run: Running, take: int) -> Chunk:
    toks = run.req.prompt[run.next_prompt : run.next_prompt + take]
    done = take == run.prompt_left
    return Chunk(run.rid, run.slot, run.next_prompt, toks, sample=done, index=run.index,
                 forks=run.forks if done else ())


def floor_tokens(cost: CostModel, pos: int, most: int) -> int:
    """The least prompt progress of a step with prompts: MIN_PREFILL_TOKENS, or a
    chunk long enough for tiled attention where that is clearly cheaper per token.
    Far into a context one-query-at-a-time attention dominates: at position 1,000,
    16 tokens cost about 15 ms each and 65 tokens about 4 ms each."""
    rows = cost.tile_rows
    small, tiled = min(most, MIN_PREFILL_TOKENS), min(most, rows + 1)
    if tiled <= rows or tiled <= small:
        return small  # too short for tiles, or the small chunk is tiled already

    def per_token(n: int) -> float:
        return cost.predict_extra(cost.chunk(pos, n)) / n

    return tiled if TILED_FLOOR_GAIN * per_token(tiled) <= per_token(small) else small


def prompt_room_ms(limits: SchedulerLimits, cost: CostModel, decoders: list[Chunk],
                   prefilling: list[Running], queued: int) -> float:
    """Milliseconds of prompt work a step may take beside ``decoders``, of the
    ``prefilling`` prompts, with ``queued`` requests waiting for a slot: those and the
    prompts are the requests yet to see a first token.

    The step's budget follows the work. Every millisecond of prompt work in a step is a
    millisecond more for every decoding stream's gap; every millisecond of it put off is
    a millisecond more for every waiting request's first token. So the room is the
    decoders' own cost times ``first_token_weight`` times waiting ÷ decoding: one prompt
    beside sixteen streams lengthens their gaps a little (the floors below still move it
    every step), a backlog of prompts grows the budget to ``target_step_ms``, which is
    the ceiling, not the usual. A step in which some prompt can finish within the
    ceiling, or with no stream decoding, takes the ceiling's room: a short question's
    first token is not put off, and nobody pays for a gap. Never less than
    MIN_PROMPT_SHARE of the step."""
    decode = cost.predict(decoders_shape(limits, decoders))
    room = limits.target_step_ms - decode
    # inf (the default) skips the weighing: inf x 0 waiting would be NaN.
    weighed = decoders and limits.first_token_weight < math.inf
    if weighed and not _some_can_finish(cost, prefilling, room):
        waiting = len(prefilling) + queued
        room = min(room, decode * limits.first_token_weight * waiting / len(decoders))
    return max(room, decode * MIN_PROMPT_SHARE / (1 - MIN_PROMPT_SHARE))


def _some_can_finish(cost: CostModel, prefilling: list[Running], room: float) -> bool:
    return any(cost.predict_extra(cost.chunk(r.next_prompt, r.prompt_left)) <= room
               for r in prefilling)


def prefill_sequence(limits: SchedulerLimits, cost: CostModel, prefilling: list[Running],
                     room: float, max_chunks: int) -> list[tuple[Running, float]]:
    """The prompts in the order they get this step's room, each with the most of it
    (milliseconds) it may take.

    The aging order (:func:`prefill_order`), except that the leading class's prompts
    shorter than its head go first, shortest remaining first, within half of the
    room: a short question arriving during a long prefill gets its first token in the
    next step, or, where it cannot finish within half a step (a slow machine, many
    decoders), in the next few, instead of waiting in aging order for the whole long
    prompt (seen: 21 steps, 6 s, behind a 632-token file). The head takes the rest,
    at least half of every step, so it is never starved.
    """
    order = sorted(prefilling, key=lambda run: prefill_order(limits, run))
    if not order:
        return []
    head = order[0]
    shorter = sorted((r for r in order[1:] if r.req.rank == head.req.rank
                      and r.prompt_left < head.prompt_left), key=lambda r: r.prompt_left)
    first: list[tuple[Running, float]] = []
    half = room / 2
    for run in shorter[: max_chunks - 1]:  # the last chunk of the step is the head's
        if half <= 0:
            break
        work = cost.predict_extra(cost.chunk(run.next_prompt, run.prompt_left))
        first.append((run, min(work, half)))
        half -= work
    taken = {id(r) for r, _ in first}
    return first + [(r, math.inf) for r in order if id(r) not in taken]


def step_shape(limits: SchedulerLimits, cost: CostModel, chunks: list[Chunk],
               running: Mapping[Key, Running]) -> StepShape:
    """What the cost model needs to predict the step of ``chunks``."""
    decode = [c.pos for c in chunks if running[c.key].phase is Phase.DECODE]
    shape = decode_shape(decode)
    for c in chunks:
        if running[c.key].phase is Phase.PREFILL:
            shape = shape.plus(cost.chunk(c.pos, len(c.tokens)))
    return _passes(limits, shape, chunks)


def decoders_shape(limits: SchedulerLimits, decoders: list[Chunk]) -> StepShape:
    """A step of ``decoders`` alone: with per-slot streams, each gap in their slots'
    ids costs a pass (micro-batches take consecutive ids only)."""
    return _passes(limits, decode_shape([c.pos for c in decoders]), decoders)


def _passes(limits: SchedulerLimits, shape: StepShape, chunks: list[Chunk]) -> StepShape:
    if not limits.per_slot or not chunks:
        return shape
    return with_passes(shape, [(c.seq, len(c.tokens)) for c in chunks], limits.batch_tokens)
