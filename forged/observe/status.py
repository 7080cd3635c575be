"""``forged status``: a human summary of a running daemon, read from its admin listener."""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.parse
from typing import Any

import msgspec

from forged.engine.stats import Totals, WorkerStats, prompt_step_shares
from forged.errors import ForgedError


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("admin", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def _connect(admin: str, timeout: float) -> http.client.HTTPConnection:
    if admin.startswith("unix:"):
        return _UnixHTTPConnection(admin[5:], timeout)
    url = urllib.parse.urlsplit(admin if "://" in admin else f"http://{admin}")
    if url.scheme != "http" or url.hostname is None or url.port is None:
        raise ForgedError(f"not an admin listener address: {admin!r} "
                          "(unix:PATH, HOST:PORT or http://HOST:PORT)")
    return http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)


def fetch_stats(admin: str, timeout: float = 5.0) -> dict[str, Any]:
    """GET /stats from ``admin`` (``unix:PATH``, ``HOST:PORT`` or ``http://HOST:PORT``,
    a node's admin listener where the admin exposes it on the network)."""
    status, stats = admin_call(admin, "GET", "/stats", timeout=timeout)
    if status != 200 or not isinstance(stats, dict) or "engine" not in stats:
        raise ForgedError(f"{admin} answered HTTP {status} without statistics: not an "
                          "admin listener? (the API's port is not the admin's)")
    return stats


def admin_call(admin: str, method: str, path: str, body: dict[str, Any] | None = None,
               *, timeout: float = 5.0, token: str = "") -> tuple[int, dict[str, Any]]:
    """One request to the admin listener: its status and JSON answer. ``token``: the
    admin token, which actions need on a TCP listener."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        conn = _connect(admin, timeout)  # a port that is no number: ValueError
    except ValueError as exc:
        raise ForgedError(f"not an admin listener address: {admin!r}: {exc}") from exc
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body),
                     headers=headers)
        resp = conn.getresponse()
        data: dict[str, Any] = json.loads(resp.read())
        return resp.status, data
    except (OSError, ValueError, http.client.HTTPException) as exc:
        raise ForgedError(f"cannot read the admin listener at {admin}: {exc}") from exc
    finally:
        conn.close()


def _seconds(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f} s"


def _uptime(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    d, h = divmod(h, 24)
    return f"{d}d {h:02d}h {m:02d}m" if d else f"{h}h {m:02d}m {s:02d}s"


def render(stats: dict[str, Any]) -> str:
    eng = stats["engine"]
    t = _totals(stats)
    lm = stats["last_minute"]
    used, total = t.kv_cells_used, t.kv_cells_total or 1
    node = f"  node {stats['node']}" if "node" in stats else ""
    lines = [
        f"forged {stats['version']}{node}  model {stats['model']}  {_state(stats)}, "
        f"up {_uptime(eng['uptime'])}",
        f"streams     {stats['open_streams']} open; {int(t.running)} running, "
        f"{int(t.queued_interactive + t.queued_batch)} queued "
        f"({int(t.queued_tokens)} prompt tokens)",
        f"KV cache    {100 * used / total:.0f}% used ({int(used)} / {int(total)} cells, "
        f"{int(t.kv_cells_cached)} held as prefix cache)",
        f"reuse       prefix cache {int(t.prefix_cache_hits)} hits in "
        f"{int(t.prefix_cache_queries)} requests "
        f"({int(t.prefix_cache_tokens_saved)} tokens saved, "
        f"{int(t.prefix_holds)} held for a shared prefix); sessions "
        f"{int(t.sessions_pinned)} pinned, {int(t.session_resumes)} resumed",
        *_models(stats),
        *_tiers(t),
        *_indexes(stats),
        f"routing     by cache {int(t.routed_by_cache)}, by session "
        f"{int(t.routed_by_session)}, by load {int(t.routed_by_load)}; "
        f"{int(t.resubmitted)} resubmitted after a worker was lost",
        f"throughput  {lm['tokens_per_second']:.1f} tok/s over the last minute "
        f"({int(lm['requests'])} requests)",
        f"TTFT        p50 {_seconds(lm['ttft_p50'])}   p99 {_seconds(lm['ttft_p99'])}",
        f"ITL         p50 {_seconds(lm['itl_p50'])}   p99 {_seconds(lm['itl_p99'])}",
    ]
    if "agent" in stats:
        lines.append(f"agent       {stats['agent']}")
    lines += _door(stats)
    for w in eng["workers"]:
        lines += _worker(w, several_models=len(stats.get("models", [])) > 1)
    return "\n".join(lines)


def _totals(stats: dict[str, Any]) -> Totals:
    """A node's totals, typed (a field an older daemon does not report reads 0)."""
    return msgspec.convert(stats["engine"]["totals"], Totals)


def _worker(w: dict[str, Any], *, several_models: bool) -> list[str]:
    s = msgspec.convert(w["stats"], WorkerStats)
    ready = "ready" if w["ready"] else "starting"
    if s.nice:  # a swap's new model not yet (or not allowed) back at 0
        ready += f" at nice {int(s.nice)}"
    model = f" ({w['model']})" if several_models else ""
    return [f"worker {w['index']}{model}    pid {w['pid']} {ready}, "
            f"{w['pending']} requests, {w['restarts']} restarts, "
            f"{w.get('digests', 0)} prefix digests", *_threads(w), *_attention(w),
            *_steps(s)]


def _door(stats: dict[str, Any]) -> list[str]:
    """The CPUs the door keeps to, and why; its processes (absent from older daemons)."""
    if "door" not in stats:
        return []
    door = stats["door"]
    cpus = ", ".join(map(str, door["cpus"])) or "every CPU"
    lines = [f"door        {cpus} ({door['why']})"]
    if "processes" in door:
        lines.append(f"            door processes {door['processes']} "
                     f"({door['processes_why']})")
    lines += [f"            door pid {p['pid']}: {p['answered']} answered, {p['handed']} "
              f"handed to the daemon, {p['restarts']} restarts"
              + ("" if p.get("steady", 1) else ", not reporting steadily")
              for p in door.get("process", [])]
    if door.get("daemon_accepts"):
        lines.append("            no door process is ready: the daemon accepts itself")
    return lines


def _threads(w: dict[str, Any]) -> list[str]:
    """llama.cpp's threads in the worker, and why that many (absent from older daemons)."""
    if not w.get("threads"):
        return []
    why = f" ({w['threads_why']})" if w.get("threads_why") else ""
    return [f"  threads   {w['threads']}{why}"]


def _attention(w: dict[str, Any]) -> list[str]:
    """Flash attention as the worker runs it, and why (absent from older daemons)."""
    if not w.get("flash_attn_why"):
        return []
    return [f"  attention flash attention {'on' if w['flash_attn'] else 'off'}: "
            f"{w['flash_attn_why']}"]


def _models(stats: dict[str, Any]) -> list[str]:
    """Each model served, and during a swap the one loading or draining."""
    models = stats.get("models", [])
    if len(models) < 2:
        return []
    return [f"model       {m['id']} {m['status']}: {m['path']}, {m['workers']} workers, "
            f"about {_mib(m['memory_bytes'])} MiB, {m['in_use']} requests"
            for m in models]


def _indexes(stats: dict[str, Any]) -> list[str]:
    """The repository indexes and how fresh each is (absent from older daemons)."""
    now = time.time()
    return [f"index       {i['name']}: {i['files']} files, {i['chunks']} chunks, "
            + ("never updated" if i["updated_at"] is None
               else f"updated {_uptime(now - i['updated_at'])} ago")
            for i in stats.get("indexes", [])]


def _state(stats: dict[str, Any]) -> str:
    return "draining" if stats["draining"] else ("ready" if stats["ready"] else "not ready")


def render_pool(nodes: list[tuple[str, dict[str, Any] | str]]) -> str:
    """One line per node of a pool (its admin URL and its /stats, or why it could not
    be read), then the pool's sums."""
    lines = [f"{'node':<16} {'state':<10} {'agent':<16} {'open':>5} {'run':>4} "
             f"{'queued':>6} {'KV':>4} {'tok/s':>7}  admin"]
    sums = [0.0, 0.0, 0.0, 0.0]
    for url, stats in nodes:
        if isinstance(stats, str):
            lines.append(f"{'?':<16} {'unreachable':<10} {'':<16} {'':>5} {'':>4} {'':>6} "
                         f"{'':>4} {'':>7}  {url}: {stats}")
            continue
        t = _totals(stats)
        row = [float(stats["open_streams"]), t.running, t.queued_interactive + t.queued_batch,
               stats["last_minute"]["tokens_per_second"]]
        sums = [a + b for a, b in zip(sums, row, strict=True)]
        kv = 100 * t.kv_cells_used / (t.kv_cells_total or 1)
        lines.append(f"{stats.get('node', '?'):<16} {_state(stats):<10} "
                     f"{stats.get('agent', '-'):<16} {int(row[0]):>5} {int(row[1]):>4} "
                     f"{int(row[2]):>6} {kv:>3.0f}% {row[3]:>7.1f}  {url}")
    lines.append(f"{'pool':<16} {'':<10} {'':<16} {int(sums[0]):>5} {int(sums[1]):>4} "
                 f"{int(sums[2]):>6} {'':>4} {sums[3]:>7.1f}")
    return "\n".join(lines)


def _step_mix(s: WorkerStats) -> list[str]:
    """How much of the work the steps with prompt work were: past half of the tokens
    generated, a stream's median gap is such a step's."""
    if (shares := prompt_step_shares(s)) is None:
        return []
    steps, time, tokens = shares
    return [f"  with prompt work {steps:.0%} of steps, {time:.0%} of their time, "
            f"{tokens:.0%} of the tokens generated"]


def _steps(s: WorkerStats) -> list[str]:
    """A worker's step budget and the cost model it comes from (none: an embedding
    model's worker, which has no step target)."""
    if not s.target_step_ms:
        return []
    return [
        f"  steps     target {s.target_step_ms:.0f} ms; last planned "
        f"{s.step_plan_ms:.0f} ms, took {s.step_ms:.0f} ms; room for "
        f"prompts beside today's decoders {max(0.0, s.step_prompt_room_ms):.0f} ms",
        *_step_mix(s),
        f"  cost      {s.cost_fixed_ms:.1f} ms + {s.cost_decoder_ms:.2f} /decoder + "
        f"{s.cost_prompt_token_ms:.2f} /prompt token + {s.cost_chunk_ms:.2f} /chunk + "
        f"{s.cost_kpair_ms:.2f} /1k attended pairs, "
        f"{s.cost_tiled_kpair_ms:.2f} tiled (fitted on "
        f"{int(s.cost_steps_observed)} steps)",
        f"  admission wait estimate {s.wait_estimate_s:.1f} s; "
        f"{int(s.early_rejections)} refused at once",
    ]


def _tiers(t: Totals) -> list[str]:
    """The KV tiers beyond the slots: use against budget, and what moved."""
    lines = []
    for name, budget, used, entries, restores in (
            ("RAM", t.kv_ram_budget_bytes, t.kv_ram_bytes, t.kv_ram_entries, t.kv_ram_restores),
            ("disk", t.kv_disk_budget_bytes, t.kv_disk_bytes, t.kv_disk_entries,
             t.kv_disk_restores)):
        if not budget:
            lines.append(f"KV {name:<8} off")
            continue
        lines.append(f"KV {name:<8} {_mib(used)} of {_mib(budget)} MiB, "
                     f"{int(entries)} states, {int(restores)} restores")
    lines.append(
        f"KV moves    {int(t.kv_saves)} saved, "
        f"{int(t.kv_restored_tokens)} tokens restored, "
        f"{int(t.kv_demotions)} to disk, {int(t.kv_drops)} dropped, "
        f"{int(t.kv_swaps)} swaps, {int(t.kv_restore_failures)} refused")
    return lines


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.0f}"
