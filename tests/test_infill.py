"""Fill-in-the-middle through the API: llama.cpp's /infill as editors call it, and
`suffix` and raw FIM prompts on /v1/completions, on the tiny model with FIM tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import trio

from forged.auth import add_key
from forged.engine import testhooks
from forged.engine.backend import Model
from forged.engine.fim import ExtraFile
from forged.engine.kvtiers import common_prefix
from forged.engine.prompts import Prompter
from tests.conftest import DaemonFactory
from tests.test_api import assert_a_dropped_stream_is_freed_within_a_step, open_raw_stream
from tests.tinymodel import FIM_TOKENS

CODE_BEFORE = "def add(a, b):\n    return "
CODE_AFTER = "\n\ndef sub(a, b):\n    return a - b\n"


def infill(**kw: Any) -> dict[str, Any]:
    return {"input_prefix": CODE_BEFORE, "input_suffix": CODE_AFTER, "n_predict": 12,
            "temperature": 0, **kw}


def events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


def layout(model: Path, extra: list[dict[str, Any]], typed: str) -> list[int]:
    p = Prompter(str(model))
    try:
        files = [ExtraFile(text=x["text"], filename=x["filename"]) for x in extra]
        return p.encode_infill(CODE_BEFORE, CODE_AFTER, files, typed, n_batch=1024,
                               n_ctx=2048, n_predict=12, room=12)
    finally:
        p.close()


def test_the_layout_puts_the_pieces_where_llama_cpp_does(fim_model: Path) -> None:
    p = Prompter(str(fim_model))
    try:
        assert p.fim is not None and p.fim.rep is not None and p.fim.sep is not None
        ids = p.encode_infill("ab", "cd", [ExtraFile(text="x", filename="f.py")], "Z",
                              n_batch=1024, n_ctx=2048, n_predict=16, room=16)
        plain = lambda s: p.vocab.tokenize(s, add_special=False, parse_special=False)  # noqa: E731
        assert ids == [p.fim.rep, *plain("myproject\n"), p.fim.sep, *plain("f.py\n"),
                       *plain("x"), p.fim.sep, *plain("filename\n"), p.vocab.bos,
                       p.fim.pre, *plain("ab"), *plain("Z"), p.fim.suf, *plain("cd"),
                       p.fim.mid]
    finally:
        p.close()


def test_the_fim_tokens_come_from_the_gguf(fim_model: Path, tiny_model: Path) -> None:
    with Model(str(fim_model), vocab_only=True) as m:
        fim = m.fim_tokens()
        assert fim is not None
        names = {m.piece(t, special=True).decode() for t in (fim.pre, fim.suf, fim.mid)}
        assert names == set(list(FIM_TOKENS)[:3])
    with Model(str(tiny_model), vocab_only=True) as m:
        assert m.fim_tokens() is None


async def test_infill_whole_and_streamed(fim_model: Path, start_daemon: DaemonFactory) -> None:
    with trio.fail_after(60):
        async with start_daemon(fim_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            r = await c.post("/infill", json=infill(id_slot=3))
            assert r.status_code == 200, r.text
            whole = r.json()
            assert whole["stop"] is True and whole["stop_type"] in ("eos", "limit")
            assert whole["tokens_predicted"] <= 12 and whole["truncated"] is False
            t = whole["timings"]
            assert t["prompt_n"] == whole["tokens_evaluated"] - t["cache_n"]
            assert t["predicted_n"] == whole["tokens_predicted"]
            r = await c.post("/infill", json=infill(stream=True))
            chunks = events(r.text)
            assert all(not ch["stop"] for ch in chunks[:-1]) and chunks[-1]["stop"] is True
            # the same greedy completion, streamed piece by piece
            assert "".join(ch["content"] for ch in chunks) == whole["content"]
            assert "timings" in chunks[-1] and "[DONE]" not in r.text


async def test_a_warm_up_fills_the_cache_and_the_next_request_computes_only_new_tokens(
        fim_model: Path, start_daemon: DaemonFactory) -> None:
    with trio.fail_after(60):
        async with start_daemon(fim_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            extra = [{"filename": "util.py", "text": "def mul(a, b):\n    return a * b\n",
                      "time": 1}]  # llama.vim sends "time" too
            r = await c.post("/infill", json=infill(n_predict=0, input_extra=extra,
                                                    samplers=[], response_fields=[""]))
            assert r.status_code == 200 and r.json() == {}
            same = infill(input_extra=extra, samplers=["top_k", "top_p", "infill"], top_k=40)
            r = await c.post("/infill", json=same)
            t = r.json()["timings"]
            # the same context: the warm-up computed all of it but the last token
            assert t["prompt_n"] == 1 and t["cache_n"] == r.json()["tokens_evaluated"] - 1
            # a character typed: the typed text sits between the prefix and the suffix (as
            # llama.cpp lays it out), so what follows the prefix is computed again
            r = await c.post("/infill", json={**same, "prompt": "a"})
            t = r.json()["timings"]
            before, after = (layout(fim_model, extra, typed) for typed in ("", "a"))
            assert t["cache_n"] == common_prefix(before, after) > t["prompt_n"]
            assert r.json()["tokens_evaluated"] == len(after) == t["cache_n"] + t["prompt_n"]


async def test_two_editors_naming_slots_do_not_evict_each_other(
        fim_model: Path, start_daemon: DaemonFactory) -> None:
    with trio.fail_after(60):
        async with start_daemon(fim_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            a = infill(input_prefix="class A:\n" * 20, id_slot=0)
            b = infill(input_prefix="class B:\n" * 20, id_slot=0)
            for body in (a, b, a, b):
                r = await c.post("/infill", json=body)
                assert r.status_code == 200
            # the second turn of each found its own context cached, all but a token
            t = r.json()["timings"]
            assert t["prompt_n"] <= 2 and t["cache_n"] > 100


NEWLINE = 3 + 0x0A  # the tiny vocabulary's byte token for "\n"


async def test_the_time_limit_ends_a_completion_at_the_next_newline(
        fim_model: Path, start_daemon: DaemonFactory) -> None:
    """(n_indent, and the time limit token by token, are tested in tests/test_core.py.)"""
    with trio.fail_after(60):
        async with start_daemon(fim_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            testhooks.slow_steps(d.daemon.pool, 0, 0.01)  # 10 ms per token at least
            body = infill(n_predict=200, ignore_eos=True, logit_bias={str(NEWLINE): 100},
                          t_max_predict_ms=50, n_indent=2)
            cut = (await c.post("/infill", json=body)).json()
            # every token is a newline: the first one made after 50 ms ends it, long
            # before the 200 tokens (2 s at least) were made
            assert cut["stop_type"] == "limit" and 2 <= cut["tokens_predicted"] < 200
            assert cut["timings"]["predicted_ms"] >= 50 and set(cut["content"]) == {"\n"}


async def test_suffix_and_raw_fim_prompts_on_completions(
        fim_model: Path, start_daemon: DaemonFactory) -> None:
    with trio.fail_after(60):
        async with start_daemon(fim_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            base = {"max_tokens": 8, "temperature": 0}
            by_suffix = await c.post("/v1/completions", json={
                **base, "prompt": CODE_BEFORE, "suffix": CODE_AFTER})
            via_infill = await c.post("/infill", json=infill(n_predict=8))
            # OpenAI's suffix is /infill's layout with nothing typed and no extra files
            assert by_suffix.json()["choices"][0]["text"] == via_infill.json()["content"]
            assert by_suffix.json()["usage"]["prompt_tokens"] == \
                via_infill.json()["tokens_evaluated"]
            # Continue and Tabby write the FIM tokens into the prompt: they are parsed
            text = f"<|fim_prefix|>{CODE_BEFORE}<|fim_suffix|>{CODE_AFTER}<|fim_middle|>"
            raw = await c.post("/v1/completions", json={**base, "prompt": text})
            p = Prompter(str(fim_model))
            ids, fim = p.encode_completion(text), p.fim
            p.close()
            assert fim is not None and {fim.pre, fim.suf, fim.mid} <= set(ids)
            assert raw.json()["usage"]["prompt_tokens"] == len(ids)


async def test_fim_on_a_model_without_fim_tokens_is_a_400(
        tiny_model: Path, start_daemon: DaemonFactory) -> None:
    with trio.fail_after(60):
        async with start_daemon(tiny_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            for path, body in (
                ("/infill", infill()),
                ("/v1/completions", {"prompt": CODE_BEFORE, "suffix": CODE_AFTER}),
                ("/v1/completions", {"prompt": "<|fim_prefix|>x<|fim_suffix|>y<|fim_middle|>"}),
                # DeepSeek-Coder's, whose bars are fullwidth (U+FF5C).
                ("/v1/completions", {"prompt": "<\uff5cfim\u2581begin\uff5c>x"
                                               "<\uff5cfim\u2581hole\uff5c>y<\uff5cfim\u2581end\uff5c>"}),
            ):
                r = await c.post(path, json=body)
                assert r.status_code == 400, (path, r.text)
                assert r.json()["error"]["code"] == "fim_not_supported"
            r = await c.post("/v1/completions", json={"prompt": "x",
                                                      "samplers": ["adaptive_p"]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "samplers"
            assert d.daemon.pool.in_flight() == 0


async def test_a_streamed_infill_that_fails_ends_with_its_error_alone(
        fim_model: Path, start_daemon: DaemonFactory) -> None:
    """Like its success (and llama-server's stream), with no [DONE] after the error:
    the error event was followed by "data: [DONE]", which llama.cpp's clients read as
    one more JSON object."""
    with trio.fail_after(60):
        async with start_daemon(fim_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            # A grammar llama.cpp takes that no token can write: the first draw fails.
            r = await c.post("/infill", json=infill(stream=True, grammar='root ::= "\\u0000"'))
    assert r.status_code == 200, r.text
    frames = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert len(frames) == 1, r.text
    assert "error" in json.loads(frames[0][6:])


def _lines(name: str, n: int) -> str:
    return "".join(f"    {name}{i} = compute({i}, y)\n" for i in range(n))


async def test_an_infill_without_n_predict_clips_its_extra_context_to_fit(
        fim_model: Path, start_daemon: DaemonFactory) -> None:
    """Absent n_predict (or -1), the layout gave the extra files all the context but
    the prefix's and suffix's (llama.cpp's n_predict -1 budget, 2 tokens more): the
    prompt alone passed the context (2,052 of 2,048 tokens) and was refused."""
    body = {"input_prefix": _lines("a", 200), "input_suffix": _lines("b", 60),
            "input_extra": [{"filename": f"f{i}.py", "text": _lines(f"c{i}_", 100)}
                            for i in range(5)]}
    with trio.fail_after(60):
        async with start_daemon(fim_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            asked = (await c.post("/infill", json={**body, "n_predict": 8})).json()
            answers = {}
            for n_predict in (None, 0, 1):
                r = await c.post("/infill", json={**body, "n_predict": n_predict,
                                                  "t_max_predict_ms": 1})
                assert r.status_code == 200, (n_predict, r.text)
                answers[n_predict] = r.json()
            # -1 runs to the context's end: its first event is enough (it was a 400)
            sock = await open_raw_stream(d, "/infill", {**body, "n_predict": -1,
                                                        "stream": True}, events=1)
            await sock.aclose()
    assert asked["tokens_evaluated"] + 8 <= 2048
    # the extra files were clipped, leaving the default budget's room
    assert answers[None]["tokens_evaluated"] < asked["tokens_evaluated"]
    assert answers[None]["tokens_predicted"] > 0
    assert answers[0]["tokens_evaluated"] < 2048 and answers[1]["tokens_evaluated"] < 2048


async def test_a_superseded_infill_frees_its_sequence_within_a_step(
        fim_model: Path, start_daemon: DaemonFactory) -> None:
    with trio.fail_after(60):
        async with start_daemon(fim_model) as d:
            # the editor's next keystroke drops this request after its first event
            await assert_a_dropped_stream_is_freed_within_a_step(
                d, "/infill", infill(n_predict=500, ignore_eos=True, stream=True), events=1)


async def test_infill_needs_an_api_key_like_the_v1_routes(
        fim_model: Path, start_daemon: DaemonFactory, tmp_path: Path) -> None:
    key = add_key(tmp_path / "keys.toml", "editor", max_streams=2, max_queued=2,
                  priority="interactive")
    with trio.fail_after(60):
        async with start_daemon(fim_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            r = await c.post("/infill", json=infill())
            assert r.status_code == 401
            r = await c.post("/infill", json=infill(),
                             headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200
