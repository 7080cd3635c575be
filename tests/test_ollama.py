"""Ollama's API (/api/*) through the official ``ollama`` Python client, against an
in-process daemon on loopback."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest
import trio

from forged.auth import add_key
from tests.conftest import DaemonFactory

pytestmark = pytest.mark.trio

HI = [{"role": "user", "content": "hi"}]


def _client(url: str, **kw: Any) -> ollama.AsyncClient:
    return ollama.AsyncClient(host=url, timeout=60, **kw)


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
            assert tiny.size == tiny_model.stat().st_size and tiny.modified_at is not None
            assert tiny.digest and len(tiny.digest) == 64
            assert tiny.details is not None
            assert (tiny.details.format, tiny.details.family) == ("gguf", "llama")
            assert tiny.details.quantization_level == "F32"
            assert tiny.details.parameter_size
            shown = await c.show("tiny:latest")  # a client's default tag names it too
            assert shown.capabilities == ["completion", "tools"]
            assert shown.modelinfo is not None
            assert shown.modelinfo["llama.context_length"] == 2048
            assert shown.modelinfo["general.architecture"] == "llama"
            assert shown.template and "im_start" in shown.template
            assert "insert" in ((await c.show("fim")).capabilities or [])
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
