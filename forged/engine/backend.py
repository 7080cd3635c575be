"""The only module that calls llama.cpp (through llama-cpp-python's ctypes API).

Everything above this speaks token ids and sequence ids. llama.cpp aborts the whole
process on misuse (for instance a batch larger than ``n_batch``), so the decode loop
runs in a worker process and every batch is checked here before it is handed over.

Resource handling: :class:`Model`, :class:`Context`, :class:`Sampler` and the batch
own C memory and free it in ``close()``; each is also a context manager.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import llama_cpp as ll
import numpy as np
import numpy.typing as npt
from llama_cpp.llama_chat_format import Jinja2ChatFormatter
from llama_cpp.llama_grammar import (
    INVALID_RULE_CHARS_RE,
    JSON_GBNF,
    RESERVED_NAMES,
    SchemaConverter,
)

from forged.engine.closing import Closing
from forged.engine.decoding import DecodeError, DecodeItem, NoKVSpace, TokenLogprob, TokenSampler
from forged.engine.fim import FimTokens
from forged.engine.numrange import bounded_rule
from forged.engine.request import Grammar, SamplerName, Sampling
from forged.engine.schemawalk import mapped
from forged.engine.utf8 import Utf8Guard, Utf8Table

_init_lock = threading.Lock()
_initialised = False


@ll.llama_log_callback  # type: ignore[untyped-decorator]
def _log_errors_only(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    # llama.cpp is chatty at INFO; an appliance's journal wants only its errors.
    if level == 3:
        sys.stderr.write(text.decode("utf-8", "replace"))


def _init() -> None:
    global _initialised
    with _init_lock:
        if _initialised:
            return
        ll.llama_log_set(_log_errors_only, ctypes.c_void_p(0))
        # The packaged llama.cpp is built with one CPU backend per x86-64 feature level
        # (GGML_BACKEND_DL and GGML_CPU_ALL_VARIANTS: libggml-cpu-sse42.so, -haswell.so,
        # -skylakex.so, ...) and links none of them, so that the .deb runs on any x86-64
        # CPU: ggml loads the best one this CPU can run. llama_backend_init() would look
        # for them only beside the executable (python) and in the current directory, so
        # load them from the wheel's library folder first. The development build links
        # its one native CPU backend in, so a backend is registered already and this
        # step does nothing there.
        lib_dir = ll.llama_cpp._base_path  # honours LLAMA_CPP_LIB_PATH, as the binding does
        # ggml's functions through libllama's handle: the libggml it links, not a second
        # copy from another of the wheel's duplicate files (libggml.so, .so.0, .so.0.x.y).
        ggml = ll.llama_cpp._lib
        ggml.ggml_backend_reg_count.restype = ctypes.c_size_t
        if ggml.ggml_backend_reg_count() == 0:
            ggml.ggml_backend_load_all_from_path.argtypes = [ctypes.c_char_p]
            ggml.ggml_backend_load_all_from_path.restype = None
            ggml.ggml_backend_load_all_from_path(str(lib_dir).encode())
            if ggml.ggml_backend_reg_count() == 0:
                raise BackendError(f"no llama.cpp CPU backend in {lib_dir} runs on this CPU")
        ll.llama_backend_init()
        _initialised = True


def llama_version() -> str:
    """llama-cpp-python's version: a saved KV state is valid only for the same one."""
    return str(ll.__version__)


# llama.cpp's JSON grammar: an object at the top.
JSON_OBJECT_GBNF: str = JSON_GBNF


def chat_formatter(template: str, eos: str, bos: str) -> Jinja2ChatFormatter:
    """llama-cpp-python's renderer of a Jinja2 chat template, adding the prompt that
    starts the assistant's turn."""
    return Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos,
                               add_generation_prompt=True)


# What a GBNF literal cannot hold as itself: its quote and escape character, and control
# characters (llama.cpp reads the grammar as a C string: a NUL would end it).
_GBNF_SPECIAL = re.compile(r'["\\\x00-\x1f\x7f]')


def gbnf_literal(text: str) -> str:
    """``text`` as a GBNF literal that matches exactly it. Not json.dumps: it writes an
    emoji as two surrogate escapes (GBNF reads two code points no token can write) and
    \\b, \\f as escapes llama.cpp's GBNF does not know."""
    return '"' + _GBNF_SPECIAL.sub(_gbnf_escape, text) + '"'


def _gbnf_escape(m: re.Match[str]) -> str:
    c = m.group()
    return "\\" + c if c in '"\\' else f"\\x{ord(c):02x}"


def gbnf_alternatives(texts: list[str], then: dict[str, str] | None = None) -> str:
    """A GBNF expression that matches exactly one of ``texts`` (not empty), each
    followed by what ``then`` writes after it (GBNF; nothing where absent), written as
    a prefix tree: ``"\\"a" ("b\\"" | "c\\"")`` rather than ``"\\"ab\\"" | "\\"ac\\""``.

    Why: llama.cpp's grammar keeps one stack per alternative still alive and checks
    every candidate token against each, so a flat list of N texts costs N times one
    over the whole vocabulary until the texts part: 490 ms a token for an enum of 3,500
    words on SmolLM2's 49k tokens, in the worker's step, where every other stream
    waits. In the tree, the stacks alive are the branches at one node (at most the
    characters that can come next). The language is the same."""
    after = then or {}
    words = sorted((w, after.get(w, "")) for w in set(texts))
    try:
        return _tree(words)
    except RecursionError:  # a tree nested past Python's stack: the flat list is exact,
        # in a group as the tree is (after a call's '"name":', each branch needs it)
        return "(" + " | ".join(_joined(gbnf_literal(w), c) for w, c in words) + ")"


def _tree(words: list[tuple[str, str]]) -> str:
    """:func:`gbnf_alternatives` of sorted, distinct ``(word, then)`` pairs: the words'
    common prefix, then one branch per next character, and where a word ends there,
    what comes after it (nothing: the branches are optional)."""
    first, last = words[0][0], words[-1][0]  # sorted: what they share, all share
    n = next((i for i, (a, b) in enumerate(zip(first, last, strict=False)) if a != b),
             min(len(first), len(last)))
    rest = [(w[n:], c) for w, c in words]
    ended = rest[0][0] == ""  # sorted: a word that ends here comes first
    branches = [_tree(list(group)) for _, group in
                itertools.groupby(rest[ended:], key=lambda p: p[0][0])]
    if ended and rest[0][1]:
        branches.insert(0, f"({rest[0][1]})")
    body = "(" + " | ".join(branches) + ")" if len(branches) > 1 else "".join(branches)
    if ended and not rest[0][1] and branches:
        body = f"{body}?" if len(branches) > 1 else f"({body})?"
    return _joined(gbnf_literal(first[:n]) if n else "", body) or '""'


def _joined(head: str, body: str) -> str:
    return f"{head} {body}" if head and body else head or body


# What the converter's visit looks at before an enum (then the enum is not its rule).
_OUTRANKS_ENUM = frozenset({"$ref", "oneOf", "anyOf", "const"})


class _Converter(SchemaConverter):
    """llama-cpp-python's converter, with literals escaped for GBNF in full: it left a
    backslash as is, so JSON's ``\\n`` in an enum's value became the grammar's newline
    (a raw line break inside a JSON string), and ``\\"`` ended the grammar's literal."""

    def _format_literal(self, literal: str) -> str:
        return gbnf_literal(literal)

    # The rule each name visited was written as (see :func:`schema_gbnf`), and each
    # $ref's rule, by the whole ref.
    written: dict[str, str]
    ref_rules: dict[str, str]

    def visit(self, schema: dict[str, Any], name: str) -> str:
        """The converter's visit, with an integer's or a number's bounds enforced (it
        wrote any number: forged.engine.numrange), and the rule it wrote noted."""
        rule = self._visit(schema, name)
        self.written.setdefault(name, rule)
        return rule

    def _visit(self, schema: dict[str, Any], name: str) -> str:
        rule_name = name + "-" if name in RESERVED_NAMES else name or "root"
        if schema.get("type") in ("integer", "number") and (
                rule := bounded_rule(schema)) is not None:
            return str(self._add_rule(rule_name, rule + " space"))  # type: ignore[no-untyped-call]
        if "enum" in schema and not _OUTRANKS_ENUM & schema.keys() \
                and not isinstance(schema.get("type"), list):
            # Where the converter's own visit takes the enum, as a prefix tree.
            rule = gbnf_alternatives([json.dumps(v) for v in schema["enum"]])
            return str(self._add_rule(rule_name, rule))  # type: ignore[no-untyped-call]
        return str(super().visit(schema, name))  # type: ignore[no-untyped-call]

    def _resolve_ref(self, ref: str) -> str:
        """The rule of the schema ``ref`` points at, named by the ref's last part where
        that name is free. The converter's own reused any rule so named: two tools'
        "#/properties/from" (zod's schema used twice) both wrote the first's, and a
        ref to .../item wrote a property "item" of another object."""
        if (known := self.ref_rules.get(ref)) is not None:
            return known  # or being resolved: a recursive schema refers to itself
        base = INVALID_RULE_CHARS_RE.sub("-", ref.split("/")[-1]) or "ref"
        taken = self._rules.keys() | RESERVED_NAMES | set(self.ref_rules.values())
        name = next(n for n in (base, *(f"{base}-ref{k}" for k in range(len(taken) + 1)))
                    if n not in taken)
        self.ref_rules[ref] = name
        rule = self.visit(self._refs[ref], name)
        if rule != name:  # a primitive's own rule ("string"): named here as well
            self._add_rule(name, rule)  # type: ignore[no-untyped-call]
        return name

    def resolve_refs(self, schema: dict[str, Any], url: str) -> dict[str, Any]:
        """The converter's resolve_refs for local references, walking schemas only: its
        own rewrote every ``"$ref"`` key it met, data included, so a ``const`` of
        ``{"$ref": "#/$defs/X"}`` had the model write ``"s#/$defs/X"``."""

        def visit(node: Any) -> Any:
            if not isinstance(node, dict):
                return node
            for key, value in node.items():  # beside a $ref too: pydantic writes a
                mapped(key, value, visit)  # recursive model as {"$ref", "$defs"}
            if (ref := node.get("$ref")) is None:
                return node
            if not isinstance(ref, str) or not ref.startswith("#/"):
                raise ValueError(f"unsupported $ref {ref!r}: only local ones (#/...)")
            target: Any = schema
            for sel in ref[2:].split("/"):
                if isinstance(target, list) and sel.isdigit() and int(sel) < len(target):
                    target = target[int(sel)]  # an anyOf's branch: a tool's, say
                    continue
                if not isinstance(target, dict) or sel not in target:
                    raise ValueError(f"$ref {ref!r} points at nothing")
                target = target[sel]
            node["$ref"] = f"{url}{ref}"
            self._refs[node["$ref"]] = target
            return node

        return visit(schema)  # type: ignore[no-any-return]


def schema_gbnf(schema: dict[str, Any], name: str, param: str,
                prop_order: dict[str, int], written: dict[str, str] | None = None) -> str:
    """GBNF for a JSON schema (llama.cpp's converter, nothing fetched); its top rule is
    ``name`` ("" is ``root``). ``written`` is filled with the rule each subschema's
    name (``NAME-PROPERTY``, ...) was written as: not always that name, as the converter
    names a primitive's rule by its type and adds a digit to a name already taken (a
    property "kv" of ``x`` takes ``x-kv``, and ``x``'s own key-value rule becomes
    ``x-kv0``). The converter's own exceptions pass through: it raises
    AssertionError, ValueError, KeyError, TypeError, AttributeError, IndexError or
    RecursionError on a schema it cannot convert."""
    converter = _Converter(  # type: ignore[no-untyped-call]
        prop_order=prop_order, allow_fetch=False, dotall=False, raw_pattern=False)
    converter.written = {} if written is None else written
    converter.ref_rules = {}
    converter.visit(converter.resolve_refs(schema, param), name)
    return str(converter.format_grammar())  # type: ignore[no-untyped-call]


class BackendError(Exception):
    """llama.cpp refused something (a file it cannot load, a context it cannot make)."""


@dataclass(frozen=True)
class DrySettings:
    multiplier: float
    base: float
    allowed_length: int
    penalty_last_n: int
    breakers: tuple[str, ...]


# DRY samplers kept per model, by their settings: llama.cpp scans the whole vocabulary
# for every sequence breaker when it makes one (15 ms for "\n", up to a second for a
# breaker of letters, on a 49k vocabulary), and an editor sends the same settings
# every time; a clone copies what the scan found.
_DRY_KEPT = 16


class Model(Closing):
    """A loaded GGUF. With ``vocab_only`` it is cheap: enough to tokenize and template.

    Resource handling: the DRY samplers it keeps (:meth:`dry_sampler`) are freed with it.
    """

    def __init__(self, path: str, *, vocab_only: bool = False) -> None:
        _init()
        params = ll.llama_model_default_params()
        params.vocab_only = vocab_only
        params.n_gpu_layers = 0
        self._ptr = ll.llama_model_load_from_file(path.encode(), params)
        if not self._ptr:
            raise BackendError(f"llama.cpp could not load the model {path}")
        self.vocab = ll.llama_model_get_vocab(self._ptr)
        self.n_vocab: int = ll.llama_vocab_n_tokens(self.vocab)
        # llama.cpp loads no hyperparameters for a vocabulary-only model and reports 0:
        # the GGUF's own key says it then (the daemon's model is vocabulary-only).
        self.n_ctx_train = ll.llama_model_n_ctx_train(self._ptr) or self._hparam(
            "context_length")
        self.n_embd = ll.llama_model_n_embd(self._ptr) or self._hparam("embedding_length")
        self.eos: int = ll.llama_vocab_eos(self.vocab)
        self.bos: int = ll.llama_vocab_bos(self.vocab)
        self._eog = [t for t in range(self.n_vocab) if ll.llama_vocab_is_eog(self.vocab, t)]
        self._piece_buf = ctypes.create_string_buffer(256)
        self._utf8: Utf8Table | None = None
        self._dry: OrderedDict[DrySettings, Any] = OrderedDict()

    @property
    def ptr(self) -> Any:
        return self._ptr

    @property
    def eog_tokens(self) -> list[int]:
        return list(self._eog)

    @property
    def n_params(self) -> int:
        return int(ll.llama_model_n_params(self._ptr))

    @property
    def size(self) -> int:
        """Bytes of the model's tensors (llama.cpp's ``size``)."""
        return int(ll.llama_model_size(self._ptr))

    @property
    def vocab_type(self) -> int:
        """llama.cpp's enum: 1 SentencePiece, 2 BPE, 3 WordPiece, ..."""
        return int(ll.llama_vocab_type(self.vocab))

    @property
    def add_bos(self) -> bool:
        """Whether the model wants BOS at the start of a prompt."""
        return bool(ll.llama_vocab_get_add_bos(self.vocab))

    @property
    def pools(self) -> bool:
        """Whether the GGUF pools a text to one vector (mean, CLS or last token): an
        embedding model, which forged serves embeddings from and nothing else."""
        return self._hparam("pooling_type") in (ll.LLAMA_POOLING_TYPE_MEAN,
                                                ll.LLAMA_POOLING_TYPE_CLS,
                                                ll.LLAMA_POOLING_TYPE_LAST)

    def fim_tokens(self) -> FimTokens | None:
        """The vocabulary's fill-in-the-middle tokens; None without prefix, suffix and
        middle (llama.cpp reports an absent one as -1)."""
        v = self.vocab
        ids = [ll.llama_vocab_fim_pre(v), ll.llama_vocab_fim_suf(v), ll.llama_vocab_fim_mid(v)]
        if min(ids) < 0:
            return None
        rep, sep, pad = (t if t >= 0 else None for t in (
            ll.llama_vocab_fim_rep(v), ll.llama_vocab_fim_sep(v), ll.llama_vocab_fim_pad(v)))
        return FimTokens(pre=ids[0], suf=ids[1], mid=ids[2], rep=rep, sep=sep, pad=pad)

    def kv_bytes_per_cell(self) -> int:
        """Bytes one KV cell takes over every layer (f16 keys and values, llama.cpp's
        default cache type), from the GGUF's hyperparameters: what a context of N
        cells allocates, N times over."""
        heads = self._hparam("attention.head_count") or 1
        kv_heads = self._hparam("attention.head_count_kv") or heads
        head = self.n_embd // heads
        k = self._hparam("attention.key_length") or head
        v = self._hparam("attention.value_length") or head
        return 2 * self._hparam("block_count") * kv_heads * (k + v)

    def _hparam(self, name: str) -> int:
        """The architecture's hyperparameter ``name`` from the GGUF metadata; 0 if absent."""
        value = self.meta(f"{self.meta('general.architecture')}.{name}")
        return int(value) if value is not None and value.isdigit() else 0

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = ll.llama_model_meta_val_str(self._ptr, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):  # a long chat template: ask again with room for it
            buf = ctypes.create_string_buffer(n + 1)
            ll.llama_model_meta_val_str(self._ptr, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 8
        arr = (ll.llama_token * cap)()
        n = ll.llama_tokenize(self.vocab, data, len(data), arr, cap, add_special, parse_special)
        if n < 0:  # the buffer was too small; -n is the size needed
            cap = -n
            arr = (ll.llama_token * cap)()
            n = ll.llama_tokenize(self.vocab, data, len(data), arr, cap, add_special,
                                  parse_special)
        return list(arr[:n])

    def detokenize(self, tokens: Sequence[int]) -> str:
        """The text of ``tokens``, special tokens written out (as llama.cpp's server
        reports a prompt)."""
        arr = (ll.llama_token * len(tokens))(*tokens)
        cap = 8 * len(tokens) + 16
        buf = ctypes.create_string_buffer(cap)
        n = ll.llama_detokenize(self.vocab, arr, len(tokens), buf, cap, False, True)
        if n < 0:  # the buffer was too small; -n is the size needed
            buf = ctypes.create_string_buffer(-n)
            n = ll.llama_detokenize(self.vocab, arr, len(tokens), buf, -n, False, True)
        return buf.raw[:n].decode("utf-8", "replace")

    def piece(self, token: int, *, special: bool = False) -> bytes:
        if not 0 <= token < self.n_vocab:
            # A model without one (a BERT has no EOS: -1) or a bad id: llama.cpp would
            # throw out_of_range through C, which aborts the process.
            return b""
        buf = self._piece_buf
        n = ll.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = ll.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def utf8_table(self) -> Utf8Table:
        """Built on first use: one pass over the vocabulary."""
        if self._utf8 is None:
            self._utf8 = Utf8Table.build([self.piece(t) for t in range(self.n_vocab)])
        return self._utf8

    def dry_sampler(self, d: DrySettings) -> Any:
        """A DRY sampler with these settings, kept (the most recent few): clone it."""
        kept = self._dry.get(d)
        if kept is None:
            breakers = [b.encode() for b in d.breakers]
            arr = (ctypes.c_char_p * max(1, len(breakers)))(*breakers)
            kept = self._dry[d] = ll.llama_sampler_init_dry(
                self.vocab, d.multiplier, d.base, d.allowed_length, d.penalty_last_n, arr,
                len(breakers))
            if len(self._dry) > _DRY_KEPT:
                ll.llama_sampler_free(self._dry.popitem(last=False)[1])
        self._dry.move_to_end(d)
        return kept

    def close(self) -> None:
        for kept in self._dry.values():
            ll.llama_sampler_free(kept)
        self._dry.clear()
        if self._ptr:
            ll.llama_model_free(self._ptr)
            self._ptr = None


# At temperature 0 the chain keeps only the samplers that may change which token is the
# most likely; the others (top_k, top_p, min_p, top_n_sigma) always keep that one.
_MOVE_THE_TOP: frozenset[SamplerName] = frozenset(
    {"penalties", "dry", "typical_p", "xtc", "infill"})
# llama.cpp's LLAMA_DEFAULT_SEED: the dist sampler then draws a random seed.
_RANDOM_SEED = 0xFFFFFFFF


def grammar_sampler(model: Model, g: Grammar) -> Any:
    """llama.cpp's grammar sampler for ``g``; raises ValueError if llama.cpp cannot
    parse the grammar (it returns no sampler and logs why)."""
    gbnf, root = g.gbnf.encode(), b"root"
    if not g.lazy:
        ptr = ll.llama_sampler_init_grammar(model.vocab, gbnf, root)
    else:
        patterns = (ctypes.c_char_p * max(1, len(g.trigger_patterns)))(
            *(t.encode() for t in g.trigger_patterns))
        tokens = (ll.llama_token * max(1, len(g.trigger_tokens)))(*g.trigger_tokens)
        ptr = ll.llama_sampler_init_grammar_lazy_patterns(
            model.vocab, gbnf, root, patterns, len(g.trigger_patterns), tokens,
            len(g.trigger_tokens))
    if not ptr:
        raise ValueError("llama.cpp could not parse the grammar")
    return ptr


def check_grammar(model: Model, g: Grammar) -> None:
    """Raise ValueError unless llama.cpp accepts ``g`` (the daemon checks each request's
    grammar with its vocabulary-only model before a worker sees it)."""
    ll.llama_sampler_free(grammar_sampler(model, g))


# llama_token_data, as numpy lays out a candidate array llama.cpp can read.
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


class _Candidates:
    """A reusable llama_token_data_array over one vocabulary: a draw that must ban
    tokens, or check what a grammar left, builds its candidates here from a copy of
    the logits row (the row itself stays the model's, for logprobs)."""

    def __init__(self, n_vocab: int) -> None:
        self.data = np.zeros(n_vocab, dtype=_TOKEN_DATA)
        self._ids = np.arange(n_vocab, dtype=np.int32)
        self.array = ll.llama_token_data_array(
            data=self.data.ctypes.data_as(ctypes.POINTER(ll.llama_token_data)),
            size=n_vocab, selected=-1, sorted=False)

    def fill(self, logits: Any) -> npt.NDArray[np.float32]:
        """Reset to ``logits``; the logit column, indexed by token id, to ban in."""
        self.data["id"] = self._ids
        self.data["logit"] = logits
        self.data["p"] = 0.0
        a = self.array
        a.size, a.selected, a.sorted = len(self.data), -1, False
        column: npt.NDArray[np.float32] = self.data["logit"]
        return column

    def selected(self) -> int:
        return int(self.array.data[self.array.selected].id)


class Sampler(Closing):
    """One request's llama.cpp sampler chain (its RNG and penalty history are its own).

    A grammar stays out of the chain: the token drawn without it is checked against it,
    and only if it does not fit is the grammar applied to every candidate and the draw
    made again (llama.cpp's server samples so). Penalties want the prompt in their
    history, but a grammar must only ever see what it constrains (a token it cannot
    accept aborts the process); and a draw for which the grammar leaves no token (it
    may ask for text that is not valid UTF-8, which the guard bans) must fail this
    request, not abort the worker in llama.cpp's accept.
    """

    def __init__(self, model: Model, p: Sampling, prompt: Sequence[int] = ()) -> None:
        self._ptr = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        self._model, self._p = model, p
        self._grammar: Any = None
        self._guard: Utf8Guard | None = None  # with a grammar (see forged.engine.utf8)
        self._draws = 0
        self._history = False  # whether a stage reads the tokens before (_stage)
        if p.logit_bias:
            arr = (ll.llama_logit_bias * len(p.logit_bias))(
                *(ll.llama_logit_bias(tok, bias) for tok, bias in p.logit_bias)
            )
            self._add(ll.llama_sampler_init_logit_bias(model.n_vocab, len(p.logit_bias), arr))
        if p.mirostat:
            self._mirostat()
        else:
            self._chain()
        if self._history:  # as llama.cpp's server does: the prompt counts
            self.accept(prompt)
        if p.grammar is not None:
            try:
                self._grammar = grammar_sampler(model, p.grammar)
            except ValueError:
                self.close()
                raise
            self._guard = Utf8Guard(model.utf8_table())
        self._candidates = (_Candidates(model.n_vocab)
                            if self._grammar is not None or p.min_tokens else None)

    def _add(self, sampler: Any) -> None:
        ll.llama_sampler_chain_add(self._ptr, sampler)

    @property
    def _seed(self) -> int:
        return _RANDOM_SEED if self._p.seed is None else self._p.seed & 0xFFFFFFFF

    def _mirostat(self) -> None:
        """llama.cpp's mirostat chain: temperature, then mirostat draws (``order`` does
        not apply: mirostat keeps every candidate for its own estimate)."""
        p = self._p
        self._add(ll.llama_sampler_init_temp(p.temperature))
        if p.mirostat == 1:
            # m = 100: the tokens its estimate of s_hat uses, as llama.cpp sets it.
            self._add(ll.llama_sampler_init_mirostat(self._model.n_vocab, self._seed,
                                                     p.mirostat_tau, p.mirostat_eta, 100))
        else:
            self._add(ll.llama_sampler_init_mirostat_v2(self._seed, p.mirostat_tau,
                                                        p.mirostat_eta))

    def _chain(self) -> None:
        """The samplers of ``order``, then a draw: greedy at temperature 0 (without
        dynamic temperature, which would raise it), else from the distribution."""
        p = self._p
        greedy = p.temperature <= 0.0 and p.dynatemp_range <= 0.0
        # What the infill sampler is handed changes its answer (it pools candidates
        # that share a prefix), and a top_k before it bounds its cost: everything
        # before it runs, as in llama.cpp.
        infill_at = max((i for i, n in enumerate(p.order) if n == "infill"), default=-1)
        for i, name in enumerate(p.order):
            if not greedy or i <= infill_at or name in _MOVE_THE_TOP:
                self._stage(name)
        self._add(ll.llama_sampler_init_greedy() if greedy
                  else ll.llama_sampler_init_dist(self._seed))

    def _stage(self, name: SamplerName) -> None:
        """Add the named sampler, unless its setting leaves it out (top_k 0, ...)."""
        p = self._p
        match name:
            case "penalties" if p.repeat_last_n and (
                    p.repeat_penalty != 1.0 or p.presence_penalty or p.frequency_penalty):
                # The binding declares llama.cpp's 5-argument signature (n_vocab first,
                # read only by backend sampling); an older libllama takes 4 and reads
                # penalty_last_n from the first integer register. Passing last_n twice
                # is right under either ABI.
                self._add(ll.llama_sampler_init_penalties(
                    p.repeat_last_n, p.repeat_last_n, p.repeat_penalty,
                    p.frequency_penalty, p.presence_penalty))
                self._history = True
            case "dry" if p.dry_multiplier > 0.0 and p.dry_penalty_last_n:
                self._dry()
            case "top_n_sigma" if p.top_n_sigma > 0.0:
                self._add(ll.llama_sampler_init_top_n_sigma(p.top_n_sigma))
            case "top_k" if p.top_k > 0:
                self._add(ll.llama_sampler_init_top_k(p.top_k))
            case "typical_p" if p.typical_p < 1.0:
                self._add(ll.llama_sampler_init_typical(p.typical_p, p.min_keep))
            case "top_p" if p.top_p < 1.0:
                self._add(ll.llama_sampler_init_top_p(p.top_p, p.min_keep))
            case "min_p" if p.min_p > 0.0:
                self._add(ll.llama_sampler_init_min_p(p.min_p, p.min_keep))
            case "xtc" if p.xtc_probability > 0.0 and p.xtc_threshold <= 0.5:
                self._add(ll.llama_sampler_init_xtc(p.xtc_probability, p.xtc_threshold,
                                                    p.min_keep, self._seed))
            case "temperature" if p.dynatemp_range > 0.0:
                self._add(ll.llama_sampler_init_temp_ext(p.temperature, p.dynatemp_range,
                                                         p.dynatemp_exponent))
            case "temperature":
                self._add(ll.llama_sampler_init_temp(p.temperature))
            case "infill":
                self._add(ll.llama_sampler_init_infill(self._model.vocab))

    def _dry(self) -> None:
        p = self._p
        self._add(ll.llama_sampler_clone(self._model.dry_sampler(DrySettings(
            p.dry_multiplier, p.dry_base, p.dry_allowed_length, p.dry_penalty_last_n,
            p.dry_sequence_breakers))))
        self._history = True

    def accept(self, tokens: Iterable[int]) -> None:
        """Feed prompt tokens to the penalty history, as llama.cpp's server does."""
        for t in tokens:
            ll.llama_sampler_accept(self._ptr, t)

    def sample(self, ctx: Context, index: int) -> int:
        c = self._candidates
        if c is None:
            # llama_sampler_sample also accepts the sampled token into the chain.
            return int(ll.llama_sampler_sample(self._ptr, ctx.ptr, index))
        row = np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx.ptr, index),
                                    shape=(self._model.n_vocab,))
        token = self._draw(c, row, grammar=False)
        if self._grammar is not None and not self._fits(token):
            # As llama.cpp's server does: the grammar over the whole vocabulary (11 ms a
            # draw on 49k tokens) only when the token drawn without it does not fit.
            # Drawing again from what fits gives each fitting token its probability
            # within the grammar, as drawing with the grammar first would.
            token = self._draw(c, row, grammar=True)
        self._draws += 1
        ll.llama_sampler_accept(self._ptr, token)
        if self._grammar is not None:
            ll.llama_sampler_accept(self._grammar, token)
        if self._guard is not None:
            self._guard.accept(token)
        return token

    def _draw(self, c: _Candidates, row: npt.NDArray[np.float32], *, grammar: bool) -> int:
        logits = c.fill(row)
        if self._draws < self._p.min_tokens:
            logits[list(self._p.suppress)] = -np.inf
        if self._guard is not None:
            self._guard.ban(logits)
        if grammar:
            ll.llama_sampler_apply(self._grammar, ctypes.byref(c.array))
            if not np.isfinite(c.data["logit"][:c.array.size]).any():
                raise ValueError("no token can continue the answer within the grammar "
                                 "(does it ask for text that is not valid UTF-8?)")
        ll.llama_sampler_apply(self._ptr, ctypes.byref(c.array))
        return c.selected()

    def _fits(self, token: int) -> bool:
        one = ll.llama_token_data(token, 1.0, 0.0)
        array = ll.llama_token_data_array(data=ctypes.pointer(one), size=1, selected=-1,
                                          sorted=False)
        ll.llama_sampler_apply(self._grammar, ctypes.byref(array))
        return bool(np.isfinite(one.logit))

    def close(self) -> None:
        if self._ptr:
            ll.llama_sampler_free(self._ptr)
            self._ptr = None
        if self._grammar is not None:
            ll.llama_sampler_free(self._grammar)
            self._grammar = None


@dataclass(frozen=True)
class ContextParams:
    n_ctx: int
    n_seq_max: int
    n_batch: int
    threads: int
    flash_attn: bool = False
    kv_unified: bool = True


class Context(Closing):
    """A llama_context with ``n_seq_max`` sequences and one reusable batch."""

    def __init__(self, model: Model, p: ContextParams) -> None:
        self.model = model
        self.params = p
        cp = ll.llama_context_default_params()
        cp.n_ctx = p.n_ctx
        cp.n_batch = cp.n_ubatch = p.n_batch
        cp.n_seq_max = p.n_seq_max
        cp.n_threads = cp.n_threads_batch = p.threads
        cp.flash_attn_type = (
            ll.LLAMA_FLASH_ATTN_TYPE_ENABLED if p.flash_attn else ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        cp.kv_unified = p.kv_unified
        cp.no_perf = True
        self._ptr = ll.llama_init_from_model(model.ptr, cp)
        if not self._ptr:
            raise BackendError("llama.cpp could not create a context (out of memory?)")
        self._mem = ll.llama_get_memory(self._ptr)
        self._batch = ll.llama_batch_init(p.n_batch, 0, 1)

    @property
    def ptr(self) -> Any:
        return self._ptr

    def seq_rm(self, seq: int, p0: int) -> None:
        # Removing a whole tail never fails on a KV cache (only recurrent memory refuses).
        if not ll.llama_memory_seq_rm(self._mem, seq, p0, -1):
            raise BackendError(f"llama_memory_seq_rm({seq}, {p0}) refused")

    def seq_cp(self, src: int, dst: int, n: int) -> None:
        ll.llama_memory_seq_cp(self._mem, src, dst, 0, n)

    def seq_cp_stream(self, src: int, dst: int, n: int) -> None:
        """Per-slot streams: copy all of ``src``'s stream (llama.cpp asserts that a
        cross-stream copy is whole), then drop what ``dst`` does not share."""
        ll.llama_memory_seq_cp(self._mem, src, dst, -1, -1)
        self.seq_rm(dst, n)

    def seq_save(self, seq: int) -> bytearray:
        # llama.cpp writes straight into the Python buffer that is kept: no copy.
        state = bytearray(ll.llama_state_seq_get_size(self._ptr, seq))
        dst = (ctypes.c_uint8 * len(state)).from_buffer(state)
        got = ll.llama_state_seq_get_data(self._ptr, dst, len(state), seq)
        del dst  # a buffer export: the bytearray cannot be resized while it lives
        del state[got:]
        return state

    def seq_load(self, seq: int, state: bytearray, n_tokens: int) -> bool:
        src = (ctypes.c_uint8 * len(state)).from_buffer(state)  # read in place
        if ll.llama_state_seq_set_data(self._ptr, src, len(state), seq) == len(state) and (
                ll.llama_memory_seq_pos_max(self._mem, seq) == n_tokens - 1):
            return True
        self.seq_rm(seq, 0)  # llama.cpp clears it on most refusals, not on a short state
        return False

    def decode(self, items: Sequence[DecodeItem]) -> list[int]:
        """Run one batch of ``(seq, pos, tokens, n_logits)`` runs: logits for the last
        ``n_logits`` tokens of each (1 to sample from; all of a scored prompt's chunk).

        Returns the batch index of each run's last token (the index to sample at; the
        runs' other logits are at the indices just before it), or -1 for runs that asked
        for no logits. Raises :class:`NoKVSpace` or :class:`DecodeError`; on either,
        llama.cpp has rolled its memory back.
        """
        b = self._batch
        n = 0
        out: list[int] = []
        total = sum(len(toks) for _, _, toks, _ in items)
        if total > self.params.n_batch or total == 0:
            # llama.cpp would abort() the process; refuse here instead.
            raise ValueError(f"batch of {total} tokens outside 1..{self.params.n_batch}")
        for seq, pos, toks, logits in items:
            first_out = len(toks) - logits
            for j, tok in enumerate(toks):
                b.token[n] = tok
                b.pos[n] = pos + j
                b.n_seq_id[n] = 1
                b.seq_id[n][0] = seq
                b.logits[n] = j >= first_out
                n += 1
            out.append(n - 1 if logits else -1)
        b.n_tokens = n
        status = ll.llama_decode(self._ptr, b)
        if status == 1:
            raise NoKVSpace(status)
        if status != 0:
            raise DecodeError(status)
        return out

    def close(self) -> None:
        if self._ptr:
            ll.llama_batch_free(self._batch)
            ll.llama_free(self._ptr)
            self._ptr = None


class _BoundSampler:
    """A request's sampler with the context it samples from: what the core calls."""

    def __init__(self, sampler: Sampler, ctx: Context) -> None:
        self._sampler, self._ctx = sampler, ctx

    def sample(self, index: int) -> int:
        return self._sampler.sample(self._ctx, index)

    def close(self) -> None:
        self._sampler.close()


class Llama(Closing):
    """A model and its context as :class:`forged.engine.decoding.Backend`: all the worker's
    core asks of llama.cpp."""

    def __init__(self, model: str | Model, params: ContextParams) -> None:
        """``model``: a path, or a model loaded already (this object closes it)."""
        self.model = Model(model) if isinstance(model, str) else model
        try:
            self.ctx = Context(self.model, params)
        except BaseException:
            self.model.close()
            raise
        self.eog_tokens = self.model.eog_tokens
        self.n_batch = params.n_batch

    def piece(self, token: int, special: bool = False) -> bytes:
        return self.model.piece(token, special=special)

    def sampler(self, sampling: Sampling, prompt: list[int]) -> TokenSampler:
        return _BoundSampler(Sampler(self.model, sampling, prompt), self.ctx)

    def decode(self, items: Sequence[DecodeItem]) -> list[int]:
        return self.ctx.decode(items)

    def logprobs(self, index: int, token: int, top: int) -> TokenLogprob:
        """``token``'s log-probability under the raw logits at batch ``index`` of the
        last decode (their log-softmax: before penalties, bias, grammar, temperature or
        truncation), and the ``top`` most likely tokens there, most likely first."""
        ptr = ll.llama_get_logits_ith(self.ctx.ptr, index)
        row = np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,)).astype(np.float64)
        peak = row.max()
        # One vector for the token and its alternatives: equal tokens, equal floats.
        logp = row - (peak + np.log(np.exp(row - peak).sum()))
        best: list[tuple[int, float]] = []
        if top > 0:
            k = min(top, len(row))
            ids = np.argpartition(logp, -k)[-k:]
            ids = ids[np.argsort(-logp[ids], kind="stable")]
            best = [(int(t), float(logp[t])) for t in ids]
        return TokenLogprob(token, float(logp[token]), best)

    def seq_rm(self, seq: int, p0: int) -> None:
        self.ctx.seq_rm(seq, p0)

    def seq_cp(self, src: int, dst: int, n: int) -> None:
        self.ctx.seq_cp(src, dst, n)

    def seq_cp_stream(self, src: int, dst: int, n: int) -> None:
        self.ctx.seq_cp_stream(src, dst, n)

    def seq_save(self, seq: int) -> bytearray:
        return self.ctx.seq_save(seq)

    def seq_load(self, seq: int, state: bytearray, n_tokens: int) -> bool:
        return self.ctx.seq_load(seq, state, n_tokens)

    def close(self) -> None:
        self.ctx.close()
        self.model.close()


class Embedder(Closing):
    """An embedding model and its context as :class:`forged.engine.embedcore.
    EmbedBackend`: every input its own sequence in one batch, pooled by the model's own
    pooling (a GGUF without one is refused: its tokens' vectors are not a text's)."""

    def __init__(self, model_path: str, params: ContextParams) -> None:
        self.model = Model(model_path)
        try:
            self._ptr = self._context(params)
        except BaseException:
            self.model.close()
            raise
        self.n_embd: int = self.model.n_embd
        self.params = params
        self._mem = ll.llama_get_memory(self._ptr)  # None for an encoder without a cache
        self._batch = ll.llama_batch_init(params.n_batch, 0, 1)

    def _context(self, p: ContextParams) -> Any:
        cp = ll.llama_context_default_params()
        # An encoder computes a sequence in one micro-batch: the batch is the context.
        cp.n_ctx = cp.n_batch = cp.n_ubatch = p.n_batch
        cp.n_seq_max = p.n_seq_max
        cp.n_threads = cp.n_threads_batch = p.threads
        cp.embeddings = True
        cp.kv_unified = True  # one stream: llama.cpp would split n_ctx per sequence
        cp.no_perf = True
        ptr = ll.llama_init_from_model(self.model.ptr, cp)
        if not ptr:
            raise BackendError("llama.cpp could not create a context (out of memory?)")
        if ll.llama_pooling_type(ptr) in (ll.LLAMA_POOLING_TYPE_NONE,
                                          ll.LLAMA_POOLING_TYPE_RANK):
            ll.llama_free(ptr)
            raise BackendError("the model pools no text to one vector (pooling none "
                               "or rank): it is not an embedding model forged serves")
        return ptr

    def embed(self, inputs: Sequence[Sequence[int]]) -> bytes:
        b, n = self._batch, 0
        total = sum(len(x) for x in inputs)
        if total > self.params.n_batch or not total or len(inputs) > self.params.n_seq_max:
            # llama.cpp would abort() the process; refuse here instead.
            raise ValueError(f"an embedding batch of {total} tokens in {len(inputs)} "
                             f"inputs, outside {self.params.n_batch} and "
                             f"{self.params.n_seq_max}")
        for seq, toks in enumerate(inputs):
            for pos, tok in enumerate(toks):
                b.token[n], b.pos[n], b.n_seq_id[n] = tok, pos, 1
                b.seq_id[n][0] = seq
                b.logits[n] = True  # pooling reads every token's output
                n += 1
        b.n_tokens = n
        if self._mem:
            ll.llama_memory_clear(self._mem, True)
        status = ll.llama_decode(self._ptr, b)
        if status != 0:
            raise DecodeError(status)
        rows = np.empty((len(inputs), self.n_embd), dtype="<f4")
        for seq in range(len(inputs)):
            rows[seq] = np.ctypeslib.as_array(ll.llama_get_embeddings_seq(self._ptr, seq),
                                              shape=(self.n_embd,))
        norms = np.linalg.norm(rows, axis=1, keepdims=True)
        unit: npt.NDArray[np.float32] = (rows / np.maximum(norms, 1e-12)).astype("<f4")
        return unit.tobytes()

    def close(self) -> None:
        if self._ptr:
            ll.llama_batch_free(self._batch)
            ll.llama_free(self._ptr)
            self._ptr = None
        self.model.close()
