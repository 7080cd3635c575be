"""CORS (server.cors_origins): off by default; for a configured origin, a preflight is
answered before any key is asked for, and every answer (errors too) is marked so that
the page can read it; other origins get nothing a browser would accept."""

from __future__ import annotations

from pathlib import Path

import httpx
import trio

from forged.auth import add_key
from tests.conftest import DaemonFactory

TOOL = "https://tools.example.com"
PREFLIGHT = {"Origin": TOOL, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"}


async def test_off_by_default(tiny_model: Path, start_daemon: DaemonFactory) -> None:
    with trio.fail_after(60):
        async with start_daemon(tiny_model) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            r = await c.options("/v1/chat/completions", headers=PREFLIGHT)
            assert r.status_code == 204
            assert "access-control-allow-origin" not in r.headers
            r = await c.get("/v1/models", headers={"Origin": TOOL})
            assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


async def test_a_configured_origin_gets_preflights_and_marked_answers(
        tiny_model: Path, tmp_path: Path, start_daemon: DaemonFactory) -> None:
    key = add_key(tmp_path / "keys.toml", "web", max_streams=4, max_queued=4,
                  priority="interactive")
    with trio.fail_after(60):
        async with start_daemon(tiny_model, server={"cors_origins": [TOOL]}) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            for path in ("/v1/chat/completions", "/v1/messages", "/api/chat"):
                r = await c.options(path, headers=PREFLIGHT)  # no key: a browser sends none
                assert r.status_code == 204, path
                assert r.headers["access-control-allow-origin"] == TOOL
                assert "POST" in r.headers["access-control-allow-methods"]
                assert r.headers["access-control-allow-headers"] == \
                    PREFLIGHT["Access-Control-Request-Headers"]
                assert "access-control-allow-credentials" not in r.headers
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            ok = await c.post("/v1/chat/completions", json=body, headers={
                "Origin": TOOL, "Authorization": f"Bearer {key}"})
            assert ok.status_code == 200
            assert ok.headers["access-control-allow-origin"] == TOOL
            assert "X-Request-Id" in ok.headers["access-control-expose-headers"]
            # An error is readable too, so that the page can show it.
            denied = await c.post("/v1/chat/completions", json=body, headers={"Origin": TOOL})
            assert denied.status_code == 401
            assert denied.headers["access-control-allow-origin"] == TOOL
            other = {**PREFLIGHT, "Origin": "https://evil.example"}
            r = await c.options("/v1/chat/completions", headers=other)
            assert "access-control-allow-origin" not in r.headers
            r = await c.post("/v1/chat/completions", json=body, headers={
                "Origin": "https://evil.example", "Authorization": f"Bearer {key}"})
            assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


async def test_a_star_allows_any_origin(tiny_model: Path, start_daemon: DaemonFactory) -> None:
    with trio.fail_after(60):
        async with start_daemon(tiny_model, server={"cors_origins": ["*"]}) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as c:
            r = await c.options("/v1/completions", headers={
                **PREFLIGHT, "Origin": "http://localhost:5173"})
            assert r.headers["access-control-allow-origin"] == "*"
            r = await c.get("/health", headers={"Origin": "http://localhost:5173"})
            assert r.headers["access-control-allow-origin"] == "*"
