"""Running one generation for an HTTP request: admission, streaming or collecting,
and what it leaves behind (metrics, one access-log line).

Resource handling: what a generation holds (its key's places, its count in the drain,
the engine request, its access-log record) is entered into the request's resources
(:mod:`forged.http.lifetime`) as it is taken, and released when the request's ASGI
call ends, on every path: an error, the end of the response, or a client that leaves
at any point, also before the SSE body has started. The SSE body only streams.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
import trio
from quart import Response

from forged import errors as e
from forged.engine.events import Admitted, Delta, Done, Event, Scored
from forged.engine.groups import ModelGroup
from forged.engine.pool import RequestStream
from forged.engine.request import Request
from forged.http import sse
from forged.http.direct import ChunkWriter, StepSink
from forged.http.lifetime import Call, call, rule
from forged.http.responses import from_exception, http_error, json_response
from forged.http.schemas import GenerationFields
from forged.http.state import AppState, DrainDeadlines
from forged.observe.metrics import Metrics
from forged.observe.telemetry import Completion, Recorder, Usage

access_log = logging.getLogger("forged.access")


@dataclass
class Outcome:
    """What the access log and the metrics say about one generation: its request's
    :class:`Call` (id, start, key, labels, places), then what happened to it."""

    call: Call
    endpoint: str
    # Where it is recorded: the node's metrics, and the telemetry for `forged report`.
    metrics: Metrics
    telemetry: Recorder
    # Until a response is made, the caller is one that left: 499, client_gone.
    status: str = "499"
    end: str = "client_gone"  # ok, client_gone, drain, queue_timeout, error
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    queue_time: float | None = None
    ttft: float | None = None
    admitted: bool = False
    rs: RequestStream | None = None
    prefill: tuple[float, int] = (0.0, 0)  # admission to first token: seconds, steps
    # Only with log.log_content: the prompt as the caller sent it, and the text made,
    # by choice.
    prompt: str | None = None
    completion: dict[int, list[str]] | None = None
    completion_id: str = ""  # the response's id, which editors' events name
    error: str = ""  # the error code of a generation that failed, for the access log

    def _telemetry(self, duration: float) -> None:
        """A generation that answered in full, for ``forged report``: id, key name,
        route and latency; never its text."""
        if self.end != "ok" or not self.completion_id:
            return
        key = self.call.key_name
        self.metrics.completions.labels(key, self.endpoint).inc()
        self.telemetry.record(Completion(self.completion_id, key, self.endpoint,
                                          time.time(), duration * 1000))

    def whole(self) -> None:
        """Every choice is done: editors' events may name this completion from now on,
        from the key it was made for. Said before its last frame goes out, so that no
        editor holds an id the daemon does not know yet."""
        self.telemetry.served.add(self.completion_id, self.call.key_name)

    def mark_admitted(self) -> None:
        if self.call.hold is not None:
            self.call.hold.admitted()
        self.admitted = True

    def responded(self, status: int) -> None:
        self.status = str(status)
        if status >= 400 and self.end == "client_gone":
            self.end = "error"

    def failed(self, exc: e.ForgedError) -> None:
        if self.end == "client_gone":  # not said more precisely where it was raised
            self.end = "queue_timeout" if isinstance(exc, e.QueueTimeout) else "error"
        # Which error, as the caller's body names it: a 503 is unavailable (no worker),
        # overloaded (the queue) or worker_lost, and the log must tell them apart.
        self.error = from_exception(exc).body.error.code or ""

    def keep_content(self, req: GenerationFields) -> None:
        """With log.log_content: keep what the access log line will show of it."""
        given = req.content()
        self.prompt = given if isinstance(given, str) else msgspec.json.encode(given).decode()
        self.completion = {}

    def text(self, piece: str, index: int) -> None:
        if self.completion is not None:
            self.completion.setdefault(index, []).append(piece)

    def record(self) -> None:
        """Called once, by the request's resources when the request ends."""
        c = self.call
        duration = time.monotonic() - c.started
        self._observe(duration)
        ttft = f"{self.ttft:.3f}" if self.ttft is not None else "-"
        fields: dict[str, object] = {
            "request_id": c.request_id, "key": c.key_name, "model": c.model,
            "status": self.status, **({"error": self.error} if self.error else {}),
            "end": self.end,
            "priority": c.priority, "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens, "ttft": ttft,
            # where the TTFT went: waiting for a slot, then admission to first token
            "queue": "-" if self.queue_time is None else f"{self.queue_time:.3f}",
            "prefill": f"{self.prefill[0]:.3f}", "prefill_steps": self.prefill[1],
            "duration": f"{duration:.3f}"}
        if self.prompt is not None and self.completion is not None:
            fields["prompt"] = self.prompt
            texts = ["".join(parts) for _, parts in sorted(self.completion.items())]
            # One choice as its text; n choices as a JSON list of their texts.
            fields["completion"] = texts[0] if len(texts) == 1 else \
                msgspec.json.encode(texts).decode()
        access_log.info("%s %s", self.endpoint, self.status, extra={"fields": fields})

    def _observe(self, duration: float) -> None:
        """The metrics' and the usage telemetry's share of the record."""
        m, c = self.metrics, self.call
        rs = self.rs
        if rs is not None and rs.delta_times:
            self.ttft = rs.delta_times[0] - c.started
            m.observe_ttft(self.ttft)
            times = rs.delta_times
            m.observe_itl([b - a for a, b in itertools.pairwise(times)])
        m.e2e.observe(duration)
        self._telemetry(duration)
        self.telemetry.record(Usage(c.key_name, c.model, time.time(), self.prompt_tokens,
                                     self.completion_tokens))
        if self.queue_time is not None:
            m.queue_time.labels(c.priority).observe(self.queue_time)
        m.prompt_tokens.labels(c.key_name, c.model).inc(self.prompt_tokens)
        m.observe_tokens(self.completion_tokens, c.key_name, c.model)
        if self.end in ("client_gone", "drain", "queue_timeout"):
            m.cancellations.labels(self.end).inc()


def begin_outcome(state: AppState, priority: str) -> Outcome:
    """The current request's generation record at ``priority``, recorded once when the
    request ends, however it ends (which also gives the key its places back)."""
    c = call()
    c.priority = priority  # the metrics' label
    outcome = c.outcome = Outcome(c, rule(), state.metrics, state.telemetry)
    c.held.callback(outcome.record)
    return outcome


async def generate(state: AppState, group: ModelGroup, req: GenerationFields,
                   request: Request,
                   fmt: sse.MakeFormat, outcome: Outcome) -> Response:
    out = fmt(model=req.model or group.model_id, created=int(time.time()), n=request.n)
    outcome.prompt_tokens = len(request.prompt)
    outcome.completion_id = out.id
    c = call()
    held = c.held
    try:
        held.enter_context(state.drain.generation())
        rs = outcome.rs = await held.enter_async_context(group.pool.open_request(request))
        if state.holds is not None:
            await state.holds.at("submitted")
        first = await admitted_events(state.drain, state.cfg.limits.retry_after, rs, outcome)
        out.prompt_tokens, out.cached_tokens = len(request.prompt), outcome.cached_tokens
        if state.holds is not None:
            await state.holds.at("admitted")
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            sock = c.connection if state.cfg.server.hot_door else None
            body = _stream(state, rs, first, out, include_usage, outcome, sock)
            return Response(body, content_type=out.content_type,
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        whole = await _collect(state, rs, first, out, outcome, keep=req.n)
        return json_response(whole)
    except e.ForgedError as exc:
        outcome.failed(exc)
        raise


async def admitted_events(drain: DrainDeadlines, retry_after: int, rs: RequestStream,
                          outcome: Outcome) -> list[Event]:
    """Wait for the worker to admit the request, so that a full queue is an honest 503,
    and so that a request still queued when a drain ends gets one too."""
    scope = drain.wait_scope()
    try:
        with scope:
            events = await _until_admitted(rs, outcome)
    finally:
        drain.end_wait(scope)
    if scope.cancelled_caught:
        outcome.end = "drain"
        raise e.Unavailable("the server is shutting down", retry_after)
    return events


async def _until_admitted(rs: RequestStream, outcome: Outcome) -> list[Event]:
    events: list[Event] = []
    while True:
        batch = await rs.receive()
        for ev in batch:
            if isinstance(ev, Admitted):
                outcome.queue_time, outcome.cached_tokens = ev.queue_time, ev.cached
        events.extend(batch)
        if rs.admitted or rs.finished:
            # A request that fails before its first token is refused with its error's
            # status, not streamed.
            rs.raise_failure()
            outcome.mark_admitted()
            return events


async def _next_events(drain: DrainDeadlines, rs: RequestStream, pace: Pace | None = None,
                       sink: StepSink | None = None) -> list[Event] | None:
    """The request's next events (with ``pace``, those that arrive soon after them
    too), or None once the drain's deadline has passed. The deadline cuts only the
    wait: events taken go out (a pace's gathering is bounded by its budget). A direct
    stream's ``sink`` holds from the moment they are taken: later events queue behind
    them."""
    scope = drain.wait_scope()
    try:
        with scope:
            # Events already waiting return without a checkpoint: a deadline that has
            # passed must be seen even by a stream that never waits for them.
            await trio.lowlevel.checkpoint_if_cancelled()
            events = await rs.receive()
    finally:
        drain.end_wait(scope)
    if scope.cancelled_caught:
        return None
    if sink is not None:
        sink.held = True
    return events + await pace.gather(rs) if pace is not None else events


class _Reader:
    """The one match over a request's events. What every answer needs is done here
    (the outcome's text, each choice's end); what an answer makes of each event (a
    stream's frames, a whole completion's parts) is its subclass's."""

    def __init__(self, outcome: Outcome, n: int) -> None:
        self.outcome, self.n = outcome, n
        self.dones: dict[int, Done] = {}

    def read(self, events: list[Event]) -> bool:
        """Read ``events`` in order; whether the last choice ended among them."""
        for ev in events:
            match ev:
                case Delta(text=text, index=index):
                    self.outcome.text(text, index)
                    self.delta(ev)
                case Scored():
                    self.scored(ev)
                case Done():
                    last = self._done(ev)
                    self.done(ev, last)
                    if last:
                        return True
        return False

    def _done(self, ev: Done) -> bool:
        """Count one choice's end; whether it was the last, which makes the answer
        whole."""
        self.dones[ev.index] = ev
        outcome = self.outcome
        outcome.completion_tokens += ev.completion_tokens
        outcome.cached_tokens = ev.cached_tokens
        # Every choice's first token comes from the one prompt, in the same step.
        outcome.prefill = (ev.prefill_s, ev.prefill_steps)
        outcome.text(ev.text, ev.index)
        if len(self.dones) < self.n:
            return False
        outcome.whole()
        return True

    def delta(self, ev: Delta) -> None:
        raise NotImplementedError

    def scored(self, ev: Scored) -> None:
        raise NotImplementedError

    def done(self, ev: Done, last: bool) -> None:
        raise NotImplementedError


class _Whole(_Reader):
    """A whole completion's text and scores, per choice."""

    def __init__(self, outcome: Outcome, n: int) -> None:
        super().__init__(outcome, n)
        self.parts: list[list[str]] = [[] for _ in range(n)]
        self.scores = [sse.Scores() for _ in range(n)]

    def delta(self, ev: Delta) -> None:
        self.parts[ev.index].append(ev.text)
        self.scores[ev.index].tokens += ev.logprobs or []

    def scored(self, ev: Scored) -> None:
        for score in self.scores:  # every choice echoes the prompt
            score.prompt = ev.logprobs

    def done(self, ev: Done, last: bool) -> None:
        self.parts[ev.index].append(ev.text)
        self.scores[ev.index].tokens += ev.logprobs or []


class _Frames(_Reader):
    """A stream's SSE frames, taken after each read to go out in one write."""

    def __init__(self, outcome: Outcome, out: sse.Format, include_usage: bool) -> None:
        super().__init__(outcome, out.n)
        self.out, self.include_usage = out, include_usage
        self.frames: list[bytes] = []

    def take(self) -> bytes:
        frames, self.frames = self.frames, []
        return b"".join(frames)

    def delta(self, ev: Delta) -> None:
        self.frames.append(self.out.delta(ev.text, ev.index, ev.logprobs))

    def scored(self, ev: Scored) -> None:
        self.frames.append(self.out.scored(ev.logprobs))

    def done(self, ev: Done, last: bool) -> None:
        self.frames.append(_finish(self.out, ev, self.dones if last else None,
                                   self.include_usage))


async def _collect(state: AppState, rs: RequestStream, events: list[Event] | None,
                   out: sse.Format, outcome: Outcome, keep: int) -> dict[str, Any]:
    """The whole completion, its best ``keep`` choices (all but with ``best_of``).
    Counted among the open generations like a stream, it may finish until the drain's
    deadline; past it the caller gets a 503 to retry."""
    whole = _Whole(outcome, out.n)
    while events is not None:
        if whole.read(events):
            outcome.end = "ok"
            return _whole(out, ["".join(p) for p in whole.parts],
                          [whole.dones[i] for i in range(out.n)], whole.scores, keep)
        events = await _next_events(state.drain, rs)
    outcome.end = "drain"
    raise e.Unavailable("the server is shutting down; the completion was cut short",
                        state.cfg.limits.retry_after)


def _whole(out: sse.Format, texts: list[str], dones: list[Done], scores: list[sse.Scores],
           keep: int) -> dict[str, Any]:
    """The response of the ``keep`` choices with the highest mean logprob per token
    (OpenAI's ``best_of``), numbered from 0; usage counts every choice generated."""
    if keep == len(dones):
        return out.whole(texts, dones, scores)
    best = sorted(range(len(dones)), key=lambda i: -_mean_logprob(scores[i]))[:keep]
    whole = out.whole([texts[i] for i in best],
                      [msgspec.structs.replace(dones[i], index=j) for j, i in enumerate(best)],
                      [scores[i] for i in best])
    whole["usage"] = sse.usage(dones)
    return whole


def _mean_logprob(scores: sse.Scores) -> float:
    entries = scores.tokens
    return sum(t.logprob for t in entries) / len(entries) if entries else -math.inf


def _finish(out: sse.Format, ev: Done, dones: dict[int, Done] | None,
            include_usage: bool) -> bytes:
    """A choice's end; after the last (``dones``: every choice's), the usage chunk and
    [DONE] in the same write. The finish is made first: a dialect's format may end on
    what the finish fed it."""
    frames = out.finish(ev)
    if dones is not None:
        frames += out.end(list(dones.values()), include_usage)
    return frames


async def _stream(state: AppState, rs: RequestStream, events: list[Event] | None,
                  out: sse.Format, include_usage: bool, outcome: Outcome,
                  sock: trio.SocketStream | None) -> AsyncIterator[bytes]:
    """The SSE body: the frames of the events that arrived together in one write; with
    ``sock``, written there directly (:func:`_direct`), and nothing yielded. It
    releases nothing: the request's resources do, also when the client goes away
    before this body has started."""
    if state.holds is not None:
        await state.holds.at("streaming")
    frames = _Frames(outcome, out, include_usage)
    pace = Pace(state.cfg.server.stream_coalesce_ms / 1000)
    if sock is not None:
        await _direct(state, rs, events, frames, pace, sock)
        return
    try:
        if head := out.start():
            yield head
        while events is not None:
            last = frames.read(events)
            yield frames.take()
            if last:
                outcome.end = "ok"  # the last frame went out
                return
            events = await _next_events(state.drain, rs, pace)
        outcome.end = "drain"
        yield _cut_short(state, out)
    except e.ForgedError as exc:
        outcome.end = "error"
        yield out.error(from_exception(exc))


def _cut_short(state: AppState, out: sse.Format) -> bytes:
    """A stream's last frame when the drain's deadline passes before its end."""
    return out.error(http_error(503, "the server is shutting down; the stream was cut short",
                                "server_error", None, "draining",
                                state.cfg.limits.retry_after))


async def _direct(state: AppState, rs: RequestStream, events: list[Event] | None,
                  frames: _Frames, pace: Pace, sock: trio.SocketStream) -> None:
    """``_stream``'s loop on a direct stream (forged.http.direct): the pool's reader
    writes the text events it can; this task writes the rest (the start, the
    coalesced, the end and the errors), each of its writes drained before it waits
    again."""
    writer = ChunkWriter(sock)
    sink = StepSink(frames, writer, rs.nudge, lambda: pace.waits(rs))
    rs.sink = sink
    out, outcome = frames.out, frames.outcome
    try:
        writer.send(out.start())
        while events is not None and not writer.broken:
            sink.raise_error()
            last = frames.read(events)
            writer.send(frames.take())
            await writer.drain()
            if last:
                outcome.end = "ok"  # the last frame went out
                return
            sink.held = False
            events = await _next_events(state.drain, rs, pace, sink)
        if events is None:
            outcome.end = "drain"
            writer.send(_cut_short(state, out))
    except e.ForgedError as exc:
        outcome.end = "error"
        writer.send(out.error(from_exception(exc)))
    finally:
        rs.sink = None
        try:
            await writer.drain()
        finally:
            writer.close()


class Pace:
    """Tokens per write: when a stream's events come less than half ``budget_s``
    apart (an engine faster than a useful write cadence, or a door running behind),
    the events of the next ``budget_s`` after the first go out in one write, so the
    door's CPU per token falls as the engine gets faster. No event waits longer than
    ``budget_s`` past its arrival; a slower stream writes each event at once. Half:
    a wait costs a timer, and is worth it only if another event is likely to come
    within it (at 6 ms steps and a 5 ms budget, waiting cost as much as it saved)."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s

    def waits(self, rs: RequestStream) -> bool:
        """Whether the events pending on ``rs`` wait for more to share their write."""
        return 2 * rs.gap < self.budget_s and not rs.finished  # budget 0: never

    async def gather(self, rs: RequestStream) -> list[Event]:
        """After ``rs.receive()``: the events to write with those it returned."""
        if not self.waits(rs):
            return []
        await trio.sleep(max(0.0, rs.arrived + self.budget_s - rs.clock()))
        return rs.take()
