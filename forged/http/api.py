"""The public API listener: OpenAI's routes (``/v1/models``, ``/v1/completions``,
``/v1/chat/completions``), llama.cpp's ``/infill``, ``/tokenize`` and ``/detokenize``,
``/v1/retrieve``, ``/v1/events`` and a minimal ``/health``; the other dialects
(llama.cpp's native API, Anthropic's, OpenAI's Responses, Ollama's) add their routes
from their own modules (:func:`_add_dialects`), each a translation to :func:`run_chat`
or :func:`run_completion`. Admin actions and metrics are never served on this port.

Each request runs in quart-trio's per-request nursery beside a task that watches for
the client going away; whichever finishes first cancels the other. A departed
caller therefore cancels its handler, wherever it is; what the request holds (its
key's places, its ``EnginePool.open_request``) is released when the request's ASGI
call ends (:mod:`forged.http.lifetime`), and the worker frees its sequence at its
next step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import msgspec
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from forged import errors as e
from forged.auth import KeyEntry, KeyStore
from forged.config import Config, LimitsConfig
from forged.engine.grammar import TOOL_CLOSE, TOOL_OPEN
from forged.engine.groups import ModelGroup
from forged.engine.request import Grammar, Request
from forged.http import refused, sse
from forged.http.access import count_request, log_access
from forged.http.chat import ChatPrompt, chat_prompt
from forged.http.cors import add_cors
from forged.http.editor_telemetry import event_decoder, record_event
from forged.http.generate import begin_outcome, generate
from forged.http.infill import (
    check_ids,
    extra_files,
    fim_prompt,
    infill_context,
    infill_decoder,
    infill_format,
    infill_tokens,
    requested_tokens,
)
from forged.http.keylimits import KeyUsage, capped_priority, hold_generation, hold_side
from forged.http.lifetime import Call, RequestResources, call, rule
from forged.http.logprobs import Asked, chat_asked, completion_asked
from forged.http.modellist import model_list, model_object, system_fingerprint
from forged.http.responses import (
    HTTPError,
    error_response,
    from_exception,
    http_error,
    json_response,
)
from forged.http.retrieve import (
    Retrieved,
    as_snippets,
    chat_with_context,
    code_text,
    context,
    last_user_text,
    query_around,
    retrieve,
    retrieve_decoder,
    with_retrieved,
)
from forged.http.sampling import sampling
from forged.http.schemas import (
    ChatRequest,
    CompletionRequest,
    GenerationFields,
    body_error,
    chat_decoder,
    completion_decoder,
    json_depth,
)
from forged.http.state import AppState
from forged.http.structured import asks_grammar, request_grammar
from forged.http.tokens import detokenize, detokenize_decoder, tokenize, tokenize_decoder
from forged.http.tools import ToolPlan
from forged.retrieval.store import cursor_names

# Routes outside /v1/ that need an API key as /v1/ does: llama.cpp's and Ollama's (/api/).
# With keys, every path but these needs one: a route (or an alias) added later is keyed
# unless it is named here. A load balancer's probe carries no key.
_OPEN_PATHS = frozenset({"/health"})
T = TypeVar("T")


def create_app(state: AppState) -> QuartTrio:
    app = QuartTrio("forged")
    app.config.update(
        RESPONSE_TIMEOUT=None,  # streams last as long as generation does
        PROVIDE_AUTOMATIC_OPTIONS=False,
    )
    configure(app, state.cfg)
    # Every request's holdings are released when its ASGI call ends (forged.http.lifetime).
    app.asgi_app = RequestResources(app.asgi_app)  # type: ignore[method-assign]
    add_cors(app, state)  # first: a browser's preflight carries no key
    _add_request_hooks(app, state)
    _add_error_handlers(app)
    _add_info_routes(app, state)
    _add_generation_routes(app, state)
    _add_dialects(app, state)
    return app


# How a dialect (Ollama's, Anthropic's) renders an error, by the path prefix of its routes;
# every other path gets OpenAI's error body.
ErrorShape = Callable[[HTTPError], Response]
_SHAPES = "FORGED_ERROR_SHAPES"


def add_error_shape(app: QuartTrio, prefix: str, shape: ErrorShape) -> None:
    app.config.setdefault(_SHAPES, []).append((prefix, shape))


def _error_shape(app: QuartTrio) -> ErrorShape:
    for prefix, shape in app.config.get(_SHAPES, []):
        if request.path.startswith(prefix):
            return shape  # type: ignore[no-any-return]
    if request.path.startswith("/v1/models") and (shared := _shared(app)) is not None:
        return shared.error
    return error_response


class SharedRoutes(NamedTuple):
    """How a dialect answers a route it shares with OpenAI's (``/v1/models``), for the
    requests that carry a header its clients always send (Anthropic's
    ``anthropic-version``): the model list, one model, and errors, in its shapes."""

    header: str
    model_list: Callable[[list[dict[str, Any]]], dict[str, Any]]
    model: Callable[[dict[str, Any]], dict[str, Any]]
    error: ErrorShape


_SHARED = "FORGED_SHARED_ROUTES"


def add_shared_routes(app: QuartTrio, shared: SharedRoutes) -> None:
    app.config.setdefault(_SHARED, []).append(shared)


def _shared(app: QuartTrio) -> SharedRoutes | None:
    for shared in app.config.get(_SHARED, []):
        if shared.header in request.headers:
            return shared  # type: ignore[no-any-return]
    return None


def _add_dialects(app: QuartTrio, state: AppState) -> None:
    """The other APIs' routes: each dialect is a module that translates its bodies to
    the one engine request (through :func:`run_chat` and :func:`run_completion`) and
    back. They import this module, so they are imported here, not at its top."""
    from forged.http import anthropic, embeddings, llamacpp, oairesponses, ollama

    anthropic.add_routes(app, state)
    embeddings.add_routes(app, state)
    llamacpp.add_routes(app, state)
    oairesponses.add_routes(app, state)
    ollama.add_routes(app, state)


def _add_request_hooks(app: QuartTrio, state: AppState) -> None:
    """Before each request: its id, its start and (with keys) its caller; after each:
    the response's accounting and, unless it generated, its access-log line."""

    @app.before_request
    async def _caller() -> None:
        if state.keys.enabled and request.path not in _OPEN_PATHS:
            call().key = await _authenticate(state.keys)

    @app.after_request
    async def _account(resp: Response) -> Response:
        await responded(state, call(), resp)
        if "Connection" not in resp.headers and not await _drain_body():
            resp.headers["Connection"] = "close"
        return resp


async def responded(state: AppState, c: Call, resp: Response) -> None:
    """What a response's request records before it is sent: its generation's status,
    its request id, its count and (unless it generated: its own line when it ends) its
    access-log line. The general path's and the hot door's (forged.http.hotpost)."""
    if c.outcome is not None:
        c.outcome.responded(resp.status_code)
        if state.holds is not None:
            await state.holds.at("responding")
    resp.headers["X-Request-Id"] = c.request_id
    count_request(state.metrics, rule(), resp.status_code, c.priority, c.key, c.model)
    if c.outcome is None:
        log_access(rule(), resp.status_code, c.request_id, c.key, c.started)


async def _authenticate(keys: KeyStore) -> KeyEntry:
    # Anthropic's clients send the key as x-api-key; every other client as a Bearer token.
    given = request.headers.get("Authorization")
    if given is None and (x_api_key := request.headers.get("x-api-key")) is not None:
        given = f"Bearer {x_api_key}"
    key = keys.lookup(given)
    if key is None:
        await _drain_body()  # keep the client's keep-alive connection usable
        raise e.Unauthorized("Incorrect or missing API key: send "
                             "'Authorization: Bearer <key>' or 'x-api-key: <key>'.")
    return key


def _add_error_handlers(app: QuartTrio) -> None:
    """Werkzeug's errors and the domain's, as OpenAI error bodies."""

    @app.errorhandler(HTTPException)
    async def _http_error(exc: HTTPException) -> Response:
        resp = _error_shape(app)(werkzeug_error(exc))
        if resp.status_code in (408, 413):
            # The rest of the body was never read: this connection cannot be reused.
            resp.headers["Connection"] = "close"
        return resp

    @app.errorhandler(e.ForgedError)
    async def _domain_error(exc: e.ForgedError) -> Response:
        return _error_shape(app)(from_exception(exc))


def werkzeug_error(exc: HTTPException) -> HTTPError:
    status = exc.code or 400
    # An unexpected exception reaches here as a 500: OpenAI calls that server_error.
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return http_error(status, exc.description or exc.name, kind)


def _add_info_routes(app: QuartTrio, state: AppState) -> None:
    # Also answered by the hot door (forged.http.hotdoor) in their plainest form.
    @app.get("/health")
    async def health() -> Response:
        status, body = state.health()
        return json_response(body, status)

    @app.get("/v1/models")
    async def models() -> Response:
        listed = model_list(state.models, int(state.started))
        shared = _shared(app)
        return json_response(listed if shared is None else shared.model_list(listed["data"]))

    @app.get("/v1/models/<path:model_id>")
    async def model(model_id: str) -> Response:
        found = model_object(state.models, int(state.started), model_id)
        shared = _shared(app)
        return json_response(found if shared is None else shared.model(found))

    @app.post("/tokenize")
    async def tokenize_route() -> Response:
        req = await decoded_body(state, tokenize_decoder, engine=False)
        return Response(await tokenize(state, req), content_type="application/json")

    @app.post("/v1/retrieve")
    async def retrieve_route() -> Response:
        req = await decoded_body(state, retrieve_decoder, engine=False)
        return json_response(await retrieve(state, req, call().key))

    @app.post("/v1/events")
    async def events_route() -> Response:
        record_event(state, await decoded_body(state, event_decoder, engine=False), call().key)
        return json_response({})

    @app.post("/detokenize")
    async def detokenize_route() -> Response:
        return json_response(await detokenize(state, await decoded_body(
            state, detokenize_decoder, engine=False)))


def _add_generation_routes(app: QuartTrio, state: AppState) -> None:
    @app.post("/v1/completions")
    async def completions() -> Response:
        return await completion_route(state, await _read_body())

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await chat_route(state, await _read_body())

    @app.post("/infill")
    async def infill() -> Response:
        req = await decoded_body(state, infill_decoder, refuse=True)
        group = _use_model(state, req, fim=True)
        found = await infill_context(state, group, req, call().key)
        prompt = await infill_tokens(state, group, req, found)
        try:
            return await _run(state, group, req, prompt, requested_tokens(req),
                              with_retrieved(infill_format(req), found))
        except e.ContextTooLong as exc:
            exc.param = "input_prefix"
            raise


async def chat_route(state: AppState, body: bytes) -> Response:
    """``POST /v1/chat/completions`` of ``body``: Quart's route and the hot door's."""
    return await run_chat(state, await checked_body(state, body, chat_decoder, refuse=True))


async def completion_route(state: AppState, body: bytes) -> Response:
    """``POST /v1/completions`` of ``body``: Quart's route and the hot door's."""
    req = await checked_body(state, body, completion_decoder, refuse=True)
    return await run_completion(state, req)


async def run_chat(state: AppState, req: ChatRequest,
                   shape: type[sse.ChatFormat] = sse.ChatFormat) -> Response:
    """A chat completion of ``req``, answered in ``shape``: OpenAI's chat objects by
    default; a dialect that translated its body to a ChatRequest passes its own."""
    group = _use_model(state, req)
    req, found, prompt = await _chat_prompt(state, group, req)
    plan, asked = prompt.tools, chat_asked(req)
    return await _run(state, group, req, prompt.tokens, _chat_budget(req),
                      with_retrieved(_chat_format(group, req, plan, asked, shape), found),
                      grammar=plan.grammar if plan else None, asked=asked)


def _chat_budget(req: ChatRequest) -> int | None:
    """What a chat asks to generate: OpenAI's two names for it; never 0."""
    field, requested = ("max_completion_tokens", req.max_completion_tokens) \
        if req.max_completion_tokens is not None else ("max_tokens", req.max_tokens)
    if requested == 0:
        raise e.BadRequest(f"{field} must be at least 1 (or -1: until the context is full)",
                           param=field)
    return requested


async def chat_prompt_tokens(state: AppState, req: ChatRequest) -> int:
    """How many tokens ``req``'s prompt has, as :func:`run_chat` would lay it out (its
    model's chat template, tools, repository context): Anthropic's count_tokens."""
    # Like /tokenize: its key place, a side route's, was taken with the body (decoded_body).
    with state.models.use(req.model) as group:
        return len((await _chat_prompt(state, group, req))[2].tokens)


async def _chat_prompt(state: AppState, group: ModelGroup, req: ChatRequest
                       ) -> tuple[ChatRequest, Retrieved | None, ChatPrompt]:
    """The chat with the repository chunks it draws on, those chunks, and its prompt."""
    found = await context(state, group.prompter, req.repo, call().key,
                          last_user_text(req), by_meaning=True)
    req = chat_with_context(req, found)
    return req, found, await chat_prompt(state, group, req)


async def run_completion(state: AppState, req: CompletionRequest,
                         shape: Callable[..., sse.CompletionFormat] = sse.CompletionFormat
                         ) -> Response:
    """A completion of ``req``, answered in ``shape`` (as :func:`run_chat`; a shape may
    come with settings of this request bound, as a ``functools.partial``)."""
    group = _use_model(state, req, fim=req.suffix is not None)
    asked = completion_asked(req)
    prompt, found = await _completion_prompt(state, group, req)
    fmt = with_retrieved(_completion_format(group, req, prompt, asked, shape), found)
    try:
        return await _run(state, group, req, prompt, req.max_tokens, fmt, asked=asked)
    except e.ContextTooLong as exc:
        exc.param = "prompt"  # a completion's prompt is `prompt`, not chat's `messages`
        raise


def configure(app: QuartTrio, cfg: Config) -> None:
    """The request limits of ``cfg``: Quart reads them as each request arrives, so a
    reload applies them to the requests that come after it."""
    app.config.update(BODY_TIMEOUT=cfg.server.read_timeout,
                      MAX_CONTENT_LENGTH=cfg.server.max_body_bytes)


async def _drain_body() -> bool:
    """Read and drop an unread request body (bounded by the body size and time limits),
    so that a keep-alive connection stays usable after an early error: hypercorn
    neither reuses nor closes a connection whose last request body was left unread."""
    try:
        await request.get_data(cache=False)
    except HTTPException:
        return False
    return True


async def decoded_body(state: AppState, decoder: msgspec.json.Decoder[T], *,
                   engine: bool = True, refuse: bool = False) -> T:
    """The request's body, decoded; for the ``engine``, a full queue answers before any
    parsing, and a body that is not JSON, or JSON of the wrong shape, is a 400 naming
    the field; so is, with ``refuse``, a field forged knows but does not do
    (forged.http.refused)."""
    return await checked_body(state, await _read_body(), decoder, engine=engine,
                              refuse=refuse)


async def checked_body(state: AppState, body: bytes, decoder: msgspec.json.Decoder[T], *,
                       engine: bool = True, refuse: bool = False) -> T:
    """:func:`decoded_body` of a body already read (the hot door reads its own)."""
    # Checked after the body arrived: a request that was mid-upload when the drain
    # began is refused too, with a Retry-After the client can act on.
    if state.draining:
        raise e.Unavailable("the server is shutting down", state.cfg.limits.retry_after)
    if engine:
        state.check_capacity()
    else:  # the door's other routes: one place of the key's, before any work
        _hold_side(state.key_usage, state.cfg.limits.retry_after)
    try:
        decoded = await _decode(state, decoder, body)
        if refuse:
            refused.check(body)
        return decoded
    except msgspec.MsgspecError as exc:
        raise body_error(exc) from exc


async def _read_body() -> bytes:
    check_encoding(request.headers.get("Content-Encoding", ""))
    data = await request.get_data(cache=False, as_text=False)
    assert isinstance(data, bytes)
    return data


def check_encoding(header: str) -> None:
    """A compressed body is refused (415, RFC 9110 15.5.16), never parsed as JSON (a
    400 "could not parse" that hid the cause) nor decompressed: llama-server answers a
    gzip body so (its cpp-httplib is built without zlib), and vLLM's uvicorn decodes
    none (its parse fails). Decompressing would let a body within max_body_bytes
    grow a thousandfold in memory and CPU before any limit saw it, for no client:
    the OpenAI, Anthropic and Ollama SDKs send their bodies uncompressed. The body is
    drained after the answer (_account), so the connection serves on."""
    codings = [c.strip().lower() for c in header.split(",") if c.strip()]
    if any(c != "identity" for c in codings):
        raise e.UnsupportedEncoding(
            f"Content-Encoding: {header} is not supported: send the request body "
            "uncompressed (Content-Encoding: identity, or none)")


# A body this small decodes in well under a millisecond: on the loop, no thread hop.
_SMALL_BODY = 64 * 1024


async def _decode(state: AppState, decoder: msgspec.json.Decoder[T], body: bytes) -> T:
    limit = state.cfg.limits.max_json_depth
    # Depth can only pass the limit with more brackets than the limit: scan only then,
    # and in a thread, since a body of brackets up to max_body_bytes takes a while.
    if body.count(b"[") + body.count(b"{") > limit and \
            await state.off_loop(json_depth, body) > limit:
        raise e.BadRequest(f"the JSON body is nested deeper than {limit} levels")
    try:
        if len(body) <= _SMALL_BODY:
            return decoder.decode(body)
        return await state.off_loop(decoder.decode, body)
    except RecursionError as exc:  # msgspec's own guard, below our limit's reach
        raise e.BadRequest("the JSON body is nested too deeply") from exc


# --- prompts ---------------------------------------------------------------------------


def _one_prompt(p: str | list[int | str | list[int]]) -> str | list[int | str]:
    """The request's one prompt: text, token ids or llama.cpp's mix of both (``[12,
    "text", 34]``), alone or in a list of one."""
    if isinstance(p, str) or (p and all(isinstance(t, int | str) for t in p)
                              and any(isinstance(t, int) for t in p)):
        return p  # type: ignore[return-value]
    if len(p) == 1 and isinstance(p[0], str | list) and p[0]:
        return p[0]  # type: ignore[return-value]
    raise e.BadRequest("exactly one prompt is supported per request", param="prompt")


def _completion_format(group: ModelGroup, req: CompletionRequest, tokens: list[int],
                       asked: Asked, shape: Callable[..., sse.CompletionFormat]
                       ) -> sse.MakeFormat:
    """The answer's shape: with logprobs, and with ``echo``, the prompt as given (or the
    text of the token ids given) before the completion."""
    echo = None
    if req.echo:
        given = _one_prompt(req.prompt)
        text = given if isinstance(given, str) else group.prompter.detokenize(tokens)
        echo = sse.Echo(text, tokens, asked.prompt)
    return functools.partial(shape, echo=echo,
                             fingerprint=system_fingerprint(group),
                             vocab=None if asked.top is None else group.prompter)


def _chat_format(group: ModelGroup, req: ChatRequest, plan: ToolPlan | None,
                 asked: Asked, shape: type[sse.ChatFormat]) -> sse.MakeFormat:
    """The answer's shape: the calls parsed out when the model may make them, and
    logprobs when asked."""
    calls = plan is not None and plan.parse
    if calls and asks_grammar(req):
        raise e.BadRequest("response_format cannot be combined with tool calls "
                           "(tool_choice 'none' allows it)", param="response_format")
    return functools.partial(shape, tools=calls,
                             fingerprint=system_fingerprint(group),
                             vocab=None if asked.top is None else group.prompter)


async def _completion_prompt(state: AppState, group: ModelGroup, req: CompletionRequest
                             ) -> tuple[list[int], Retrieved | None]:
    """The prompt's tokens, and the repository chunks it draws on (with ``repo``, or
    the key's default): as extra files before a fill-in-the-middle prompt, as
    snippets before a plain one."""
    given = _one_prompt(req.prompt)
    if not isinstance(given, str):
        check_ids(group, given, "prompt")
        if req.suffix is None:
            if req.repo is not None:
                raise e.BadRequest("repo needs the prompt as text, or a suffix",
                                   param="repo")
            if all(isinstance(t, int) for t in given):
                return list(given), None  # type: ignore[arg-type]
            return await state.off_loop(group.prompter.encode_mixed, given), None
    found = await context(state, group.prompter, req.repo, call().key, query_around(
        code_text(given), req.suffix or "", state.cfg.retrieval.query_lines),
        cursor_names(code_text(given)))
    if req.suffix is not None:  # OpenAI's fill-in-the-middle: the prompt is the prefix
        extra = extra_files(found) if found else []
        return await fim_prompt(state, group, given, req.suffix, extra, "",
                                req.max_tokens), found
    assert isinstance(given, str)
    _refuse_raw_fim(group, given)
    tokens = await state.off_loop(group.prompter.encode_completion,
                                  as_snippets(found) + given)
    if not tokens:
        raise e.BadRequest("the prompt is empty", param="prompt")
    return tokens, found


# How FIM-trained models write their tokens (StarCoder, Qwen-Coder, CodeLlama, DeepSeek:
# its bars are U+FF5C, fullwidth; the ASCII look-alike is kept for hand-typed prompts).
_FIM_MARKERS = ("<|fim_prefix|>", "<fim_prefix>", "<fim-prefix>", "<|fim▁begin|>",
                "<\uff5cfim\u2581begin\uff5c>", "<PRE>")


def _refuse_raw_fim(group: ModelGroup, text: str) -> None:
    """A prompt written with FIM tokens, to a model without them, would be completed as
    plain text: say so instead."""
    if group.prompter.fim is None and any(m in text for m in _FIM_MARKERS):
        raise e.BadRequest("the prompt is written with fill-in-the-middle tokens, but this "
                           "model has none", param="prompt", code="fim_not_supported")


def _use_model(state: AppState, req: GenerationFields, *, fim: bool = False) -> ModelGroup:
    """The group serving ``req.model`` (none named: the one whose role fits, ``fim``
    or chat), held until the request ends (a swap drains a group only once nobody
    holds it), and the key's places for ``req`` on it."""
    c = call()
    group = c.held.enter_context(state.models.use(req.model, fim=fim))
    c.model = group.model_id  # the metrics' model label: configured, never as asked
    _hold_key(state.key_usage, state.cfg.limits.retry_after, group, req)
    return group


# --- generation --------------------------------------------------------------------------


def _request(state: AppState, group: ModelGroup, req: GenerationFields, prompt: list[int],
             requested: int | None, grammar: Grammar | None, asked: Asked) -> Request:
    """The one engine request for this body, its API key, its model and the config."""
    lim = state.cfg.limits
    max_tokens = _max_tokens(lim, group.max_context, len(prompt), requested, req.min_tokens)
    if req.stop_token_ids:
        check_ids(group, req.stop_token_ids, "stop_token_ids")
    key = call().key
    n = _choices(group, req, prompt, max_tokens)
    max_predict_ms, n_indent = req.editor_bounds()  # an editor's, on llama.cpp's routes
    if n > req.n and asked.top is None:  # best_of ranks by the tokens' logprobs
        asked = Asked(0, asked.prompt)
    return Request(
        prompt=prompt, max_tokens=max_tokens, n=n,
        priority=capped_priority(req.priority, key, lim.default_priority),
        sampling=msgspec.structs.replace(sampling(state, group, req), grammar=grammar),
        stop=_stops(lim, req.stop), preserve=group.prompter.tool_tokens if grammar else [],
        stop_tokens=req.stop_token_ids or [], include_stop=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos, cache=req.cache_prompt, queue_timeout=lim.queue_timeout,
        max_predict_ms=max_predict_ms, n_indent=n_indent,
        session=None if req.session is None else engine_session(key.name if key else "",
                                                                req.session),
        tenant=key.tenant if key else "", logprobs=asked.top, prompt_logprobs=asked.prompt,
    )


def engine_session(key_name: str, session: str) -> str:
    """A request's ``session`` as the engine knows it: namespaced by its API key's name,
    so that one key cannot pin (or unpin) another key's conversations."""
    return f"{key_name}/{session}"


def _max_tokens(lim: LimitsConfig, limit: int, n_prompt: int, requested: int | None,
                min_tokens: int) -> int:
    """The completion's budget: as asked (-1: the rest of the context), or the default,
    within the context (``limit``); at least vLLM's ``min_tokens`` when not asked."""
    if n_prompt >= limit:
        raise e.ContextTooLong(
            f"This model's maximum context length is {limit} tokens. However, your prompt "
            f"has {n_prompt} tokens. Please reduce the length of the prompt."
        )
    if requested is None:
        wanted = max(lim.default_max_tokens, min_tokens)
        max_tokens = min(wanted, limit - n_prompt)
    elif requested < 0:  # llama.cpp's -1: until the context is full
        max_tokens = limit - n_prompt
    elif n_prompt + requested > limit:
        raise e.ContextTooLong(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{n_prompt + requested} tokens ({n_prompt} in the prompt, {requested} in "
            "the completion). Please reduce the length of the prompt or completion.",
            asked=(n_prompt, requested, limit))
    else:
        max_tokens = requested
    if min_tokens > max_tokens:
        raise e.BadRequest(f"min_tokens ({min_tokens}) is more than the completion may have "
                           f"({max_tokens})", param="min_tokens")
    return max_tokens


def _choices(group: ModelGroup, req: GenerationFields, prompt: list[int], max_tokens: int) -> int:
    """The choices to generate: ``n``, or ``best_of`` of which the best ``n`` are
    returned; checked against what a worker can run at once."""
    best_of = req.best_of or req.n
    if best_of < req.n:
        raise e.BadRequest(f"best_of ({best_of}) must be at least n ({req.n})",
                           param="best_of")
    if best_of > req.n and req.stream:  # as OpenAI: the best are known only at the end
        raise e.BadRequest("best_of cannot be combined with stream", param="best_of")
    most = group.pool.limits.max_choices(len(prompt), max_tokens)
    if best_of > most:
        field = "n" if best_of == req.n else "best_of"
        raise e.BadRequest(f"{field} is {best_of}, but at most {most} choices of this "
                           "request can run at once on this server", param=field)
    return int(best_of)


def _stops(lim: LimitsConfig, stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > lim.max_stop:
        raise e.BadRequest(f"at most {lim.max_stop} stop strings are allowed", param="stop")
    if any(not s or len(s) > lim.max_stop_length for s in stops):
        raise e.BadRequest(f"stop strings must have 1 to {lim.max_stop_length} characters",
                           param="stop")
    return stops


async def _run(state: AppState, group: ModelGroup, req: GenerationFields, prompt: list[int],
               requested: int | None, fmt: sse.MakeFormat, *,
               grammar: Grammar | None = None, asked: Asked | None = None) -> Response:
    """Generate for ``req``; ``grammar`` is the tools' (chat), else the body's own;
    ``asked``: the logprobs it wants."""
    calls = grammar is not None  # the tools' grammar: the answer may hold calls
    grammar = await _grammar(state, group, req, grammar)
    engine_request = _request(state, group, req, prompt, requested, grammar,
                              asked or Asked())
    if calls:
        engine_request = msgspec.structs.replace(engine_request,
                                                 unique_blocks=(TOOL_OPEN, TOOL_CLOSE))
    outcome = begin_outcome(state, engine_request.priority)
    if state.cfg.log.log_content:
        outcome.keep_content(req)
    return await generate(state, group, req, engine_request, fmt, outcome)


async def _grammar(state: AppState, group: ModelGroup, req: GenerationFields,
                   tools: Grammar | None) -> Grammar | None:
    """The request's grammar: the tools' (chat), else the body's own; converted and
    checked by llama.cpp in one of the door's threads, since both grow with the input."""
    if tools is None and not asks_grammar(req):
        return None
    # A finished grammar allows only the end of generation: banning it (ignore_eos, or
    # min_tokens not yet reached) would leave the sampler no token at all.
    for field, value in (("ignore_eos", req.ignore_eos), ("min_tokens", req.min_tokens)):
        if value:
            raise e.BadRequest(f"{field} cannot be combined with a grammar, a JSON schema "
                               "or tools", param=field)
    return await state.off_loop(_checked_grammar, group, req, tools)


def _checked_grammar(group: ModelGroup, req: GenerationFields, tools: Grammar | None) -> Grammar:
    try:
        grammar = group.prompter.triggered(tools) if tools else request_grammar(req)
        assert grammar is not None  # asks_grammar said so
        group.prompter.check_grammar(grammar)
    except MemoryError as exc:
        raise e.BadRequest("the grammar is too large to build", param="grammar") from exc
    except ValueError as exc:
        raise e.BadRequest("llama.cpp could not parse the grammar", param="grammar") from exc
    return grammar


def _hold_key(usage: dict[str, KeyUsage], retry_after: int, group: ModelGroup,
              req: GenerationFields) -> None:
    """Per-key limits, taken before any work that grows with the request: over them
    this key gets 429 and every other key is unaffected. A request takes a place per
    sequence it runs (``n`` choices, or ``best_of``, take as many)."""
    c = call()
    if c.key is None:
        return
    places = max(req.n, req.best_of or 0)
    c.hold = hold_generation(usage, c.key, places, would_wait=group.pool.would_wait(places),
                             retry_after=retry_after,
                             param="n" if places == req.n else "best_of")


def _hold_side(usage: dict[str, KeyUsage], retry_after: int) -> None:
    """Per-key limits of the door's other routes (tokenize, retrieve, events)."""
    if (key := call().key) is not None:
        hold_side(usage, key, retry_after)
