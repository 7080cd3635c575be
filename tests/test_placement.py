"""CPU placement (forged.placement): the door keeps to server.door_cpus, and its
workers, with every thread llama.cpp starts, to the other CPUs or engine.cpus."""

from __future__ import annotations

from pathlib import Path

import pytest

from forged import config as fc
from forged.config import STARTED_ON, worker_cpus
from tests.daemonproc import free_port, serve, write_config

TWO = len(STARTED_ON) >= 2


def test_workers_get_their_own_cpus_or_all_but_the_doors() -> None:
    assert worker_cpus([], []) == []  # nothing asked: left where started
    assert worker_cpus([3, 1], [0]) == [1, 3]  # engine.cpus wins
    door = min(STARTED_ON)
    assert worker_cpus([], [door]) == sorted(STARTED_ON - {door}) or sorted(STARTED_ON)
    assert worker_cpus([], sorted(STARTED_ON)) == sorted(STARTED_ON)  # the door took all


def test_a_cpu_forged_may_not_run_on_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "forged.toml"
    for table, key in (("server", "door_cpus"), ("engine", "cpus")):
        path.write_text(f"[{table}]\n{key} = [4095]\n")
        with pytest.raises(fc.ConfigError, match=rf"{table}\.{key}: CPU 4095 is not one"):
            fc.load(path)


def _allowed(pid: int) -> set[str]:
    """The CPU lists of every thread of ``pid``."""
    lists = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                lists.add(line.split()[1])
    return lists


def _children(pid: int) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
            for c in (task / "children").read_text().split()]


@pytest.mark.skipif(not TWO, reason="needs two CPUs")
def test_the_door_and_every_worker_thread_keep_to_their_cpus(
        tiny_model: Path, tmp_path: Path) -> None:
    door, rest = min(STARTED_ON), sorted(STARTED_ON - {min(STARTED_ON)})
    port = free_port()
    config = write_config(tmp_path / "forged.toml", tiny_model, port,
                          server={"door_cpus": [door]}, engine={"threads": len(rest)})
    for d in serve(config, port):
        assert _allowed(d.proc.pid) == {str(door)}
        workers = _children(d.proc.pid)
        assert workers
        expected = str(rest[0]) if len(rest) == 1 else f"{rest[0]}-{rest[-1]}"
        for pid in workers:  # llama.cpp's threads included: they started after the mask
            assert _allowed(pid) == {expected}
