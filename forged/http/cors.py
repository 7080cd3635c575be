"""CORS for browser-based tools (``server.cors_origins``; off by default).

A browser lets a page read an answer from another origin only if the server says so,
and before a request with a key or a JSON body it asks first (a preflight, ``OPTIONS``
with ``Access-Control-Request-Method``). forged answers the preflight itself, before
authentication (a browser sends no key with it), and marks every answer to an allowed
origin. Off by default: a page on any web site an engineer opens could otherwise spend
the appliance's compute from inside the network, and read what it answers. ``"*"``
allows every origin, as llama-server and vLLM do by default.

Keys travel in ``Authorization`` or ``x-api-key`` headers, never in cookies, so no
credentials mode is ever allowed.
"""

from __future__ import annotations

from quart import Response, request
from quart_trio import QuartTrio

from forged.http.state import AppState

METHODS = "GET, POST, DELETE, OPTIONS"
MAX_AGE = "600"  # seconds a browser may keep a preflight's answer
# What a page may read of an answer beyond the basic headers.
EXPOSED = "X-Request-Id, Retry-After"


def add_cors(app: QuartTrio, state: AppState) -> None:
    """Registered before the request hooks, so that a preflight needs no key."""

    @app.before_request
    async def _preflight() -> Response | None:
        if request.method != "OPTIONS" or "Access-Control-Request-Method" not in \
                request.headers:
            return None
        resp = Response(b"", status=204)
        origin = _allowed(state.cfg.server.cors_origins)
        if origin is not None:
            asked = request.headers.get("Access-Control-Request-Headers", "")
            resp.headers.update({
                "Access-Control-Allow-Origin": origin,
                "Access-Control-Allow-Methods": METHODS,
                "Access-Control-Max-Age": MAX_AGE})
            if asked:  # whichever headers the page's client sends (SDKs add their own)
                resp.headers["Access-Control-Allow-Headers"] = asked
        resp.vary.update(("Origin", "Access-Control-Request-Headers"))
        return resp

    @app.after_request
    async def _mark(resp: Response) -> Response:
        origin = _allowed(state.cfg.server.cors_origins)
        if origin is not None and "Access-Control-Allow-Origin" not in resp.headers:
            resp.headers["Access-Control-Allow-Origin"] = origin
            resp.headers["Access-Control-Expose-Headers"] = EXPOSED
        if state.cfg.server.cors_origins:
            resp.vary.add("Origin")  # caches must not give one origin's answer to another
        return resp


def _allowed(allowed: list[str]) -> str | None:
    """The value of Access-Control-Allow-Origin for this request, or None: no Origin
    header, or one not configured. Given from the config each time: a reload applies."""
    origin = request.headers.get("Origin")
    if origin is None or not allowed:
        return None
    if "*" in allowed:
        return "*"
    # Scheme and host are case-insensitive; browsers send them in lower case.
    return origin if origin.lower() in (a.lower() for a in allowed) else None
