"""What Ollama's API answers (:mod:`forged.http.ollama`): the NDJSON lines of chat and
generate, its error body, and its descriptions of models (``/api/tags``, ``/api/ps``,
``/api/show``).

A stream is one JSON object per line (``application/x-ndjson``): each with ``model``,
``created_at``, the piece of text (chat's ``message``, generate's ``response``) and
``done: false``; the last with ``done: true``, ``done_reason`` (``stop``, ``length``)
and the timings in nanoseconds. The whole answer is that last object with all the text.
A failure once the stream has begun is a last line ``{"error": "..."}``.
"""

from __future__ import annotations

import hashlib
import json
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import msgspec
from quart import Response

from forged.http import sse
from forged.http.lifetime import call
from forged.http.responses import HTTPError
from forged.http.tools import ToolCall

if TYPE_CHECKING:
    from forged.engine.decoding import TokenLogprob
    from forged.engine.events import Done
    from forged.engine.groups import ModelGroup, Models

# The Ollama API version whose shapes forged speaks: clients compare it with the least
# version they need (Copilot's Ollama provider wants 0.6.4).
OLLAMA_VERSION = "0.12.0"
NDJSON = "application/x-ndjson"
_json = msgspec.json.Encoder()


def _line(obj: Any) -> bytes:
    """One NDJSON line. U+2028, U+2029 and U+0085 are escaped, as Ollama's Go encoder
    does: the ollama client reads lines with httpx, which splits on them too. Raw, they
    can only be inside a JSON string, where the escape means the same."""
    return (_json.encode(obj).replace(b"\xe2\x80\xa8", b"\\u2028")
            .replace(b"\xe2\x80\xa9", b"\\u2029").replace(b"\xc2\x85", b"\\u0085") + b"\n")


def _timestamp(t: float | None = None) -> str:
    """RFC 3339 in UTC, as Ollama writes ``created_at`` and ``modified_at``."""
    return datetime.fromtimestamp(time.time() if t is None else t, UTC).strftime(
        "%Y-%m-%dT%H:%M:%S.%fZ")


def nanoseconds(seconds: float) -> int:
    return int(seconds * 1e9)


def error_shape(err: HTTPError) -> Response:
    """Ollama's error body: only the message, with the status forged would use."""
    return Response(_json.encode({"error": err.body.error.message}), status=err.status,
                    headers=err.headers())


def loaded(model: str, keep_alive: str | float | None, *, chat: bool) -> dict[str, Any]:
    """The answer to a request with no prompt (or no messages), Ollama's way to load a
    model (``keep_alive`` 0: to unload it); forged keeps its models loaded."""
    out: dict[str, Any] = {"model": model, "created_at": _timestamp()}
    if chat:
        out["message"] = {"role": "assistant", "content": ""}
    else:
        out["response"] = ""
    unload = keep_alive in (0, "0", "0s", "0m")
    return {**out, "done": True, "done_reason": "unload" if unload else "load"}


# --- answers ---------------------------------------------------------------------------


class _Lines(sse.Format):
    """Ollama's objects, for either of forged's shapes (chat's and completion's): a
    subclass says what a piece of the answer is (:meth:`_piece`)."""

    content_type = NDJSON

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Ollama's total_duration runs from the request's arrival (api's before_request).
        self.arrived: float = call().started

    def _piece(self, content: str, calls: list[ToolCall]) -> dict[str, Any]:
        raise NotImplementedError

    def _split(self, text: str, index: int) -> tuple[str, list[ToolCall]]:
        """The text as content and the tool calls completed in it."""
        return text, []

    def _rest(self, index: int) -> str:
        """What :meth:`_split` still holds at the end."""
        return ""

    def _object(self, piece: dict[str, Any], done: bool) -> dict[str, Any]:
        return {"model": self.model, "created_at": _timestamp(), **piece, "done": done}

    def start(self) -> bytes:
        return b""

    def delta(self, text: str, index: int = 0,
              logprobs: list[TokenLogprob] | None = None) -> bytes:
        content, calls = self._split(text, index)
        if not content and not calls:
            return b""
        return _line(self._object(self._piece(content, calls), False))

    def _tail(self, index: int) -> bytes:
        rest = self._rest(index)
        return _line(self._object(self._piece(rest, []), False)) if rest else b""

    def _final_chunk(self, done: Done, reason: str) -> bytes:
        return _line(self._last(done, self._piece("", [])))

    def end(self, dones: list[Done], include_usage: bool) -> bytes:
        return b""

    def error(self, err: HTTPError) -> bytes:
        return _line({"error": err.body.error.message})

    def whole(self, texts: list[str], dones: list[Done],
              scores: list[sse.Scores] | None = None) -> dict[str, Any]:
        content, calls = self._split(texts[0], 0)  # Ollama's requests have one choice
        return self._last(dones[0], self._piece(content + self._rest(0), calls))

    def _last(self, done: Done, piece: dict[str, Any]) -> dict[str, Any]:
        out = self._object(piece, True)
        out.update(
            done_reason=done.finish_reason,
            total_duration=nanoseconds(time.monotonic() - self.arrived),
            load_duration=0,  # the model was loaded before the request came
            # The whole prompt, its cached tokens too: what the context holds.
            prompt_eval_count=done.prompt_tokens,
            prompt_eval_duration=nanoseconds(done.prefill_s),
            eval_count=done.completion_tokens, eval_duration=nanoseconds(done.decode_s))
        if self.retrieved is not None:
            out["retrieved"] = self.retrieved
        return out


class OllamaChat(_Lines, sse.ChatFormat):
    """``/api/chat``: the text as ``message.content``, tool calls as
    ``message.tool_calls`` with their arguments as an object and, as Ollama numbers
    them, their place in the answer as ``function.index``: Open WebUI gathers a
    stream's calls by it (0 where absent), and ran two calls' names and arguments
    together."""

    def _piece(self, content: str, calls: list[ToolCall]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            made = self.parsers[0].calls if self.parsers else calls  # one choice
            message["tool_calls"] = [
                {"id": c.id, "function": {"index": made.index(c), "name": c.name,
                                          "arguments": json.loads(c.arguments)}}
                for c in calls]
        return {"message": message}

    def _split(self, text: str, index: int) -> tuple[str, list[ToolCall]]:
        return (text, []) if self.parsers is None else self.parsers[index].feed(text)

    def _rest(self, index: int) -> str:
        return "" if self.parsers is None else self.parsers[index].flush()


class _Generated(_Lines):
    def _piece(self, content: str, calls: list[ToolCall]) -> dict[str, Any]:
        return {"response": content}


class GenerateFromChat(_Generated, sse.ChatFormat):
    """``/api/generate`` of a prompt that went through the chat template."""


class GenerateFromText(_Generated, sse.CompletionFormat):
    """``/api/generate`` of a prompt as it is (``raw``), or of fill-in-the-middle."""


# --- models ----------------------------------------------------------------------------


# llama.cpp's llama_ftype (the GGUF's general.file_type), by the names Ollama reports.
_FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
    17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS",
    23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S",
    29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0",
    38: "MXFP4",
}
# A model kept loaded for good: Ollama's expires_at for keep_alive < 0 is as far off.
_NEVER = "9999-12-31T23:59:59Z"


def _parameter_size(group: ModelGroup) -> str:
    """The GGUF's size label ("135M"), else the count of parameters written short."""
    label = group.prompter.meta("general.size_label")
    if label:
        return label
    n = group.prompter.info.n_params
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def _details(group: ModelGroup) -> dict[str, Any]:
    family = group.prompter.meta("general.architecture") or ""
    file_type = group.prompter.meta("general.file_type") or ""
    return {"parent_model": "", "format": "gguf", "family": family,
            "families": [family] if family else None,
            "parameter_size": _parameter_size(group),
            "quantization_level": _FILE_TYPES.get(int(file_type), "unknown")
            if file_type.isdigit() else "unknown"}


def _digest(group: ModelGroup) -> str:
    """Not the file's SHA-256 (hashing gigabytes at start-up is too slow): a hash of
    what tells models and builds apart (forged's system_fingerprint), the same while
    they are."""
    return hashlib.sha256(group.prompter.info.identity.encode()).hexdigest()


def _entry(group: ModelGroup, model_id: str) -> dict[str, Any]:
    size, mtime_ns = group.file.stamp[2], group.file.stamp[3]
    return {"name": model_id, "model": model_id, "modified_at": _timestamp(mtime_ns / 1e9),
            "size": size, "digest": _digest(group), "details": _details(group),
            # forged's: what it serves of requests naming no model, and its context
            "role": group.role, "context_length": group.max_context}


def model_list(models: Models) -> dict[str, Any]:
    """``/api/tags``: each serving model under each of its ids, as /v1/models."""
    return {"models": [_entry(group, model_id) for group in models.serving
                       for model_id in group.ids]}


def running_list(models: Models) -> dict[str, Any]:
    """``/api/ps``: the loaded models, which forged never unloads by itself; ``size``
    is what a model's group allocates (weights and every worker's KV cache)."""
    return {"models": [{**_entry(group, model_id), "size": group.memory, "size_vram": 0,
                        "expires_at": _NEVER, "context_length": group.max_context}
                       for group in models.serving for model_id in group.ids]}


def _capabilities(group: ModelGroup) -> list[str]:
    if group.role == "embed":  # Ollama's word for a model /api/embed takes
        return ["embedding"]
    # forged writes tools into any model's prompt (forged.http.tools).
    out = ["completion", "tools"]
    if group.prompter.fim is not None:
        out.append("insert")
    return out


def _model_info(group: ModelGroup) -> dict[str, Any]:
    """The GGUF's keys forged knows. ``context_length`` is the context forged serves
    (``engine.max_context``), not the training context: clients size prompts by it."""
    p = group.prompter
    arch = p.meta("general.architecture") or "unknown"
    info: dict[str, Any] = {"general.architecture": arch,
                            "general.parameter_count": p.info.n_params,
                            f"{arch}.context_length": group.max_context,
                            f"{arch}.embedding_length": p.info.n_embd,
                            f"{arch}.vocab_size": p.info.n_vocab}
    for key in ("general.name", "general.basename", "general.size_label",
                "general.license"):
        if (value := p.meta(key)) is not None:
            info[key] = value
    return info


def _template(group: ModelGroup) -> str:
    """The chat template; for a model with FIM tokens, inside the branch on ``.Suffix``
    that Ollama's templates of FIM models open with, written with forged's FIM layout
    (forged.engine.fim, prefix-suffix-middle). Ollama's API has no other sign of FIM:
    Continue's Ollama provider completes code with a suffix only when the template
    holds ``.Suffix``, and sent such a model no suffix before."""
    p = group.prompter
    if p.fim is None:
        return p.template
    pre, suf, mid = (p.piece(t).decode("utf-8", "replace")
                     for t in (p.fim.pre, p.fim.suf, p.fim.mid))
    return (f"{{{{- if .Suffix }}}}{pre}{{{{ .Prompt }}}}{suf}{{{{ .Suffix }}}}{mid}"
            f"{{{{- else }}}}{p.template}{{{{- end }}}}")


def show(group: ModelGroup, verbose: bool) -> dict[str, Any]:
    """``/api/show``: the model's details, its GGUF keys, its chat template (Jinja2, as
    the GGUF has it; Ollama's are Go templates; see :func:`_template` for FIM models)
    and what it can do. ``verbose`` asks
    Ollama for the tokenizer's lists too, which forged does not give. ``parameters``
    holds the context forged serves as Ollama's ``num_ctx`` line: Continue reads its
    context length there and sends it back as ``options.num_ctx`` on every request
    (without it, its own default, which then sized its prompts)."""
    return {"modified_at": _timestamp(group.file.stamp[3] / 1e9),
            "parameters": f"num_ctx {group.max_context}",
            "template": _template(group), "details": _details(group),
            "model_info": _model_info(group), "capabilities": _capabilities(group),
            "license": group.prompter.meta("general.license") or ""}
