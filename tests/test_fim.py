"""The infill prompt layout against llama.cpp's format_prompt_infill, with made-up ids.

The fake tokenizer turns each character into its code point, so a test can write the
expected ids as text. FIM and BOS ids sit far above ASCII to stay recognisable.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from forged.engine.fim import ExtraFile, FimTokens, InfillPrompt, infill_prompt, leave_room

PRE, SUF, MID, REP, SEP, PAD, BOS = 9001, 9002, 9003, 9004, 9005, 9006, 1

PLAIN = FimTokens(pre=PRE, suf=SUF, mid=MID)  # CodeLlama-like: no repo/file tokens
REPO = FimTokens(pre=PRE, suf=SUF, mid=MID, rep=REP, sep=SEP, pad=PAD)  # Qwen2.5-Coder-like


def t(text: str) -> list[int]:
    return [ord(c) for c in text]


def build(prefix: str = "ab", suffix: str = "yz", extra: list[ExtraFile] | None = None,
          prompt: str = "p", fim: FimTokens = PLAIN, *, bos: int | None = None,
          n_batch: int = 2048, n_ctx: int = 4096, n_predict: int = -1,
          spm: bool = False) -> InfillPrompt:
    return infill_prompt(prefix, suffix, extra or [], t(prompt), fim, t, bos=bos,
                         n_batch=n_batch, n_ctx=n_ctx, n_predict=n_predict, spm=spm)


def test_plain_model_layout_puts_the_prompt_after_the_prefix() -> None:
    out = build("def f(", ")\n", prompt="  x")
    assert out.tokens == [PRE, *t("def f("), *t("  x"), SUF, *t(")\n"), MID]
    assert not out.clipped


def test_repo_level_layout_with_files() -> None:
    extra = [ExtraFile(text="A = 1\n", filename="a.py"), ExtraFile(text="B\n", filename="b.py")]
    out = build(extra=extra, fim=REPO)
    assert out.tokens == [
        REP, *t("myproject\n"),
        SEP, *t("a.py\n"), *t("A = 1\n"),
        SEP, *t("b.py\n"), *t("B\n"),
        SEP, *t("filename\n"),
        PRE, *t("ab"), *t("p"), SUF, *t("yz"), MID,
    ]


def test_repo_model_without_extra_still_writes_header_and_current_file() -> None:
    out = build(fim=REPO)
    assert out.tokens == [REP, *t("myproject\n"), SEP, *t("filename\n"),
                          PRE, *t("abp"), SUF, *t("yz"), MID]


def test_model_with_sep_but_no_rep_skips_the_header() -> None:
    out = build(fim=FimTokens(pre=PRE, suf=SUF, mid=MID, sep=SEP))
    assert out.tokens[:10] == [SEP, *t("filename\n")]


def test_plain_model_introduces_chunks_with_the_snippet_separator() -> None:
    out = build(extra=[ExtraFile(text="X\n", filename="ignored.py")], prompt="")
    assert out.tokens == [*t("\n\n--- snippet ---\n\n"), *t("X\n"),
                          PRE, *t("ab"), SUF, *t("yz"), MID]


def test_chunk_without_filename_is_called_tmp() -> None:
    out = build(extra=[ExtraFile(text="X")], fim=REPO)
    assert out.tokens[11:17] == [SEP, *t("tmp\n"), *t("X")]


def test_bos_goes_after_the_extra_context_and_before_the_prefix() -> None:
    out = build(extra=[ExtraFile(text="X", filename="f")], fim=REPO, bos=BOS)
    i = out.tokens.index(BOS)
    assert out.tokens[i - 10 : i + 2] == [SEP, *t("filename\n"), BOS, PRE]
    assert out.tokens.count(BOS) == 1


def test_bos_leads_when_there_is_no_extra_context() -> None:
    assert build(bos=BOS).tokens == [BOS, PRE, *t("abp"), SUF, *t("yz"), MID]


def test_spm_order_swaps_the_halves_and_keeps_bos_and_extra_in_front() -> None:
    out = build(fim=REPO, bos=BOS, spm=True)
    assert out.tokens == [REP, *t("myproject\n"), SEP, *t("filename\n"), BOS,
                          SUF, *t("yz"), PRE, *t("abp"), MID]


def test_warm_up_with_empty_context_is_just_the_markers() -> None:
    assert build("", "", prompt="").tokens == [PRE, SUF, MID]


def test_long_prefix_keeps_its_end() -> None:
    # n_batch 16: the prefix gets 3 * (16 // 4) = 12 tokens.
    out = build("0123456789abcdefghij", n_batch=16)
    assert out.tokens[:13] == [PRE, *t("89abcdefghij")]
    assert out.prefix_dropped == 8 and out.clipped


def test_prefix_budget_uses_integer_division() -> None:
    # 3 * (18 // 4) = 12, not 3 * 18 / 4 = 13.5.
    out = build("0123456789abcdefghij", n_batch=18)
    assert out.prefix_dropped == 8


def test_long_suffix_keeps_its_start_and_pays_for_the_prompt() -> None:
    # n_batch 32: the suffix gets 32 // 4 - (2 + len(prompt)) = 8 - 5 = 3 tokens.
    out = build(suffix="0123456789", prompt="abc", n_batch=32)
    assert out.tokens[-5:] == [SUF, *t("012"), MID]
    assert out.suffix_dropped == 7 and out.prefix_dropped == 0


def test_a_long_prompt_leaves_no_room_for_the_suffix_and_is_never_clipped() -> None:
    out = build(suffix="0123456789", prompt="x" * 40, n_batch=32)
    assert out.tokens == [PRE, *t("ab"), *t("x" * 40), SUF, MID]
    assert out.suffix_dropped == 10


def test_mixed_prefix_keeps_token_ids_and_tokenizes_strings() -> None:
    out = infill_prompt(["ab", 777, "c"], "", [], [], PLAIN, t, bos=None,
                        n_batch=2048, n_ctx=4096)
    assert out.tokens == [PRE, *t("ab"), 777, *t("c"), SUF, MID]


def test_extra_context_is_clipped_from_its_front() -> None:
    # n_ctx - n_batch - 2 * n_predict = 40 - 16 - 2 * 6 = 12 tokens of extra context.
    extra = [ExtraFile(text="old\n", filename="o"), ExtraFile(text="new\n", filename="n")]
    full = build(extra=extra, fim=REPO, n_batch=16, n_ctx=4096, prompt="")
    out = build(extra=extra, fim=REPO, n_batch=16, n_ctx=40, n_predict=6, prompt="")
    extra_full = full.tokens[: full.tokens.index(PRE)]
    assert out.tokens[: out.tokens.index(PRE)] == extra_full[-12:]
    assert extra_full[-12:] == [*t("w\n"), SEP, *t("filename\n")]  # cut inside a chunk
    assert out.extra_dropped == len(extra_full) - 12


def test_unlimited_n_predict_gives_the_extra_context_two_more_tokens() -> None:
    # llama-server passes its --n-predict (default -1): n_ctx - n_batch + 2.
    out = build(fim=REPO, n_batch=16, n_ctx=20)
    assert out.tokens[: out.tokens.index(PRE)] == [SEP, *t("filename\n")][-6:]


def test_no_room_drops_all_extra_context() -> None:
    out = build(extra=[ExtraFile(text="X")], fim=REPO, n_batch=2048, n_ctx=2048, n_predict=0)
    assert out.tokens[0] == PRE
    assert out.extra_dropped == (1 + len("myproject\n") + 1 + len("tmp\n") + len("X")
                                 + 1 + len("filename\n"))


def test_leave_room_clips_only_the_extra_context_from_its_front() -> None:
    """llama.cpp's -1 budget gives the extra context n_ctx - n_batch + 2 tokens: with a
    full prefix and suffix the prompt passes the context, which forged never shifts."""
    extra = [ExtraFile(text="old\n" * 20, filename="o"), ExtraFile(text="new\n", filename="n")]
    laid = build(prefix="a" * 40, suffix="z" * 40, extra=extra, fim=REPO, prompt="",
                 n_batch=16, n_ctx=60)
    assert len(laid.tokens) > 60 and laid.extra_kept == 60 - 16 + 2
    out = leave_room(laid, 60, 8)
    assert len(out.tokens) == 60 - 8
    assert out.tokens == laid.tokens[len(laid.tokens) - 52:]  # its front went
    assert out.extra_kept == laid.extra_kept - (len(laid.tokens) - 52)
    assert out.extra_dropped + out.extra_kept == laid.extra_dropped + laid.extra_kept
    assert leave_room(out, 60, 8) == out  # it fits: unchanged
    # the prefix, suffix and prompt are never cut: with no extra left, it stays too long
    assert leave_room(laid, 20, 8).tokens[0] == PRE


@pytest.mark.parametrize(("n_batch", "n_ctx", "n_predict"), [(0, 10, -1), (4, 0, -1),
                                                             (4, 10, -2)])
def test_budgets_outside_llama_cpp_arithmetic_are_refused(n_batch: int, n_ctx: int,
                                                          n_predict: int) -> None:
    with pytest.raises(ValueError, match="bad budget"):
        build(n_batch=n_batch, n_ctx=n_ctx, n_predict=n_predict)


def transliterated(prefix: list[int], suffix: list[int], extra: list[ExtraFile],
                   prompt: list[int], fim: FimTokens, bos: int | None, n_batch: int,
                   n_ctx: int, n_predict: int, spm: bool) -> list[int]:
    """format_prompt_infill statement by statement, C++ vector operations and all."""
    extra_tokens: list[int] = []
    if fim.rep is not None:
        extra_tokens.append(fim.rep)
        extra_tokens[len(extra_tokens):] = t("myproject\n")
    for chunk in extra:
        if fim.sep is not None:
            extra_tokens[len(extra_tokens):] = [fim.sep, *t(chunk.filename + "\n")]
        else:
            extra_tokens[len(extra_tokens):] = t("\n\n--- snippet ---\n\n")
        extra_tokens[len(extra_tokens):] = t(chunk.text)
    if fim.sep is not None:
        extra_tokens[len(extra_tokens):] = [fim.sep, *t("filename\n")]
    n_prefix_take = min(len(prefix), 3 * int(n_batch / 4))
    n_suffix_take = min(len(suffix), max(0, int(n_batch / 4) - (2 + len(prompt))))
    n_extra_take = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_tokens))
    tokens_prefix = list(prefix)
    del tokens_prefix[0 : len(tokens_prefix) - n_prefix_take]
    tokens_suffix = list(suffix)[:n_suffix_take]
    tokens_prefix.insert(0, fim.pre)
    tokens_prefix[len(tokens_prefix):] = prompt
    tokens_suffix.insert(0, fim.suf)
    embd_inp = list(tokens_suffix if spm else tokens_prefix)
    embd_end = list(tokens_prefix if spm else tokens_suffix)
    if bos is not None:
        embd_inp.insert(0, bos)
    embd_inp[0:0] = extra_tokens[len(extra_tokens) - n_extra_take :]
    embd_inp[len(embd_inp):] = embd_end
    embd_inp.append(fim.mid)
    return embd_inp


text = st.text(alphabet="ab\n ", max_size=40)


@given(prefix=text, suffix=text, prompt=text,
       extra=st.lists(st.builds(ExtraFile, text=text, filename=st.sampled_from(["f", "tmp"])),
                      max_size=4),
       fim=st.sampled_from([PLAIN, REPO, FimTokens(pre=PRE, suf=SUF, mid=MID, rep=REP)]),
       bos=st.sampled_from([None, BOS]), n_batch=st.integers(1, 64),
       n_ctx=st.integers(1, 200), n_predict=st.integers(-1, 40), spm=st.booleans())
def test_matches_a_statement_by_statement_transliteration(
        prefix: str, suffix: str, prompt: str, extra: list[ExtraFile], fim: FimTokens,
        bos: int | None, n_batch: int, n_ctx: int, n_predict: int, spm: bool) -> None:
    out = infill_prompt(prefix, suffix, extra, t(prompt), fim, t, bos=bos, n_batch=n_batch,
                        n_ctx=n_ctx, n_predict=n_predict, spm=spm)
    assert out.tokens == transliterated(t(prefix), t(suffix), extra, t(prompt), fim, bos,
                                        n_batch, n_ctx, n_predict, spm)
