"""The prefix cache is shared within a tenant and never across tenants, end to end:
API key -> tenant -> the worker's prefix lookup -> ``cached_tokens``."""

from __future__ import annotations

from pathlib import Path

import httpx
import trio

from forged.auth import add_key
from tests.conftest import DaemonFactory

PROMPT = "def shared_context():\n" + "    value = items[index]\n" * 30


async def test_cached_tokens_never_reveal_another_tenants_prompt(
        tiny_model: Path, start_daemon: DaemonFactory, tmp_path: Path) -> None:
    keys = {name: add_key(tmp_path / "keys.toml", name, max_streams=4, max_queued=4,
                          priority="interactive", tenant=tenant)
            for name, tenant in (("a1", "alpha"), ("a2", "alpha"), ("b1", "beta"))}

    async def cached(c: httpx.AsyncClient, name: str, tail: str) -> int:
        r = await c.post("/v1/completions", headers={"Authorization": f"Bearer {keys[name]}"},
                         json={"prompt": PROMPT + tail, "max_tokens": 2})
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    with trio.fail_after(60):
        async with start_daemon(tiny_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            assert await cached(c, "a1", "# one\n") == 0
            assert await cached(c, "b1", "# two\n") == 0  # another tenant: no reuse
            assert await cached(c, "a2", "# three\n") > 100  # the same tenant: reuse
