"""KV tiers end to end, with llama.cpp's real sequence states (the tiny model).

Greedy output is only bit-stable for the same computation, so each comparison is
like with like: the same prompt on the same cached prefix, once from a slot (or a
copy of one) and once from a saved state."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import trio

from forged.engine import testhooks
from tests.conftest import DaemonFactory

# Per-slot streams: a restored state lands in another stream, whose arithmetic is the
# same as its source's, so restored and in-slot answers agree to the bit.
ENGINE = {"kv_layout": "per_slot", "kv_cells": 2 * 512, "slots": 2, "max_running": 2,
          "max_context": 512}
CONTEXT = "The shared repository context: " + "def f(x): return x * 2\n" * 6


def body(prompt: str, **kw: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **kw}


def cached(r: dict[str, Any]) -> int:
    return int(r["usage"]["prompt_tokens_details"]["cached_tokens"])


async def complete(c: httpx.AsyncClient, **kw: Any) -> dict[str, Any]:
    r = await c.post("/v1/completions", json=body(**kw))
    assert r.status_code == 200, r.text
    return dict(r.json())


async def test_an_evicted_prompt_is_restored_from_ram_with_the_same_answer(
        tiny_model: Path, start_daemon: DaemonFactory) -> None:
    with trio.fail_after(60):
        async with start_daemon(tiny_model, engine=ENGINE) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            prompt = CONTEXT + "Question A"
            await complete(c, prompt=prompt)
            from_slot = await complete(c, prompt=prompt)  # the slot's cache
            for other in ("Beta", "Gamma"):  # two other contexts take both slots
                await complete(c, prompt=f"{other}: " + f"{other} = 1\n" * 30)
            assert d.stats().kv_ram_entries >= 1
            from_ram = await complete(c, prompt=prompt)
            assert d.stats().kv_ram_restores == 1
    assert cached(from_ram) == cached(from_slot) > 32
    assert from_ram["choices"][0]["text"] == from_slot["choices"][0]["text"]


async def chat(c: httpx.AsyncClient, messages: list[dict[str, str]], session: str,
               **kw: Any) -> dict[str, Any]:
    r = await c.post("/v1/chat/completions", json={
        "messages": messages, "session": session, "max_tokens": 12, "temperature": 0,
        **kw})
    assert r.status_code == 200, r.text
    return dict(r.json())


def turn_two(first: dict[str, Any]) -> list[dict[str, str]]:
    return [{"role": "user", "content": CONTEXT + "What does f do?"},
            {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And g?"}]


async def serve_first_turn(start_daemon: DaemonFactory, model: Path
                           ) -> tuple[list[dict[str, str]], dict[str, Any]]:
    """Turn one of session s; then turn two, as another caller computes it on a copy of
    the same cached state (the reference); the daemon stops, writing s to disk."""
    async with start_daemon(model, engine=ENGINE) as d, \
            httpx.AsyncClient(base_url=d.url, timeout=30) as c:
        first = await chat(c, turn_two({"choices": [{"message": {"content": ""}}]})[:1], "s")
        messages = turn_two(first)
        # cache_prompt false: this copy is not kept, so only s's state is saved
        ref = await chat(c, messages, "other", cache_prompt=False)
    return messages, ref


async def test_a_session_survives_a_restart_with_the_same_answer(
        tiny_model: Path, start_daemon: DaemonFactory, tmp_path: Path) -> None:
    with trio.fail_after(90):
        messages, ref = await serve_first_turn(start_daemon, tiny_model)
        files = list((tmp_path / "state" / "kvcache").glob("*/worker-0/*.kv"))
        assert len(files) == 1
        async with start_daemon(tiny_model, engine=ENGINE) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            assert d.stats().kv_disk_entries == 1
            # flash_attn "auto": measured at the first start, kept beside the states,
            # so this start cannot choose the other way and drop them
            worker = d.daemon.pool.statistics()["workers"][0]
            assert worker["flash_attn_why"].endswith("at an earlier start")
            again = await chat(c, messages, "s")
            assert d.stats().kv_disk_restores == 1 and d.stats().session_resumes == 1
    assert cached(again) == cached(ref) > 32
    assert again["choices"][0]["message"] == ref["choices"][0]["message"]


async def test_saved_states_no_worker_reads_are_deleted_at_start(
        tiny_model: Path, start_daemon: DaemonFactory, tmp_path: Path) -> None:
    """A worker's folder beyond a lowered ``engine.workers`` goes at the next start, and
    every saved state once ``engine.cache_disk_mib`` is 0 ("keeps nothing on disk").
    (Both stayed forever: never read, never counted against a budget.)"""
    with trio.fail_after(90):
        await serve_first_turn(start_daemon, tiny_model)
        (saved,) = (tmp_path / "state" / "kvcache").glob("*/worker-0/*.kv")
        extra = saved.parent.parent / "worker-1"  # as two workers left it
        extra.mkdir()
        (extra / "old.kv").write_bytes(b"x")
        async with start_daemon(tiny_model, engine=ENGINE):
            assert not extra.exists() and saved.exists()
        async with start_daemon(tiny_model, engine={**ENGINE, "cache_disk_mib": 0}):
            assert not list((tmp_path / "state" / "kvcache").iterdir())


async def test_a_corrupt_cache_file_is_dropped_and_the_turn_recomputed(
        tiny_model: Path, start_daemon: DaemonFactory, tmp_path: Path) -> None:
    with trio.fail_after(90):
        messages, _ = await serve_first_turn(start_daemon, tiny_model)
        (path,) = (tmp_path / "state" / "kvcache").glob("*/worker-0/*.kv")
        data = path.read_bytes()
        path.write_bytes(data[:-100] + bytes(b ^ 0xFF for b in data[-100:]))
        async with start_daemon(tiny_model, engine=ENGINE) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            again = await chat(c, messages, "s")
            assert d.stats().kv_restore_failures == 1
    assert cached(again) == 0 and again["choices"][0]["message"]["content"]
    assert not path.exists()


async def stream_text(c: httpx.AsyncClient, started: trio.Event | None, **kw: Any) -> str:
    out = []
    async with c.stream("POST", "/v1/completions", json=body(stream=True, **kw)) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                out.append(json.loads(line[6:])["choices"][0]["text"])
                if started is not None:
                    started.set()
    return "".join(out)


async def test_a_batch_request_swapped_out_for_interactive_work_ends_the_same(
        tiny_model: Path, start_daemon: DaemonFactory) -> None:
    engine = {**ENGINE, "slots": 1, "max_running": 1, "kv_cells": 512}
    batch = {"prompt": CONTEXT + "Summarise", "max_tokens": 48, "priority": "batch"}
    with trio.fail_after(90):
        async with start_daemon(tiny_model, engine=engine) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=60) as c:
            await complete(c, **batch)  # the cache both runs below start from
            never_swapped = await stream_text(c, None, **batch)
            testhooks.slow_steps(d.daemon.pool, 0, 0.03)  # the batch run lasts > 1 s
            started = trio.Event()
            async with trio.open_nursery() as n:
                result: list[str] = []

                async def run_batch() -> None:
                    result.append(await stream_text(c, started, **batch))

                n.start_soon(run_batch)
                await started.wait()
                quick = await complete(c, prompt="Another file: " + "y = 1\n" * 12)
                assert d.stats().kv_swaps == 1
            assert d.stats().kv_ram_restores >= 1
    assert quick["choices"][0]["text"]
    assert result == [never_swapped]


async def test_two_models_of_one_file_keep_their_saved_states_apart(
        fim_model: Path, start_daemon: DaemonFactory) -> None:
    """One file may serve as two models (a FIM model for editors and a chat model, each
    with its settings). Their workers' folders of saved states were one (the folder
    was the file's): each worker indexed, budgeted and wrote over the other's files."""
    with trio.fail_after(90):
        async with start_daemon(fim_model, models=[
                {"path": str(fim_model), "name": "chat", "role": "chat"}]) as d:
            serving = d.daemon.models.serving
            assert len(serving) == 2
            first, second = (g.pool.disk_folders() for g in serving)
            assert first and second and not first & second
