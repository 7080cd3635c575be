"""Prompt building on the daemon side: tokenization and the chat template.

The daemon loads the model's vocabulary only (cheap), so it can count prompt tokens,
refuse prompts that cannot fit before they reach a worker, and render chat messages
with the GGUF's own Jinja2 template through llama-cpp-python's formatter.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

import forged
from forged.engine.backend import Model, chat_formatter, check_grammar, llama_version
from forged.engine.closing import Closing
from forged.engine.fim import ExtraFile, MixedText, infill_prompt, leave_room
from forged.engine.grammar import TOOL_CLOSE, TOOL_OPEN
from forged.engine.kvdisk import model_identity
from forged.engine.request import Grammar
from forged.errors import BadRequest

# Used when a GGUF carries no template: ChatML, which SmolLM2 and many others speak.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# What the template is rendered with already; a request's chat_template_kwargs may not
# replace them (messages and tools have fields of their own).
TEMPLATE_NAMES = frozenset({"messages", "tools", "tool_choice", "functions", "function_call",
                            "add_generation_prompt", "bos_token", "eos_token",
                            "raise_exception", "strftime_now"})


# What a system message says in the probe of whether a template writes one.
_SYSTEM_NEEDLE = "<System Needle>"


def system_in_user_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` for a template without a system role, as llama.cpp sends them to
    one (minja's polyfill): system messages' text, a line each, opens the next user
    message, or a user message of its own before any other turn or at the end."""
    out: list[dict[str, Any]] = []
    pending: list[str] = []
    for m in messages:
        if m["role"] == "system":
            pending.append(m["content"])
            continue
        if pending and m["role"] == "user":
            m = {**m, "content": "\n".join([*pending, m["content"]] if m["content"]
                                           else pending)}
        elif pending:
            out.append({"role": "user", "content": "\n".join(pending)})
        pending = []
        out.append(m)
    if pending:
        out.append({"role": "user", "content": "\n".join(pending)})
    return out


class ModelInfo(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """What ``/v1/models`` says of the model (llama.cpp's ``meta``), and ``identity``:
    a short hash of the model and of the build serving it (OpenAI's
    ``system_fingerprint``), the same for the same model, template and versions."""

    vocab_type: int
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_params: int
    size: int
    identity: str


def model_info(model: Model, template: str, content: str = "") -> ModelInfo:
    # Hashing a multi-gigabyte file at start-up is too slow: what tells models apart
    # (name, shape, tensor bytes, the template in use, ``content``: a hash of the
    # file's ends, which tells retrained weights of one shape apart) and the versions
    # stand for it.
    ident = [model.meta("general.name") or "", model.n_vocab, model.n_ctx_train,
             model.n_embd, model.n_params, model.size, template, content,
             forged.__version__, llama_version()]
    digest = hashlib.sha256("\0".join(map(str, ident)).encode()).hexdigest()
    return ModelInfo(vocab_type=model.vocab_type, n_vocab=model.n_vocab,
                     n_ctx_train=model.n_ctx_train, n_embd=model.n_embd,
                     n_params=model.n_params, size=model.size, identity=digest[:10])


class Prompter(Closing):
    def __init__(self, model_path: str, chat_template: str = "") -> None:
        # The vocabulary only (llama.cpp's model, without weights): not the config's
        # ``group.model``.
        self.vocab = Model(model_path, vocab_only=True)
        template = chat_template or self.vocab.meta("tokenizer.chat_template") or CHATML
        self.chat_template = template
        eos = self.vocab.piece(self.vocab.eos, special=True).decode("utf-8", "replace")
        bos = self.vocab.piece(self.vocab.bos, special=True).decode("utf-8", "replace")
        self._chat = chat_formatter(template, eos, bos)
        self.takes_system = self._takes_system()
        # A template that renders tools and writes calls as <tool_call> blocks (the
        # format forged parses); others get the tools in a system message of forged's.
        self.renders_tools = "tools" in template and TOOL_OPEN in template
        # <tool_call> and </tool_call> where they are single special tokens: their text
        # must reach the tool-call parser (llama.cpp's "preserved tokens").
        self._open_token = self._special_token(TOOL_OPEN)
        self.tool_tokens = [t for t in (self._open_token, self._special_token(TOOL_CLOSE))
                            if t is not None]
        self.n_vocab = self.vocab.n_vocab
        self.n_ctx_train = self.vocab.n_ctx_train
        self.fim = self.vocab.fim_tokens()
        self.embedding = self.vocab.pools
        self._bos = self.vocab.bos if self.vocab.add_bos else None
        self._bos_text = bos if self._bos is not None else ""
        # The file's content (its size and ends): what an index's vectors must be made
        # by to be compared with this model's (forged.retrieval.vectors).
        self.content_id = model_identity(model_path)
        self.info = model_info(self.vocab, template, self.content_id)
        self.template = template  # the one in use (Ollama's /api/show reports it)
        self._pieces: dict[int, bytes] = {}

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as text (``general.architecture``, ...); None if absent."""
        return self.vocab.meta(key)

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        return self.vocab.tokenize(text, add_special=add_special, parse_special=parse_special)

    def piece(self, token: int) -> bytes:
        """The token's bytes, special tokens written out (llama.cpp's /tokenize pieces)."""
        return self.vocab.piece(token, special=True)

    def token_bytes(self, token: int) -> bytes:
        """:meth:`piece`, cached for logprobs, which ask per token. Called on the event
        loop only (the cache is not locked); bounded by the vocabulary."""
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self.vocab.piece(token, special=True)
        return piece

    def detokenize(self, tokens: list[int]) -> str:
        return self.vocab.detokenize(tokens)

    def encode_completion(self, text: str) -> list[int]:
        # Like llama.cpp's server and llama-cpp-python: BOS if the model wants one, and
        # special tokens written in the text are parsed as such.
        return self.vocab.tokenize(text, add_special=True, parse_special=True)

    def encode_mixed(self, pieces: list[int | str]) -> list[int]:
        """llama.cpp's mixed prompt (``[12, "text", 34]``): ids as given, text as
        :meth:`encode_completion` has it, BOS only before text that comes first."""
        out: list[int] = []
        for i, piece in enumerate(pieces):
            out += [piece] if isinstance(piece, int) else self.vocab.tokenize(
                piece, add_special=i == 0, parse_special=True)
        return out

    def _takes_system(self) -> bool:
        """Whether the template writes a system message's text (minja's test, which
        llama.cpp runs): Gemma's and older Mistrals' raise on one, or drop it."""
        try:
            text = self._chat(messages=[
                {"role": "system", "content": _SYSTEM_NEEDLE},
                {"role": "user", "content": "Hey"}]).prompt
        except Exception:  # a template's raise_exception or a Jinja2 error
            return False
        return _SYSTEM_NEEDLE in str(text)

    def _special_token(self, text: str) -> int | None:
        ids = self.vocab.tokenize(text, add_special=False, parse_special=True)
        plain = self.vocab.tokenize(text, add_special=False, parse_special=False)
        return ids[0] if len(ids) == 1 and ids != plain else None

    def triggered(self, grammar: Grammar) -> Grammar:
        """``grammar`` (a lazy tool grammar) triggered by the ``<tool_call>`` token
        where the vocabulary has one: until a pattern fires, llama.cpp searches the
        whole text so far with it at every token, on every sequence of the worker (43 us
        a token at 1,000 tokens of prose, growing with the answer: bench.trigger); a
        token is one comparison, and prose that mentions the marker does not fire it."""
        if not grammar.lazy or self._open_token is None:
            return grammar
        return msgspec.structs.replace(grammar, trigger_patterns=[],
                                       trigger_tokens=[self._open_token])

    def check_grammar(self, grammar: Grammar) -> None:
        """ValueError unless llama.cpp parses ``grammar`` (it logs where it fails)."""
        check_grammar(self.vocab, grammar)

    def render_chat(self, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None,
                    variables: dict[str, Any] | None = None) -> str:
        """The prompt of ``messages``; ``variables`` are the request's own for the
        template (vLLM's chat_template_kwargs, e.g. ``enable_thinking``)."""
        for name in variables or {}:
            if name in TEMPLATE_NAMES:
                raise BadRequest(f"{name!r} is set by forged, not by chat_template_kwargs",
                                 param=f"chat_template_kwargs.{name}")
        if not self.takes_system:
            messages = system_in_user_turns(messages)
        try:
            text = str(self._chat(messages=messages,  # type: ignore[arg-type]
                                  tools=tools,  # type: ignore[arg-type]
                                  **(variables or {})).prompt)
        except Exception as exc:  # a template's raise_exception or a Jinja2 error
            raise BadRequest(f"the chat template rejected the messages: {exc}",
                             param="messages") from exc
        # As llama-server: where the model wants BOS, the template's own goes and the
        # tokenizer adds it (encode_chat), so that it is there once whether or not the
        # template writes it.
        return text.removeprefix(self._bos_text) if self._bos_text else text

    def encode_chat(self, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None,
                    variables: dict[str, Any] | None = None) -> list[int]:
        # BOS where the model wants it (render_chat took the template's away), as
        # llama-server tokenizes a chat's prompt; a template that does not write one
        # (ChatML's, on a model that wants it) left the prompt without.
        return self.vocab.tokenize(self.render_chat(messages, tools, variables),
                                   add_special=True, parse_special=True)

    def encode_infill(self, prefix: MixedText, suffix: MixedText, extra: list[ExtraFile],
                      prompt: str, *, n_batch: int, n_ctx: int, n_predict: int,
                      room: int) -> list[int]:
        """llama.cpp's /infill prompt (forged.engine.fim): each piece tokenized as its
        server does, the typed ``prompt`` with special tokens parsed, the rest without;
        the extra context clipped to leave ``room`` of ``n_ctx`` to the completion."""
        if self.fim is None:
            raise BadRequest("this model has no fill-in-the-middle tokens (prefix, suffix "
                             "and middle): serve a FIM-capable model for completions "
                             "with code after the cursor", code="fim_not_supported")
        ids = self.vocab.tokenize(prompt, add_special=False, parse_special=True)
        laid_out = infill_prompt(
            prefix, suffix, extra, ids, self.fim,
            lambda s: self.vocab.tokenize(s, add_special=False, parse_special=False),
            bos=self._bos, n_batch=n_batch, n_ctx=n_ctx, n_predict=n_predict)
        return leave_room(laid_out, n_ctx, room).tokens

    def close(self) -> None:
        self.vocab.close()
