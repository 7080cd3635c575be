"""llama.cpp's native API: ``POST /completion`` (and its alias ``/completions``),
``GET /props`` and ``POST /apply-template``, as llama-server serves them, for
llama.vscode, llama.vim and Continue's ``llama.cpp`` provider.

``/completion`` is a translation to :func:`forged.http.api.run_completion`: the body
is a completion request with llama.cpp's names (``n_predict``, ``n_probs``,
``return_tokens``, ``id_slot``, ``t_max_predict_ms``, ``n_indent``,
``response_fields``) and every sampler of llama.cpp's chain
(:mod:`forged.http.sampling`); the answer is llama-server's object (``content``,
``tokens``, ``stop``, ``stop_type``, ``stopping_word``, ``timings``,
``completion_probabilities``, ...), whole or as SSE events without ``[DONE]``.

``id_slot`` is accepted as -1 only: forged has no slots to pin, its shared prefix
cache does what a pinned slot would (``cache_prompt``). llama-server's ``prompt``
(the prompt as text) is left out of the answer, as is a ``generation_settings`` in
full: the answer's carries the sampling settings, the context and the budget.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import Meta
from quart import Response, request
from quart_trio import QuartTrio

import forged
from forged import errors as e
from forged.engine.decoding import TokenLogprob
from forged.engine.events import Done
from forged.engine.groups import Models
from forged.engine.request import Sampling
from forged.http import api, sse
from forged.http.chat import chat_text
from forged.http.embeddings import answer, embed
from forged.http.infill import final_fields, select
from forged.http.logprobs import Vocabulary
from forged.http.refused import unsupported
from forged.http.responses import HTTPError, json_response
from forged.http.sampling import sampling
from forged.http.schemas import (
    MAX_TOP_LOGPROBS,
    ChatRequest,
    CompletionRequest,
    Window,
)
from forged.http.state import AppState


class LlamaCompletion(CompletionRequest, kw_only=True):
    """llama-server's /completion body: a completion request with its names."""

    # n_predict 0 computes the prompt into the cache and answers with no text.
    warms_up: ClassVar[bool] = True
    # llama-server answers one completion per prompt; forged takes one prompt.
    n: Annotated[int, Meta(ge=1, le=1)] = 1
    # max_tokens' name here; -1 (llama.cpp's default): until the context is full.
    n_predict: Window | None = None
    # Each generated token's top-N probabilities (``logprobs`` is its other name).
    n_probs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # The generated token ids in ``tokens`` (a stream always has them).
    return_tokens: bool = False
    id_slot: int = -1
    t_max_predict_ms: Annotated[float, Meta(ge=0)] = 0.0
    n_indent: Annotated[int, Meta(ge=0)] = 0
    # llama.cpp's: which tokens to keep when the context overflows. forged never
    # shifts the context (a prompt that does not fit is refused), so none is lost.
    n_keep: Annotated[int, Meta(ge=-1)] = 0
    response_fields: Annotated[list[str], Meta(max_length=64)] | None = None

    def editor_bounds(self) -> tuple[float, int]:
        return self.t_max_predict_ms, self.n_indent


_completion_decoder = msgspec.json.Decoder(LlamaCompletion)
_template_decoder = msgspec.json.Decoder(ChatRequest)


class LlamaEmbedding(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """llama-server's /embedding body: text, token ids, or a list of either."""

    content: str | list[Any]  # as /v1/embeddings' input
    model: str | None = None
    # llama-server's normalisation: 2 (Euclidean) is what every vector here has.
    embd_normalize: Literal[2] = 2
    truncate: bool = False  # forged's, as /v1/embeddings'


_embedding_decoder = msgspec.json.Decoder(LlamaEmbedding)


def add_routes(app: QuartTrio, state: AppState) -> None:
    async def completion() -> Response:
        req = await api.decoded_body(state, _completion_decoder, refuse=True)
        return await api.run_completion(state, *_translated(state, req))

    app.post("/completion")(completion)
    app.post("/completions", endpoint="completions_alias")(completion)

    @app.get("/props")
    async def props() -> Response:
        return json_response(_props(state.models, request.args.get("model")))

    @app.post("/embedding")
    async def embedding() -> Response:
        req = await api.decoded_body(state, _embedding_decoder, engine=False)
        done = await embed(state, req.model, req.content, truncate=req.truncate,
                           param="content")
        # llama-server's shape: per input, its pooled vector as a list of one.
        return await answer(state, done, lambda d, _: [
            {"index": i, "embedding": [row.tolist()]} for i, row in enumerate(d.vectors)])

    @app.post("/apply-template")
    async def apply_template() -> Response:
        req = await api.decoded_body(state, _template_decoder, engine=False)
        with state.models.use(req.model) as group:
            return json_response({"prompt": await chat_text(state, group, req)})


def _translated(state: AppState, req: LlamaCompletion
                ) -> tuple[CompletionRequest, functools.partial[LlamaFormat]]:
    """The completion request, and the answer's shape with this request's settings."""
    if req.id_slot != -1:
        raise e.BadRequest("id_slot must be -1: forged has no slots to pin (its shared "
                           "prefix cache reuses any earlier prompt)", param="id_slot")
    if req.echo:  # /v1/completions' field, which llama-server's answer has no room for
        raise unsupported("the answer holds the completion only: /v1/completions echoes "
                          "the prompt", "echo")
    probs = req.n_probs if req.n_probs is not None else req.logprobs or 0
    budget = req.n_predict if req.n_predict is not None else req.max_tokens
    # Token ids come with the logprob entries: asked for whenever the answer has ids.
    tokens = req.stream or req.return_tokens
    completion = msgspec.structs.replace(req, max_tokens=budget, logprobs=(
        probs if probs or tokens else None))
    group = state.models.resolve(req.model)
    settings = generation_settings(sampling(state, group, req), group.max_context,
                                   -1 if budget is None else budget)
    settings.update(stream=req.stream, n_probs=probs, stop=req.stop or [],
                    ignore_eos=req.ignore_eos)
    return completion, functools.partial(LlamaFormat, settings=settings, probs=probs,
                                         tokens=tokens, fields=req.response_fields)


def generation_settings(s: Sampling, n_ctx: int, n_predict: int) -> dict[str, Any]:
    """llama-server's ``generation_settings``, of what forged applies: the sampling
    settings, the context and the budget."""
    out = {f: getattr(s, f) for f in _SETTINGS}
    out.update(n_ctx=n_ctx, n_predict=n_predict, max_tokens=n_predict,
               seed=0xFFFFFFFF if s.seed is None else s.seed,  # llama.cpp's "random"
               samplers=list(s.order), dry_sequence_breakers=list(s.dry_sequence_breakers))
    return out


_SETTINGS = ("temperature", "dynatemp_range", "dynatemp_exponent", "top_k", "top_p",
             "min_p", "top_n_sigma", "xtc_probability", "xtc_threshold", "typical_p",
             "repeat_last_n", "repeat_penalty", "presence_penalty", "frequency_penalty",
             "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
             "mirostat", "mirostat_tau", "mirostat_eta", "min_keep")


def _props(models: Models, model: str | None) -> dict[str, Any]:
    group = models.resolve(model, embed=None)
    settings = generation_settings(Sampling(), group.max_context, -1)
    settings.update(model=group.model_id)
    return {
        "default_generation_settings": {"n_ctx": group.max_context, "params": settings},
        "total_slots": group.pool.limits.max_running * len(group.pool.workers),
        "model_alias": group.model_id,
        "model_path": group.model.path.rsplit("/", 1)[-1],
        "chat_template": group.prompter.chat_template,
        "modalities": {"vision": False, "audio": False},
        "build_info": f"forged {forged.__version__}",
        "is_sleeping": False,
    }


class LlamaFormat(sse.CompletionFormat):
    """llama-server's completion objects: one per SSE event, no ``[DONE]``; the last
    has ``stop: true`` and the whole answer's accounting."""

    def __init__(self, model: str, created: int, n: int = 1, *,
                 settings: dict[str, Any], probs: int, tokens: bool,
                 fields: list[str] | None, fingerprint: str | None = None,
                 vocab: Vocabulary | None = None, echo: sse.Echo | None = None) -> None:
        super().__init__(model, created, n, fingerprint=fingerprint)
        self.settings, self.probs, self.tokens, self.fields = settings, probs, tokens, fields
        self.vocab = vocab
        self.new_line = False  # whether a delta sent so far held a newline

    def start(self) -> bytes:
        return b""

    def delta(self, text: str, index: int = 0,
              logprobs: list[TokenLogprob] | None = None) -> bytes:
        entries = logprobs or []
        self.new_line = self.new_line or "\n" in text
        out: dict[str, Any] = {"index": 0, "content": text,
                               "tokens": [t.token for t in entries], "stop": False,
                               "id_slot": -1}
        if self.probs:
            out["completion_probabilities"] = self._probabilities(entries)
        return sse.event(out)

    def finish(self, done: Done) -> bytes:
        out = self.delta(done.text, 0, done.logprobs) if done.text or done.logprobs else b""
        return out + sse.event(self._final("", done, [], self.new_line))

    def end(self, dones: list[Done], include_usage: bool) -> bytes:
        return b""  # llama-server's events end with the last one, without [DONE]

    def error(self, err: HTTPError) -> bytes:
        return sse.event(err.body)

    def whole(self, texts: list[str], dones: list[Done],
              scores: list[sse.Scores] | None = None) -> dict[str, Any]:
        entries = scores[0].tokens if scores else []
        body = self._final(texts[0], dones[0], entries, "\n" in texts[0])
        if self.probs:
            body["completion_probabilities"] = self._probabilities(entries)
        return body if self.fields is None else select(body, self.fields)

    def _final(self, text: str, done: Done, entries: list[TokenLogprob], new_line: bool
               ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "index": 0, "content": text,
            "tokens": [t.token for t in entries] if self.tokens else [],
            **final_fields(done, new_line, self.model),
            "generation_settings": {**self.settings, "model": self.model},
        }
        if self.retrieved is not None:
            body["retrieved"] = self.retrieved
        return body

    def _probabilities(self, entries: list[TokenLogprob]) -> list[dict[str, Any]]:
        """llama-server's ``completion_probabilities``: each token, and its ``n_probs``
        most likely alternatives, under the model's own distribution."""
        return [{**self._token(t.token, t.logprob),
                 "top_logprobs": [self._token(a, lp) for a, lp in t.top[:self.probs]]}
                for t in entries]

    def _token(self, token: int, logprob: float) -> dict[str, Any]:
        assert self.vocab is not None  # asked for with n_probs
        piece = self.vocab.token_bytes(token)
        return {"id": token, "token": piece.decode("utf-8", "ignore"),
                "bytes": list(piece), "logprob": logprob}

