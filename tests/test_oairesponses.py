"""OpenAI's Responses API (/v1/responses) through the official openai client.

The units check the store's bounds and the translation of input items without a
daemon. The end-to-end tests run ``forged serve`` on the tiny random-weight model
(with tools in its vocabulary and template, and two API keys), and on SmolLM2 for a
function call and its output's follow-up. The tiny model's text is random: its tests
check shapes, counts and identities, at temperature 0 where the text must repeat.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import trio
from openai.types.responses import Response

from forged import errors as e
from forged.auth import add_key
from forged.config import ResponsesConfig
from forged.engine import testhooks
from forged.http.oairesponses import Answered, Called, Said, input_items, messages
from forged.http.oaistore import ResponseStore, Stored
from tests.conftest import DaemonFactory
from tests.daemonproc import DaemonProcess, free_port, serve, write_config
from tests.test_api import until
from tests.tinymodel import write_tiny_llama

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 20}},
               "required": ["city"], "additionalProperties": False}}
SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
         "additionalProperties": False}
MAX_STORED = 4


# --- units ------------------------------------------------------------------------------


def _stored(n: int, key: str = "alice", at: float = 0.0) -> Stored:
    return Stored(f"resp_{n}", key, at, {"id": f"resp_{n}"}, (), None)


def test_the_store_keeps_the_newest_for_their_retention_and_only_for_their_key() -> None:
    cfg = ResponsesConfig(max_stored=3, retention=60.0)
    store = ResponseStore()
    for n in range(4):
        store.put(_stored(n, at=float(n)), cfg)
    assert len(store) == 3 and store.get("resp_0", "alice", cfg, 4.0) is None
    assert store.get("resp_1", "alice", cfg, 4.0) is not None
    assert store.get("resp_1", "bob", cfg, 4.0) is None  # another key: not there
    assert not store.delete("resp_1", "bob", cfg, 4.0)
    assert store.delete("resp_1", "alice", cfg, 4.0)
    assert store.get("resp_1", "alice", cfg, 4.0) is None
    # resp_2 was stored at 2 s: kept at 62 s, gone after, and resp_3 a second later
    assert store.get("resp_2", "alice", cfg, 62.0) is not None
    assert store.get("resp_2", "alice", cfg, 62.5) is None
    assert store.get("resp_3", "alice", cfg, 63.5) is None and len(store) == 0


def test_a_key_storing_many_evicts_its_own_not_another_keys() -> None:
    cfg = ResponsesConfig(max_stored=3, retention=60.0)
    store = ResponseStore()
    store.put(_stored(0, "bob"), cfg)  # bob's conversation, then alice's batch
    for n in range(1, 6):
        store.put(_stored(n, "alice", at=float(n)), cfg)
    assert store.get("resp_0", "bob", cfg, 6.0) is not None
    assert [store.get(f"resp_{n}", "alice", cfg, 6.0) is not None for n in range(1, 6)] \
        == [False, False, False, True, True]
    # Even shares: the oldest of theirs goes.
    store.put(_stored(6, "bob", at=6.0), cfg)
    assert store.get("resp_0", "bob", cfg, 6.0) is None and len(store) == 3
    assert store.get("resp_4", "alice", cfg, 6.0) is not None


def test_the_last_response_of_a_session_gone_releases_it() -> None:
    """Deleting, evicting or expiring a stored response left its conversation's KV
    pinned until limits.session_ttl; the store says when no response holds a session
    (a conversation's turns share one), so that it is unpinned."""
    released: list[tuple[str, str]] = []
    cfg = ResponsesConfig(max_stored=3, retention=60.0)
    store = ResponseStore(released=lambda key, session: released.append((key, session)))

    def put(n: int, session: str | None, at: float = 0.0) -> None:
        store.put(Stored(f"resp_{n}", "alice", at, {}, (), session), cfg)

    put(0, "s0")
    put(1, "s0")  # a follow-up: the same session
    put(2, None)  # store false... or a response without a session
    assert store.delete("resp_0", "alice", cfg, 1.0) and released == []
    assert store.delete("resp_1", "alice", cfg, 1.0)
    assert released == [("alice", "s0")]
    put(3, "s3", 2.0)
    put(4, "s4", 3.0)
    put(5, "s5", 4.0)  # past max_stored: resp_2 goes, then resp_3
    put(6, "s6", 5.0)
    assert released == [("alice", "s0"), ("alice", "s3")]
    assert store.get("resp_6", "alice", cfg, 63.5) is not None  # resp_4 expired
    assert released == [("alice", "s0"), ("alice", "s3"), ("alice", "s4")]


def test_input_items_become_chat_turns() -> None:
    items = input_items([
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text",
                                                                  "text": "in Oslo?"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Looking.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"a\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ])
    assert items[:2] == [Said("developer", "Be brief."), Said("user", "Weather \nin Oslo?")]
    assert items[3:] == [Called("c1", "f", "{}"), Called("c2", "g", "{\"a\": 1}"),
                         Answered("c1", "sunny")]
    chat = messages("Answer in French.", items)
    assert [m.role for m in chat] == ["system", "developer", "user", "assistant", "tool"]
    # the text and both calls are one assistant turn, as the model wrote them
    assert chat[3].content == "Looking."
    assert [c["function"]["name"] for c in chat[3].tool_calls or []] == ["f", "g"]
    assert chat[4].tool_call_id == "c1" and chat[4].content == "sunny"


@pytest.mark.parametrize(("item", "param"), [
    ({"role": "user", "content": [{"type": "input_image", "image_url": "x"}]},
     "input[0].content[0].type"),
    ({"type": "reasoning", "summary": []}, "input[0].type"),
    ({"role": "user", "content": "hi", "colour": "red"}, "input[0].colour"),
    ({"type": "function_call", "call_id": "c", "name": "f"}, "input[0].arguments"),
    ({"role": "tool", "content": "x"}, "input[0].role"),
    # Stored with the conversation, not always in its prompt: bounded as OpenAI's are.
    ({"type": "function_call", "call_id": "c" * 65, "name": "f", "arguments": "{}"},
     "input[0].call_id"),
    ({"type": "function_call_output", "call_id": "c" * 65, "output": "4"},
     "input[0].call_id"),
])
def test_an_input_item_forged_cannot_read_is_named(item: dict[str, Any], param: str) -> None:
    with pytest.raises(e.BadRequest) as info:
        input_items([item])
    assert info.value.param == param


# --- the daemon -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess,
                                                                      dict[str, str]]]:
    tmp = tmp_path_factory.mktemp("responses")
    keys = {name: add_key(tmp / "keys.toml", name, max_streams=8, max_queued=16,
                          priority="interactive") for name in ("alice", "bob")}
    port = free_port()
    cfg = write_config(tmp / "forged.toml", write_tiny_llama(tmp / "tiny.gguf", tools=True),
                       port, engine={"kv_cells": 8192, "kv_layout": "unified",
                                     "max_context": 2048, "slots": 8, "max_running": 8},
                       responses={"max_stored": MAX_STORED})
    for d in serve(cfg, port):
        yield d, keys


_CLIENTS: dict[str, openai.OpenAI] = {}


def _client(tiny: tuple[DaemonProcess, dict[str, str]], key: str = "alice") -> openai.OpenAI:
    d, keys = tiny
    name = f"{d.url} {key}"
    if name not in _CLIENTS:
        _CLIENTS[name] = openai.OpenAI(base_url=d.url + "/v1", api_key=keys.get(key, key),
                                       max_retries=0, timeout=300)
    return _CLIENTS[name]


@pytest.fixture(scope="module", autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    for c in _CLIENTS.values():
        c.close()
    _CLIENTS.clear()


def _text_of(r: Response) -> str:
    """The text of the message items, read from the items themselves."""
    return "".join(part.text for item in r.output if item.type == "message"
                   for part in item.content if part.type == "output_text")


def test_a_text_input_gets_a_whole_response(tiny: Any) -> None:
    r = _client(tiny).responses.create(input="Hello there", max_output_tokens=6,
                                       temperature=0, metadata={"case": "text"})
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.status in ("completed", "incomplete") and r.metadata == {"case": "text"}
    assert r.output and r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.output_text == _text_of(r) and r.output_text
    u = r.usage
    assert u is not None and 0 < u.output_tokens <= 6 and u.input_tokens > 0
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert u.input_tokens_details.cached_tokens <= u.input_tokens


def test_max_output_tokens_makes_it_incomplete_whole_and_streamed(tiny: Any) -> None:
    c = _client(tiny)
    r = c.responses.create(input="Count", max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 3
    events = list(c.responses.create(input="Count", max_output_tokens=3, temperature=0,
                                     stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == r.output_text  # greedy: the same text


def test_items_and_instructions(tiny: Any) -> None:
    c = _client(tiny)
    bare = c.responses.create(input="Hi", max_output_tokens=2, temperature=0)
    r = c.responses.create(
        instructions="You answer in one word.", max_output_tokens=4, temperature=0,
        input=[{"role": "system", "content": "Be kind."},
               {"role": "user", "content": "Hi"},
               {"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": "Hello!"}]},
               {"role": "developer", "content": [{"type": "input_text", "text": "Short."}]},
               {"role": "user", "content": [{"type": "input_text", "text": "And now?"}]}])
    assert r.instructions == "You answer in one word." and r.output_text
    assert r.usage is not None and bare.usage is not None
    assert r.usage.input_tokens > bare.usage.input_tokens + 10


def _stream_events(c: openai.OpenAI, **kw: Any) -> list[Any]:
    with c.responses.create(stream=True, **kw) as stream:
        return list(stream)


def test_a_stream_has_the_responses_events_in_order(tiny: Any) -> None:
    c = _client(tiny)
    events = _stream_events(c, input="Hello there", max_output_tokens=5, temperature=0)
    assert [ev.sequence_number for ev in events] == list(range(len(events)))
    types = [ev.type for ev in events]
    deltas = types.count("response.output_text.delta")
    assert types == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added",
                     *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.incomplete"]
    final = events[-1].response
    text = "".join(ev.delta for ev in events if ev.type == "response.output_text.delta")
    assert text == final.output_text == events[-4].text
    assert events[2].item.id == final.output[0].id == events[4].item_id
    assert final.usage.output_tokens == 5
    whole = c.responses.create(input="Hello there", max_output_tokens=5, temperature=0)
    assert whole.output_text == text


def test_a_json_schema_answer_streams_to_completion_through_the_sdk_helper(tiny: Any) -> None:
    c = _client(tiny)
    fmt = {"type": "json_schema", "name": "ok", "schema": SMALL, "strict": True}
    with c.responses.stream(model=_model(tiny), input="JSON please", text={"format": fmt},
                            max_output_tokens=60) as stream:
        final = stream.get_final_response()  # needs response.completed
    assert final.status == "completed" and final.text is not None
    jsonschema.validate(json.loads(final.output_text), SMALL)
    # Any object: the random model may not close it in 20 tokens, but it opens one.
    obj = c.responses.create(input="JSON please", text={"format": {"type": "json_object"}},
                             max_output_tokens=20, temperature=0)
    assert obj.output_text.lstrip().startswith("{")


def _model(tiny: Any) -> str:
    return str(_client(tiny).models.list().data[0].id)


def test_a_function_call_and_its_output(tiny: Any) -> None:
    """The tiny template renders tools; ``required`` makes the random model call."""
    c = _client(tiny)
    r = c.responses.create(input="Weather in Oslo?", tools=[WEATHER],  # type: ignore[list-item]
                           tool_choice="required", parallel_tool_calls=False,
                           max_output_tokens=400)
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert calls[0].call_id.startswith("call_") and r.status == "completed"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    # the whole conversation sent back as items, the SDK's own output objects among them
    after = c.responses.create(
        input=[{"role": "user", "content": "Weather in Oslo?"}, *r.output,  # type: ignore[list-item]
               {"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "12 degrees"}],
        tools=[WEATHER], tool_choice="none", max_output_tokens=4)  # type: ignore[list-item]
    assert after.usage is not None and r.usage is not None
    assert after.usage.input_tokens > r.usage.input_tokens
    assert all(item.type == "message" for item in after.output)


def test_a_streamed_function_call(tiny: Any) -> None:
    events = _stream_events(_client(tiny), input="Weather?", tools=[WEATHER],
                            tool_choice={"type": "function", "name": "get_weather"},
                            parallel_tool_calls=False, max_output_tokens=400)
    types = [ev.type for ev in events]
    assert types[-5:] == ["response.output_item.added",
                          "response.function_call_arguments.delta",
                          "response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    done = events[-2].item
    assert done.type == "function_call" and done.name == "get_weather"
    assert done.arguments == events[-3].arguments == events[-4].delta
    assert events[-1].response.output[-1].call_id == done.call_id


def test_a_follow_up_computes_only_its_new_tokens(tiny: Any) -> None:
    c = _client(tiny)
    first = c.responses.create(input="Tell me a story", max_output_tokens=8, temperature=0)
    second = c.responses.create(input="Go on", previous_response_id=first.id,
                                max_output_tokens=8, temperature=0)
    assert first.usage is not None and second.usage is not None
    # the earlier turn (its prompt and answer) is in the prompt, and was not recomputed
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert second.previous_response_id == first.id
    # the same conversation sent whole gives the same prompt
    again = c.responses.create(
        input=[{"role": "user", "content": "Tell me a story"},
               {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "Go on"}], max_output_tokens=1, store=False)
    assert again.usage is not None and again.usage.input_tokens == second.usage.input_tokens


def test_store_false_and_another_key_cannot_follow_up(tiny: Any) -> None:
    alice, bob = _client(tiny), _client(tiny, "bob")
    unstored = alice.responses.create(input="Hi", max_output_tokens=1, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError) as info:
        alice.responses.create(input="More", previous_response_id=unstored.id,
                               max_output_tokens=1)
    assert info.value.body["param"] == "previous_response_id"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(unstored.id)
    kept = alice.responses.create(input="Hi", max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        bob.responses.create(input="More", previous_response_id=kept.id, max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        bob.responses.delete(kept.id)
    assert alice.responses.retrieve(kept.id).id == kept.id


def test_get_and_delete(tiny: Any) -> None:
    c = _client(tiny)
    r = c.responses.create(input="Hi", max_output_tokens=2, metadata={"k": "v"})
    got = c.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    c.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as info:
        c.responses.retrieve(r.id)
    assert r.id in str(info.value)
    with pytest.raises(openai.NotFoundError):
        c.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve("resp_unknown")


@pytest.mark.parametrize(("query", "param"), [
    ({"stream": True}, "stream"), ({"starting_after": 3}, "starting_after"),
    ({"include": ["message.output_text.logprobs"]}, "include[0]")])
def test_a_retrieve_asking_for_what_forged_does_not_do_is_a_400(
        tiny: Any, query: dict[str, Any], param: str) -> None:
    """The query was never read: ?stream=true was answered with the JSON body, which
    the SDK's stream read as no events at all."""
    c = _client(tiny)
    r = c.responses.create(input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        c.responses.retrieve(r.id, **query)
    assert info.value.body["param"] == param  # type: ignore[index]
    asks_nothing = c.responses.retrieve(r.id, stream=False, include=[
        "reasoning.encrypted_content"])
    assert asks_nothing.id == r.id


def test_input_items_list_the_whole_context_in_pages(tiny: Any) -> None:
    c, bob = _client(tiny), _client(tiny, "bob")
    first = c.responses.create(input="Tell me a story", instructions="Be brief",
                               max_output_tokens=4, temperature=0)
    second = c.responses.create(input=[
        {"role": "user", "content": "Go on"},
        {"type": "function_call_output", "call_id": "call_1", "output": "42"}],
        previous_response_id=first.id, max_output_tokens=4, temperature=0)
    listed = c.responses.input_items.list(second.id, order="asc")
    kinds = [(i.type, getattr(i, "role", None)) for i in listed.data]
    # what its prompt was made of: the first turn, its answer, then its own input
    assert kinds == [("message", "user"), ("message", "assistant"), ("message", "user"),
                     ("function_call_output", None)]
    assert listed.data[0].content[0].text == "Tell me a story"  # type: ignore[union-attr]
    assert listed.data[1].content[0].text == first.output_text  # type: ignore[union-attr]
    assert listed.data[3].output == "42"  # type: ignore[union-attr]
    newest_first = c.responses.input_items.list(second.id)  # OpenAI's default: desc
    assert [i.id for i in newest_first.data] == [i.id for i in reversed(listed.data)]
    page = c.responses.input_items.list(second.id, order="asc", limit=3)
    assert page.has_more and [i.id for i in page.data] == [i.id for i in listed.data[:3]]
    rest = c.responses.input_items.list(second.id, order="asc", after=page.data[-1].id)
    assert [i.id for i in rest.data] == [listed.data[3].id] and not rest.has_more
    assert [i.id for i in c.responses.input_items.list(second.id, order="asc")] == \
        [i.id for i in listed.data]  # the SDK's auto-pagination
    with pytest.raises(openai.NotFoundError):
        bob.responses.input_items.list(second.id)
    with pytest.raises(openai.BadRequestError) as info:
        c.responses.input_items.list(second.id, limit=0)
    assert info.value.body["param"] == "limit"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        c.responses.input_items.list(second.id, include=["message.input_image.image_url"])
    assert info.value.body["param"] == "include"  # type: ignore[index]


def test_stored_responses_are_bounded(tiny: Any) -> None:
    c = _client(tiny)
    made = [c.responses.create(input=f"Hi {i}", max_output_tokens=1).id
            for i in range(MAX_STORED + 1)]
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(made[0])
    assert [c.responses.retrieve(i).id for i in made[1:]] == made[1:]


def test_errors_are_the_sdks_exceptions(tiny: Any) -> None:
    with pytest.raises(openai.AuthenticationError):
        _client(tiny, "sk-forged-wrong").responses.create(input="Hi", max_output_tokens=1)
    c = _client(tiny)
    with pytest.raises(openai.NotFoundError) as info:
        c.responses.create(model="nope", input="Hi", max_output_tokens=1)
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        c.responses.create(input="word " * 3000, max_output_tokens=1)
    assert info.value.code == "context_length_exceeded"
    assert info.value.body["param"] == "input"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        c.responses.create(input="Hi", max_output_tokens=1, extra_body={"seed": 3})
    assert info.value.body["param"] == "seed"  # type: ignore[index]
    # a map's key or value: the map (param was null, or `metadata[...]`)
    for metadata in ({"k" * 65: "v"}, {"k": "v" * 513}):
        with pytest.raises(openai.BadRequestError) as info:
            c.responses.create(input="Hi", max_output_tokens=1, metadata=metadata)
        assert info.value.body["param"] == "metadata"  # type: ignore[index]


@pytest.mark.parametrize(("fields", "param"), [
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0].type"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["message.output_text.logprobs"]}, "include[0]"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"text": {"format": {"type": "text"}, "verbosity": "low"}}, "text.verbosity"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice.type"),
    ({"tools": [{**WEATHER, "parameters": {"type": "object", "properties": {
        "n": {"type": "integer", "multipleOf": 2}}}}]},
     "tools[0].parameters.properties.n.multipleOf"),
    ({"text": {"format": {"type": "json_schema", "schema": SMALL}}}, "text.format.name"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"include": "reasoning.encrypted_content"}, "include"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    # Echoed by every stored response and never in its prompt: bounded.
    ({"user": "u" * 257}, "user"),
    ({"safety_identifier": "s" * 257}, "safety_identifier"),
    ({"text": {"format": {"type": "json_schema", "name": "n", "schema": SMALL,
                          "description": "d" * 65537}}}, "text.format.description"),
])
def test_what_forged_cannot_honour_is_a_400_naming_it(tiny: Any, fields: dict[str, Any],
                                                      param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _client(tiny).responses.create(input="Hi", extra_body=fields)
    assert info.value.body["param"] == param  # type: ignore[index]


def test_values_that_ask_for_nothing_are_accepted(tiny: Any) -> None:
    r = _client(tiny).responses.create(
        input="Hi", max_output_tokens=1, background=False, truncation="disabled",
        include=[], reasoning={"effort": None}, service_tier="auto", top_logprobs=0,
        prompt_cache_key="conv-7", user="u", safety_identifier="s",
        text={"format": {"type": "text"}}, store=False)
    assert r.status == "incomplete" and r.prompt_cache_key == "conv-7"


def test_codexs_client_metadata_is_accepted(tiny: Any) -> None:
    """Codex sends client_metadata on every request; it was a 400 (unknown field), so
    no Codex turn was answered."""
    turn = json.dumps({"session_id": "0199", "workspaces": {"/w": {"has_changes": True}},
                       "sandbox": "workspace-write", "request_kind": "turn"} | {
        "pad": "x" * 600})
    r = _client(tiny).responses.create(
        input="Hi", max_output_tokens=1, store=False, extra_body={"client_metadata": {
            "session_id": "0199", "thread_id": "0199", "x-codex-window-id": "w1",
            "x-codex-turn-metadata": turn}})
    assert r.status == "incomplete"


# --- the same prompt, the same greedy answer ---------------------------------------------


async def test_greedy_text_is_the_same_as_on_chat(tiny_model: Path,
                                                  start_daemon: DaemonFactory) -> None:
    """A fresh daemon: chat computes the prompt afresh and drops its KV
    (``cache_prompt: false``), so both answers come from the same computation."""
    with trio.fail_after(120):
        async with start_daemon(tiny_model) as d:
            def both() -> tuple[str, str]:
                with openai.OpenAI(base_url=d.url + "/v1", api_key="none",
                                   max_retries=0) as c:
                    chat = c.chat.completions.create(
                        model=c.models.list().data[0].id, max_tokens=12,
                        messages=[{"role": "user", "content": "Say a thing"}],
                        temperature=0, extra_body={"cache_prompt": False})
                    resp = c.responses.create(input="Say a thing", max_output_tokens=12,
                                              temperature=0, store=False)
                return chat.choices[0].message.content or "", resp.output_text

            chat, resp = await trio.to_thread.run_sync(both)
            assert chat and chat == resp


async def test_deleting_a_stored_response_unpins_its_conversation(
        tiny_model: Path, start_daemon: DaemonFactory) -> None:
    """A stored response's conversation keeps its KV pinned for its follow-ups; once
    the last response of it is deleted no follow-up can come, and the slot is an
    ordinary cache again (it stayed pinned for limits.session_ttl, ten minutes)."""
    body = {"input": "Hi", "max_output_tokens": 2}
    with trio.fail_after(60):
        async with start_daemon(tiny_model) as d, httpx.AsyncClient(base_url=d.url) as c:
            first = (await c.post("/v1/responses", json=body)).json()["id"]
            second = (await c.post("/v1/responses", json={
                **body, "previous_response_id": first})).json()["id"]
            await c.post("/v1/responses", json={**body, "prompt_cache_key": "mine"})
            await until(lambda: d.stats().sessions_pinned == 2)
            # The follow-up holds the conversation still (the store's unit test counts
            # that); deleting it too unpins it.
            assert (await c.delete(f"/v1/responses/{first}")).status_code == 200
            assert (await c.delete(f"/v1/responses/{second}")).status_code == 200
            # prompt_cache_key's session is the caller's: it stays pinned
            await until(lambda: d.stats().sessions_pinned == 1)


async def test_a_stream_cut_by_a_lost_worker_ends_with_response_failed(
        tiny_model: Path, start_daemon: DaemonFactory) -> None:
    """The frames are SSE with an event name; the worker dies mid-answer (the greedy
    random model does not end on its own in 2000 tokens), and the last frame is a
    response.failed carrying the error; nothing is stored."""
    with trio.fail_after(60):
        async with start_daemon(tiny_model) as d, httpx.AsyncClient(base_url=d.url,
                                                                    timeout=30) as c:
            testhooks.slow_steps(d.daemon.pool, 0, 0.01)
            pid, body = d.daemon.pool.workers[0].pid, ""
            assert pid is not None
            async with c.stream("POST", "/v1/responses", json={
                    "input": "Go on", "max_output_tokens": 2000, "temperature": 0,
                    "stream": True}) as r:
                async for text in r.aiter_text():
                    if body.count("\n\n") < 8 <= (body + text).count("\n\n"):
                        os.kill(pid, signal.SIGKILL)  # a few deltas in
                    body += text
            failed = _events(body)[-1]
            assert failed["type"] == "response.failed", body[-500:]
            assert failed["response"]["status"] == "failed"
            assert failed["response"]["error"]["code"] == "server_error"
            assert "worker" in failed["response"]["error"]["message"]
            gone = await c.get(f"/v1/responses/{failed['response']['id']}")
            assert gone.status_code == 404


def _events(body: str) -> list[dict[str, Any]]:
    """SSE frames, each an event's name and its data, the name the data's type."""
    events = []
    for frame in filter(None, body.split("\n\n")):
        name, data = frame.split("\n")
        events.append(json.loads(data.removeprefix("data: ")))
        assert name == "event: " + events[-1]["type"]
    return events


# --- SmolLM2 ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol(real_model: Path, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[DaemonProcess]:
    tmp = tmp_path_factory.mktemp("smol-responses")
    port = free_port()
    yield from serve(write_config(tmp / "forged.toml", real_model, port, engine={
        "kv_cells": 8192, "slots": 4, "max_running": 4}), port)


@pytest.mark.model
def test_a_function_call_and_its_follow_up_smollm2(smol: DaemonProcess) -> None:
    with openai.OpenAI(base_url=smol.url + "/v1", api_key="none", max_retries=0,
                       timeout=600) as c:
        tools: Any = [WEATHER]
        first = c.responses.create(input="What is the weather in Paris?", tools=tools,
                                   tool_choice="required", max_output_tokens=60,
                                   temperature=0)
        calls = [item for item in first.output if item.type == "function_call"]
        assert calls and calls[0].name == "get_weather"
        jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
        answer = c.responses.create(
            previous_response_id=first.id, tools=tools, tool_choice="none",
            input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                    "output": '{"temperature": "21 C", "sky": "clear"}'}],
            max_output_tokens=24, temperature=0)
        assert answer.output_text and answer.output[0].type == "message"
        assert first.usage is not None and answer.usage is not None
        assert answer.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


def test_the_api_is_served_with_the_openai_error_shape(tiny: Any) -> None:
    d, keys = tiny
    r = httpx.post(d.url + "/v1/responses", json={"input": "x", "nope": 1},
                   headers={"Authorization": f"Bearer {keys['alice']}"}, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "nope"
    assert err["type"] == "invalid_request_error" and err["code"] == "unsupported_field"
