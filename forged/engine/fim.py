"""The fill-in-the-middle prompt, laid out token for token as llama.cpp's server does.

Theory of operation
===================

This module mirrors ``format_prompt_infill`` in llama.cpp's
``tools/server/server-common.cpp`` (lines 1737-1837 of the tree vendored by
llama-cpp-python 0.3.36, the llama-server the benchmark builds). It is pure: no model,
no I/O. The caller owns the tokenizer and hands in a ``tokenize`` callable.

The layout, in the default PSM order ("prefix, suffix, middle")::

    [extra context, clipped from its front] [BOS?] FIM_PRE prefix prompt FIM_SUF suffix FIM_MID

where the extra context is the repo-level pattern of https://arxiv.org/pdf/2409.12186::

    FIM_REP "myproject\\n"                      only if the model has FIM_REP
    FIM_SEP filename0 "\\n" text0               per input_extra chunk, if it has FIM_SEP;
    FIM_SEP filename1 "\\n" text1               without FIM_SEP each chunk is introduced by
    ...                                        "\\n\\n--- snippet ---\\n\\n" instead
    FIM_SEP "filename\\n"                       only if the model has FIM_SEP (llama.cpp's
                                               placeholder for the current file's name)

With ``spm=True`` (llama-server's ``--spm-infill``) the two halves swap:
``[extra] [BOS?] FIM_SUF suffix FIM_PRE prefix prompt FIM_MID``.

Three things surprise a reader who knows FIM only from papers; each is llama.cpp's, kept
so that forged sends the model the same ids:

* ``prompt`` (the text of the cursor's line before the cursor) is appended to the
  *prefix*, before FIM_SUF, not after FIM_MID as llama.cpp's own comment draws it.
* BOS, when the model adds one, goes *after* the extra context, just before FIM_PRE.
* The extra context is clipped as one token stream from its front: the repo header and
  the oldest chunks go first, and the cut may fall inside a chunk.

Budgets (``//`` is C's integer division; all operands are non-negative here)::

    n_prefix_take = min(len(prefix), 3 * (n_batch // 4))                  keeps the END
    n_suffix_take = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt))))  the START
    n_extra_take  = min(len(extra), max(0, n_ctx - n_batch - 2 * n_predict))    the END

The prompt itself is never clipped, and nothing checks that the result fits ``n_ctx``:
llama-server refuses a too-long prompt later, when a slot starts it. With ``n_predict``
-1 it does not: the extra context's budget is then ``n_ctx - n_batch + 2``, and a full
prefix and suffix take the rest and 2 to 4 tokens more. forged never shifts the context,
so :func:`leave_room` then clips the extra context further, from the same front, until
the completion has its room (where llama-server's layout fits, it changes nothing).

Tokenization seam
=================

llama.cpp tokenizes inside ``format_prompt_infill`` with ``common_tokenize(vocab, s,
add_special=false, parse_special=false)``, once per piece: ``"myproject\\n"``, each
``filename + "\\n"``, each chunk's text, the snippet separator, ``"filename\\n"``, the
prefix and the suffix. Token ids depend on where those pieces are cut (a BPE merge
never crosses a cut), so the cuts live here and the caller passes only ``tokenize``,
which must be exactly that call (``Model.tokenize(s, add_special=False,
parse_special=False)``): no BOS, and text such as ``<|fim_prefix|>`` typed in the editor
stays text. The prompt is the exception, as in llama.cpp: its handler tokenizes it
before the call with ``parse_special=true`` and still no BOS (``server-context.cpp``
line 4864), so the caller passes ``prompt`` as tokens. :func:`lay_out` is the same
algorithm after tokenization, for a caller that already holds every piece's ids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec

Tokenize = Callable[[str], list[int]]
"""``text -> ids`` with no BOS/EOS added and special tokens not parsed."""

# A prefix or suffix as llama.cpp's tokenize_mixed accepts it: a string, or a list
# mixing strings (tokenized) and token ids (kept as they are).
MixedText = str | Sequence[str | int]

# Written as hex bytes in llama.cpp ("chunk separator in binary form to avoid confusing
# the AI", server-common.cpp line 1787); the same bytes. Used when there is no FIM_SEP.
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"
REPO_HEADER = "myproject\n"  # llama.cpp: "TODO: make project name an input"
CURRENT_FILE = "filename\n"  # llama.cpp: "TODO: current filename"
DEFAULT_FILENAME = "tmp"  # an input_extra chunk without "filename"


class FimTokens(msgspec.Struct, frozen=True):
    """A model's FIM token ids, as llama.cpp's vocabulary reports them.

    The backend reads them with ``llama_vocab_fim_pre/suf/mid/pad/rep/sep``, which return
    ``LLAMA_TOKEN_NULL`` (-1; ``None`` here) when absent. llama.cpp fills them from the
    GGUF keys ``tokenizer.ggml.fim_{pre,suf,mid,pad,rep,sep}_token_id`` (older files:
    ``tokenizer.ggml.{prefix,suffix,middle}_token_id``), else by recognising token texts
    such as ``<|fim_prefix|>``/``<fim-prefix>``/``<PRE>``, ``<|fim_repo|>``/``<reponame>``
    and ``<|file_sep|>`` (``src/llama-vocab.cpp`` lines 2595-2612 and 2731-2840).
    Infill needs pre, suf and mid; llama-server refuses it without them. pad, rep and sep
    are also end-of-generation tokens there (lines 2876-2886).
    """

    pre: int
    suf: int
    mid: int
    rep: int | None = None
    sep: int | None = None
    pad: int | None = None  # not part of the prompt; listed for the stop set


class ExtraFile(msgspec.Struct, frozen=True):
    """One ``input_extra`` chunk. llama.cpp ignores other keys, and llama.vim sends
    ``time`` beside these two, so a wire schema for it must not forbid unknown fields."""

    text: str
    filename: str = DEFAULT_FILENAME


class InfillPrompt(msgspec.Struct, frozen=True):
    """The prompt's token ids and how much of each input the budgets left out.

    llama.cpp reports none of these counts: its response's ``truncated`` is set only by a
    context shift or by running out of context while generating, not by this clipping.
    """

    tokens: list[int]
    prefix_dropped: int  # from the prefix's start
    suffix_dropped: int  # from the suffix's end
    extra_dropped: int  # from the extra context's start (header and oldest chunks)
    extra_kept: int  # the extra context's tokens, at the front of ``tokens``

    @property
    def clipped(self) -> bool:
        return bool(self.prefix_dropped or self.suffix_dropped or self.extra_dropped)


def tokenize_mixed(text: MixedText, tokenize: Tokenize) -> list[int]:
    """llama.cpp's ``tokenize_mixed`` with add_special off (server-common.cpp 867-901)."""
    if isinstance(text, str):
        return tokenize(text)
    out: list[int] = []
    for piece in text:
        out.extend(tokenize(piece) if isinstance(piece, str) else [piece])
    return out


def extra_context(extra: Sequence[ExtraFile], fim: FimTokens, tokenize: Tokenize) -> list[int]:
    """The repo-level context before the FIM prefix, unclipped (server-common.cpp 1768-1803)."""
    out: list[int] = []
    if fim.rep is not None:
        out += [fim.rep, *tokenize(REPO_HEADER)]
    for chunk in extra:
        if fim.sep is not None:
            out += [fim.sep, *tokenize(chunk.filename + "\n")]
        else:
            out += tokenize(SNIPPET_SEPARATOR)
        out += tokenize(chunk.text)
    if fim.sep is not None:
        out += [fim.sep, *tokenize(CURRENT_FILE)]
    return out


def infill_prompt(
    prefix: MixedText,
    suffix: MixedText,
    extra: Sequence[ExtraFile],
    prompt: Sequence[int],
    fim: FimTokens,
    tokenize: Tokenize,
    *,
    bos: int | None,
    n_batch: int,
    n_ctx: int,
    n_predict: int = -1,
    spm: bool = False,
) -> InfillPrompt:
    """Lay out an infill prompt exactly as llama-server's ``/infill`` does.

    ``bos``: the model's BOS if ``llama_vocab_get_add_bos``, else None. ``n_batch``:
    llama-server's ``--batch-size`` (default 2048); ``n_ctx``: one slot's context.
    ``n_predict``: the *server-wide* ``--n-predict`` (-1 unless set), not the request's,
    because llama.cpp passes ``params.n_predict`` (server-context.cpp line 4872).
    ``spm``: ``--spm-infill``.
    """
    return lay_out(
        tokenize_mixed(prefix, tokenize),
        tokenize_mixed(suffix, tokenize),
        extra_context(extra, fim, tokenize),
        prompt,
        fim,
        bos=bos,
        n_batch=n_batch,
        n_ctx=n_ctx,
        n_predict=n_predict,
        spm=spm,
    )


def lay_out(
    prefix: Sequence[int],
    suffix: Sequence[int],
    extra: Sequence[int],
    prompt: Sequence[int],
    fim: FimTokens,
    *,
    bos: int | None,
    n_batch: int,
    n_ctx: int,
    n_predict: int,
    spm: bool,
) -> InfillPrompt:
    """Clip the tokenized pieces to their budgets and join them (server-common.cpp lines
    1806-1834). ``extra`` is :func:`extra_context`'s stream.

    Error handling: ``ValueError`` for a budget where C's integer division and Python's
    would disagree (n_batch or n_ctx below 1, n_predict below -1).
    """
    if n_batch <= 0 or n_ctx <= 0 or n_predict < -1:
        raise ValueError(f"bad budget: n_batch={n_batch} n_ctx={n_ctx} n_predict={n_predict}")
    n_prefix_take = min(len(prefix), 3 * (n_batch // 4))
    n_suffix_take = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt))))
    n_extra_take = min(len(extra), max(0, n_ctx - n_batch - 2 * n_predict))

    # The prefix keeps its end (nearest the cursor), the suffix its start, and the extra
    # context its end (the newest chunks and the current file's separator).
    head = [fim.pre, *prefix[len(prefix) - n_prefix_take :], *prompt]
    tail = [fim.suf, *suffix[:n_suffix_take]]
    if spm:
        head, tail = tail, head
    lead = [*extra[len(extra) - n_extra_take :], *([] if bos is None else [bos])]
    return InfillPrompt(
        tokens=[*lead, *head, *tail, fim.mid],
        prefix_dropped=len(prefix) - n_prefix_take,
        suffix_dropped=len(suffix) - n_suffix_take,
        extra_dropped=len(extra) - n_extra_take,
        extra_kept=n_extra_take,
    )


def leave_room(p: InfillPrompt, n_ctx: int, room: int) -> InfillPrompt:
    """``p`` with its extra context clipped further from its front, as far as it takes
    to leave ``room`` of ``n_ctx`` to the completion. Only the extra context is cut: if
    the prefix, suffix and prompt alone leave no room, the prompt is too long."""
    cut = min(max(0, len(p.tokens) + room - n_ctx), p.extra_kept)
    if cut == 0:
        return p
    return msgspec.structs.replace(p, tokens=p.tokens[cut:], extra_dropped=p.extra_dropped
                                   + cut, extra_kept=p.extra_kept - cut)
