"""The early refusal's wait estimate against the waits that followed (issue 34, item 2).

    .venv/bin/python -m bench.calibration [--seconds 150] [--set SECTION.KEY=VALUE ...]

forged with its shipped settings (llama-server's threads, context and 16 slots, as
every comparison runs it) under closed loops of 24, 32 and 48 mixed callers, each for
``--seconds``. ``limits.queue_timeout`` is raised to 600 s, so that nothing is refused
at the door and nothing times out: every request's real wait is seen. Meanwhile a
poller reads each worker's ``wait_estimate_s`` from ``/stats`` every 0.25 s; the door
refuses when the least of them passes the queue timeout, so that least is "the
estimate". Each request's wait for a slot is the ``queue`` field of its access-log
line (joined by its X-Request-Id), and the estimate it met is the last one polled
before it was sent.

Prints, and writes to ``bench/results/calibration.{json,md}``: by the estimate at
arrival, how long requests then waited; and, at the shipped 60 s timeout, how many
requests the door would have refused that were served within it (false refusals)
and how many it would have admitted that waited past it (late).
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import trio

from bench.consistency import shipped_sections
from bench.daemonproc import DaemonProcess, free_port, write_config
from bench.run import MAX_TOKENS, MODEL, RESULTS
from forged.observe.loadtest import Prompt, make_prompts
from forged.observe.stats import percentile
from forged.observe.status import fetch_stats

TIMEOUT = 60.0  # the shipped limits.queue_timeout the estimate is compared with
POLL_S = 0.25
LEVELS = (24, 32, 48)
# The mix's short prompts (a few lines) and long ones (a file): the door's estimate is
# for the shortest request, which the queue's order lets pass the long ones.
KINDS: dict[str, Callable[[int], bool]] = {
    "all": lambda n: True, "short": lambda n: n <= 200, "long": lambda n: n > 200}
BUCKETS = (0.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 80.0, float("inf"))
_FIELD = re.compile(r'(\w+)=("[^"]*"|\S+)')


@dataclass
class Sent:
    request_id: str
    at: float  # time.monotonic() when it was sent
    callers: int
    status: int = 0


async def _poll(admin: str, series: list[tuple[float, float]]) -> None:
    """(time, the least wait estimate over ready workers), every POLL_S."""
    while True:
        stats = await trio.to_thread.run_sync(fetch_stats, admin)
        ready = [w["stats"].get("wait_estimate_s", 0.0) for w in stats["engine"]["workers"]
                 if w["ready"]]
        series.append((time.monotonic(), min(ready, default=0.0)))
        await trio.sleep(POLL_S)


async def _in_flight(admin: str) -> int:
    return int((await trio.to_thread.run_sync(fetch_stats, admin))["engine"]["in_flight"])


async def _one(client: httpx.AsyncClient, url: str, prompt: Prompt, callers: int
               ) -> Sent:
    sent = Sent("", time.monotonic(), callers)
    try:
        async with client.stream("POST", url + "/v1/completions", json=prompt.body) as r:
            sent.request_id, sent.status = r.headers.get("x-request-id", ""), r.status_code
            async for _ in r.aiter_bytes():
                pass
    except httpx.HTTPError:
        sent.status = 598
    return sent


async def _closed(url: str, callers: int, seconds: float, seed: int, out: list[Sent]) -> None:
    prompts = iter(make_prompts("mixed", 10_000, MAX_TOKENS, seed=seed))
    timeout = httpx.Timeout(seconds + 700, connect=30)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(
            max_connections=None, max_keepalive_connections=256)) as client:

        # Callers stop sending at the deadline and finish what they sent: a request cut
        # short while it waits would take its wait out of the table.
        deadline = trio.current_time() + seconds

        async def caller() -> None:
            for p in prompts:
                if trio.current_time() >= deadline:
                    return
                out.append(await _one(client, url, p, callers))

        async with trio.open_nursery() as nursery:
            for _ in range(callers):
                nursery.start_soon(caller)


async def measure(url: str, admin: str, seconds: float) -> tuple[list[Sent], list[tuple[
        float, float]]]:
    sent: list[Sent] = []
    series: list[tuple[float, float]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_poll, admin, series)
        for i, callers in enumerate(LEVELS):
            await _closed(url, callers, seconds, seed=40 + i, out=sent)
            # Let the queue empty before the next level: its first estimates then
            # start from an idle engine, as a burst's would.
            with trio.move_on_after(600):
                while await _in_flight(admin):  # noqa: ASYNC110 (another process's state)
                    await trio.sleep(1.0)
        nursery.cancel_scope.cancel()
    return sent, series


def queue_waits(log: Path) -> dict[str, tuple[float, int]]:
    """Each served request's wait for a slot and its prompt tokens, by its id, from the
    access log."""
    waits = {}
    for raw in log.read_text(errors="replace").splitlines():
        fields = dict(_FIELD.findall(raw))
        if fields.get("logger") == "forged.access" and fields.get("queue", "-") != "-":
            waits[fields["request_id"].strip('"')] = (float(fields["queue"]),
                                                      int(fields.get("prompt_tokens", "0")))
    return waits


def estimate_at(series: list[tuple[float, float]], at: float) -> float | None:
    """The last estimate polled before ``at``."""
    before = [e for t, e in series if t <= at]
    return before[-1] if before else None


def table(rows: list[tuple[float, float]]) -> dict[str, Any]:
    """(estimate, real wait) pairs: by estimate bucket, and against the timeout."""
    buckets = []
    for lo, hi in itertools.pairwise(BUCKETS):
        waits = [w for e, w in rows if lo <= e < hi]
        ests = [e for e, _ in rows if lo <= e < hi]
        if waits:
            buckets.append({"from": lo, "to": hi, "requests": len(waits),
                            "estimate_mean": sum(ests) / len(ests),
                            "wait_p50": percentile(waits, 50),
                            "wait_p95": percentile(waits, 95), "wait_max": max(waits)})
    return {
        "requests": len(rows), "buckets": buckets,
        "false_refusals": sum(1 for e, w in rows if e > TIMEOUT and w <= TIMEOUT),
        "late": sum(1 for e, w in rows if e <= TIMEOUT and w > TIMEOUT),
        "refused_rightly": sum(1 for e, w in rows if e > TIMEOUT and w > TIMEOUT),
    }


def markdown(result: dict[str, Any]) -> str:
    lines = []
    for kind, t in result["tables"].items():
        lines += [f"{kind} prompts:", "",
                  "| estimate at arrival | requests | estimate mean | wait p50 | wait p95 | "
                  "wait max |", "|---|---|---|---|---|---|"]
        for b in t["buckets"]:
            span = f"{b['from']:.0f} to {b['to']:.0f} s" if b["to"] < float("inf") else \
                f"≥ {b['from']:.0f} s"
            lines.append(f"| {span} | {b['requests']} | {b['estimate_mean']:.1f} s | "
                         f"{b['wait_p50']:.1f} s | {b['wait_p95']:.1f} s | "
                         f"{b['wait_max']:.1f} s |")
        lines += ["", f"At a {TIMEOUT:.0f} s queue timeout, of {t['requests']} requests: "
                  f"{t['false_refusals']} would have been refused though served within it "
                  f"(false refusals), {t['refused_rightly']} refused rightly, "
                  f"{t['late']} admitted that waited past it.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=150.0, help="per level of callers")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = ap.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp())
    port = free_port()
    sections = shipped_sections(args.set)
    # Nothing refused, nothing timed out: every request's real wait is seen.
    sections.setdefault("limits", {}).update(queue_timeout=600.0, max_queued=256)
    forged = DaemonProcess(write_config(tmp / "forged.toml", MODEL, port, **sections), port)
    try:
        forged.wait_ready()
        sent, series = trio.run(measure, forged.url, f"unix:{tmp}/admin.sock", args.seconds)
    finally:
        forged.stop()
    waits = queue_waits(forged.log)
    rows = [(e, *waits[s.request_id]) for s in sent
            if s.request_id in waits and (e := estimate_at(series, s.at)) is not None]
    result = {"levels": LEVELS, "seconds": args.seconds, "overrides": args.set,
              "sent": len(sent), "served": sum(1 for s in sent if s.status == 200),
              "tables": {kind: table([(e, w) for e, w, n in rows if keep(n)])
                         for kind, keep in KINDS.items()},
              "rows": rows}
    (RESULTS / "calibration.json").write_text(json.dumps(result, indent=2))
    (RESULTS / "calibration.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
