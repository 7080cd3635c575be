"""Door processes (forged.daemon.doors): processes that accept the API's connections,
answer the hot routes from the daemon's view, and hand every other connection to the
daemon, which alone admits, counts and limits. Two doors, real processes, real sockets."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import httpx
import msgspec
import pytest
import trio

import forged.config as fc
from forged.auth import add_key
from forged.daemon import doors as doors_module
from forged.daemon.doors import Door, Doors
from forged.daemon.doorwire import Handed, encoder, from_door
from forged.observe.status import _door as status_door
from tests.conftest import DaemonFactory, RunningDaemon
from tests.daemonproc import DaemonProcess, free_port, write_config
from tests.test_api import until
from tests.test_hotdoor import (
    GENERAL,
    _connect,
    _exchange,
    _get,
    _requests,
    _shape,
    listener_ends,
)
from tests.test_models import as_toml

TWO = {"door_processes": 2}


def _doors(d: RunningDaemon) -> list[dict[str, int]]:
    assert d.daemon.state is not None
    doors: list[dict[str, int]] = d.daemon.state.door_report()["process"]  # type: ignore[assignment]
    return doors


async def _running(d: RunningDaemon) -> list[dict[str, int]]:
    """The doors, once each has its view and accepts (the first answer proves it, once
    counted: later counts then start from here)."""
    await until(lambda: all(door["pid"] for door in _doors(d)))
    answered = sum(door["answered"] for door in _doors(d))
    async with await _connect(d) as stream:
        await _exchange(stream, _get("/health"), 1)
    await until(lambda: sum(door["answered"] for door in _doors(d)) == answered + 1)
    return _doors(d)


@contextmanager
def _stopped(pid: int) -> Iterator[None]:
    """One door paused (SIGSTOP), so that the other accepts every new connection."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _alive(pid: int) -> bool:
    """Running: not gone, and not a zombie that nobody has reaped yet (an orphan's
    reaper may be slow, or absent in a container)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wrapped_door(real: list[str], before: str = "", after: str = "pass") -> list[str]:
    """A door process's argv (``real``) run through ``python -c``: ``before`` first, and
    ``after`` once the door has returned (or raised)."""
    code = (f"import runpy, sys\n{before}\nsys.argv[0] = 'doorproc'\ntry:\n"
            "    runpy.run_module('forged.daemon.doorproc', run_name='__main__')\n"
            f"finally:\n    {after}")
    return [sys.executable, "-c", code, *real[real.index("--hub"):]]


async def test_doors_answer_the_hot_routes_and_hand_the_rest(
        tiny_model: Path, start_daemon: DaemonFactory, posted: list[str]) -> None:
    async with start_daemon(tiny_model, server=TWO) as d:
        doors = await _running(d)
        assert len(doors) == 2 and len({door["pid"] for door in doors} | {os.getpid()}) == 3
        before = _requests(d, "/health")
        answered = sum(door["answered"] for door in _doors(d))
        for _ in range(30):  # each on a new connection: the kernel picks a door
            async with await _connect(d) as stream:
                hot, = await _exchange(stream, _get("/health"), 1)
        async with await _connect(d) as stream:  # the daemon's answer, for comparison
            general, = await _exchange(stream, _get("/health", GENERAL), 1)
        assert _shape(hot) == _shape(general)
        # Each door reports what it answered: the daemon's metrics count it.
        await until(lambda: _requests(d, "/health") == before + 31)
        assert sum(door["answered"] for door in _doors(d)) == answered + 30
        # A generation comes through a door to the daemon, and streams.
        handed = sum(door["handed"] for door in _doors(d))
        async with httpx.AsyncClient(base_url=d.url, timeout=30) as client:
            r = await client.post("/v1/completions", json={
                "prompt": "x", "max_tokens": 4, "stream": True})
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        assert sum(door["handed"] for door in _doors(d)) == handed + 1
        assert posted == ["/v1/completions"]  # the daemon's hot door, not hypercorn
        # forged status shows them
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=d.admin_sock),
                                     base_url="http://admin", timeout=30) as admin:
            shown = "\n".join(status_door((await admin.get("/stats")).json()))
        assert "door processes 2 (set in the config)" in shown
        for door in doors:
            assert re.search(rf"door pid {door['pid']}: \d+ answered, \d+ handed to the "
                             r"daemon, 0 restarts", shown), shown
    assert not any(_alive(door["pid"]) for door in doors)  # stopped with the daemon


async def test_per_key_limits_are_exact_across_doors(
        tiny_model: Path, start_daemon: DaemonFactory, tmp_path: Path) -> None:
    """A key's second stream, through the other door, is refused: the daemon alone
    counts the key's streams, whichever door accepted each connection."""
    key = add_key(tmp_path / "keys.toml", "solo", max_streams=1, max_queued=0,
                  priority="interactive")
    auth = {"Authorization": f"Bearer {key}"}
    body = {"prompt": "go on", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with trio.fail_after(60):
        async with start_daemon(tiny_model, server=TWO) as d, \
                httpx.AsyncClient(base_url=d.url, headers=auth, timeout=30) as first, \
                httpx.AsyncClient(base_url=d.url, headers=auth, timeout=30) as second:
            state = d.daemon.state
            assert state is not None
            one, two = await _running(d)
            with _stopped(two["pid"]):  # the first stream through door one
                streaming = await first.send(first.build_request(
                    "POST", "/v1/completions", json=body), stream=True)
            try:
                assert streaming.status_code == 200
                await until(lambda: state.key_usage["solo"].open == 1)
                with _stopped(one["pid"]):  # the second through door two
                    r = await second.post("/v1/completions", json=body)
            finally:
                await streaming.aclose()
            assert r.status_code == 429, r.text
            assert "has 1 sequences in flight" in json.loads(r.text)["error"]["message"]
            await until(lambda: state.key_usage["solo"].open == 0)
            r = await second.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert [door["handed"] for door in _doors(d)][:2] >= [1, 1]


async def test_a_door_that_dies_is_restarted(
        tiny_model: Path, start_daemon: DaemonFactory) -> None:
    async with start_daemon(tiny_model, server=TWO) as d:
        one, _ = await _running(d)
        os.kill(one["pid"], signal.SIGKILL)
        await until(lambda: _doors(d)[0]["restarts"] == 1 and _doors(d)[0]["pid"] != one["pid"])
        assert d.daemon.state is not None
        assert d.daemon.state.metrics.registry.get_sample_value(
            "forged_door_restarts_total") == 1.0
        with _stopped(_doors(d)[1]["pid"]):  # so the new door answers
            answered = _doors(d)[0]["answered"]
            async with await _connect(d) as stream:
                answer, = await _exchange(stream, _get("/health"), 1)
        assert answer.startswith(b"HTTP/1.1 200 ")
        await until(lambda: _doors(d)[0]["answered"] == answered + 1)


async def test_a_door_that_cannot_start_is_tried_again(
        tiny_model: Path, start_daemon: DaemonFactory, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Out of processes or memory at a door's start: logged, and tried again, never
    the end of the daemon."""
    argv = Doors._argv
    tries: list[int] = []

    def failing_once(self: Doors, hub_fd: int) -> list[str]:
        tries.append(hub_fd)
        return ["/nonexistent/python"] if len(tries) == 1 else argv(self, hub_fd)

    monkeypatch.setattr(Doors, "_argv", failing_once)
    async with start_daemon(tiny_model, server={"door_processes": 1}) as d:
        door, = await _running(d)
        assert door["restarts"] == 1
    assert "cannot start a door process" in caplog.text


async def test_the_daemon_accepts_itself_while_no_door_is_ready(
        tiny_model: Path, start_daemon: DaemonFactory, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A door that exits as it starts (a broken install, a bug) must not take the API
    down: after FALLBACK_AFTER_S with no door ready the daemon accepts and serves the
    connections itself, and hands them back to the doors once one is ready."""
    argv = Doors._argv
    broken = [True]

    def exiting(self: Doors, hub_fd: int) -> list[str]:
        return [sys.executable, "-c", "raise SystemExit(3)"] if broken[0] \
            else argv(self, hub_fd)

    monkeypatch.setattr(Doors, "_argv", exiting)
    async with start_daemon(tiny_model, server={"door_processes": 1}) as d:
        assert d.daemon.state is not None
        report = d.daemon.state.door_report
        await until(lambda: report()["daemon_accepts"] is True)
        async with await _connect(d) as stream:
            answer, = await _exchange(stream, _get("/health"), 1)
        assert answer.startswith(b"HTTP/1.1 200 ")
        async with httpx.AsyncClient(base_url=d.url, timeout=30) as client:
            r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 200 and _doors(d)[0]["handed"] == 0
        assert _doors(d)[0]["restarts"] >= 2
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=d.admin_sock),
                                     base_url="http://admin", timeout=30) as admin:
            shown = "\n".join(status_door((await admin.get("/stats")).json()))
        assert "no door process is ready: the daemon accepts itself" in shown
        assert "restarts, not reporting steadily" in shown
        broken[0] = False
        await until(lambda: report()["daemon_accepts"] is False)
        await _running(d)  # the door answers again
    assert "the daemon accepts the API's connections itself" in caplog.text


async def test_the_daemons_own_accepting_retries_what_fails(
        tiny_model: Path, start_daemon: DaemonFactory, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Out of descriptors when the fallback copies the listening sockets (likely when
    doors cannot start either): logged and tried again a second later, never the end
    of the listener."""
    monkeypatch.setattr(Doors, "_argv", lambda self, fd: [sys.executable, "-c", "pass"])
    dup = socket.socket.dup
    failures = [2]

    def failing_dup(self: socket.socket) -> socket.socket:
        if failures[0]:
            failures[0] -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return dup(self)

    monkeypatch.setattr(socket.socket, "dup", failing_dup)
    async with start_daemon(tiny_model, server={"door_processes": 1}) as d:
        await until(lambda: failures[0] == 0)
        with trio.fail_after(10):
            while True:
                try:
                    async with await _connect(d) as stream:
                        answer, = await _exchange(stream, _get("/health"), 1)
                    break
                except (OSError, trio.BrokenResourceError, trio.TooSlowError):
                    await trio.sleep(0.2)
        assert answer.startswith(b"HTTP/1.1 200 ")
    assert "the daemon cannot accept either" in caplog.text


async def test_a_door_that_dies_soon_after_it_starts_or_stops_is_no_door(
        tiny_model: Path, start_daemon: DaemonFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """A door counts as accepting only while it reports, without a break for a while: one
    that takes its view and dies within a second, again and again, or one stopped
    (SIGSTOP, a blocked loop), leaves the daemon to accept. (A door was once counted
    ready as soon as its view was written to its pipe: one that lived 0.4 s a go kept
    the fallback off forever, and nothing accepted.)"""
    argv = Doors._argv
    dying = [True]

    def short_lived(self: Doors, hub_fd: int) -> list[str]:
        real = argv(self, hub_fd)
        if not dying[0]:
            return real
        return _wrapped_door(real, before="import os, threading; "
                             "threading.Timer(0.4, os._exit, (3,)).start()")

    monkeypatch.setattr(Doors, "_argv", short_lived)
    async with start_daemon(tiny_model, server={"door_processes": 1}) as d:
        assert d.daemon.state is not None
        report = d.daemon.state.door_report
        await until(lambda: report()["daemon_accepts"] is True)
        assert _doors(d)[0]["restarts"] >= 2
        async with await _connect(d) as stream:
            answer, = await _exchange(stream, _get("/health"), 1)
        assert answer.startswith(b"HTTP/1.1 200 ")
        dying[0] = False
        await until(lambda: report()["daemon_accepts"] is False)
        door, = await _running(d)
        with _stopped(door["pid"]):
            await until(lambda: report()["daemon_accepts"] is True)
            async with await _connect(d) as stream:  # the daemon answers meanwhile
                answer, = await _exchange(stream, _get("/health"), 1)
            assert answer.startswith(b"HTTP/1.1 200 ")
        await until(lambda: report()["daemon_accepts"] is False)


async def test_a_door_that_stops_reporting_is_killed_and_restarted(
        tiny_model: Path, start_daemon: DaemonFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """A door whose loop is blocked (here SIGSTOP) holds the connections it accepts:
    silent past STUCK_S, it is killed and restarted, as a worker that misses its
    heartbeat is."""
    monkeypatch.setattr(doors_module, "STUCK_S", 1.5)
    async with start_daemon(tiny_model, server={"door_processes": 1}) as d:
        door, = await _running(d)
        os.kill(door["pid"], signal.SIGSTOP)
        await until(lambda: _doors(d)[0]["restarts"] == 1)
        assert not _alive(door["pid"])
        new, = await _running(d)
        assert new["pid"] != door["pid"]


async def test_a_stuck_door_delays_no_other_doors_view(
        tiny_model: Path, start_daemon: DaemonFactory, tmp_path: Path) -> None:
    """Each door has its own sender: with a view larger than a pipe holds (many keys)
    and one door stopped, a drain's 503 still reaches the other within a second. (The
    views went to the doors one after another, so the other waited up to 5 s, until
    the stopped one was killed.)"""
    (tmp_path / "keys.toml").write_text("".join(
        f'[[key]]\nname = "k{i}"\nsha256 = "{i:064x}"\n' for i in range(1200)))
    async with start_daemon(tiny_model, server=TWO) as d:
        state = d.daemon.state
        assert state is not None
        stuck, _ = await _running(d)
        with _stopped(stuck["pid"]):
            await trio.sleep(0.3)
            state.leaving = True  # a new view for both: the stopped one's pipe fills
            await trio.sleep(0.3)
            state.leaving = False  # and another, which the stopped one cannot take
            await trio.sleep(0.3)
            state.leaving = True
            with trio.fail_after(1.5):
                while True:
                    async with await _connect(d) as stream:  # the other door answers
                        answer, = await _exchange(stream, _get("/health"), 1)
                    if answer.startswith(b"HTTP/1.1 503 "):
                        break
                    await trio.sleep(0.05)
            state.leaving = False


async def test_an_error_in_the_hubs_side_of_a_door_restarts_that_door_only(
        tiny_model: Path, start_daemon: DaemonFactory, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A bug in taking one door's message restarts that door (logged, counted); the
    listener, and with it the API, goes on. (It ended the door processes' task, which
    ended the listener.)"""
    take = Doors._take
    failed: list[int] = []

    def failing_once(self: Doors, door: Door, data: bytes, fds: list[int]) -> None:
        if not failed:
            failed.append(door.pid)
            for fd in fds:
                os.close(fd)
            raise RuntimeError("a bug")
        take(self, door, data, fds)

    monkeypatch.setattr(Doors, "_take", failing_once)
    async with start_daemon(tiny_model, server={"door_processes": 1}) as d:
        await until(lambda: bool(failed) and _doors(d)[0]["restarts"] == 1)
        door, = await _running(d)
        assert door["pid"] != failed[0]
    assert "failed: restarting it" in caplog.text and "RuntimeError: a bug" in caplog.text

async def test_a_door_whose_stop_fails_too_is_still_killed(
        tiny_model: Path, start_daemon: DaemonFactory, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The bug of the test above, again while the door is stopped: the stop still kills
    the door and closes its pipes (it skipped them: the old door lived on beside the
    new one, holding the listening socket)."""
    take = Doors._take
    failed: list[int] = []

    def failing_twice(self: Doors, door: Door, data: bytes, fds: list[int]) -> None:
        if len(failed) < 2:
            failed.append(door.pid)
            for fd in fds:
                os.close(fd)
            raise RuntimeError("a bug")
        take(self, door, data, fds)

    stop = Doors._stop
    stopped: list[socket.socket] = []

    async def recorded(self: Doors, ours: socket.socket, door: Door) -> None:
        stopped.append(ours)
        await stop(self, ours, door)

    monkeypatch.setattr(Doors, "_take", failing_twice)
    monkeypatch.setattr(Doors, "_stop", recorded)
    async with start_daemon(tiny_model, server={"door_processes": 1}) as d:
        await until(lambda: len(failed) == 2 and _doors(d)[0]["restarts"] == 1)
        await until(lambda: not _alive(failed[0]))
        door, = await _running(d)
        assert door["pid"] != failed[0]
        assert stopped[0].fileno() == -1  # the hub's end of the first door's pipe


async def test_doors_follow_the_daemons_state_and_keys(
        tiny_model: Path, start_daemon: DaemonFactory, tmp_path: Path) -> None:
    key = add_key(tmp_path / "keys.toml", "k", max_streams=2, max_queued=2,
                  priority="interactive")
    async with start_daemon(tiny_model, server=TWO) as d:
        state = d.daemon.state
        assert state is not None
        await _running(d)

        async def get(path: str, extra: bytes = b"") -> bytes:
            async with await _connect(d) as stream:
                answer, = await _exchange(stream, _get(path, extra), 1)
            return answer

        state.leaving = True  # a stop has begun: the balancer must hear 503 at once
        with trio.fail_after(5):
            while not (await get("/health")).startswith(b"HTTP/1.1 503 "):  # noqa: ASYNC110
                await trio.sleep(0.02)  # (another process's view)
        state.leaving = False
        # A known key is answered by a door; an unknown one gets the daemon's 401.
        handed = sum(door["handed"] for door in _doors(d))
        assert (await get("/v1/models", b"Authorization: Bearer %s\r\n" % key.encode())
                ).startswith(b"HTTP/1.1 200 ")
        assert sum(door["handed"] for door in _doors(d)) == handed
        assert (await get("/v1/models", b"Authorization: Bearer nope\r\n")
                ).startswith(b"HTTP/1.1 401 ")
        assert sum(door["handed"] for door in _doors(d)) == handed + 1


async def test_doors_follow_a_reload_of_the_log_level(
        tiny_model: Path, start_daemon: DaemonFactory, capfd: pytest.CaptureFixture[str]
        ) -> None:
    """A reload to log.level "warning" silences a door's access lines as the daemon's.
    (A door kept the level it started with: a /health it answered still wrote its
    forged.access line, one the daemon answered none.)"""
    async with start_daemon(tiny_model, server={"door_processes": 1}) as d:
        state = d.daemon.state
        assert state is not None
        await _running(d)
        assert "forged.access" in capfd.readouterr().out  # the door logs to our stdout
        quiet = msgspec.structs.replace(d.daemon.cfg, log=fc.LogConfig(level="warning"))
        d.daemon.config_path.write_text(as_toml(quiet))
        d.daemon.reload()
        assert d.daemon.cfg.log.level == "warning"
        for leaving in (True, False):  # a view the door is seen to have taken, twice
            state.leaving = leaving
            with trio.fail_after(5):
                while (await _health(d)).startswith(b"HTTP/1.1 200 ") == leaving:  # noqa: ASYNC110
                    await trio.sleep(0.02)  # (another process's view)
        capfd.readouterr()  # the door's lines (it logs to the stdout it shares) so far
        for _ in range(3):
            assert (await _health(d)).startswith(b"HTTP/1.1 200 ")
        await until(lambda: _doors(d)[0]["answered"] >= 3)  # the door's, not the daemon's
        assert "forged.access" not in capfd.readouterr().out


async def _health(d: RunningDaemon) -> bytes:
    async with await _connect(d) as stream:
        answer, = await _exchange(stream, _get("/health"), 1)
    return answer


@pytest.mark.parametrize("doors", [0, 1])
async def test_requests_the_hot_door_answered_count_towards_hypercorns_limit(
        tiny_model: Path, start_daemon: DaemonFactory, doors: int) -> None:
    """keep_alive_max_requests (1000) holds for a connection whatever answered its
    requests: after 999 hot ones, hypercorn's first answer on it is its last. (hypercorn
    counted from 0 when the connection was handed to it: nearly 2,000 requests.)"""
    async with start_daemon(tiny_model, server={"door_processes": doors}) as d:
        if doors:
            await _running(d)
        async with await _connect(d) as stream:
            answers = await _exchange(stream, _get("/health") * 999 + _get("/health", GENERAL),
                                      1000)
            assert b"connection: close" not in answers[-2]
            assert answers[-1].startswith(b"HTTP/1.1 200 ")
            assert b"\r\nconnection: close\r\n" in answers[-1]
            with trio.fail_after(10):
                assert await stream.receive_some(100) == b""


@pytest.mark.parametrize("doors", [0, 1])
async def test_a_slow_head_handed_over_has_the_keep_alive_it_began_with(
        tiny_model: Path, start_daemon: DaemonFactory, doors: int) -> None:
    """A head that began as a hot route's and turned out another's is hypercorn's from
    there, with what was left of its keep-alive (server.keep_alive_timeout bounds slow
    headers). hypercorn started a whole keep-alive of its own at the handoff: a slow
    head had nearly twice the time (1.5 s + 2 s here, 30 s + 30 s by default)."""
    async with start_daemon(tiny_model, server={"door_processes": doors,
                                                "keep_alive_timeout": 2.0}) as d:
        if doors:
            await _running(d)
        async with await _connect(d) as stream:
            started = trio.current_time()
            await stream.send_all(b"GET /he")
            await trio.sleep(1.5)
            await stream.send_all(b"x")  # no hot route's: handed over
            with trio.fail_after(5):
                assert await stream.receive_some(100) == b""
            assert trio.current_time() - started < 2.0 + 0.5


def test_a_fresh_connections_handoff_is_the_datagram_it_was() -> None:
    """A door's Handed names the requests it answered only when there were some: a
    daemon older than its doors (a package upgraded under it, a door restarted) then
    still takes the fresh connections it refuses unknown fields of."""
    assert msgspec.msgpack.decode(encoder.encode(Handed(b"GET"))) == {
        "type": "Handed", "data": b"GET"}
    assert from_door.decode(encoder.encode(Handed(b"GET", 3))) == Handed(b"GET", 3)
    assert from_door.decode(encoder.encode(Handed(b"GET", 0, 1.5))) == Handed(b"GET", 0, 1.5)


async def test_a_drain_stops_the_doors_and_lets_their_streams_finish(
        tiny_model: Path, start_daemon: DaemonFactory) -> None:
    """At a drain's start the doors stop accepting (as the daemon's own accepting did),
    the streams they handed over run to their end, and the port then refuses."""
    body = {"prompt": "go on", "max_tokens": 64, "ignore_eos": True, "stream": True}
    with trio.fail_after(60):
        async with start_daemon(tiny_model, server=TWO) as d, \
                httpx.AsyncClient(base_url=d.url, timeout=30) as client:
            doors = await _running(d)
            async with client.stream("POST", "/v1/completions", json=body) as streaming:
                assert streaming.status_code == 200
                d.daemon.begin_drain()
                await until(lambda: not any(_alive(door["pid"]) for door in doors))
                text = "".join([chunk async for chunk in streaming.aiter_text()])
            assert text.rstrip().endswith("data: [DONE]")
            with pytest.raises(OSError), trio.fail_after(5):
                while True:  # the daemon closes its copy of the socket just after
                    stream = await _connect(d)
                    await stream.aclose()
                    await trio.sleep(0.05)


async def test_at_a_drains_start_the_port_refuses_while_the_doors_stop(
        tiny_model: Path, start_daemon: DaemonFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the doors are told to stop, a new connection is refused (or, under socket
    activation, waits in systemd's socket for the next daemon), however long a door
    takes to exit. (The daemon kept its copy of the listening socket until every door
    had exited: a connection made meanwhile was queued, then reset.)"""
    argv = Doors._argv

    def slow_to_exit(self: Doors, hub_fd: int) -> list[str]:
        return _wrapped_door(argv(self, hub_fd), after="import time; time.sleep(2)")

    monkeypatch.setattr(Doors, "_argv", slow_to_exit)
    async with start_daemon(tiny_model, server={"door_processes": 1}) as d:
        door, = await _running(d)
        d.daemon.begin_drain()
        await trio.sleep(0.5)  # the door has stopped accepting; it exits 1.5 s later
        assert _alive(door["pid"])
        host, port = d.url.removeprefix("http://").rsplit(":", 1)
        with pytest.raises(ConnectionRefusedError):  # the kernel answers: no blocking
            socket.create_connection((host, int(port)), timeout=5).close()
        await until(lambda: not _alive(door["pid"]))


async def test_a_request_a_door_accepted_before_its_stop_is_answered_by_the_daemon(
        tiny_model: Path, start_daemon: DaemonFactory, caplog: pytest.LogCaptureFixture,
        ) -> None:
    """A connection a door accepted just before it was told to stop, whose client had
    sent nothing yet or part of a head, is read and handed to the daemon, which answers
    from its state now: during a drain, /health's 503. A second SIGTERM (``systemctl
    kill``, then the daemon's own) does not cut the door's stop short. (Such a
    connection was closed unanswered, and a second SIGTERM killed the door.)"""
    async with start_daemon(tiny_model, server={"door_processes": 1}) as d:
        door, = await _running(d)
        fresh, partial = await _connect(d), await _connect(d)
        await partial.send_all(b"GET /health HTTP/1.1\r\n")
        await until(lambda: _holds(door["pid"], fresh) and _holds(door["pid"], partial))
        os.kill(door["pid"], signal.SIGTERM)
        await trio.sleep(0.2)
        os.kill(door["pid"], signal.SIGTERM)
        await trio.sleep(0.2)
        assert d.daemon.state is not None
        d.daemon.state.leaving = True  # the daemon's state changed after the door's view
        await fresh.send_all(_get("/health"))
        await partial.send_all(b"Host: forged\r\n\r\n")
        for stream in (fresh, partial):
            answer, = await _exchange(stream, b"", 1)
            assert answer.startswith(b"HTTP/1.1 503 "), answer
            await stream.aclose()
        await until(lambda: _doors(d)[0]["restarts"] == 1)
        d.daemon.state.leaving = False
    assert f"door process {door['pid']} exited with code 0" in caplog.text


async def test_a_door_whose_daemon_has_gone_answers_nothing_from_its_last_view(
        tiny_model: Path, start_daemon: DaemonFactory) -> None:
    """A door learns that its daemon has died when its stdin closes, and stops; what it
    reads during its stop is handed, as at a drain, never answered from the view of a
    daemon that is gone. (It answered /health with its last view's 200 "ok" for the
    connections it had accepted: a dead node looked healthy to its balancer.) Here the
    daemon lives on, and answers what it is handed from its state now."""
    async with start_daemon(tiny_model, server={"door_processes": 1}) as d:
        door, = await _running(d)
        fresh = await _connect(d)
        await until(lambda: _holds(door["pid"], fresh))
        assert d.daemon.state is not None
        doors = d.daemon.state.door_report.__self__  # type: ignore[attr-defined]
        process = doors.doors[0].process
        assert process is not None and process.stdin is not None
        await process.stdin.aclose()  # to the door, its daemon has gone
        d.daemon.state.leaving = True  # a state the door's last view predates
        await fresh.send_all(_get("/health"))
        answer, = await _exchange(fresh, b"", 1)
        assert answer.startswith(b"HTTP/1.1 503 "), answer
        await fresh.aclose()
        await until(lambda: _doors(d)[0]["restarts"] == 1)
        d.daemon.state.leaving = False


@pytest.mark.parametrize("doors", [0, 1])
async def test_at_a_drain_a_connection_accepted_before_it_has_its_grace(
        tiny_model: Path, start_daemon: DaemonFactory, monkeypatch: pytest.MonkeyPatch,
        doors: int) -> None:
    """A connection accepted (by the daemon's hot door, or a door process) whose request
    comes within the grace after a drain's start (hotdoor.CLOSING_GRACE_S) is answered:
    the listeners stay up until that grace, and the doors' stop, are over; and then
    end, the connection of a client that sends nothing holding them no longer. (They
    were ended half a second into the drain, with the grace cut short and what the
    doors handed after it closed unread: an empty reply.)"""
    ended = listener_ends(monkeypatch)

    async with start_daemon(tiny_model, server={"door_processes": doors}) as d:
        pid = (await _running(d))[0]["pid"] if doors else os.getpid()
        late, silent = await _connect(d), await _connect(d)
        await until(lambda: _holds(pid, late) and _holds(pid, silent))
        d.daemon.begin_drain()
        started = trio.current_time()
        await trio.sleep(0.75)
        answer, = await _exchange(late, _get("/health"), 1)
        assert answer.startswith(b"HTTP/1.1 503 "), answer
        await until(lambda: len(ended) == 2, limit=5)  # the API's and the admin's
        assert max(ended) - started < 2.5  # the grace (1 s), a door's exit, 0.5 s
        for stream in (late, silent):
            await stream.aclose()


def _holds(pid: int, stream: trio.SocketStream) -> bool:
    """Process ``pid`` holds the server's end of ``stream`` (it has accepted it)."""
    port = stream.socket.getsockname()[1]
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[2].rsplit(":", 1)[1], 16) == port:  # its remote end: ours
                inodes.add(f"socket:[{fields[9]}]")
    held = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with suppress(FileNotFoundError):  # closed meanwhile
            held.add(os.readlink(fd))
    return bool(held & inodes)


def _door_pids(daemon_pid: int) -> list[int]:
    """The door processes of a daemon (any of its threads may have started them)."""
    pids = []
    for task in Path(f"/proc/{daemon_pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            if b"forged.daemon.doorproc" in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(int(pid))
    return pids


def test_doors_stop_when_the_daemon_dies_however_it_dies(
        tiny_model: Path, tmp_path: Path) -> None:
    """A daemon killed outright (SIGKILL: no drain, no SIGTERM to its doors) leaves no
    door accepting connections that nobody would serve: each sees its stdin close."""
    port = free_port()
    d = DaemonProcess(write_config(tmp_path / "forged.toml", tiny_model, port,
                                   server=TWO), port)
    try:
        d.wait_ready(120)
        deadline = time.monotonic() + 20
        while len(pids := _door_pids(d.proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(pids) == 2
        d.proc.kill()
        d.proc.wait(10)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in pids)
    finally:
        d.stop()


@pytest.mark.parametrize(("door_cpus", "setting", "expected"), [
    ([0, 8], "auto", 0),  # one core (and its hyperthread): the daemon accepts
    ([0, 1, 8, 9], "auto", 1),  # two cores: one door, and the daemon
    ([0, 1, 2, 3], "auto", 3),
    ([], "auto", 0),  # the door shares every CPU
    ([], 2, 2),  # set: kept
    ([0, 1, 8, 9], "tls", 0),  # with TLS the daemon accepts itself
    ([0, 1, 8, 9], "no hot door", 0),  # a door would hand over every request
    ([0, 1, 8, 9], "cors", 0),  # so would one with CORS (it answers none): they ran
])
def test_door_processes_default_to_the_doors_cores_but_one(
        door_cpus: list[int], setting: object, expected: int, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import msgspec

    import forged.config as fc
    from tests.test_config import _fake_cpus

    _fake_cpus(tmp_path, {cpu: cpu % 8 for cpu in range(16)})  # siblings: 0 and 8, ...
    monkeypatch.setattr(fc, "_SYS_CPU", tmp_path)
    monkeypatch.setattr(fc, "STARTED_ON", frozenset(range(16)))
    server: dict[str, object] = {"door_cpus": door_cpus, "door_processes": setting}
    if setting == "tls":
        server.update(door_processes=2, tls_cert="/c.pem", tls_key="/k.pem")
    elif setting == "no hot door":
        server.update(door_processes=2, hot_door=False)
    elif setting == "cors":
        server.update(door_processes=2, cors_origins=["https://ide.example"])
    cfg = msgspec.convert({"server": server}, fc.Config)
    assert cfg.door_processes[0] == expected
