"""Ollama's API (/api/*) through the official ``ollama`` Python client, against an
in-process daemon on loopback."""

from __future__ import annotations

import json
import os
import re
import signal
import types
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest
import trio

from forged.auth import add_key
from forged.engine import testhooks
from forged.http import ollama_shapes
from forged.http.ollama import _budget
from forged.http.ollama_shapes import OllamaChat, _line
from tests.conftest import DaemonFactory
from tests.test_api import until

pytestmark = pytest.mark.trio

HI = [{"role": "user", "content": "hi"}]


def _client(url: str, timeout: float = 60.0, **kw: Any) -> ollama.AsyncClient:
    return ollama.AsyncClient(host=url, timeout=timeout, **kw)


async def _joined(parts: AsyncIterator[Any], field: str) -> tuple[str, list[Any]]:
    """A stream's text, and its objects."""
    objects = [p async for p in parts]
    if field == "message":
        return "".join(o.message.content or "" for o in objects), objects
    return "".join(o.response or "" for o in objects), objects


async def test_version_tags_show_and_ps(tiny_model: Path, fim_model: Path,
                                        start_daemon: DaemonFactory) -> None:
    models = [{"path": str(fim_model), "aliases": ["fim"]}]
    with trio.fail_after(60):
        async with start_daemon(tiny_model, models=models) as d, _client(d.url) as c:
            async with httpx.AsyncClient(base_url=d.url) as h:
                version = (await h.get("/api/version")).json()["version"]
                assert [int(n) for n in version.split(".")] >= [0, 6, 4]
            listed = await c.list()
            names = [m.model for m in listed.models]
            assert names == ["tiny", "tiny-fim", "fim"]
            tiny = listed.models[0]
            assert tiny.size == (await trio.Path(tiny_model).stat()).st_size
            assert tiny.modified_at is not None
            assert tiny.digest and len(tiny.digest) == 64
            assert tiny.details is not None
            assert (tiny.details.format, tiny.details.family) == ("gguf", "llama")
            assert tiny.details.quantization_level == "F32"
            assert tiny.details.parameter_size
            shown = await c.show("tiny:latest")  # a client's default tag names it too
            assert shown.capabilities == ["completion", "tools"]
            assert shown.modelinfo is not None
            assert shown.modelinfo["llama.context_length"] == 2048
            # Continue's Ollama provider reads its num_ctx from here, and sends it back
            assert shown.parameters == "num_ctx 2048"
            assert shown.modelinfo["general.architecture"] == "llama"
            assert shown.template and "im_start" in shown.template
            fim = await c.show("fim")
            assert "insert" in (fim.capabilities or [])
            # Continue's Ollama provider sends a suffix only where the template holds
            # .Suffix (Ollama's FIM models' Go templates branch on it).
            assert fim.template and fim.template.startswith("{{- if .Suffix }}<|fim_prefix|>")
            assert "{{ .Suffix }}<|fim_middle|>{{- else }}" in fim.template
            assert "im_start" in fim.template and ".Suffix" not in shown.template
            ps = await c.ps()
            assert [m.name for m in ps.models] == names
            assert ps.models[0].context_length == 2048
            assert ps.models[0].size and ps.models[0].size > tiny.size


async def test_chat_whole_and_streamed(tiny_model: Path, start_daemon: DaemonFactory) -> None:
    greedy = {"temperature": 0, "num_predict": 12}
    with trio.fail_after(60):
        async with start_daemon(tiny_model) as d, _client(d.url) as c:
            whole = await c.chat("tiny", HI, options=greedy, stream=False)
            assert whole.done and whole.done_reason in ("stop", "length")
            assert whole.message.role == "assistant" and whole.message.content
            assert whole.eval_count is not None and 0 < whole.eval_count <= 12
            assert whole.prompt_eval_count and whole.prompt_eval_count > 0
            assert whole.total_duration and whole.eval_duration is not None
            assert whole.total_duration > whole.eval_duration
            text, parts = await _joined(await c.chat("tiny", HI, options=greedy, stream=True),
                                        "message")
            assert text == whole.message.content  # the same greedy answer, in pieces
            assert all(not p.done for p in parts[:-1]) and parts[-1].done
            assert parts[-1].eval_count == whole.eval_count
            assert parts[-1].done_reason == whole.done_reason
            # Ollama's default is a stream, as NDJSON
            async with httpx.AsyncClient(base_url=d.url, timeout=60) as h:
                r = await h.post("/api/chat", json={"model": "tiny", "messages": HI,
                                                    "options": greedy})
            assert r.headers["content-type"] == "application/x-ndjson"
            lines = [json.loads(line) for line in r.text.splitlines()]
            assert "".join(x["message"]["content"] for x in lines) == text
            assert lines[-1]["done"] is True and isinstance(lines[-1]["created_at"], str)


async def test_generate_whole_streamed_raw_and_with_a_system(
        tiny_model: Path, start_daemon: DaemonFactory) -> None:
    greedy = {"temperature": 0, "num_predict": 12}
    with trio.fail_after(60):
        async with start_daemon(tiny_model) as d, _client(d.url) as c, \
                httpx.AsyncClient(base_url=d.url, timeout=60) as h:
            whole = await c.generate("tiny", "hi", options=greedy)
            assert whole.done and whole.response and whole.done_reason in ("stop", "length")
            text, parts = await _joined(await c.generate("tiny", "hi", options=greedy,
                                                         stream=True), "response")
            assert text == whole.response and parts[-1].done
            # the prompt went through the chat template, as a user's turn
            chat = await c.chat("tiny", HI, options=greedy)
            assert chat.message.content == whole.response
            with_system = await c.generate("tiny", "hi", system="Be brief.", options=greedy)
            chat = await c.chat("tiny", [{"role": "system", "content": "Be brief."}, *HI],
                                options=greedy)
            assert with_system.response == chat.message.content
            assert with_system.prompt_eval_count == chat.prompt_eval_count
            # raw: the prompt as it is, as /v1/completions takes it
            raw = await c.generate("tiny", "Once upon", raw=True, options=greedy)
            r = await h.post("/v1/completions", json={"prompt": "Once upon", "max_tokens": 12,
                                                      "temperature": 0})
            assert raw.response == r.json()["choices"][0]["text"]
            assert raw.prompt_eval_count == r.json()["usage"]["prompt_tokens"]
            # no prompt: Ollama's way to load a model, answered at once
            load = await c.generate("tiny")
            assert (load.done, load.done_reason, load.response) == (True, "load", "")
            unload = await c.chat("tiny", [], keep_alive=0)
            assert unload.done_reason == "unload"


async def test_options_bound_stop_and_seed_the_answer(
        tiny_model: Path, start_daemon: DaemonFactory) -> None:
    greedy = {"temperature": 0, "num_predict": 40}
    with trio.fail_after(120):  # nine generations
        async with start_daemon(tiny_model) as d, _client(d.url) as c:
            # The tiny model's greedy answer to "Hello" runs past 60 tokens.
            long = await c.generate("tiny", "Hello", raw=True, options=greedy)
            short = await c.generate("tiny", "Hello", raw=True,
                                     options={**greedy, "num_predict": 5})
            assert (long.eval_count, long.done_reason) == (40, "length")
            assert (short.eval_count, short.done_reason) == (5, "length")
            text = long.response or ""
            assert text.startswith(short.response or "")
            stop = re.findall(r"[A-Za-z]{2}", text[10:])[0]
            stopped = await c.generate("tiny", "Hello", raw=True,
                                       options={**greedy, "stop": [stop]})
            assert stopped.response == text[:text.index(stop)]
            assert stopped.done_reason == "stop"
            seeded = {"temperature": 1.0, "seed": 7, "num_predict": 16, "top_k": 50,
                      "top_p": 0.95, "min_p": 0.01, "repeat_penalty": 1.1,
                      "presence_penalty": 0.1, "frequency_penalty": 0.1,
                      # what Ollama's clients send and that changes no answer
                      "num_ctx": 2048, "num_thread": 4, "num_gpu": 0, "mirostat": 0,
                      "typical_p": 1.0, "repeat_last_n": 64, "mirostat_tau": 5.0}
            first = await c.chat("tiny", HI, options=seeded, keep_alive="5m")
            again = await c.chat("tiny", HI, options=seeded, keep_alive=-1)
            other = await c.chat("tiny", HI, options={**seeded, "seed": 8})
            assert first.message.content == again.message.content
            assert other.message.content != first.message.content


# Each client's /api/chat body as its source builds it: Zed's ChatRequest (its options'
# unset fields as nulls, num_ctx its default 4096 for a model it does not know), Cline's
# (num_ctx 32768 unless set) and Aider's through litellm's ollama_chat (num_ctx the
# prompt's tokens * 1.25 + 8192, in options beside temperature 0).
_ZED = {"model": "tiny:latest", "stream": True, "keep_alive": -1, "think": False, "tools": [],
        "options": {"num_ctx": 4096, "num_predict": None, "stop": [], "temperature": 1.0,
                    "top_p": None},
        "messages": [{"role": "system", "content": "You are a helpful assistant."},
                     {"role": "user", "content": "What is in main.rs?"},
                     {"role": "assistant", "content": "Let me look.", "thinking": None,
                      "tool_calls": [{"function": {"name": "read_file",
                                                   "arguments": {"path": "src/main.rs"}}}]},
                     {"role": "tool", "tool_name": "read_file", "content": "fn main() {}"},
                     {"role": "user", "content": "hi"}]}
_CLINE = {"model": "tiny", "stream": True, "options": {"num_ctx": 32768},
          "messages": [{"role": "system", "content": "You are Cline."}, *HI]}
_AIDER = {"model": "tiny", "stream": True, "options": {"temperature": 0, "num_ctx": 8212},
          "messages": HI}


async def test_num_ctx_above_the_served_context_is_served_within_it(
        tiny_model: Path, start_daemon: DaemonFactory) -> None:
    """As Ollama serves a num_ctx above the model's own context: every turn of Zed's,
    Cline's and Aider's Ollama providers was a 400 naming options.num_ctx."""
    with trio.fail_after(60):
        async with start_daemon(tiny_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=60) as h:
            for body in (_ZED, _CLINE, _AIDER):
                body = {**body, "options": {**body["options"], "num_predict": 4}}
                r = await h.post("/api/chat", json=body)
                assert r.status_code == 200, r.text
                lines = [json.loads(line) for line in r.text.splitlines()]
                assert lines[-1]["done"] and lines[-1]["eval_count"] == 4
            # the context is still the one served: a prompt past it is named so
            long = {**_CLINE, "messages": [{"role": "user", "content": "hi " * 3000}]}
            r = await h.post("/api/chat", json=long)
            assert r.status_code == 400 and "2048" in r.json()["error"]


async def test_format_json_and_a_schema(tiny_model: Path, start_daemon: DaemonFactory) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}
    with trio.fail_after(60):
        async with start_daemon(tiny_model) as d, _client(d.url) as c:
            answer = await c.chat("tiny", HI, format=schema, options={"num_predict": 40})
            assert answer.done_reason == "stop"
            assert isinstance(json.loads(answer.message.content or "")["ok"], bool)
            text, _ = await _joined(await c.generate(
                "tiny", "JSON:", format="json", stream=True, options={"num_predict": 20}),
                "response")
            assert text.startswith("{")


async def test_a_suffix_is_fill_in_the_middle(fim_model: Path, tiny_model: Path,
                                              start_daemon: DaemonFactory) -> None:
    prefix, suffix = "def add(a, b):\n", "\n    return c\n"
    models = [{"path": str(tiny_model)}]
    with trio.fail_after(60):
        async with start_daemon(fim_model, models=models) as d, _client(d.url) as c, \
                httpx.AsyncClient(base_url=d.url, timeout=60) as h:
            middle = await c.generate("tiny-fim", prefix, suffix,
                                      options={"temperature": 0, "num_predict": 12})
            r = await h.post("/v1/completions", json={
                "prompt": prefix, "suffix": suffix, "max_tokens": 12, "temperature": 0})
            assert middle.response == r.json()["choices"][0]["text"]
            raw = await c.generate("tiny-fim", prefix, suffix, raw=True,  # as Continue sends it
                                   options={"temperature": 0, "num_predict": 12})
            assert raw.response == middle.response
            with pytest.raises(ollama.ResponseError) as err:
                await c.generate("tiny", prefix, suffix)
            assert err.value.status_code == 400 and "fill-in-the-middle" in err.value.error


# Zed's Ollama edit predictions: the prompt written in the model's FIM tokens (Qwen's for a
# model named qwen2.5-coder), raw, with every FIM marker Zed knows as a stop string.
_ZED_STOPS = ["<|endoftext|>", "<|file_separator|>", "<|fim_pad|>", "<|fim_prefix|>",
              "<|fim_middle|>", "<|fim_suffix|>", "<fim_prefix>", "<fim_middle>",
              "<fim_suffix>", "<PRE>", "<SUF>", "<MID>", "[PREFIX]", "[SUFFIX]"]


async def test_zeds_edit_prediction_with_its_fourteen_stop_strings(
        fim_model: Path, start_daemon: DaemonFactory) -> None:
    """Zed sends 14 stop strings with every prediction: past limits.max_stop's 8, each
    one was a 400 naming stop."""
    body = {"model": "qwen2.5-coder:7b", "raw": True, "stream": False,
            "prompt": "<|fim_prefix|>def add(a, b):\n<|fim_suffix|>\n    return c\n"
                      "<|fim_middle|>",
            "options": {"num_predict": 8, "temperature": 0.2, "stop": _ZED_STOPS}}
    with trio.fail_after(60):
        async with start_daemon(fim_model, model={"aliases": ["qwen2.5-coder:7b"]}) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=60) as h:
            r = await h.post("/api/generate", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["done"] and isinstance(r.json()["response"], str)


async def test_errors_in_ollamas_shape(tiny_model: Path, tmp_path: Path,
                                       start_daemon: DaemonFactory) -> None:
    key = add_key(tmp_path / "keys.toml", "dev", max_streams=4, max_queued=4,
                  priority="interactive")
    refused: list[tuple[Any, int, str]] = [
        (lambda c: c.chat("gpt-9", HI), 404, "gpt-9"),
        (lambda c: c.chat("tiny", HI, options={"mirostat": 3}), 400, "options.mirostat"),
        (lambda c: c.chat("tiny", HI, options={"tfs_z": 0.5}), 400, "options.tfs_z"),
        (lambda c: c.chat("tiny", HI, options={"mirostatt": 2}), 400, "mirostatt"),
        (lambda c: c.chat("tiny", HI, options={"temperature": 9}), 400,
         "options.temperature"),
        (lambda c: c.chat("tiny", HI, options={"num_ctx": 0}), 400, "options.num_ctx"),
        (lambda c: c.chat("tiny", HI, options={"num_predict": 0}), 400, "options.num_predict"),
        (lambda c: c.chat("tiny", HI, options={"num_predict": -3}), 400,
         "options.num_predict"),
        (lambda c: c.chat("tiny", HI, options={"num_predict": 4000}), 400, "context"),
        (lambda c: c.chat("tiny", HI, think=True), 400, "think"),
        (lambda c: c.chat("tiny", [*HI, {"role": "assistant", "content": "The answer is"}]),
         400, "messages[1]"),
        (lambda c: c.chat("tiny", [{**HI[0], "images": [b"\x89PNG"]}]), 400, "images"),
        (lambda c: c.generate("tiny", "x", template="{{ .Prompt }}"), 400, "template"),
        (lambda c: c.generate("tiny", "x", raw=True, system="s"), 400, "system"),
        (lambda c: c.embed("tiny", "x"), 400, "embedding"),
        (lambda c: c.embeddings("tiny", "x"), 400, "embedding"),
        (lambda c: c.pull("tiny"), 403, "admin"),
        (lambda c: c.delete("tiny"), 403, "admin"),
        (lambda c: c.copy("tiny", "mine"), 403, "admin"),
    ]
    with trio.fail_after(60):
        async with start_daemon(tiny_model) as d, _client(d.url) as anonymous, \
                _client(d.url, headers={"Authorization": f"Bearer {key}"}) as c:
            with pytest.raises(ollama.ResponseError) as err:
                await anonymous.list()
            assert err.value.status_code == 401 and "API key" in err.value.error
            for call, status, named in refused:
                with pytest.raises(ollama.ResponseError) as err:
                    await call(c)
                assert (err.value.status_code, named in err.value.error) == (status, True), \
                    err.value
            async with httpx.AsyncClient(base_url=d.url, headers={"x-api-key": key}) as h:
                r = await h.get("/api/nope")
                assert r.status_code == 404 and set(r.json()) == {"error"}
                r = await h.post("/api/chat", content=b"{not json")
                assert r.status_code == 400 and set(r.json()) == {"error"}
                r = await h.post("/api/generate", json={"model": "tiny", "prompt": "x",
                                                        "format": "yaml"})
                assert r.status_code == 400 and "format" in r.json()["error"]
                r = await h.post("/api/show", json={"model": ""})
                assert r.status_code == 400 and "model" in r.json()["error"]
            # the key's requests are served, and counted as the key's
            assert (await c.chat("tiny", HI, options={"num_predict": 3})).done
            state = d.daemon.state
            assert state is not None and "dev" in state.key_usage
            await until(lambda: state.key_usage["dev"].open == 0)  # released at the end


async def test_a_failure_mid_stream_ends_it_with_an_error_line(
        tiny_model: Path, start_daemon: DaemonFactory) -> None:
    """The client raises ResponseError on that line (read here with httpx: the client's
    own generator, left by its exception, warns as it is collected)."""
    body = {"model": "tiny", "prompt": "Hello", "raw": True,
            "options": {"temperature": 0, "num_predict": 1000}}
    with trio.fail_after(60):
        async with start_daemon(tiny_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=60) as h:
            testhooks.slow_steps(d.daemon.pool, 0, 0.05)  # the stream outlasts the kill
            pid = d.daemon.pool.workers[0].pid
            assert pid is not None
            lines = []
            async with h.stream("POST", "/api/generate", json=body) as r:
                async for line in r.aiter_lines():
                    lines.append(json.loads(line))
                    if len(lines) == 1:
                        os.kill(pid, signal.SIGKILL)
            assert lines[0]["done"] is False
            assert set(lines[-1]) == {"error"} and "worker" in lines[-1]["error"]


async def test_the_same_greedy_answer_as_openais_chat(
        tiny_model: Path, start_daemon: DaemonFactory) -> None:
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a colour."}]
    with trio.fail_after(60):
        async with start_daemon(tiny_model) as d, _client(d.url) as c, \
                httpx.AsyncClient(base_url=d.url, timeout=60) as h:
            r = await h.post("/v1/chat/completions", json={
                "messages": messages, "max_tokens": 16, "temperature": 0})
            openai_answer = r.json()
            ours = await c.chat("tiny", messages, options={"temperature": 0,
                                                           "num_predict": 16})
            assert ours.message.content == openai_answer["choices"][0]["message"]["content"]
            assert ours.prompt_eval_count == openai_answer["usage"]["prompt_tokens"]
            assert ours.eval_count == openai_answer["usage"]["completion_tokens"]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


@pytest.mark.model
async def test_smollm2_calls_a_tool(real_model: Path, start_daemon: DaemonFactory) -> None:
    """SmolLM2-135M calls no tool unprompted, and Ollama has no tool_choice to require
    one: an earlier call in the conversation shows it how."""
    earlier = {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"},
                           earlier, {"role": "user", "content": "What is the weather in Oslo?"}]
    greedy = {"temperature": 0, "num_predict": 60}
    # A slow step on a busy machine is no lost worker.
    with trio.fail_after(600):
        async with start_daemon(real_model, engine={"heartbeat_timeout": 60.0}) as d, \
                _client(d.url, timeout=600) as c:
            model = (await c.list()).models[0].model or ""
            details = (await c.show(model)).details
            assert details is not None
            assert (details.family, details.parameter_size, details.quantization_level) == \
                ("llama", "135M", "Q4_1")
            answer = await c.chat(model, messages, tools=[WEATHER], options=greedy)
            calls = answer.message.tool_calls
            assert calls and calls[0].function.name == "get_weather", answer
            assert calls[0].function.arguments == {"city": "Oslo"}
            assert (answer.message.content, answer.done_reason) == ("", "stop")
            streamed = [p async for p in await c.chat(model, messages, tools=[WEATHER],
                                                      options=greedy, stream=True)]
            assert [tc.function for p in streamed for tc in p.message.tool_calls or []] == \
                [calls[0].function]
            # the call and its result go back in, and the model answers
            messages += [answer.message, {"role": "tool", "tool_name": "get_weather",
                                          "content": "12 degrees, sunny"}]
            final = await c.chat(model, messages, tools=[WEATHER], options=greedy)
            assert final.done and final.message.content and not final.message.tool_calls
            assert final.prompt_eval_count and answer.prompt_eval_count
            assert final.prompt_eval_count > answer.prompt_eval_count


async def test_a_line_separator_in_a_token_stays_inside_its_ndjson_line() -> None:
    """The ollama client reads the stream with httpx's line decoder, which splits on
    U+2028 and U+2029 too (str.splitlines): written raw, a token holding one cut its
    line in two and the client failed mid-stream. Ollama (Go's JSON) escapes them."""
    raw = _line({"response": "a\u2028b\u2029c\x85d"}).decode()
    lines = httpx._decoders.LineDecoder().decode(raw)
    assert len(lines) == 1 and json.loads(lines[0]) == {"response": "a\u2028b\u2029c\x85d"}


async def test_num_predict_minus_2_fills_the_context() -> None:
    assert _budget(-2) == -1  # forged's "until the context is full"
    assert _budget(-1) is None  # Ollama's default: forged's default_max_tokens


async def test_each_tool_call_carries_its_index_as_ollama_writes_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ollama numbers an answer's calls in ``function.index``; Open WebUI gathers a
    stream's calls by that number (0 where absent), so two of forged's calls became
    one, their names and arguments run together."""
    monkeypatch.setattr(ollama_shapes, "call", lambda: types.SimpleNamespace(started=0.0))
    block = '<tool_call>\n{{"name": "{}", "arguments": {{"city": "{}"}}}}\n</tool_call>\n'
    text = block.format("weather", "Oslo") + block.format("time", "Lima")
    streamed = OllamaChat("m", 0, tools=True)
    lines = [json.loads(line) for line in (streamed.delta(text[:60]) +
                                           streamed.delta(text[60:])).splitlines()]
    calls = [c for line in lines for c in line["message"].get("tool_calls", [])]
    whole = OllamaChat("m", 0, tools=True)  # stream: false, the answer in one piece
    message = whole._piece("", whole._split(text, 0)[1])["message"]
    for got in (calls, message["tool_calls"]):
        assert [(c["function"]["index"], c["function"]["name"]) for c in got] == \
            [(0, "weather"), (1, "time")]
        assert got[1]["function"]["arguments"] == {"city": "Lima"}
