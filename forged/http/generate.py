"""Running one generation for an HTTP request: admission, streaming or collecting,
and what it leaves behind (metrics, one access-log line).

Resource handling: the engine request is opened in an ``AsyncExitStack`` that is
closed exactly once, by whoever ends the request: the handler when it fails before
responding, the JSON path when it returns, or the SSE body's ``finally`` (also when
the client goes away and quart-trio cancels it).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import trio
from quart import Response

from forged import errors as e
from forged.engine import frames as fr
from forged.engine.pool import Job, RequestStream
from forged.engine.scheduler import CLASS_NAMES
from forged.http import errors as he
from forged.http import sse
from forged.http.responses import json_response
from forged.http.state import AppState, KeyUsage

access_log = logging.getLogger("forged.access")


@dataclass
class Outcome:
    """What the access log and the metrics say about one generation."""

    request_id: str
    endpoint: str
    priority: str
    started: float = field(default_factory=time.monotonic)
    status: str = "200"
    end: str = "ok"  # ok, client_gone, drain, error
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    queue_time: float | None = None
    ttft: float | None = None
    key: str = "-"
    usage: KeyUsage | None = None
    admitted: bool = False

    def mark_admitted(self) -> None:
        if not self.admitted and self.usage is not None:
            self.usage.queued -= 1
        self.admitted = True

    def record(self, state: AppState, rs: RequestStream | None) -> None:
        if self.usage is not None:  # give the key its places back, exactly once
            self.mark_admitted()
            self.usage.open -= 1
            self.usage = None
        m = state.metrics
        duration = time.monotonic() - self.started
        if rs is not None and rs.delta_times:
            self.ttft = rs.delta_times[0] - self.started
            m.observe_ttft(self.ttft)
            times = rs.delta_times
            m.observe_itl([b - a for a, b in itertools.pairwise(times)])
        m.e2e.observe(duration)
        if self.queue_time is not None:
            m.queue_time.labels(self.priority).observe(self.queue_time)
        m.prompt_tokens.inc(self.prompt_tokens)
        m.observe_tokens(self.completion_tokens)
        if self.end in ("client_gone", "drain", "queue_timeout"):
            m.cancellations.labels(self.end).inc()
        ttft = f"{self.ttft:.3f}" if self.ttft is not None else "-"
        access_log.info(
            "%s %s", self.endpoint, self.status,
            extra={"fields": {
                "request_id": self.request_id, "key": self.key, "status": self.status,
                "end": self.end,
                "priority": self.priority, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "cached_tokens": self.cached_tokens, "ttft": ttft,
                "duration": f"{duration:.3f}"}},
        )


async def generate(state: AppState, req: Any, job: Job, fmt: type[sse.Format],
                   outcome: Outcome) -> Response:
    out = fmt(model=req.model or state.cfg.model_id, created=int(time.time()))
    outcome.prompt_tokens = len(job.prompt)
    stack = AsyncExitStack()
    rs: RequestStream | None = None
    try:
        rs = await stack.enter_async_context(state.pool.open_request(job))
        first = await _admission(state, rs, outcome)
    except BaseException as exc:
        outcome.end = "client_gone" if isinstance(exc, trio.Cancelled) else "error"
        if isinstance(exc, e.QueueTimeout):
            outcome.end = "queue_timeout"
        outcome.status = str(he.from_exception(exc).status) if isinstance(
            exc, e.ForgedError) else "499"
        with trio.CancelScope(shield=True):
            await stack.aclose()
        outcome.record(state, rs)
        raise
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        body = _stream(state, rs, stack, first, out, include_usage, outcome)
        return Response(body, content_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        async with stack:
            return json_response(await _collect(rs, first, out, outcome))
    except trio.Cancelled:
        outcome.end, outcome.status = "client_gone", "499"
        raise
    except e.ForgedError as exc:
        outcome.end, outcome.status = "error", str(he.from_exception(exc).status)
        raise
    finally:
        outcome.record(state, rs)


async def _admission(state: AppState, rs: RequestStream, outcome: Outcome) -> list[fr.Event]:
    """Wait for the worker to admit the request, so that a full queue is an honest 503,
    and so that a request still queued when a drain ends gets one too."""
    scope = state.streams.open()
    try:
        with scope:
            events = await _until_admitted(state, rs, outcome)
    finally:
        state.streams.close(scope)
    if scope.cancelled_caught:
        outcome.end = "drain"
        raise e.Unavailable("the server is shutting down", state.cfg.limits.retry_after)
    return events


async def _until_admitted(state: AppState, rs: RequestStream, outcome: Outcome
                          ) -> list[fr.Event]:
    events: list[fr.Event] = []
    while True:
        batch = await rs.receive()
        for ev in batch:
            if isinstance(ev, fr.Failed):
                raise _failure(state, ev)
            if isinstance(ev, fr.Admitted):
                outcome.queue_time, outcome.cached_tokens = ev.queue_time, ev.cached
        events.extend(batch)
        if rs.admitted or rs.finished:
            outcome.mark_admitted()
            return events


def _failure(state: AppState, ev: fr.Failed) -> e.ForgedError:
    retry = state.cfg.limits.retry_after
    match ev.code:
        case "overloaded":
            return e.Overloaded(ev.message, retry)
        case "queue_timeout":
            return e.QueueTimeout(ev.message, retry)
        case "bad_request":
            return e.BadRequest(ev.message)
        case _:
            return e.EngineError(ev.message)


def _done(outcome: Outcome, ev: fr.Done) -> None:
    outcome.completion_tokens = ev.completion_tokens
    outcome.cached_tokens = ev.cached_tokens


async def _collect(rs: RequestStream, events: list[fr.Event], out: sse.Format,
                   outcome: Outcome) -> dict[str, Any]:
    parts: list[str] = []
    while True:
        for ev in events:
            match ev:
                case fr.Delta(text=text):
                    parts.append(text)
                case fr.Done():
                    parts.append(ev.text)
                    _done(outcome, ev)
                    return out.whole("".join(parts), ev)
                case fr.Failed():
                    raise e.EngineError(ev.message)
        events = await rs.receive()


async def _stream(state: AppState, rs: RequestStream, stack: AsyncExitStack,
                  events: list[fr.Event], out: sse.Format, include_usage: bool,
                  outcome: Outcome) -> AsyncIterator[bytes]:
    """The SSE body. Its ``finally`` closes the request, whoever ends the stream."""
    try:
        if head := out.start():
            yield head
        while True:
            for ev in events:
                match ev:
                    case fr.Delta(text=text):
                        yield out.delta(text)
                    case fr.Done():
                        _done(outcome, ev)
                        yield out.finish(ev, include_usage)
                        return
                    case fr.Failed():
                        outcome.end = "error"
                        yield sse.error_event(he.from_exception(e.EngineError(ev.message)))
                        return
            scope = state.streams.open()
            try:
                with scope:
                    events = await rs.receive()
            finally:
                state.streams.close(scope)
            if scope.cancelled_caught:
                outcome.end = "drain"
                yield sse.error_event(he.http_error(
                    503, "the server is shutting down; the stream was cut short",
                    "server_error", None, "draining", state.cfg.limits.retry_after))
                return
    except e.ForgedError as exc:
        outcome.end = "error"
        yield sse.error_event(he.from_exception(exc))
    except BaseException:
        outcome.end = "client_gone"
        raise
    finally:
        with trio.CancelScope(shield=True):
            await stack.aclose()
        outcome.record(state, rs)


def priority_name(job: Job) -> str:
    return CLASS_NAMES[job.priority]
