"""Anthropic's Messages API (forged.http.anthropic) through the official ``anthropic``
client, against a daemon on loopback."""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import msgspec
import pytest
import quart_trio
import trio

from forged.auth import add_key
from forged.engine import testhooks
from forged.engine.events import Done
from forged.http.anthropic import (
    MessageFormat,
    MessagesRequest,
    chat_request,
    error_detail,
    error_response,
    model_page,
)
from forged.http.responses import http_error
from forged.retrieval.store import Index
from tests.conftest import DaemonFactory
from tests.daemonproc import DaemonProcess, free_port, serve, write_config

GREEDY: dict[str, Any] = {"temperature": 0}  # not among the client's own arguments
HELLO = [{"role": "user", "content": "Hello there"}]


class Tiny:
    def __init__(self, daemon: DaemonProcess, key: str, rag_key: str) -> None:
        self.daemon, self.key = daemon, key
        self.rag_key = rag_key  # its default_repo is the index "demo"
        self.client = anthropic.Anthropic(base_url=daemon.url, api_key=key, max_retries=0,
                                          timeout=60)

    def post(self, path: str, body: dict[str, Any], key: str | None = None) -> httpx.Response:
        return httpx.post(self.daemon.url + path, json=body, timeout=60,
                          headers={"x-api-key": key or self.key})


@pytest.fixture(scope="module")
def tiny(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tiny]:
    """The tiny model, with API keys on: every request carries one, as x-api-key."""
    tmp = tmp_path_factory.mktemp("anthropic")
    key = add_key(tmp / "keys.toml", "claude", max_streams=4, max_queued=8,
                  priority="interactive")
    src = tmp / "src"
    src.mkdir()
    (src / "nursery.py").write_text("def open_nursery(strict: bool) -> int:\n    return 1\n")
    with Index.create(tmp / "state" / "index", "demo", src) as idx:
        idx.update()
    rag_key = add_key(tmp / "keys.toml", "rag", max_streams=4, max_queued=8,
                      priority="interactive", default_repo="demo")
    port = free_port()
    config = write_config(tmp / "forged.toml", tiny_model, port, engine={
        "kv_cells": 4096, "kv_layout": "unified", "max_context": 1024, "slots": 8,
        "max_running": 8}, server={"max_body_bytes": 100_000})
    for d in serve(config, port):
        t = Tiny(d, key, rag_key)
        with t.client:
            yield t


def events(r: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """The stream's frames, each ``event: NAME`` then ``data: JSON`` and a blank line."""
    out = []
    for frame in r.text.split("\n\n")[:-1]:
        name, data = frame.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), frame
        out.append((name[7:], json.loads(data[6:])))
        assert out[-1][1]["type"] == out[-1][0]
    return out


# --- whole and streamed --------------------------------------------------------------------


def test_a_message_whole_and_streamed_through_the_client(tiny: Tiny) -> None:
    kw: dict[str, Any] = {"model": "tiny", "max_tokens": 12, "messages": HELLO,
                          "extra_body": GREEDY}
    whole = tiny.client.messages.create(**kw)
    assert whole.id.startswith("msg_") and whole.type == "message"
    assert whole.role == "assistant" and whole.model == "tiny"
    assert [b.type for b in whole.content] == ["text"]
    assert whole.stop_reason in ("max_tokens", "end_turn")
    assert (whole.stop_reason == "max_tokens") == (whole.usage.output_tokens == 12)
    with tiny.client.messages.stream(**kw) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.stop_sequence is None
    assert final.usage.output_tokens == whole.usage.output_tokens
    # The second run's prompt came from the prefix cache: Anthropic counts it apart.
    assert final.usage.cache_read_input_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)


def test_the_stream_is_anthropics_event_sequence(tiny: Tiny) -> None:
    r = tiny.post("/v1/messages", {"model": "tiny", "max_tokens": 5, "messages": HELLO,
                                   "stream": True, **GREEDY})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    frames = events(r)
    names = [name for name, _ in frames]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    start = frames[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    prompt = start["usage"]["input_tokens"] + start["usage"]["cache_read_input_tokens"]
    assert prompt > 0 and start["usage"]["output_tokens"] == 0
    assert frames[2][1] == {"type": "content_block_start", "index": 0,
                            "content_block": {"type": "text", "text": ""}}
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta"
               for _, d in frames[3:-3])
    end = frames[-2][1]
    assert end["delta"]["stop_reason"] in ("max_tokens", "end_turn")
    assert end["usage"]["output_tokens"] <= 5
    assert end["usage"]["input_tokens"] + end["usage"]["cache_read_input_tokens"] == prompt


def test_the_same_greedy_prompt_gives_the_same_text_as_chat_completions(tiny: Tiny) -> None:
    messages = [{"role": "user", "content": "What is a nursery?"},
                {"role": "assistant", "content": "A scope for tasks."},
                {"role": "user", "content": "And a cancel scope?"}]
    system = "You answer in one line."
    msg = tiny.client.messages.create(model="tiny", max_tokens=16, system=system,
                                      messages=messages, extra_body=GREEDY)
    chat = tiny.post("/v1/chat/completions", {
        "model": "tiny", "max_tokens": 16, "temperature": 0,
        "messages": [{"role": "system", "content": system}, *messages]}).json()
    assert msg.content[0].text == chat["choices"][0]["message"]["content"]
    assert {"max_tokens": "length", "end_turn": "stop"}[msg.stop_reason or ""] == \
        chat["choices"][0]["finish_reason"]
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == \
        chat["usage"]["prompt_tokens"]
    assert msg.usage.output_tokens == chat["usage"]["completion_tokens"]


def test_a_system_prompt_as_blocks_is_the_same_prompt_as_its_text(tiny: Tiny) -> None:
    count = tiny.client.messages.count_tokens
    plain = count(model="tiny", messages=HELLO).input_tokens
    text = count(model="tiny", messages=HELLO, system="Be brief. Be kind.")
    blocks = count(model="tiny", messages=HELLO, system=[
        {"type": "text", "text": "Be brief. "},
        {"type": "text", "text": "Be kind.", "cache_control": {"type": "ephemeral"}}])
    assert text.input_tokens == blocks.input_tokens > plain


@pytest.mark.parametrize("as_blocks", [False, True])
def test_claude_codes_billing_stamp_does_not_stop_the_prefix_cache(tiny: Tiny,
                                                                  as_blocks: bool) -> None:
    """Claude Code's system prompt opens with a billing line whose cch= stamp changes
    on every request: each turn recomputed the whole prompt after its first line."""
    def ask(stamp: str) -> Any:
        head = f"x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; " \
               f"cch={stamp};"
        rest = "You are a careful assistant. " * 6 + f"Blocks: {as_blocks}."
        system: Any = [{"type": "text", "text": head}, {"type": "text", "text": rest}] \
            if as_blocks else head + rest
        return tiny.client.messages.create(model="tiny", max_tokens=1, system=system,
                                           messages=HELLO).usage
    first, second = (ask("c1d2e"), ask("9f8e7")) if as_blocks else (ask("a5145"),
                                                                     ask("0b3c7"))
    prompt = first.input_tokens + (first.cache_read_input_tokens or 0)
    assert second.input_tokens + (second.cache_read_input_tokens or 0) == prompt
    assert (second.cache_read_input_tokens or 0) >= prompt - 8, second


def test_a_system_prompt_as_blocks_takes_the_repository_chunks_as_its_text_does(
        tiny: Tiny) -> None:
    """Claude Code sends its system prompt as blocks: with a key's default_repo, the
    chunks went into a second system message before the client's own."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "where is open_nursery?"}]}
    counts = [tiny.post("/v1/messages/count_tokens", {**body, "system": system},
                        key=tiny.rag_key).json()["input_tokens"]
              for system in ("Be brief.", [{"type": "text", "text": "Be brief."}])]
    assert counts[0] == counts[1]


def test_max_tokens_past_the_context_is_said_as_anthropic_says_it(tiny: Tiny) -> None:
    """Claude Code reads Anthropic's wording (the numbers) to retry with a lower
    max_tokens; a prompt too long alone keeps OpenAI's."""
    r = tiny.post("/v1/messages", {"model": "tiny", "max_tokens": 1024, "messages": HELLO})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert re.search(r"input length and `max_tokens` exceed context limit: "
                     r"\d+ \+ 1024 > 1024, decrease input length or `max_tokens` and try "
                     r"again", message), message


def test_count_tokens_is_the_prompt_a_message_is_given(tiny: Tiny) -> None:
    messages = [*HELLO, {"role": "assistant", "content": "Hi."},
                {"role": "user", "content": [{"type": "text", "text": "Count "},
                                             {"type": "text", "text": "me"}]}]
    counted = tiny.client.messages.count_tokens(model="tiny", messages=messages)
    msg = tiny.client.messages.create(model="tiny", max_tokens=1, messages=messages)
    assert counted.input_tokens == \
        msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)


def test_the_repository_chunks_used_are_named(tiny: Tiny) -> None:
    """A key's default_repo puts chunks into the prompt (count_tokens counts them) and
    the message names them, streamed in its message_delta."""
    body = {"model": "tiny", "max_tokens": 2,
            "messages": [{"role": "user", "content": "where is open_nursery?"}]}
    whole = tiny.post("/v1/messages", body, key=tiny.rag_key).json()
    assert whole["retrieved"][0]["path"] == "nursery.py"
    end = events(tiny.post("/v1/messages", {**body, "stream": True}, key=tiny.rag_key))[-2]
    assert end[0] == "message_delta" and end[1]["retrieved"] == whole["retrieved"]
    counts = [tiny.post("/v1/messages/count_tokens", {"model": "tiny", "messages": body[
        "messages"]}, key=k).json()["input_tokens"] for k in (tiny.key, tiny.rag_key)]
    assert counts[1] > counts[0]
    assert counts[1] == whole["usage"]["input_tokens"] + \
        whole["usage"]["cache_read_input_tokens"]


def test_a_stop_sequence_ends_the_message_and_is_named(tiny: Tiny) -> None:
    kw: dict[str, Any] = {"model": "tiny", "max_tokens": 24, "messages": HELLO,
                          "extra_body": GREEDY}
    text = tiny.client.messages.create(**kw).content[0].text
    stop = text[6:8]
    assert stop.strip() and len(text) > 8
    with tiny.client.messages.stream(**kw, stop_sequences=[stop]) as stream:
        streamed = stream.get_final_message()
    for msg in (tiny.client.messages.create(**kw, stop_sequences=[stop]), streamed):
        assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
        assert msg.content[0].text == text[:text.index(stop)]


def test_max_tokens_0_is_a_bad_request_as_anthropic_s(tiny: Tiny) -> None:
    """Anthropic's max_tokens is at least 1, as OpenAI chat's is (llama.cpp's
    n_predict 0 warm-up is /completion's)."""
    messages = [{"role": "user", "content": "Warm this prompt up, please"}]
    with pytest.raises(anthropic.BadRequestError) as caught:
        tiny.client.messages.create(model="tiny", max_tokens=0, messages=messages)
    assert "max_tokens" in _error(caught.value, "invalid_request_error")


def test_an_output_format_is_json_of_its_schema(tiny: Tiny) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    msg = tiny.client.messages.create(
        model="tiny", max_tokens=60, messages=HELLO,
        output_config={"format": {"type": "json_schema", "schema": schema}})
    assert msg.stop_reason == "end_turn"
    assert isinstance(json.loads(msg.content[0].text)["n"], int)


# --- errors in Anthropic's shape -----------------------------------------------------------


def _error(exc: anthropic.APIStatusError, kind: str) -> str:
    body = exc.response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    assert set(body["error"]) == {"type", "message"}
    return str(body["error"]["message"])


def test_a_bad_key_is_an_authentication_error(tiny: Tiny) -> None:
    bad = anthropic.Anthropic(base_url=tiny.daemon.url, api_key="fgd-wrong", max_retries=0)
    with bad, pytest.raises(anthropic.AuthenticationError) as info:
        bad.messages.create(model="tiny", max_tokens=4, messages=HELLO)
    assert "API key" in _error(info.value, "authentication_error")
    assert tiny.post("/v1/messages/count_tokens", {"model": "tiny", "messages": HELLO},
                     key="fgd-wrong").status_code == 401


def test_an_unknown_model_is_not_found(tiny: Tiny) -> None:
    with pytest.raises(anthropic.NotFoundError) as info:
        tiny.client.messages.create(model="claude-sonnet-4-5", max_tokens=4,
                                    messages=HELLO)
    assert "claude-sonnet-4-5" in _error(info.value, "not_found_error")
    with pytest.raises(anthropic.NotFoundError):
        tiny.client.messages.count_tokens(model="claude-sonnet-4-5",
                                          messages=HELLO)


def test_models_are_listed_in_anthropics_shape_to_its_clients(tiny: Tiny) -> None:
    """Claude Code and the SDK read /v1/models with anthropic-version: Anthropic's list;
    the OpenAI SDK, on the same path, still OpenAI's."""
    page = tiny.client.models.list()
    assert [m.id for m in page.data] == ["tiny"]
    assert page.data[0].type == "model" and page.data[0].created_at.year >= 2025
    one = tiny.client.models.retrieve("tiny")
    assert (one.id, one.display_name) == ("tiny", "tiny")
    with pytest.raises(anthropic.NotFoundError) as info:
        tiny.client.models.retrieve("claude-sonnet-4-5")
    assert "claude-sonnet-4-5" in _error(info.value, "not_found_error")
    with pytest.raises(anthropic.BadRequestError):
        tiny.client.models.list(limit=0)
    assert tiny.client.models.list(after_id="tiny").data == []
    openai_shape = httpx.get(tiny.daemon.url + "/v1/models", timeout=30,
                             headers={"Authorization": f"Bearer {tiny.key}"}).json()
    assert openai_shape["object"] == "list" and openai_shape["data"][0]["object"] == "model"


async def test_a_page_before_an_id_is_the_page_just_before_it() -> None:
    app = quart_trio.QuartTrio("t")
    models = [{"id": m, "created": 1_750_000_000} for m in "abc"]
    async with app.test_request_context("/v1/models?before_id=c&limit=1"):
        page = model_page(models)
    assert [m["id"] for m in page["data"]] == ["b"] and page["has_more"]
    async with app.test_request_context("/v1/models?before_id=c&limit=5"):
        page = model_page(models)
    assert [m["id"] for m in page["data"]] == ["a", "b"] and not page["has_more"]


def test_a_prompt_too_long_is_a_bad_request(tiny: Tiny) -> None:
    long = [{"role": "user", "content": "word " * 2000}]
    with pytest.raises(anthropic.BadRequestError) as info:
        tiny.client.messages.create(model="tiny", max_tokens=4, messages=long)
    assert "maximum context length" in _error(info.value, "invalid_request_error")
    with pytest.raises(anthropic.BadRequestError):
        tiny.client.messages.create(model="tiny", max_tokens=1024, messages=HELLO)


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "iVBORw0KGgo="}}
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
# (a change to a good body, the field the 400 names)
REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking"),
    ({"container": "c-1"}, "container"),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
    ({"speed": "fast"}, "speed"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "see"}, IMAGE]}]},
     "messages[0].content[1].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": [IMAGE]}]}]},
     "messages[0].content[0].content[0].type"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [{**WEATHER, "defer_loading": True}]}, "tools[0].defer_loading"),
    ({"tools": [{**WEATHER, "input_schema": {"type": "object", "properties": {
        "n": {"type": "integer", "multipleOf": 2}}}}]}, "tools[0].input_schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice.name"),
    ({"messages": [*HELLO, {"role": "assistant", "content": "The answer is"}]},
     "messages[1]"),
    ({"frobnicate": True}, "frobnicate"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": ""}]}, "messages[0].content"),
    ({"messages": [*HELLO, {"role": "assistant", "content": []}, *HELLO]},
     "messages[1].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
     "messages[0].content[0].text"),
    ({"max_tokens": None}, "max_tokens"),
    ({"temperature": 1.5}, "temperature"),
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"output_config": {"effort": "high"}}, "output_config.effort"),
    ({"tools": [WEATHER], "output_config": {"format": {"type": "json_schema", "schema": {
        "type": "object"}}}}, "output_config.format"),
]


@pytest.mark.parametrize(("change", "field"), REFUSED, ids=[f for _, f in REFUSED])
def test_what_forged_cannot_honour_is_a_400_naming_it(tiny: Tiny, change: dict[str, Any],
                                                      field: str) -> None:
    r = tiny.post("/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": HELLO,
                                   **change})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert field in body["error"]["message"], body


# Values that ask for nothing, and fields that change no output: accepted.
ACCEPTED: list[dict[str, Any]] = [
    {"thinking": {"type": "disabled"}}, {"mcp_servers": []}, {"speed": "standard"},
    {"metadata": {"user_id": "u-1"}}, {"service_tier": "standard_only"},
    {"cache_control": {"type": "ephemeral"}}, {"top_k": 40, "top_p": 0.9},
    {"tools": [{**WEATHER, "strict": True, "cache_control": {"type": "ephemeral"}}],
     "tool_choice": {"type": "none"}},
]


@pytest.mark.parametrize("change", ACCEPTED, ids=lambda c: next(iter(c)))
def test_values_that_ask_for_nothing_are_accepted(tiny: Tiny, change: dict[str, Any]) -> None:
    r = tiny.post("/v1/messages", {"model": "tiny", "max_tokens": 2, "messages": HELLO,
                                   **change})
    assert r.status_code == 200, r.text


def test_other_errors_on_these_paths_are_in_anthropics_shape(tiny: Tiny) -> None:
    r = tiny.post("/v1/messages/nope", {})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(tiny.daemon.url + "/v1/messages", headers={"x-api-key": tiny.key})
    assert r.status_code == 405 and r.json()["type"] == "error"
    r = httpx.post(tiny.daemon.url + "/v1/messages", content=b"{nope",
                   headers={"x-api-key": tiny.key})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = tiny.post("/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": [
        {"role": "user", "content": "x" * 200_000}]})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    # and OpenAI's shape elsewhere
    assert "type" not in tiny.post("/v1/chat/completions", {"messages": []}).json()


# --- the translation ---------------------------------------------------------------------


def test_tool_use_and_tool_results_become_openais_calls_and_tool_messages() -> None:
    raw = {"model": "m", "max_tokens": 9, "system": "sys", "tools": [WEATHER],
           "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
           "messages": [
               {"role": "user", "content": "Weather in Oslo and Rome?"},
               {"role": "assistant", "content": [
                   {"type": "text", "text": "Looking."},
                   {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                    "input": {"city": "Oslo"}}]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": "toolu_1", "content": "12 C"},
                   {"type": "text", "text": "And Rome?"}]}]}
    req = chat_request(msgspec.convert(raw, MessagesRequest))
    assert req.tool_choice == "required" and req.parallel_tool_calls is False
    assert req.tools == [{"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER["input_schema"],
        "description": "The weather in a city"}}]
    assert [m.role for m in req.messages] == ["system", "user", "assistant", "tool", "user"]
    assert req.messages[2].tool_calls == [{"id": "toolu_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Oslo"}}}]
    assert req.messages[3].tool_call_id == "toolu_1" and req.messages[3].content == "12 C"
    assert req.max_tokens == 9 and req.stream is False



def test_text_then_a_tool_call_stream_as_two_blocks() -> None:
    """Text until the model writes a call, then the call as a tool_use block whose input
    comes in one input_json_delta."""
    fmt = MessageFormat("m", 0, tools=True)
    fmt.prompt_tokens, fmt.cached_tokens = 30, 20
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    raw = fmt.start() + fmt.delta("Let me look. ") + fmt.delta(call[:15]) + \
        fmt.delta(call[15:]) + fmt.finish(Done(
            rid=0, text="", stop_type="eos", prompt_tokens=30, completion_tokens=25,
            cached_tokens=20)) + fmt.end([], False)
    frames = events(httpx.Response(200, content=raw))
    assert [(n, d.get("index")) for n, d in frames] == [
        ("message_start", None), ("ping", None), ("content_block_start", 0),
        ("content_block_delta", 0), ("content_block_stop", 0), ("content_block_start", 1),
        ("content_block_delta", 1), ("content_block_stop", 1), ("message_delta", None),
        ("message_stop", None)]
    assert frames[0][1]["message"]["usage"]["input_tokens"] == 10
    assert frames[3][1]["delta"] == {"type": "text_delta", "text": "Let me look. "}
    block = frames[5][1]["content_block"]
    assert block["type"] == "tool_use" and block["id"].startswith("toolu_")
    assert (block["name"], block["input"]) == ("get_weather", {})
    assert json.loads(frames[6][1]["delta"]["partial_json"]) == {"city": "Oslo"}
    assert frames[8][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert frames[8][1]["usage"] == {"input_tokens": 10, "cache_creation_input_tokens": 0,
                                     "cache_read_input_tokens": 20, "output_tokens": 25}


@pytest.mark.parametrize(("status", "code", "kind"), [
    (400, None, "invalid_request_error"), (401, "invalid_api_key", "authentication_error"),
    (403, "permission_denied", "permission_error"), (404, None, "not_found_error"),
    (413, None, "request_too_large"), (429, "rate_limit_exceeded", "rate_limit_error"),
    (503, "overloaded", "overloaded_error"), (503, "queue_timeout", "overloaded_error"),
    (503, "worker_lost", "api_error"), (503, "unavailable", "api_error")])
def test_forgeds_statuses_keep_their_status_with_anthropics_error_types(
        status: int, code: str | None, kind: str) -> None:
    err = http_error(status, "no", "x", "max_tokens", code, retry_after=2)
    resp = error_response(err)
    assert resp.status_code == status and resp.headers["Retry-After"] == "2"
    assert error_detail(err) == {"type": kind, "message": "max_tokens: no"}

# --- mid-stream --------------------------------------------------------------------------


async def test_an_error_mid_stream_is_anthropics_error_event(
        tiny_model: Path, start_daemon: DaemonFactory) -> None:
    """The worker dies while the message streams: the stream ends with an ``error`` event,
    which the client raises."""
    with trio.fail_after(60):
        async with start_daemon(tiny_model) as d, anthropic.AsyncAnthropic(
                base_url=d.url, api_key="none", max_retries=0) as client:
            testhooks.slow_steps(d.daemon.pool, 0, 0.01)  # the stream outlasts the kill
            pid = d.daemon.pool.workers[0].pid
            assert pid is not None
            async with client.messages.stream(model="tiny", max_tokens=1000, messages=HELLO,
                                              extra_body=GREEDY) as stream:
                with pytest.raises(anthropic.APIStatusError) as info:
                    async for ev in stream:
                        if ev.type == "content_block_delta":
                            os.kill(pid, signal.SIGKILL)
    error = info.value.body["error"]
    assert error["type"] == "api_error" and "worker" in error["message"]


# --- tools, on the real model ----------------------------------------------------------------

SMOL = "SmolLM2-135M-Instruct.Q4_1"


@pytest.fixture(scope="module")
def smol(real_model: Path, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[anthropic.Anthropic]:
    tmp = tmp_path_factory.mktemp("anthropic-smol")
    port = free_port()
    config = write_config(tmp / "forged.toml", real_model, port, engine={
        "kv_cells": 8192, "kv_layout": "unified", "max_context": 2048, "slots": 8,
        "max_running": 8})
    for d in serve(config, port):
        with anthropic.Anthropic(base_url=d.url, api_key="none", max_retries=0,
                                 timeout=300) as client:
            yield client


@pytest.mark.model
def test_a_forced_tool_call_round_trip(smol: anthropic.Anthropic) -> None:
    """tool_use (forced by tool_choice, whole and streamed), then its tool_result: the
    answer is the one chat completions gives for the same conversation."""
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Oslo?"}]
    kw: dict[str, Any] = {"model": SMOL, "max_tokens": 60, "tools": [WEATHER],
                          "extra_body": GREEDY}
    forced = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    first = smol.messages.create(messages=messages, tool_choice=forced, **kw)
    assert first.stop_reason == "tool_use"
    [call] = first.content
    assert call.type == "tool_use" and call.name == "get_weather"
    assert call.id.startswith("toolu_") and isinstance(call.input["city"], str)
    with smol.messages.stream(messages=messages, tool_choice=forced, **kw) as stream:
        kinds = [ev.type for ev in stream]
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and "input_json" in kinds
    assert [(b.type, b.input) for b in streamed.content] == [("tool_use", call.input)]

    messages += [{"role": "assistant", "content": first.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                               "content": "12 C and sunny"}]}]
    answer = smol.messages.create(messages=messages, tool_choice={"type": "none"}, **kw)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    chat = httpx.post(str(smol.base_url).rstrip("/") + "/v1/chat/completions", timeout=300,
                      json={"model": SMOL, "max_tokens": 60, "temperature": 0,
                            "tool_choice": "none", "tools": [{"type": "function", "function": {
                                "name": WEATHER["name"], "description": WEATHER["description"],
                                "parameters": WEATHER["input_schema"]}}],
                            "messages": [messages[0], {
                                "role": "assistant", "content": None, "tool_calls": [{
                                    "id": call.id, "type": "function", "function": {
                                        "name": call.name,
                                        "arguments": json.dumps(call.input)}}]},
                                {"role": "tool", "tool_call_id": call.id,
                                 "content": "12 C and sunny"}]}).json()
    assert answer.content[0].text == chat["choices"][0]["message"]["content"]
