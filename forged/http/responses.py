"""The one place where domain errors become HTTP statuses and OpenAI error bodies, and
where JSON responses are made (for the API and admin listeners)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from quart import Response

from forged import errors as e


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


@dataclass(frozen=True)
class HTTPError:
    status: int
    body: ErrorBody
    retry_after: int | None = None

    def encode(self) -> bytes:
        return msgspec.json.encode(self.body)

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.retry_after is not None:
            h["Retry-After"] = str(self.retry_after)
        if self.status == 415:  # RFC 9110 12.5.3: the codings a request body may have
            h["Accept-Encoding"] = "identity"
        return h


def http_error(status: int, message: str, type_: str, param: str | None = None,
               code: str | None = None, retry_after: int | None = None) -> HTTPError:
    return HTTPError(status, ErrorBody(ErrorDetail(message, type_, param, code)), retry_after)


# What the other domain errors are on the wire: status, OpenAI's error type, and code.
# The first class that matches wins, so subclasses come before their bases.
_MAPPING: tuple[tuple[type[e.ForgedError], int, str, str], ...] = (
    (e.Unauthorized, 401, "invalid_request_error", "invalid_api_key"),
    (e.Forbidden, 403, "invalid_request_error", "permission_denied"),
    (e.UnsupportedEncoding, 415, "invalid_request_error", "unsupported_content_encoding"),
    (e.RateLimited, 429, "requests", "rate_limit_exceeded"),
    (e.QueueTimeout, 503, "server_error", "queue_timeout"),
    (e.Overloaded, 503, "server_error", "overloaded"),
    (e.Unavailable, 503, "server_error", "unavailable"),
)


def from_exception(exc: e.ForgedError) -> HTTPError:
    """Map a domain error to what the caller sees."""
    if isinstance(exc, e.NotFound):
        return http_error(404, str(exc), "invalid_request_error", exc.param, exc.code)
    if isinstance(exc, e.BadRequest):
        return http_error(400, str(exc), "invalid_request_error", exc.param, exc.code)
    if isinstance(exc, e.ModelNotFound):
        return http_error(404, str(exc), "invalid_request_error", "model", "model_not_found")
    if isinstance(exc, e.WorkerLost):  # the process restarts at once: retry in a second
        return http_error(503, f"the model worker stopped: {exc}; retry", "server_error",
                          None, "worker_lost", 1)
    for cls, status, type_, code in _MAPPING:
        if isinstance(exc, cls):
            return http_error(status, str(exc), type_, None, code,
                              getattr(exc, "retry_after", None))
    return http_error(503, str(exc), "server_error", None, "engine_error", 1)


_json = msgspec.json.Encoder()


def encode_json(obj: Any) -> bytes:
    """A JSON body, as every answer of the door encodes it."""
    return _json.encode(obj)


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(encode_json(obj), status=status, content_type="application/json")


def error_response(err: HTTPError) -> Response:
    return Response(err.encode(), status=err.status, headers=err.headers())
