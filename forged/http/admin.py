"""The admin listener: statistics and health details, never exposed on the API port.

By default it listens on a Unix socket under ``/run/forged/``, so only local users
with access to that directory (root and the forged group) can reach it.
"""

from __future__ import annotations

import msgspec
from quart import Response
from quart_trio import QuartTrio

from forged import __version__
from forged.http.state import AppState

_json = msgspec.json.Encoder()


def create_admin_app(state: AppState) -> QuartTrio:
    app = QuartTrio("forged-admin")
    app.config.update(RESPONSE_TIMEOUT=30, MAX_CONTENT_LENGTH=64 * 1024)

    def _status() -> dict[str, object]:
        return {
            "version": __version__,
            "model": state.cfg.model_id,
            "model_path": state.cfg.model.path,
            "ready": state.pool.ready and not state.draining,
            "draining": state.draining,
            "open_streams": len(state.streams),
            "engine": state.pool.statistics(),
        }

    @app.get("/stats")
    async def stats() -> Response:
        return Response(_json.encode(_status()), content_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        status = _status()
        return Response(_json.encode(status), status=200 if status["ready"] else 503,
                        content_type="application/json")

    return app
