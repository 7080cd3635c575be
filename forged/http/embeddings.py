"""Embeddings: OpenAI's ``POST /v1/embeddings`` here, and :func:`embed`, which every
dialect's embedding route calls (llama.cpp's ``/embedding``, Ollama's ``/api/embed``).

One API call is one engine request (``Request.inputs``) to the model whose role is
"embed" (or the one it names): the pool routes and admits it, the worker batches its
texts with other callers' (forged.engine.embedcore), and it counts against its key's
limits and in the metrics as a generation does. Vectors are unit length (L2), as
OpenAI's, llama-server's and Ollama's are.

An input longer than the model takes is refused (400, ``context_length_exceeded``)
unless the request says to truncate it: OpenAI refuses, Ollama truncates by default.
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal, NamedTuple

import msgspec
import numpy as np
import numpy.typing as npt
import trio
from quart import Response
from quart_trio import QuartTrio

from forged import errors as e
from forged.config import Priority
from forged.engine.events import Done, Event
from forged.engine.groups import ModelGroup
from forged.engine.pool import RequestStream
from forged.engine.request import Request
from forged.http import api
from forged.http.generate import Outcome, admitted_events, begin_outcome
from forged.http.infill import check_ids
from forged.http.keylimits import KeyUsage, capped_priority, hold_generation
from forged.http.lifetime import call
from forged.http.state import AppState

log = logging.getLogger("forged")
# OpenAI's limit on the inputs of one call.
MAX_INPUTS = 2048
# One text, one list of token ids, or a list of either (msgspec takes one array type
# in a union: the list's items are checked by _listed).
Input = str | list[Any]


class EmbeddingsRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    input: Input
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    # Only the model's own length: forged does not shorten vectors (no Matryoshka).
    dimensions: Annotated[int, msgspec.Meta(ge=1)] | None = None
    user: str | None = None
    # forged's (and vLLM's truncate_prompt_tokens, as a switch): cut a too-long input
    # to the model's length instead of refusing it.
    truncate: bool = False
    priority: Literal["interactive", "batch"] | None = None


embeddings_decoder = msgspec.json.Decoder(EmbeddingsRequest)


class Embedded(NamedTuple):
    model: str  # the id of the model that made them
    vectors: npt.NDArray[np.float32]  # one unit-length row per input
    prompt_tokens: int
    seconds: float


def add_routes(app: QuartTrio, state: AppState) -> None:
    @app.post("/v1/embeddings")
    @app.post("/embeddings")  # llama-server's alias
    async def embeddings() -> Response:
        req = await api.decoded_body(state, embeddings_decoder, engine=False)
        done = await embed(state, req.model, req.input, truncate=req.truncate,
                           dimensions=req.dimensions, priority=req.priority)
        return await answer(state, done, openai_body, req.encoding_format)


# Floats in an answer past which it is made in one of the door's threads: 2,048 vectors
# of 384 as JSON are ~15 MB and tens of milliseconds, which the event loop must not
# spend (every stream's next token would wait).
_ON_LOOP_FLOATS = 16_384


async def answer(state: AppState, done: Embedded,
                 shape: Callable[[Embedded, str], Any], encoding: str = "float") -> Response:
    """``shape(done, encoding)`` as a JSON response, made off the event loop when large."""
    def encoded() -> bytes:
        return msgspec.json.encode(shape(done, encoding))

    body = encoded() if done.vectors.size <= _ON_LOOP_FLOATS else \
        await state.off_loop(encoded)
    return Response(body, content_type="application/json")


def openai_body(done: Embedded, encoding: str) -> dict[str, Any]:
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(row.astype("<f4").tobytes()).decode()
             if encoding == "base64" else row.tolist()}
            for i, row in enumerate(done.vectors)]
    return {"object": "list", "data": data, "model": done.model,
            "usage": {"prompt_tokens": done.prompt_tokens,
                      "total_tokens": done.prompt_tokens}}


async def embed(state: AppState, model: str | None, given: Input, *, truncate: bool,
                dimensions: int | None = None, priority: Priority | None = None,
                param: str = "input") -> Embedded:
    """Every input's vector, from the embedding model ``model`` names (None: the one
    whose role is "embed"); ``param`` names the body's field in errors."""
    started = time.monotonic()
    c = call()
    group = c.held.enter_context(state.models.use(model, embed=True))
    c.model = group.model_id
    if dimensions is not None and dimensions != group.prompter.vocab.n_embd:
        raise e.BadRequest(f"the model {group.model_id} makes vectors of "
                           f"{group.prompter.vocab.n_embd} dimensions only; forged does "
                           "not shorten them", param="dimensions")
    _hold_key(state.key_usage, state.cfg.limits.retry_after, group)
    prompt, lengths = await state.off_loop(_prompt, group, given, truncate, param)
    request_ = Request(prompt=prompt, max_tokens=0, inputs=lengths, tenant=_tenant(),
                       priority=capped_priority(priority, c.key,
                                                state.cfg.limits.default_priority),
                       queue_timeout=state.cfg.limits.queue_timeout)
    outcome = begin_outcome(state, request_.priority)
    outcome.prompt_tokens = len(request_.prompt)
    vectors = await _run(state, group, request_, outcome)
    rows = np.frombuffer(vectors, dtype="<f4").reshape(len(lengths), -1)
    return Embedded(group.model_id, rows, len(request_.prompt), time.monotonic() - started)


def _tenant() -> str:
    key = call().key
    return key.tenant if key else ""


def _hold_key(usage: dict[str, KeyUsage], retry_after: int, group: ModelGroup) -> None:
    """One place of the key's ``max_streams`` for the call, as a generation takes."""
    if (key := (c := call()).key) is not None:
        c.hold = hold_generation(usage, key, 1, would_wait=group.pool.would_wait(1),
                                 retry_after=retry_after)


async def _run(state: AppState, group: ModelGroup, req: Request, outcome: Outcome) -> bytes:
    held = call().held
    try:
        held.enter_context(state.drain.generation())
        rs = outcome.rs = await held.enter_async_context(group.pool.open_request(req))
        events = await admitted_events(state.drain, state.cfg.limits.retry_after, rs, outcome)
        done = await _answer(rs, events)
    except e.ForgedError as exc:
        outcome.failed(exc)
        raise
    outcome.end, outcome.prefill = "ok", (done.prefill_s, 1)
    outcome.responded(200)
    return done.embeddings


async def _answer(rs: RequestStream, events: list[Event]) -> Done:
    while True:
        for ev in events:
            if isinstance(ev, Done):
                return ev
        events = await rs.receive()


async def query_vector(state: AppState, text: str, tenant: str) -> tuple[bytes, str]:
    """A search query's vector by the embedding model, and that model's content id
    (what an index's vectors must be made by); ``(b"", "")`` without an embedding
    model, or when it cannot answer within ``server.door_timeout``: BM25 alone then."""
    group = next((g for g in state.models.serving if g.role == "embed"), None)
    if group is None:
        return b"", ""
    with group.use(), trio.move_on_after(state.cfg.server.door_timeout):
        try:
            (tokens,) = await state.off_loop(_tokens, group, text, True, "query")
            req = Request(prompt=tokens, max_tokens=0, inputs=[len(tokens)], tenant=tenant,
                          queue_timeout=state.cfg.limits.queue_timeout)
            async with group.pool.open_request(req) as rs:
                done = await _answer(rs, [])
            return done.embeddings, group.prompter.content_id
        except e.ForgedError as exc:
            log.info("retrieval by BM25 alone: the embedding model did not answer: %s", exc)
            state.metrics.bm25_alone.labels("error").inc()
            return b"", ""
    # Busy with other calls (an index's, say) past the door's timeout: a question
    # silently lost its meaning-based half; the metric says how often.
    log.info("retrieval by BM25 alone: the embedding model did not answer within %g s",
             state.cfg.server.door_timeout)
    state.metrics.bm25_alone.labels("timeout").inc()
    return b"", ""


def _prompt(group: ModelGroup, given: Input, truncate: bool, param: str
            ) -> tuple[list[int], list[int]]:
    """:func:`_tokens`, one input after another, and each one's length: joined here in
    the door's thread, as a million ids (the most a call may send) take about 30 ms,
    which on the event loop every stream would wait for."""
    inputs = _tokens(group, given, truncate, param)
    return [t for x in inputs for t in x], [len(x) for x in inputs]


def _tokens(group: ModelGroup, given: Input, truncate: bool, param: str) -> list[list[int]]:
    """Each input's tokens ([CLS] text [SEP] for a BERT); token ids as given. Too long:
    cut to the model's length with ``truncate``, else a 400."""
    texts = _listed(given, param)
    if not texts:
        raise e.BadRequest("no input to embed", param=param)
    if len(texts) > MAX_INPUTS:
        raise e.BadRequest(f"at most {MAX_INPUTS} inputs in one call", param=param)
    lim = group.pool.limits
    longest = min(lim.max_context, lim.embed_batch)
    out = []
    for i, text in enumerate(texts):
        if text == "":  # a BERT still gives [CLS] [SEP]: a vector of nothing
            raise e.BadRequest(f"input {i} is empty", param=param)
        if isinstance(text, str):
            toks = group.prompter.tokenize(text, add_special=True, parse_special=False)
        else:
            check_ids(group, text, param)
            toks = text
        if not toks:
            raise e.BadRequest(f"input {i} is empty", param=param)
        out.append(_fitted(group, toks, longest, truncate, f"input {i}", param))
    return out


def _listed(given: Input, param: str) -> list[str | list[int]]:
    """The inputs as a list: one text, one list of token ids, or a list of either."""
    if isinstance(given, str):
        return [given]
    if given and all(_is_id(t) for t in given):
        return [given]
    if all(isinstance(x, str) or (isinstance(x, list) and all(map(_is_id, x)))
           for x in given):
        return given
    raise e.BadRequest("input must be a string, a list of token ids, or a list of "
                       "either", param=param)


def _is_id(t: object) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _fitted(group: ModelGroup, toks: list[int], longest: int, truncate: bool, what: str,
            param: str) -> list[int]:
    if len(toks) <= longest:
        return toks
    if not truncate:
        exc = e.ContextTooLong(f"{what} is {len(toks)} tokens, more than the {longest} "
                               f"the model {group.model_id} takes")
        exc.param = param
        raise exc
    # The end stays: a BERT's [SEP] closes what it was trained to read.
    return toks[:longest - 1] + toks[-1:]
