"""llama.cpp's ``POST /infill``: fill-in-the-middle for the editors engineers use.

llama.vscode and llama.vim send the code before and after the cursor
(``input_prefix``, ``input_suffix``), what is typed on the cursor's line (``prompt``),
chunks of other files (``input_extra``), a time limit (``t_max_predict_ms``) and an
indentation (``n_indent``). The prompt is laid out token for token as llama.cpp's
server does (:mod:`forged.engine.fim`), so a model sees what it would see there.
The answer has llama.cpp's fields (``content``, ``stop``, ``stop_type``,
``tokens_cached``, ``timings``, ...), whole or as SSE chunks.

``id_slot`` is accepted and ignored: forged's shared prefix cache replaces slot
pinning, so one editor never evicts another's context. The editors' warm-up request
(``n_predict: 0``) computes the prompt into that cache and answers with no text.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from forged import errors as e
from forged.auth import KeyEntry
from forged.config import Priority
from forged.engine.decoding import TokenLogprob
from forged.engine.events import Done
from forged.engine.fim import ExtraFile
from forged.engine.groups import ModelGroup
from forged.http import sse
from forged.http.responses import HTTPError
from forged.http.retrieve import Retrieved, code_text, context, query_around
from forged.http.schemas import GenerationFields
from forged.http.state import AppState
from forged.retrieval.store import cursor_names

# A piece of code: text, or llama.cpp's mix of text and token ids.
Code = str | list[str | int]


class InfillRequest(GenerationFields, kw_only=True):
    # llama.cpp's /infill answers one completion.
    n: Annotated[int, Meta(ge=1, le=1)] = 1
    input_prefix: Code
    input_suffix: Code
    input_extra: list[ExtraFile] = []
    prompt: str = ""
    # llama.cpp's name for max_tokens; -1: until the context is full.
    n_predict: Annotated[int, Meta(ge=-1)] | None = None
    t_max_predict_ms: Annotated[float, Meta(ge=0)] = 0.0
    n_indent: Annotated[int, Meta(ge=0)] = 0
    id_slot: int | None = None
    # As every route: the key's class by default, and never above it (a batch key's
    # editor traffic stays batch).
    priority: Priority | None = None
    # Only these fields of the answer, by path ("timings/prompt_n"), under that name.
    response_fields: list[str] | None = None

    def content(self) -> object:
        return self.prompt

    def editor_bounds(self) -> tuple[float, int]:
        return self.t_max_predict_ms, self.n_indent


infill_decoder = msgspec.json.Decoder(InfillRequest)


def requested_tokens(req: InfillRequest) -> int | None:
    """llama.cpp's n_predict, or max_tokens; -1: until the context is full (editors
    bound it with t_max_predict_ms)."""
    return req.n_predict if req.n_predict is not None else req.max_tokens


def check_ids(group: ModelGroup, code: Code | list[int], param: str) -> None:
    """Token ids given in place of text must be in the model's vocabulary."""
    n_vocab = group.prompter.n_vocab
    if not isinstance(code, str) and any(
            isinstance(t, int) and not 0 <= t < n_vocab for t in code):
        raise e.BadRequest(f"token ids must be in [0, {n_vocab})", param=param)


async def fim_prompt(state: AppState, group: ModelGroup, prefix: Code, suffix: Code,
                     extra: list[ExtraFile], typed: str, wanted: int | None) -> list[int]:
    """The infill layout (llama.cpp's) under this config, for ``wanted`` new tokens."""
    return await state.off_loop(functools.partial(
        group.prompter.encode_infill, prefix, suffix, extra, typed,
        n_batch=state.cfg.limits.infill_batch, n_ctx=group.max_context,
        n_predict=-1 if wanted is None else wanted,
        room=completion_room(state.cfg.limits.default_max_tokens, wanted)))


def completion_room(default: int, wanted: int | None) -> int:
    """What the extra context leaves of the context for the completion: ``wanted``,
    and at least the one token a prompt must leave. Absent, or -1 ("until the context
    is full"), the default budget: llama.cpp's layout then gave the extra context all
    the context but the prefix and suffix (and 2 more tokens), so that the prompt alone
    passed the context and was refused."""
    return default if wanted is None or wanted < 0 else max(wanted, 1)


async def infill_tokens(state: AppState, group: ModelGroup, req: InfillRequest,
                        found: Retrieved | None = None) -> list[int]:
    """The prompt, with the chunks ``found`` in the repository after the editor's own
    extra files: llama.cpp clips the extra context from its front, so the best chunk
    goes last, nearest the cursor, and is the last to be cut."""
    check_ids(group, req.input_prefix, "input_prefix")
    check_ids(group, req.input_suffix, "input_suffix")
    extra = req.input_extra + (extra_files(found) if found else [])
    return await fim_prompt(state, group, req.input_prefix, req.input_suffix, extra,
                            req.prompt, requested_tokens(req))


def extra_files(found: Retrieved) -> list[ExtraFile]:
    return [ExtraFile(text=h.text, filename=h.path) for h in reversed(found.hits)]


async def infill_context(state: AppState, group: ModelGroup, req: InfillRequest,
                         key: KeyEntry | None) -> Retrieved | None:
    """The repository chunks for the code around the cursor."""
    lines = state.cfg.retrieval.query_lines
    prefix = code_text(req.input_prefix) + req.prompt
    return await context(state, group.prompter, req.repo, key,
                         query_around(prefix, code_text(req.input_suffix), lines),
                         cursor_names(prefix))


def final_fields(done: Done, new_line: bool, model: str) -> dict[str, Any]:
    """llama-server's fields of a completion's last event (``/infill``, ``/completion``).
    ``new_line``: whether the text generated, all of it, holds a newline (llama-server's
    ``has_new_line``; a stream's last event has no text of its own)."""
    return {
        "id_slot": -1, "stop": True, "model": model,
        "tokens_predicted": done.completion_tokens, "tokens_evaluated": done.prompt_tokens,
        "has_new_line": new_line,
        # forged refuses a prompt that does not fit rather than cutting it
        "truncated": False, "stop_type": done.stop_type,
        "stopping_word": done.stop_reason if isinstance(done.stop_reason, str) else "",
        # as llama.cpp counts it: what the sequence holds now (the reused prefix is
        # timings.cache_n)
        "tokens_cached": done.prompt_tokens + done.completion_tokens,
        "timings": timings(done),
    }


def timings(done: Done) -> dict[str, float]:
    """llama.cpp's ``timings`` of a finished request."""
    prompt_n, predicted_n = done.prompt_tokens - done.cached_tokens, done.completion_tokens
    prompt_ms, predicted_ms = done.prefill_s * 1000, done.decode_s * 1000
    return {
        "cache_n": done.cached_tokens,
        "prompt_n": prompt_n, "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": 1000 * prompt_n / prompt_ms if prompt_ms else 0.0,
        "predicted_n": predicted_n, "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
        "predicted_per_second": 1000 * predicted_n / predicted_ms if predicted_ms else 0.0,
    }


class InfillFormat(sse.Format):
    """llama.cpp's completion objects: one per SSE event, no ``[DONE]``."""

    object_whole = object_chunk = "infill"
    id_prefix = "infill-"

    def __init__(self, model: str, created: int, n: int = 1,
                 fields: list[str] | None = None) -> None:
        super().__init__(model, created, n)  # n is 1: InfillRequest takes no other
        self.fields = fields
        self.new_line = False  # whether a delta sent so far held a newline

    def delta(self, text: str, index: int = 0,
              logprobs: list[TokenLogprob] | None = None) -> bytes:
        self.new_line = self.new_line or "\n" in text
        return sse.event({"index": 0, "content": text, "tokens": [], "stop": False,
                          "id_slot": -1})

    def finish(self, done: Done) -> bytes:
        out = self.delta(done.text) if done.text else b""
        return out + sse.event(self._choice("", done, sse.Scores(), self.new_line))

    def end(self, dones: list[Done], include_usage: bool) -> bytes:
        return b""  # llama.cpp's events end with the last one, without [DONE]

    def error(self, err: HTTPError) -> bytes:
        return sse.event(err.body)  # the last event, as a success's is: no [DONE]

    def whole(self, texts: list[str], dones: list[Done],
              scores: list[sse.Scores] | None = None) -> dict[str, Any]:
        return self._choice(texts[0], dones[0], sse.Scores(), "\n" in texts[0])

    def _choice(self, text: str, done: Done, scores: sse.Scores,
                new_line: bool = False) -> dict[str, Any]:
        body = {
            # not llama.cpp's: the id editors name in /v1/events
            "id": self.id, "index": 0, "content": text, "tokens": [],
            **final_fields(done, new_line, self.model),
        }
        if self.retrieved is not None:
            body["retrieved"] = self.retrieved
        return body if self.fields is None else select(body, self.fields)


def select(body: dict[str, Any], paths: list[str]) -> dict[str, Any]:
    """llama.cpp's ``response_fields``: each path that exists, under its own name."""
    out: dict[str, Any] = {}
    for path in paths:
        node: Any = body
        for part in path.split("/"):
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            out[path] = node
    return out


def infill_format(req: InfillRequest) -> sse.MakeFormat:
    """The answer's format, keeping only ``response_fields`` when asked."""
    return functools.partial(InfillFormat, fields=req.response_fields)
