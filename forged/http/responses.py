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
        return h


def http_error(status: int, message: str, type_: str, param: str | None = None,
               code: str | None = None, retry_after: int | None = None) -> HTTPError:
    return HTTPError(status, ErrorBody(ErrorDetail(message, type_, param, code)), retry_after)


def from_exception(exc: e.ForgedError) -> HTTPError:
    """Map a domain error to what the caller sees."""
    match exc:
        case e.BadRequest():
            return http_error(400, str(exc), "invalid_request_error", exc.param, exc.code)
        case e.ModelNotFound():
            return http_error(404, str(exc), "invalid_request_error", "model", "model_not_found")
        case e.Unauthorized():
            return http_error(401, str(exc), "invalid_request_error", None, "invalid_api_key")
        case e.RateLimited():
            return http_error(429, str(exc), "requests", None, "rate_limit_exceeded",
                              exc.retry_after)
        case e.QueueTimeout():
            return http_error(503, str(exc), "server_error", None, "queue_timeout",
                              exc.retry_after)
        case e.Overloaded():
            return http_error(503, str(exc), "server_error", None, "overloaded",
                              exc.retry_after)
        case e.Unavailable():
            return http_error(503, str(exc), "server_error", None, "unavailable",
                              exc.retry_after)
        case e.WorkerLost():
            return http_error(503, f"the model worker stopped: {exc}; retry", "server_error",
                              None, "worker_lost", 1)
        case _:
            return http_error(503, str(exc), "server_error", None, "engine_error", 1)


_json = msgspec.json.Encoder()


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(_json.encode(obj), status=status, content_type="application/json")


def error_response(err: HTTPError) -> Response:
    return Response(err.encode(), status=err.status, headers=err.headers())
