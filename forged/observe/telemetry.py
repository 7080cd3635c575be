"""Completion telemetry, as Tabby's users know it: was a completion shown, taken, dropped?

Editors send ``POST /v1/events`` with ``view``, ``select`` or ``dismiss`` and the
completion's id; the daemon records, for each generation that answered, its id, route
and latency. Both go to ``server.state_dir/telemetry.sqlite3`` under the API key's
*name*. No prompt, completion or event text is ever written: ids, names, times and
numbers only (``test_telemetry`` greps the file's bytes for the prompt).

Every generation request also adds its tokens to a per-key, per-model, per-day sum
(the ``usage`` table): its size grows with keys, models and days, not requests.

``forged report`` reads the file: usage (requests, prompt and generated tokens),
completions shown (viewed or selected), accepted (selected), the acceptance rate, and /infill
latency p50/p95, per key name and per UTC day.

An event is accepted only for a completion this daemon served to the same key: the
ids of the last ``RECENT`` completions served, with their key names, are kept in
memory (:class:`RecentCompletions`), filled when a completion is whole, before its
last frame goes out. They are not kept across restarts: an event for a completion
served before one is refused.

Resource handling: records travel from request handlers to one writer task through a
bounded channel (``QUEUE``). When it is full, a record is dropped and counted
(``forged_telemetry_dropped_total``) rather than making a request wait on the disk.
The writer gathers what arrives for ``WRITE_INTERVAL`` after a first record and writes
it as one transaction (a few, past ``BATCH`` records), in a thread. A transaction (and
a thread hop) for each request's records cost the door about 0.5 ms of CPU a request,
a tenth of a short generation's (docs/benchmarks.md); gathered, a busy door commits
twice a second.
When cancelled (the daemon stopping) it writes what is left, shielded, for at most
``FLUSH_TIMEOUT``; a crash loses at most the last ``WRITE_INTERVAL``.
The same task prunes the file, in a thread, when it starts and every
``PRUNE_INTERVAL`` seconds after: records older than ``telemetry.retention_days``,
then the oldest beyond ``telemetry.max_rows`` in each table. SQLite reuses the pages
freed, so the file stops growing.
"""

from __future__ import annotations

import datetime as dt
import logging
import sqlite3
import time
from collections import OrderedDict, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import trio

from forged.config import TelemetryConfig
from forged.observe.metrics import Metrics
from forged.observe.stats import percentile

log = logging.getLogger("forged")
QUEUE = 4096  # records waiting for the writer; more are dropped and counted
BATCH = 512  # records per transaction at most
WRITE_INTERVAL = 0.5  # seconds the writer gathers records after a first one
FLUSH_TIMEOUT = 2.0  # seconds to write what is queued when the daemon stops
PRUNE_INTERVAL = 600.0  # seconds between two prunes of the file
DAY = 86400.0
# Completions whose ids editors' events may name: about 100 bytes each in memory. An
# editor sends its events within seconds of showing a completion; at forged's rates,
# this many completions take hours.
RECENT = 65536
EventType = Literal["view", "select", "dismiss"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS completions (
    id TEXT PRIMARY KEY, key TEXT NOT NULL, route TEXT NOT NULL, at REAL NOT NULL,
    latency_ms REAL NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    completion_id TEXT NOT NULL, key TEXT NOT NULL, type TEXT NOT NULL, at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS events_at ON events (at);
CREATE INDEX IF NOT EXISTS completions_at ON completions (at);
CREATE TABLE IF NOT EXISTS usage (
    key TEXT NOT NULL, model TEXT NOT NULL, day TEXT NOT NULL,
    requests INTEGER NOT NULL, prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL, PRIMARY KEY (key, model, day));
"""


@dataclass(frozen=True)
class Completion:
    id: str
    key: str
    route: str
    at: float  # Unix time
    latency_ms: float


@dataclass(frozen=True)
class Event:
    completion_id: str
    key: str
    type: EventType
    at: float


@dataclass(frozen=True)
class Usage:
    """One generation request, however it ended: what it cost its key."""

    key: str
    model: str
    at: float
    prompt_tokens: int
    completion_tokens: int


Record = Completion | Event | Usage


def telemetry_path(state_dir: str | Path) -> Path:
    return Path(state_dir) / "telemetry.sqlite3"


def open_db(path: Path) -> sqlite3.Connection:
    path.parent.mkdir(parents=True, exist_ok=True)
    # One writer task uses it, one batch at a time, from whichever worker thread trio
    # hands that batch: never two threads at once.
    db = sqlite3.connect(path, timeout=5.0, check_same_thread=False)
    db.executescript(SCHEMA)
    return db


def write(db: sqlite3.Connection, records: list[Record]) -> None:
    """One transaction for a batch; a completion id seen again keeps its first row."""
    with db:
        db.executemany("INSERT OR IGNORE INTO completions VALUES (?, ?, ?, ?, ?)",
                       [(r.id, r.key, r.route, r.at, r.latency_ms)
                        for r in records if isinstance(r, Completion)])
        db.executemany("INSERT INTO events VALUES (?, ?, ?, ?)",
                       [(r.completion_id, r.key, r.type, r.at)
                        for r in records if isinstance(r, Event)])
        db.executemany(
            "INSERT INTO usage VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO UPDATE SET "
            "requests = requests + excluded.requests, "
            "prompt_tokens = prompt_tokens + excluded.prompt_tokens, "
            "completion_tokens = completion_tokens + excluded.completion_tokens",
            [(*k, *v) for k, v in _usage_by_day(records).items()])


def _usage_by_day(records: list[Record]) -> dict[tuple[str, str, str], list[int]]:
    """Usage summed per key, model and UTC day: one row each in the file, so that its
    size grows with keys x models x days, not with requests."""
    sums: dict[tuple[str, str, str], list[int]] = {}
    for r in records:
        if isinstance(r, Usage):
            row = sums.setdefault((r.key, r.model, _day(r.at)), [0, 0, 0])
            row[0] += 1
            row[1] += r.prompt_tokens
            row[2] += r.completion_tokens
    return sums


def prune(db: sqlite3.Connection, before: float, max_rows: int) -> int:
    """Delete the records older than ``before`` (Unix time), then the oldest beyond
    ``max_rows`` in each table, in one transaction; how many went."""
    gone = 0
    with db:
        for table in ("completions", "events"):
            gone += db.execute(f"DELETE FROM {table} WHERE at < ?", (before,)).rowcount
            gone += db.execute(
                f"DELETE FROM {table} WHERE rowid IN (SELECT rowid FROM {table} "
                "ORDER BY at DESC LIMIT -1 OFFSET ?)", (max_rows,)).rowcount
        gone += db.execute("DELETE FROM usage WHERE day < ?", (_day(before),)).rowcount
    return gone


class RecentCompletions:
    """The key name each of the last ``size`` completions served was served to."""

    def __init__(self, size: int = RECENT) -> None:
        self.size = size
        self._keys: OrderedDict[str, str] = OrderedDict()

    def add(self, completion_id: str, key: str) -> None:
        self._keys[completion_id] = key
        self._keys.move_to_end(completion_id)
        if len(self._keys) > self.size:
            self._keys.popitem(last=False)

    def key_of(self, completion_id: str) -> str | None:
        return self._keys.get(completion_id)


# How the writer runs its database work off the event loop (a test runs it inline).
RunSync = Callable[..., Awaitable[Any]]


class Recorder:
    """The request handlers' side (``record``, ``served``: never wait) and the
    writer task (``serve``), which also prunes the file.

    ``config``: the ``[telemetry]`` section now (a reload may change it); ``wall``: the
    Unix time, which the records carry."""

    def __init__(self, path: Path, metrics: Metrics, config: Callable[[], TelemetryConfig],
                 *, wall: Callable[[], float] = time.time,
                 run_sync: RunSync = trio.to_thread.run_sync) -> None:
        self.path = path
        self.metrics = metrics
        self.config, self.wall, self._run_sync = config, wall, run_sync
        self.served = RecentCompletions()
        self._send, self._receive = trio.open_memory_channel[Record](QUEUE)

    def record(self, rec: Record) -> None:
        if isinstance(rec, Event):
            self.metrics.completion_events.labels(rec.key, rec.type).inc()
        try:
            self._send.send_nowait(rec)
        except trio.WouldBlock:
            self.metrics.telemetry_dropped.inc()

    async def serve(self) -> None:
        """Write records as they come, gathered for ``WRITE_INTERVAL``, and prune the
        file every ``PRUNE_INTERVAL``, until cancelled; then write what is left."""
        try:
            db = await self._run_sync(open_db, self.path)
        except sqlite3.Error as exc:  # the queue fills; further records are counted
            log.error("telemetry: cannot open %s: %s; nothing is recorded", self.path, exc)
            return
        gathered: list[Record] = []  # received, not written yet
        try:
            next_prune = trio.current_time()
            while True:
                if trio.current_time() >= next_prune:
                    await self._prune(db)
                    next_prune = trio.current_time() + PRUNE_INTERVAL
                # Only the waits are cut short by the prune's time: what was received
                # is always written.
                with trio.move_on_at(next_prune):
                    gathered.append(await self._receive.receive())
                    await trio.sleep(WRITE_INTERVAL)  # what else comes joins it
                await self._write_all(db, gathered)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(FLUSH_TIMEOUT):
                await self._write_all(db, gathered)
            db.close()

    async def _write_all(self, db: sqlite3.Connection, gathered: list[Record]) -> None:
        """``gathered`` and everything queued, ``BATCH`` records a transaction. Each
        batch leaves ``gathered`` only once written (or counted as dropped), so a
        cancellation between two leaves the rest for the shielded last write, and
        nothing is written twice (usage rows are sums)."""
        while self._take(gathered):
            await self._write(db, gathered)
            gathered.clear()

    def _take(self, batch: list[Record]) -> list[Record]:
        """``batch``, topped up in place from the queue to at most ``BATCH``."""
        while len(batch) < BATCH:
            try:
                batch.append(self._receive.receive_nowait())
            except trio.WouldBlock:
                break
        return batch

    async def _prune(self, db: sqlite3.Connection) -> None:
        cfg = self.config()
        before = self.wall() - cfg.retention_days * DAY
        try:
            gone = await self._run_sync(prune, db, before, cfg.max_rows)
        except sqlite3.Error as exc:  # tried again at the next interval
            log.error("telemetry: cannot prune %s: %s", self.path, exc)
            return
        if gone:
            log.info("telemetry: %d records past retention_days or max_rows deleted", gone)

    async def _write(self, db: sqlite3.Connection, batch: list[Record]) -> None:
        """A batch that cannot be written (a full disk) is dropped and counted: telemetry
        must never take the daemon down."""
        try:
            await self._run_sync(write, db, batch)
        except sqlite3.Error as exc:
            log.error("telemetry: %d records not written to %s: %s", len(batch), self.path,
                      exc)
            self.metrics.telemetry_dropped.inc(len(batch))


# --- the report ------------------------------------------------------------------------


@dataclass
class ReportRow:
    key: str
    day: str  # UTC, YYYY-MM-DD
    requests: int = 0  # generation requests, however they ended
    prompt_tokens: int = 0
    completion_tokens: int = 0
    completions: int = 0  # generations answered in full
    shown: int = 0  # completions with a view event
    accepted: int = 0  # completions with a select event
    dismissed: int = 0
    infill_p50_ms: float | None = None
    infill_p95_ms: float | None = None

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.shown if self.shown else None


def _day(at: float) -> str:
    return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%d")


# Each key's and day's completions by what was done with them. A completion selected was
# shown, whether or not its view event came (a client that sends only selects, a view
# refused at the event rate, or sent the day before): counted with the views, the
# accepted are never more than the shown (the rate was 300% for selects alone).
_EVENTS = """
SELECT key, CASE type WHEN 'select' THEN 'accepted' ELSE 'dismissed' END, min(at),
       count(DISTINCT completion_id)
FROM events WHERE at >= ?1 AND type != 'view' GROUP BY key, type, date(at, 'unixepoch')
UNION ALL
SELECT key, 'shown', min(at), count(DISTINCT completion_id)
FROM events WHERE at >= ?1 AND type IN ('view', 'select')
GROUP BY key, date(at, 'unixepoch')
"""


def report(db: sqlite3.Connection, since: float = 0.0) -> list[ReportRow]:
    """Per key name and day: usage (requests and tokens, all models), completions,
    shown, accepted, dismissed, infill latency."""
    rows: dict[tuple[str, str], ReportRow] = {}

    def row(key: str, day: str) -> ReportRow:
        return rows.setdefault((key, day), ReportRow(key, day))

    for key, day, n, prompt, completion in db.execute(
            "SELECT key, day, sum(requests), sum(prompt_tokens), sum(completion_tokens) "
            "FROM usage WHERE day >= ? GROUP BY key, day", (_day(since),)):
        r = row(key, day)
        r.requests, r.prompt_tokens, r.completion_tokens = n, prompt, completion
    latencies: dict[tuple[str, str], list[float]] = defaultdict(list)
    for key, route, at, ms in db.execute(
            "SELECT key, route, at, latency_ms FROM completions WHERE at >= ?", (since,)):
        row(key, _day(at)).completions += 1
        if route == "/infill":
            latencies[key, _day(at)].append(ms)
    for key, kind, at, n in db.execute(_EVENTS, (since,)):
        setattr(row(key, _day(at)), kind, n)
    for k, values in latencies.items():
        rows[k].infill_p50_ms = percentile(values, 50)
        rows[k].infill_p95_ms = percentile(values, 95)
    return [rows[k] for k in sorted(rows, key=lambda k: (k[1], k[0]))]


def read_report(state_dir: Path, since: float = 0.0) -> list[ReportRow]:
    """``forged report``'s rows, read-only; none when nothing was recorded yet."""
    path = telemetry_path(state_dir)
    if not path.is_file():
        return []
    db = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True, timeout=5.0)
    try:
        return report(db, since)
    finally:
        db.close()


def render_report(rows: list[ReportRow]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    lines = [f"{'DAY':<10}  {'KEY':<20} {'REQUESTS':>8} {'PROMPT TOK':>10} {'GEN TOK':>9} "
             f"{'COMPLETIONS':>11} {'SHOWN':>7} {'ACCEPTED':>8} {'RATE':>6} "
             f"{'INFILL P50 MS':>13} {'P95 MS':>7}"]
    for r in rows:
        rate = "-" if r.acceptance is None else f"{r.acceptance:.0%}"
        lines.append(f"{r.day:<10}  {r.key:<20} {r.requests:>8} {r.prompt_tokens:>10} "
                     f"{r.completion_tokens:>9} {r.completions:>11} {r.shown:>7} "
                     f"{r.accepted:>8} {rate:>6} {ms(r.infill_p50_ms):>13} "
                     f"{ms(r.infill_p95_ms):>7}")
    return "\n".join(lines)
