"""Hostile and careless input (issue 30): each is a 4xx that names what was wrong, and
costs nobody else anything: no worker restarts, the daemon stays up, the event loop
is never held for long, and a key at its limit is refused before any work is done.

The daemon runs in its own process where a crash is what the test looks for (a
SIGSEGV there must not take pytest down with it), and in-process where the test
watches the event loop itself."""

from __future__ import annotations

import json
import re
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from forged import errors as e
from forged.auth import add_key
from forged.engine.grammar import MAX_REPETITION, gbnf_depth, schema_grammar
from forged.http.keylimits import KeyUsage
from forged.http.tools import _parse_call, parse_arguments, plan_tools
from tests.conftest import DaemonFactory, RunningDaemon
from tests.daemonproc import DaemonProcess, free_port, serve_model, write_config
from tests.test_models import as_toml
from tests.test_security import worker_restarts
from tests.tinymodel import write_tiny_llama


def _schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def _deep(n: int) -> str:
    return "[" * n + "]" * n


def _chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


def _called(arguments: str) -> dict[str, Any]:
    """A chat whose assistant turn called a tool with these arguments."""
    return {"messages": [{"role": "user", "content": "hi"}, {
        "role": "assistant", "content": None, "tool_calls": [{
            "id": "c1", "type": "function",
            "function": {"name": "f", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}], "max_tokens": 2}


# What json.loads takes and the prompt cannot carry: ValueError (over 4,300 digits) and a
# lone surrogate that failed when the template's text was encoded. Both were 500s.
HUGE_INT_ARGS = '{"n": ' + "9" * 5000 + "}"
SURROGATE_ARGS = '{"a": "\\ud800"}'

# (what is sent, the field the 400 names)
BOMBS: list[tuple[dict[str, Any], str]] = [
    # The daemon died with SIGSEGV: llama.cpp's parser recursed 200,000 levels deep.
    (_chat(response_format=_schema_format({"type": "string", "maxLength": 200000})),
     "response_format.json_schema.schema.maxLength"),
    # A request frame over the worker's 64 MiB limit killed three workers in a row.
    (_chat(response_format=_schema_format({"type": "array", "items": {"type": "integer"},
                                          "minItems": 4000000})),
     "response_format.json_schema.schema.minItems"),
    (_chat(json_schema={"type": "string", "pattern": "^a{100000}$"}), "json_schema.pattern"),
    # llama.cpp's own GBNF, nested deeper than its parser's recursion can take.
    (_chat(grammar="root ::= " + "(" * 50000 + '"a"' + ")" * 50000), "grammar"),
    # "²".isdigit() is true and int("²") raises: a 500.
    (_chat(logit_bias={"²": 1}), "logit_bias"),
    # json.loads recursed past Python's limit: a 500.
    (_called(_deep(1001)), "messages[1].tool_calls[0].function.arguments"),
    (_called(HUGE_INT_ARGS), "messages[1].tool_calls[0].function.arguments"),
]


@pytest.fixture(scope="module")
def tiny_daemon(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path
                ) -> Iterator[DaemonProcess]:
    yield from serve_model(tiny_model, tmp_path_factory.mktemp("hostile"))


@pytest.mark.parametrize(("body", "param"), BOMBS, ids=[p for _, p in BOMBS])
def test_a_hostile_body_is_a_400_naming_its_field_and_costs_no_worker(
        tiny_daemon: DaemonProcess, body: dict[str, Any], param: str) -> None:
    before = worker_restarts(tiny_daemon)
    with httpx.Client(base_url=tiny_daemon.url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
        assert c.get("/health").status_code == 200
        ok = c.post("/v1/chat/completions", json=_chat())
        assert ok.status_code == 200, ok.text
    assert tiny_daemon.proc.poll() is None
    assert worker_restarts(tiny_daemon) == before


# --- the grammar's bounds, without a daemon ------------------------------------------------


@pytest.mark.parametrize("keyword", ["minLength", "maxLength", "minItems", "maxItems"])
@pytest.mark.parametrize("count", [10**5, 10**7, 10**9])
def test_every_repetition_keyword_is_bounded(keyword: str, count: int) -> None:
    kind = "string" if keyword.endswith("Length") else "array"
    with pytest.raises(e.BadRequest) as caught:
        schema_grammar({"type": kind, keyword: count}, "s")
    assert caught.value.param == f"s.{keyword}"


def test_the_largest_allowed_repetition_converts_within_the_depth_bound() -> None:
    """The caps fit each other: the longest string the schema may ask for gives a
    grammar the parser can read (llama.cpp accepts it: test_structured's checks)."""
    g = schema_grammar({"type": "string", "maxLength": MAX_REPETITION}, "s")
    assert gbnf_depth(g.gbnf) >= MAX_REPETITION // 2


def test_the_depth_scan_skips_literals_classes_and_comments() -> None:
    assert gbnf_depth('root ::= ("(" [(] # ((\n ("a"))') == 2


def test_deep_tool_call_arguments_are_a_400() -> None:
    assert parse_arguments(_deep(64), "p") == json.loads(_deep(64))  # within the bound
    with pytest.raises(e.BadRequest) as caught:
        parse_arguments(_deep(1001), "p")
    assert caught.value.param == "p"


@pytest.mark.parametrize("arguments", [HUGE_INT_ARGS, SURROGATE_ARGS],
                         ids=["digits", "surrogate"])
def test_tool_call_arguments_only_python_reads_are_a_400(arguments: str) -> None:
    with pytest.raises(e.BadRequest) as caught:
        parse_arguments(arguments, "p")
    assert caught.value.param == "p"


async def test_tool_call_arguments_are_a_400_where_the_template_renders_tools(
        tmp_path: Path, start_daemon: DaemonFactory) -> None:
    """On a model whose template writes the calls (the surrogate failed only there),
    on chat and as a /v1/responses function_call item."""
    where = "messages[1].tool_calls[0].function.arguments"
    item = {"type": "function_call", "call_id": "c1", "name": "f"}
    with trio.fail_after(60):
        async with start_daemon(write_tiny_llama(tmp_path / "t.gguf", tools=True)) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            for arguments in (HUGE_INT_ARGS, SURROGATE_ARGS):
                r = await c.post("/v1/chat/completions", json=_called(arguments))
                assert (r.status_code, r.json()["error"]["param"]) == (400, where), r.text
                r = await c.post("/v1/responses", json={"input": [
                    {"role": "user", "content": "hi"}, {**item, "arguments": arguments}],
                    "max_output_tokens": 2})
                assert r.status_code == 400, r.text


async def test_an_unexpected_exception_is_a_500_of_type_server_error(
        tiny_model: Path, start_daemon: DaemonFactory, monkeypatch: pytest.MonkeyPatch
        ) -> None:
    """It was a 500 of type invalid_request_error: OpenAI's clients read that as the
    caller's fault."""
    def broken(*_: Any, **__: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr("forged.http.chat.message_dict", broken)
    with trio.fail_after(60):
        async with start_daemon(tiny_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            r = await c.post("/v1/chat/completions", json=_chat())
    assert r.status_code == 500, r.text
    assert r.json()["error"]["type"] == "server_error"


def _tool(parameters: Any) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


@pytest.mark.parametrize("pattern", ["^a{,5000}$", "^a{ 5000}$", "^a{1, 5000}$",
                                     "^\\\\{5000}$", "^a{0,1000000}$"])
def test_every_spelling_of_a_pattern_repetition_is_bounded(pattern: str) -> None:
    """The converter reads ``{,m}``, ``{ n}``, ``{n, m}`` and a quantifier after an
    escaped backslash; the bound did not, and a tool's grammar was never checked:
    ``^a{,1000000}$`` in a tool's parameters crashed the daemon in llama.cpp's parser."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}},
              "required": ["s"]}
    for build in (lambda: schema_grammar(schema, "s"),
                  lambda: plan_tools(_tool(schema), "auto", None)):
        with pytest.raises(e.BadRequest):
            build()


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": []}, {"type": "object", "properties": "abc"},
    {"$ref": 5}, {"allOf": [{"$ref": 5}]}, {"anyOf": "ab"}, {"prefixItems": "x"},
    {"type": "object", "allOf": "x"}, {"type": "string", "format": ["x"]},
    {"format": {}}, {"type": "object", "required": "a"}, {"type": 5},
    {"type": "object", "properties": {"a": {}}, "required": ["b"]},
    {"type": "object", "properties": {"": {"type": "integer"}}},
])
def test_a_malformed_schema_is_a_400(schema: dict[str, Any]) -> None:
    with pytest.raises(e.BadRequest):
        schema_grammar(schema, "s")
    with pytest.raises(e.BadRequest):
        plan_tools(_tool({"type": "object", "properties": {"x": schema}}), "auto", None)


@pytest.mark.parametrize("parameters", [{"type": "string"}, {"type": "string",
                                                             "maxLength": 5}, True, []])
def test_a_tool_whose_parameters_are_not_an_object_is_a_400(parameters: Any) -> None:
    """The call's arguments are an object: a string schema made the model write
    ``"arguments": "abc"``, which the dialects then failed to read (a 500)."""
    with pytest.raises(e.BadRequest) as caught:
        plan_tools(_tool(parameters), "required", None)
    assert caught.value.param is not None and "parameters" in caught.value.param


def test_a_tool_choice_whose_function_is_not_an_object_is_a_400() -> None:
    with pytest.raises(e.BadRequest):
        plan_tools(_tool({"type": "object"}), {"type": "function", "function": "f"}, None)


def test_a_call_whose_arguments_are_not_an_object_is_no_call() -> None:
    assert _parse_call('{"name": "f", "arguments": "abc"}') is None
    call = _parse_call('{"name": "f", "arguments": {"x": "é", "n": 1e400}}')
    assert call is None or json.loads(call.arguments, parse_constant=_no_constant)


def _no_constant(name: str) -> None:
    raise AssertionError(f"{name} is not JSON")


@pytest.mark.parametrize("pattern", ["^(a{0,1000}){0,1000}$", "^(a?){0,50}$",
                                     "^(a*){0,50}$", "^(a{1,30}){0,30}$", "^a]$", "^}$",
                                     "^[^\\\\]]{2,8}$"])
def test_a_pattern_whose_grammar_follows_too_many_parses_is_a_400(pattern: str) -> None:
    """Every count within the bound, the grammar small: but llama.cpp keeps one parse
    per way of matching, at every token. (a{0,1000}){0,1000} hung the worker in its
    first tokens (the heartbeat then killed it and everything it held). And a stray ]
    or } sent llama-cpp-python's converter into a loop that never ended, in one of the
    door's threads (a few such requests took them all)."""
    with pytest.raises(e.BadRequest) as caught:
        schema_grammar({"type": "string", "pattern": pattern}, "s")
    assert caught.value.param == "s.pattern"


@pytest.mark.parametrize("pattern", ["^([a-z]+ ){0,50}$", "^(a+){0,50}$",
                                     "^(\\\\d{1,3}\\\\.){3}\\\\d{1,3}$", "^(a?){20}$",
                                     "^(ab|cd){0,10}$", "^[^\\]\\]]{2,8}$"])
def test_a_pattern_with_few_parses_is_accepted(pattern: str) -> None:
    assert schema_grammar({"type": "string", "pattern": pattern}, "s").gbnf


# --- a door that never blocks -------------------------------------------------------------


class LongestStep(trio.abc.Instrument):
    """The longest time the event loop spent in one step of one task."""

    def __init__(self) -> None:
        self.longest = (0.0, "")
        self._t0: float | None = None  # None: the step under way when it was added

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._t0 = time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self._t0 is not None:
            self.longest = max(self.longest, (time.perf_counter() - self._t0, task.name))


async def test_large_tokenize_floods_never_hold_the_event_loop(
        tiny_model: Path, start_daemon: DaemonFactory) -> None:
    """Large contents with pieces, several at once: the tokens, their pieces and the
    answer's JSON are made in the door's threads. On the loop, 1 MB took seconds per
    request, during which no stream moved and /health waited (issue 30: 18 s)."""
    content = "def f(x):\n    return x + 1\n" * (256 * 1024 // 28)
    body = json.dumps({"content": content, "with_pieces": True}).encode()
    watch = LongestStep()
    with trio.fail_after(120):
        async with start_daemon(tiny_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=100) as c:

            async def flood() -> None:
                # Read, not parsed: parsing 20 MB of JSON here would be this task's
                # long step, not the daemon's.
                async with c.stream("POST", "/tokenize", content=body) as r:
                    assert r.status_code == 200
                    async for _ in r.aiter_raw():
                        pass

            trio.lowlevel.add_instrument(watch)
            try:
                async with trio.open_nursery() as n:
                    for _ in range(4):
                        n.start_soon(flood)
            finally:
                trio.lowlevel.remove_instrument(watch)
    assert watch.longest[0] < 0.1, watch.longest


# --- per-key limits -----------------------------------------------------------------------


async def test_max_queued_zero_runs_with_free_slots(
        tiny_model: Path, start_daemon: DaemonFactory, tmp_path: Path) -> None:
    """max_queued = 0 means "never wait for a slot", not "never run": the request's own
    wait for admission counted as queued, so every request got a 429."""
    key = add_key(tmp_path / "keys.toml", "eager", max_streams=2, max_queued=0,
                  priority="interactive")
    with trio.fail_after(60):
        async with start_daemon(tiny_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2},
                             headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text


async def test_a_batch_key_cannot_ask_for_interactive(
        tiny_model: Path, start_daemon: DaemonFactory, tmp_path: Path) -> None:
    """A key's priority is a ceiling: a batch key that sends "priority": "interactive"
    is still served (and counted) as batch."""
    key = add_key(tmp_path / "keys.toml", "nightly", max_streams=2, max_queued=2,
                  priority="batch")
    with trio.fail_after(60):
        async with start_daemon(tiny_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c, \
                httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=d.admin_sock),
                                  base_url="http://admin", timeout=30) as admin:
            for path, body in (("/v1/completions", {"prompt": "x"}), ("/infill", {
                    "input_prefix": "def f(", "input_suffix": ")"})):
                r = await c.post(path, headers={"Authorization": f"Bearer {key}"},
                                 json={**body, "max_tokens": 2, "priority": "interactive"})
                assert r.status_code in (200, 400), r.text  # tiny has no FIM tokens
            metrics = (await admin.get("/metrics")).text
    served = [line for line in metrics.splitlines()
              if line.startswith("forged_requests_total{") and 'status="200"' in line]
    assert served and all('priority="batch"' in line for line in served), served


def _usage(d: RunningDaemon, name: str) -> KeyUsage:
    assert d.daemon.state is not None
    return d.daemon.state.key_usage.setdefault(name, KeyUsage())


async def test_a_key_at_its_limit_is_refused_before_its_prompt_is_made(
        tiny_model: Path, start_daemon: DaemonFactory, tmp_path: Path) -> None:
    """Over its max_streams, a key's request is a 429 before tokenizing or templating:
    here the prompt is too long for the model, and the answer is still the 429 (it
    was the 400 of a prompt tokenized for nothing)."""
    key = add_key(tmp_path / "keys.toml", "busy", max_streams=1, max_queued=4,
                  priority="interactive")
    with trio.fail_after(60):
        async with start_daemon(tiny_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            _usage(d, "busy").open = 1  # one stream in flight: its limit
            r = await c.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                             json={"prompt": "word " * 5000, "max_tokens": 2})
            assert r.status_code == 429, r.text


async def test_tokenize_and_retrieve_are_limited_per_key(
        tiny_model: Path, start_daemon: DaemonFactory, tmp_path: Path) -> None:
    """/tokenize, /detokenize and /v1/retrieve had no per-key limit at all."""
    key = add_key(tmp_path / "keys.toml", "counter", max_streams=1, max_queued=1,
                  priority="interactive")
    auth = {"Authorization": f"Bearer {key}"}
    with trio.fail_after(60):
        async with start_daemon(tiny_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            for path, body in (("/tokenize", {"content": "x"}), ("/detokenize", {
                    "tokens": [1]}), ("/v1/retrieve", {"query": "x", "repo": "none"})):
                assert (await c.post(path, json=body, headers=auth)).status_code != 429
                # One more in flight: at its limit, whether or not the request before
                # has given its place back yet (it does once its ASGI call has ended).
                _usage(d, "counter").side += 1
                r = await c.post(path, json=body, headers=auth)
                assert r.status_code == 429, (path, r.text)
                _usage(d, "counter").side -= 1


async def test_every_api_route_but_health_needs_a_key(
        tiny_model: Path, start_daemon: DaemonFactory, tmp_path: Path) -> None:
    """Every route of the API app, as registered, refuses a caller without a key, and so
    does a path it does not know: a new alias cannot slip past the keys (llama.cpp's
    ``POST /embeddings`` did: it was served to anyone)."""
    add_key(tmp_path / "keys.toml", "someone", max_streams=1, max_queued=1,
            priority="interactive")
    with trio.fail_after(60):
        async with start_daemon(tiny_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            rules = list(d.daemon._api_app.url_map.iter_rules())
            assert {"/embeddings", "/v1/embeddings", "/api/chat"} <= {r.rule for r in rules}
            for rule in rules:
                if rule.rule == "/health" or rule.endpoint == "static":
                    continue
                path = re.sub(r"<[^>]+>", "x", rule.rule)
                for method in sorted(rule.methods - {"HEAD", "OPTIONS"}):
                    r = await c.request(method, path, json={})
                    assert r.status_code == 401, (method, path, r.status_code)
            assert (await c.get("/not-a-route")).status_code == 401
            assert (await c.get("/health")).status_code == 200


async def test_a_reload_that_finds_the_keys_file_gone_keeps_the_keys(
        tiny_model: Path, start_daemon: DaemonFactory, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """A keys file moved away (or a typo in ``auth.keys_file``) read as "no keys" at a
    reload: the API was open to anyone, with an info line. An empty file still opens it
    on purpose (``forged keys revoke --allow-open``)."""
    key = add_key(tmp_path / "keys.toml", "someone", max_streams=1, max_queued=1,
                  priority="interactive")
    with trio.fail_after(60):
        async with start_daemon(tiny_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            d.daemon.config_path.write_text(as_toml(d.daemon.cfg))
            (tmp_path / "keys.toml").rename(tmp_path / "keys.toml.bak")
            d.daemon.reload()
            assert (await c.get("/v1/models")).status_code == 401
            ok = await c.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert ok.status_code == 200
            assert "keys.toml" in caplog.text and "reload refused" in caplog.text
            (tmp_path / "keys.toml").write_text("")
            d.daemon.reload()
            assert (await c.get("/v1/models")).status_code == 200
            assert "the API is open to anyone" in caplog.text


# --- restarts ------------------------------------------------------------------------------


def test_a_stop_with_an_idle_connection_and_nothing_in_flight_is_quick(
        tmp_path: Path, tiny_model: Path) -> None:
    """hypercorn held an idle keep-alive connection open for its whole graceful timeout
    after the shutdown (drain_timeout + 5 s: 16 s here), and a restart under socket
    activation left the connections arriving meanwhile unanswered for that long."""
    port = free_port()
    d = DaemonProcess(write_config(tmp_path / "forged.toml", tiny_model, port,
                                   server={"drain_timeout": 10.0}), port)
    try:
        d.wait_ready(120)
        with socket.create_connection(("127.0.0.1", port), timeout=30) as idle:
            idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert idle.recv(100).startswith(b"HTTP/1.1 200")
            t0 = time.monotonic()
            d.proc.send_signal(signal.SIGTERM)
            assert d.proc.wait(60) == 0
            assert time.monotonic() - t0 < 5.0
    finally:
        d.stop()
