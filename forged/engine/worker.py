"""The worker process's shell: its socket, its signals and its heartbeat.

``python -m forged.engine.worker FD`` talks frames over the inherited socket ``FD``.
It is a plain synchronous loop, so the GIL and llama.cpp never touch the daemon's
event loop, and a llama.cpp ``abort()`` only costs this process. Every decision is
the sans-IO :class:`~forged.engine.core.WorkerCore`'s; this module only moves bytes.

Each turn: read whatever frames arrived (block only while idle, at most until the
next heartbeat is due), hand them to the core, let it run one step, and send the
``Step`` frame it makes (always, once a heartbeat is due: an idle worker's heartbeat
is a ``Step`` with statistics and no events).
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import time
from contextlib import closing
from pathlib import Path

import msgspec

from forged.engine import frames as fr
from forged.engine.attention import Choice, Probe, choose, recall, remember
from forged.engine.backend import ContextParams, Embedder, Llama, Model, llama_version
from forged.engine.core import WorkerCore
from forged.engine.costmodel import calibrate
from forged.engine.decoding import Backend
from forged.engine.embedcore import EmbedCore
from forged.engine.kvdisk import DiskStore, model_identity
from forged.engine.testhooks import HookedBackend
from forged.placement import keep_to


class WorkerShell:
    def __init__(self, sock: socket.socket, init: fr.Init) -> None:
        self.sock = sock
        self.init = init
        self.hooks: HookedBackend | None = None
        self.core: WorkerCore | EmbedCore
        self.llama: Llama | Embedder
        # An embedding worker's context takes no flash attention: nothing to show.
        self.attention = Choice(bool(init.flash_attn),
                                "" if init.embedding else "set in the config")
        if init.embedding:
            self.llama = Embedder(init.model_path, _context_params(init, False))
            self.core = EmbedCore(self.llama, init.limits)
        else:
            model = Model(init.model_path)
            try:
                if init.flash_attn is None:
                    self.attention = _measured_attention(init, model)
                self.llama = Llama(model, _context_params(init, self.attention.flash_attn))
            except BaseException:
                model.close()
                raise
            self.core = self._generation_core(self.llama)
        self.inbuf = fr.FrameBuffer()
        self.running = True
        self._last_send = 0.0

    def _generation_core(self, llama: Llama) -> WorkerCore:
        init, lim = self.init, self.init.limits
        self.hooks = HookedBackend(llama) if init.test_hooks else None
        backend: Backend = self.hooks or llama
        disk = _disk_tier(init, self.attention.flash_attn)
        cost = calibrate(backend, lim.slots, flash_attn=self.attention.flash_attn,
                         per_slot=lim.per_slot)
        return WorkerCore(backend, lim, cost, disk=disk,
                          saved=disk.scan() if disk is not None else ())

    def _read_frames(self, timeout: float) -> list[fr.ToWorker]:
        ready, _, _ = select.select([self.sock], [], [], timeout)
        if not ready:
            return []
        data = self.sock.recv(fr.READ_SIZE)
        if not data:  # the daemon went away: nothing left to serve
            self.running = False
            return []
        return [fr.to_worker_decoder.decode(b) for b in self.inbuf.feed(data)]

    def _handle(self, frame: fr.ToWorker) -> None:
        match frame:
            case fr.Submit() | fr.Cancel() | fr.SetLimits() | fr.Unpin():
                self.core.handle(frame, time.monotonic())
            case fr.Renice(nice=n):
                renice(n)
            case fr.Shutdown():
                self.running = False
            case fr.Hang(seconds=s) if self.init.test_hooks:  # an embedding worker too
                time.sleep(s)
            case fr.SlowSteps() | fr.CrashOn() if self.hooks is not None:
                self.hooks.apply(frame)
            case _:
                pass  # a hook frame without test hooks, or a second Init: ignored

    def send(self, force: bool, hold: bool = False) -> None:
        now = time.monotonic()
        frame = self.core.frame(now, force, hold)
        if frame is not None:
            if frame.stats:  # a worker left nicer than asked (no RLIMIT_NICE) shows it
                frame.stats.nice = os.getpriority(os.PRIO_PROCESS, 0)
            for data in fr.encode_step(frame):
                self.sock.sendall(data)
            self._last_send = now

    def _flush(self) -> None:
        self.send(force=False)

    def run(self) -> None:
        while self.running:
            self.turn()

    def turn(self) -> None:
        """Read what arrived, handle it, run a step and send what it made."""
        hb = self.init.heartbeat_interval
        idle_for = max(0.0, hb - (time.monotonic() - self._last_send))
        if not self.core.busy:
            self._flush()  # nothing held while the loop sleeps
        frames = self._read_frames(0.0 if self.core.busy else idle_for)
        if frames:
            # Held text goes before handling what arrived: a submit's grammar or a
            # hook's hang takes as long as it takes, past the hold's budget.
            self._flush()
        for frame in frames:
            self._handle(frame)
        self.core.step(time.monotonic(), flush=self._flush)
        # After a cancel the statistics change with no event: send them at once.
        # A step's tokens may wait for the next step's (forged.engine.hold).
        self.send(force=bool(frames) or time.monotonic() - self._last_send >= hb,
                  hold=True)

    def close(self) -> None:
        try:
            self.core.persist()
        finally:
            self.core.close()
            self.llama.close()


def _context_params(init: fr.Init, flash_attn: bool) -> ContextParams:
    lim = init.limits
    if init.embedding:
        return ContextParams(n_ctx=lim.embed_batch, n_seq_max=lim.slots,
                             n_batch=lim.embed_batch, threads=init.threads)
    return ContextParams(
        n_ctx=lim.kv_cells, n_seq_max=lim.slots,
        n_batch=lim.batch_tokens, threads=init.threads,
        flash_attn=flash_attn, kv_unified=not lim.per_slot)


def _measured_attention(init: fr.Init, model: Model) -> Choice:
    """engine.flash_attn = "auto": what an earlier start measured for this model file,
    llama.cpp, CPU and threads (kept beside the saved states), or a measurement now.
    Not while loading beside serving models (a swap, a drop-in: ``init.nice``): their
    streams take the cores, which skews the timing (and slowed the load from 0.1 to
    4.7 s in a test); off until a start that can measure."""
    kept = Path(init.cache_dir) / "attention.json" if init.cache_dir else None
    identity = model_identity(init.model_path, llama_version(), _cpu_name(),
                              f"threads={init.threads}")
    if kept is not None and (known := recall(kept, identity)) is not None:
        return known
    if init.nice:
        return Choice(False, "not measured: loaded beside a serving model, whose streams "
                             "would skew the timing; off until the next start")
    with closing(Probe(model, init.threads)) as probe:
        choice = choose(probe.measure)
    if kept is not None:
        remember(kept, identity, choice)
    return choice


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return "?"


def _disk_tier(init: fr.Init, flash_attn: bool) -> DiskStore | None:
    if not init.cache_dir or not init.limits.cache_disk_bytes:
        return None
    identity = model_identity(init.model_path, llama_version(),
                              f"flash_attn={flash_attn}")
    try:
        return DiskStore(Path(init.cache_dir), identity)
    except OSError as exc:  # the daemon checked state_dir; a sub-folder may still fail
        print(f"forged worker: no disk tier for KV states: {exc}", file=sys.stderr)
        return None


def renice(nice: int) -> None:
    """Every thread of this process to ``nice`` (Linux's nice is per thread, and
    llama.cpp's compute threads are already running). Lowering it needs RLIMIT_NICE
    (forged.service's LimitNICE=); without, the worker stays nicer, and says so."""
    try:
        for tid in os.listdir("/proc/self/task"):
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
    except OSError as exc:
        print(f"forged worker: cannot set nice {nice}: {exc}", file=sys.stderr, flush=True)


def _read_init(sock: socket.socket) -> fr.Init:
    buf = fr.FrameBuffer()
    while True:
        data = sock.recv(fr.READ_SIZE)
        if not data:
            raise SystemExit(0)
        bodies = buf.feed(data)
        if bodies:
            frame = fr.to_worker_decoder.decode(bodies[0])
            if not isinstance(frame, fr.Init):
                raise SystemExit("worker: the first frame must be init")
            return frame


def main(argv: list[str]) -> int:
    # The daemon owns signals: a terminal's Ctrl-C must not kill the worker first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=int(argv[1]))
    init = _read_init(sock)
    keep_to(init.cpus)  # before llama.cpp starts threads: they inherit the mask
    if init.nice:
        renice(init.nice)  # before llama.cpp starts threads: they inherit it
    try:
        shell = WorkerShell(sock, init)
    except Exception as exc:
        print(f"forged worker: cannot start: {exc}", file=sys.stderr)
        return 1
    sock.sendall(fr.encode(fr.Ready(pid=os.getpid(), flash_attn=shell.attention.flash_attn,
                                    flash_attn_why=shell.attention.why)))
    shell.send(force=True)  # statistics before the first request
    try:
        shell.run()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the daemon is gone; exit quietly
    except msgspec.DecodeError as exc:
        print(f"forged worker: bad frame from the daemon: {exc}", file=sys.stderr)
        return 1
    finally:
        shell.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
