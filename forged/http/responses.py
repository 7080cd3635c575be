"""Small response helpers shared by the API and admin listeners."""

from __future__ import annotations

from typing import Any

import msgspec
from quart import Response

from forged.http.errors import HTTPError

_json = msgspec.json.Encoder()


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(_json.encode(obj), status=status, content_type="application/json")


def error_response(err: HTTPError) -> Response:
    return Response(err.encode(), status=err.status, headers=err.headers())
