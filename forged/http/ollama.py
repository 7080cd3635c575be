"""Ollama's API (``/api/*``): the dialect of Ollama's own clients, of the "Ollama"
providers of editors (Copilot, JetBrains, Continue, Zed) and of scripts on the
``ollama`` Python client.

A thin translation. ``/api/chat`` becomes forged's one chat request
(:func:`forged.http.api.run_chat`); ``/api/generate`` becomes a chat request of one
user turn (the model's template applies, as in Ollama), a completion of the prompt as
it is (``raw``), or fill-in-the-middle (``suffix``) through
:func:`~forged.http.api.run_completion`. Keys, per-key limits, metrics and the access
log come with them. The answer goes back in Ollama's shapes
(:mod:`forged.http.ollama_shapes`): NDJSON lines by default, one object with
``"stream": false``.

``options`` map to forged's sampling fields, checked as on ``/v1/`` (a bad value is a
400 naming ``options.<name>``). Options that only say how Ollama loads a model
(``num_gpu``, ``num_thread``, ...) change no answer and are accepted; one forged
cannot honour (``tfs_z`` other than 1, ...) is a 400 naming it, and so is an
option Ollama does not have. At the top level, fields this module does not know are
ignored, as Ollama's server does; fields it knows and cannot honour (``images``,
``think``, a ``template`` of the request's own, ...) are a 400 naming them.

Models are the admin's: pulling, pushing, creating, copying and deleting are refused
(403). ``/api/embed`` and ``/api/embeddings`` are served by the embedding model (the
one whose role is "embed", or the one ``model`` names).
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta
from quart import Response
from quart_trio import QuartTrio

from forged import errors as e
from forged.engine.groups import ModelGroup, Models
from forged.http import api
from forged.http.embeddings import Embedded, answer, embed
from forged.http.ollama_shapes import (
    OLLAMA_VERSION,
    GenerateFromChat,
    GenerateFromText,
    OllamaChat,
    error_shape,
    loaded,
    model_list,
    nanoseconds,
    running_list,
    show,
)
from forged.http.refused import Refused, refuse
from forged.http.responses import json_response
from forged.http.schemas import ChatRequest, CompletionRequest, Role
from forged.http.state import AppState

T = TypeVar("T")


class Options(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Ollama's ``options``: each one it has, and no other (a misspelt option would
    otherwise be ignored without a word)."""

    # forged's sampling, its ranges checked as /v1/ checks them
    num_predict: Annotated[int, Meta(ge=-2)] | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    num_ctx: Annotated[int, Meta(ge=1)] | None = None  # see _generation_fields
    # How Ollama loads and runs a model: the appliance's config decides that, and
    # none of them changes an answer.
    num_keep: Any = None
    numa: Any = None
    num_batch: Any = None
    num_gpu: Any = None
    main_gpu: Any = None
    low_vram: Any = None
    f16_kv: Any = None
    use_mmap: Any = None
    use_mlock: Any = None
    num_thread: Any = None
    # llama.cpp's samplers, as on /v1/ (their ranges checked there)
    mirostat: Any = None
    mirostat_tau: Any = None
    mirostat_eta: Any = None
    typical_p: Any = None
    repeat_last_n: Any = None
    # refused unless off (_REFUSED_OPTIONS)
    tfs_z: Any = None
    penalize_newline: Any = None
    logits_all: Any = None
    vocab_only: Any = None
    embedding_only: Any = None


_REFUSED_OPTIONS = {
    "tfs_z": Refused("tail-free sampling is not supported", (None, 1.0)),
    "penalize_newline": Refused("newlines are never penalised apart", (None, False)),
    "logits_all": Refused("logits are not returned", (None, False)),
    "vocab_only": Refused("the model is always loaded whole", (None, False)),
    "embedding_only": Refused("there is no embedding model", (None, False)),
}


class _Body(msgspec.Struct, kw_only=True):
    """What chat and generate share."""

    model: str
    stream: bool = True  # Ollama streams unless told not to
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    # How long Ollama keeps the model loaded after the request: forged always does.
    keep_alive: str | float | None = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


# Top-level fields forged knows and cannot honour, with the values that ask for nothing.
_REFUSED = {
    "think": Refused("thinking is not told apart from the answer: a model's reasoning, "
                     "if any, is part of its content", (None, False)),
    "logprobs": Refused("use /v1/chat/completions or /v1/completions for logprobs",
                        (None, False)),
    "top_logprobs": Refused("use /v1/chat/completions or /v1/completions for logprobs",
                            (None, 0)),
}


class Message(msgspec.Struct, kw_only=True):
    role: Role
    content: str = ""
    images: list[str] | None = None
    thinking: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    # The tool a result is from: Hermes' <tool_response> (forged.http.tools) names
    # none, so it changes nothing in the prompt.
    tool_name: str | None = None


class ChatBody(_Body, kw_only=True):
    messages: list[Message] = []
    tools: list[dict[str, Any]] | None = None


class GenerateBody(_Body, kw_only=True):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None
    # image generation's
    width: int | None = None
    height: int | None = None
    steps: int | None = None


_REFUSED_GENERATE = {
    **_REFUSED,
    "template": Refused("a request's own template is not supported: the model's chat "
                        "template is used (or raw: true sends the prompt as it is)",
                        (None, "")),
    "context": Refused("the context of an earlier answer is not returned nor taken: send "
                       "the conversation to /api/chat", (None, [])),
    "images": Refused("images are not supported: this model reads text only", (None, [])),
    "width": Refused("image generation is not supported"),
    "height": Refused("image generation is not supported"),
    "steps": Refused("image generation is not supported"),
}


class ShowBody(msgspec.Struct, kw_only=True):
    model: str = ""
    name: str = ""  # Ollama's older name for model
    verbose: bool = False


class EmbedBody(msgspec.Struct, kw_only=True):
    """/api/embed's body; /api/embeddings (Ollama's older route) sends ``prompt``."""

    model: str = ""
    input: str | list[str] | None = None
    prompt: str | None = None
    truncate: bool = True  # Ollama's default: a long input is cut, not refused
    dimensions: Annotated[int, Meta(ge=1)] | None = None
    keep_alive: str | float | None = None
    options: dict[str, Any] | None = None


_chat_decoder = msgspec.json.Decoder(ChatBody)
_embed_decoder = msgspec.json.Decoder(EmbedBody)
_generate_decoder = msgspec.json.Decoder(GenerateBody)
_show_decoder = msgspec.json.Decoder(ShowBody)


def add_routes(app: QuartTrio, state: AppState) -> None:
    api.add_error_shape(app, "/api/", error_shape)
    _add_model_routes(app, state)
    _add_generation_routes(app, state)
    _add_refused_routes(app)


def _add_model_routes(app: QuartTrio, state: AppState) -> None:
    @app.get("/api/version")
    async def version() -> Response:
        return json_response({"version": OLLAMA_VERSION})

    @app.get("/api/tags")
    async def tags() -> Response:
        return json_response(model_list(state.models))

    @app.get("/api/ps")
    async def ps() -> Response:
        return json_response(running_list(state.models))

    @app.post("/api/show")
    async def show_route() -> Response:
        body = await api.decoded_body(state, _show_decoder, engine=False)
        return json_response(show(served(state.models, body.model or body.name, embed=None),
                                  body.verbose))


def _add_generation_routes(app: QuartTrio, state: AppState) -> None:
    @app.post("/api/chat")
    async def chat() -> Response:
        body = await api.decoded_body(state, _chat_decoder)
        served(state.models, body.model)
        if not body.messages:  # Ollama's way to load a model, or to unload it
            return json_response(loaded(model_name(body.model), body.keep_alive, chat=True))
        return await api.run_chat(state, chat_request(body), OllamaChat)

    @app.post("/api/generate")
    async def generate() -> Response:
        body = await api.decoded_body(state, _generate_decoder)
        return await _generate(state, body)

    @app.post("/api/embed", endpoint="ollama_embed")
    async def embed() -> Response:
        body = await api.decoded_body(state, _embed_decoder, engine=False)
        if _nothing_to_embed(state, body, body.input):
            return json_response({"model": body.model, "embeddings": []})
        done = await _embed(state, body, body.input, "input")
        return await answer(state, done, functools.partial(_embed_body, body.model))

    @app.post("/api/embeddings", endpoint="ollama_embeddings")
    async def embeddings() -> Response:
        body = await api.decoded_body(state, _embed_decoder, engine=False)
        if _nothing_to_embed(state, body, body.prompt):
            return json_response({"embedding": []})
        done = await _embed(state, body, body.prompt, "prompt")
        return await answer(state, done, lambda d, _: {"embedding": d.vectors[0].tolist()})


def _embed_body(model: str, done: Embedded, encoding: str) -> dict[str, Any]:
    return {"model": model, "embeddings": done.vectors.tolist(),
            "total_duration": nanoseconds(done.seconds), "load_duration": 0,
            "prompt_eval_count": done.prompt_tokens}


def _nothing_to_embed(state: AppState, body: EmbedBody, given: str | list[str] | None
                      ) -> bool:
    """Whether the body embeds nothing (no input, "" or []): Ollama answers it with no
    vectors, 200, once the model is found (its way to load one: OpenAI's 400 for an
    empty input failed the clients that warm a model up so)."""
    if given:
        return False
    state.models.resolve(model_name(body.model) if body.model else None, embed=True)
    return True


async def _embed(state: AppState, body: EmbedBody, given: str | list[str] | None,
                 field: str) -> Embedded:
    if given is None:
        raise e.BadRequest(f"{field} is required", param=field)
    if body.options:
        raise e.BadRequest("options are not taken for embeddings: the appliance's "
                           "admin sizes the embedding model", param="options")
    return await embed(state, model_name(body.model) if body.model else None, given,
                       truncate=body.truncate, dimensions=body.dimensions, param=field)


def _add_refused_routes(app: QuartTrio) -> None:
    """Ollama's model management: the appliance's models are its admin's to change."""

    async def managed(digest: str = "") -> Response:
        raise e.Forbidden("models are managed by this appliance's admin: they cannot be "
                          "pulled, pushed, created, copied or deleted through the API")

    for path, methods in (("/api/pull", ["POST"]), ("/api/push", ["POST"]),
                          ("/api/create", ["POST"]), ("/api/copy", ["POST"]),
                          ("/api/delete", ["DELETE"]),
                          ("/api/blobs/<digest>", ["HEAD", "POST"])):
        app.add_url_rule(path, f"ollama_{path[5:].split('/')[0]}", managed,
                         methods=methods)


def model_name(name: str) -> str:
    """Ollama's clients name a model's default tag (``:latest``); forged's ids have none."""
    return name.removesuffix(":latest")


def served(models: Models, name: str, *, embed: bool | None = False) -> ModelGroup:
    """The serving group of the model ``name``; Ollama's requests always name one."""
    if not name:
        raise e.BadRequest("model is required", param="model")
    return models.resolve(model_name(name), embed=embed)


# --- chat ----------------------------------------------------------------------------


def chat_request(body: ChatBody) -> ChatRequest:
    refuse(body, _REFUSED)
    if body.messages and body.messages[-1].role == "assistant":
        # Ollama continues it; forged's chat always opens a new assistant turn.
        last = f"messages[{len(body.messages) - 1}]"
        raise e.BadRequest(f"a last assistant message (a prefill to continue) is not "
                           f"supported: end with a user message ({last})", param=last,
                           code="unsupported_field")
    if body.tools and _structured(body.format):
        raise e.BadRequest("format cannot be combined with tools", param="format")
    return _converted({
        **_generation_fields(body), **_structured(body.format),
        "messages": [_message(i, m) for i, m in enumerate(body.messages)],
        "tools": body.tools or None,
    }, ChatRequest)


def _message(i: int, m: Message) -> dict[str, Any]:
    """One message as forged's chat takes it: Ollama's tool calls are OpenAI's, with
    ``arguments`` as an object, which forged's chat takes too."""
    where = f"messages[{i}]"
    if m.images:
        raise e.BadRequest(f"images in {where} are not supported: this model reads text "
                           "only", param=f"{where}.images", code="unsupported_field")
    if m.thinking:
        raise e.BadRequest(f"{where}.thinking is not supported: forged does not tell a "
                           "model's reasoning apart from its answer",
                           param=f"{where}.thinking", code="unsupported_field")
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = m.tool_calls
    return out


# --- generate ------------------------------------------------------------------------


async def _generate(state: AppState, body: GenerateBody) -> Response:
    """The prompt through the chat template as a user's turn, as Ollama does; as it is
    with ``raw``; with a ``suffix``, fill-in-the-middle."""
    refuse(body, _REFUSED_GENERATE)
    served(state.models, body.model)
    if not body.prompt and not body.suffix:  # Ollama's way to load a model
        return json_response(loaded(model_name(body.model), body.keep_alive, chat=False))
    fields = {**_generation_fields(body), **_structured(body.format)}
    if body.raw or body.suffix:
        _check_prompt_as_is(body)
        req = _converted({**fields, "prompt": body.prompt, "suffix": body.suffix or None},
                         CompletionRequest)
        return await api.run_completion(state, req, GenerateFromText)
    system = [{"role": "system", "content": body.system}] if body.system else []
    messages = [*system, {"role": "user", "content": body.prompt}]
    return await api.run_chat(state, _converted({**fields, "messages": messages},
                                                ChatRequest), GenerateFromChat)


def _check_prompt_as_is(body: GenerateBody) -> None:
    """A raw or fill-in-the-middle prompt has no place for a system message. (``raw``
    with a ``suffix`` is fill-in-the-middle: no chat template applies to it either, and
    Continue sends both.)"""
    if body.system:
        raise e.BadRequest("system cannot be combined with raw or suffix", param="system")


# --- options ---------------------------------------------------------------------------


# Ollama's options by forged's field names (the rest share their names).
_OPTION_OF = {"max_tokens": "num_predict"}
_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "seed", "stop", "repeat_penalty",
             "presence_penalty", "frequency_penalty", "typical_p", "repeat_last_n",
             "mirostat", "mirostat_tau", "mirostat_eta")


def _generation_fields(body: _Body) -> dict[str, Any]:
    """forged's fields for the body's model, stream and options; unset options take
    forged's defaults, as on /v1/."""
    opts = body.options or Options()
    refuse(opts, _REFUSED_OPTIONS, "options.")
    # num_ctx, any size, is served within the context forged runs the model with, as
    # Ollama serves one above the model's training context within that. Clients send
    # their own guess on every request (Zed 4096, Cline 32768, Aider the prompt's
    # tokens + 8192): refusing it refused their every turn. A prompt that does not
    # fit is still a 400 that names the context.
    fields = {name: getattr(opts, name) for name in _SAMPLING}
    fields["max_tokens"] = _budget(opts.num_predict)
    fields = {k: v for k, v in fields.items() if v is not None}
    return {**fields, "model": model_name(body.model), "stream": body.stream}


def _budget(num_predict: int | None) -> int | None:
    """``num_predict``: -1 (Ollama's default, "until the end") leaves it to forged: the
    answer runs until the model ends it, within ``limits.default_max_tokens`` and the
    context (forged never shifts the context); -2 ("fill the context") is forged's -1."""
    if num_predict == -2:
        return -1
    if num_predict is None or num_predict == -1:
        return None
    if num_predict < 0:
        raise e.BadRequest("options.num_predict must be positive, or -1 or -2",
                           param="options.num_predict")
    if num_predict == 0:
        raise e.BadRequest("options.num_predict must be positive, or -1 or -2",
                           param="options.num_predict")
    return num_predict


def _structured(fmt: str | dict[str, Any] | None) -> dict[str, Any]:
    """``format``: ``"json"`` is a JSON object, a JSON schema is JSON that matches it."""
    if fmt is None or fmt == "":
        return {}
    if fmt == "json":
        return {"response_format": {"type": "json_object"}}
    if isinstance(fmt, dict):
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": "format", "schema": fmt}}}
    raise e.BadRequest(f'format must be "json" or a JSON schema, not {fmt!r}', param="format")


def _converted(fields: dict[str, Any], cls: type[T]) -> T:
    """forged's request of ``fields``; a value out of forged's range is a 400 naming
    the option it came from."""
    try:
        return msgspec.convert(fields, cls)
    except msgspec.ValidationError as exc:
        message, _, at = str(exc).partition(" - at `$.")
        field = at.rstrip("`").split(".")[0].split("[")[0]
        option = _OPTION_OF.get(field, field)
        if not field:
            raise e.BadRequest(message) from exc
        param = f"options.{option}" if option in (*_SAMPLING, "num_predict") else field
        raise e.BadRequest(f"{message} (at {param})", param=param) from exc
