"""The models served, each by a group of workers, and the states a group goes through.

A :class:`ModelGroup` is one model with everything that follows from it: its config,
its :class:`~forged.engine.prompts.Prompter` (vocabulary, chat template, FIM tokens),
its :class:`~forged.engine.pool.EnginePool` (workers, limits, context) and the ids a
request names it by. :class:`Models` finds the group of a request's ``model``.

A group is ``loading`` (listed, not routed to), ``serving`` (its ids route to it), or
``draining`` (replaced by a swap, or its table removed: it finishes what it holds, then
stops). Each place of the config (``[model]`` is place 0, ``[[models]]`` follow) has
exactly one serving group; a swap puts a new group in its place (:meth:`Models.replace`),
and a reload adds places (:meth:`Models.add`) and withdraws them (:meth:`Models.withdraw`).

Resource handling: a request holds its group with :meth:`Models.use` for its whole life,
so that a draining group knows when nobody uses its prompter or its workers any more
(:meth:`ModelGroup.wait_idle`); only then is it stopped and its vocabulary freed.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import msgspec
import trio

from forged.config import EngineConfig, ModelConfig
from forged.engine.closing import Closing
from forged.engine.stats import Totals, added, counters_of
from forged.errors import ModelNotFound, NotServedHere

if TYPE_CHECKING:
    from forged.engine.pool import EnginePool
    from forged.engine.prompts import Prompter

GroupStatus = Literal["loading", "serving", "draining"]
# How /v1/models says it, in llama-server's words (its router mode's "status").
STATUS_WORDS: dict[GroupStatus, str] = {
    "loading": "loading", "serving": "loaded", "draining": "unloading"}
MIB = 1 << 20


def memory_bytes(prompter: Prompter, path: str, engine: EngineConfig) -> int:
    """What a group of this model allocates: the weights (the file, mapped) and each
    worker's KV cache. Compute buffers and the RAM tier of saved states are not
    counted: the first are small beside these, the second grows within its budget."""
    # An encoder keeps no KV cache.
    kv = 0 if prompter.embedding else prompter.vocab.kv_bytes_per_cell() * engine.kv_cells
    return os.path.getsize(path) + engine.workers * kv


def available_bytes() -> int:
    """The kernel's estimate of memory a new allocation may take (MemAvailable)."""
    return meminfo_bytes("MemAvailable")


def meminfo_bytes(field: str) -> int:
    """A line of /proc/meminfo (``MemTotal``, ``MemAvailable``, ...) in bytes; 0 if
    absent."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    return 0


class ModelGroup(Closing):
    """``fd``: the model file, held open for the group's life (ModelFile)."""

    def __init__(self, number: int, model: ModelConfig, prompter: Prompter,
                 pool: EnginePool, file: ModelFile, *, memory: int = 0,
                 place: int = 0) -> None:
        self.number = number  # tells a swap's two groups of one model apart
        self.model = model
        # The config place it was loaded for ([model] 0, then [[models]]); a serving
        # group's is Models.place_of (a withdrawal moves the places after it).
        self.place = place
        self.prompter = prompter
        self.pool = pool
        self.file = file
        self.memory = memory  # bytes, by memory_bytes
        self.ids = model.ids  # a swap's new group inherits the old one's too
        # The config table it serves ([[models]] are told apart by their own ids, so
        # a reload can add, change and remove them); a swap's new group inherits it.
        self.key = model.model_id
        self.status: GroupStatus = "loading"
        self.users = 0
        self._idle = trio.Event()
        self.retired = False
        self.scope = trio.CancelScope()  # its pool's task: cancelled to stop it
        self.stopped = trio.Event()
        # What the groups it replaced under its id counted (Models.replace).
        self.carried, self.carried_restarts = Totals(), 0

    def totals(self) -> Totals:
        """Its id's counts, as the metrics label them: its pool's, and the counters of
        the groups its id served before (a swap that keeps the id)."""
        return added(self.pool.totals(), self.carried)

    def restarts(self) -> int:
        return self.pool.restarts() + self.carried_restarts

    @property
    def model_id(self) -> str:
        return self.ids[0]

    @property
    def listed_id(self) -> str:
        """Its id in /v1/models: a group that is not serving shares its id with the
        one that is, so it is told apart by its number."""
        return self.model_id if self.status == "serving" else \
            f"{self.model_id}@g{self.number}"

    @property
    def max_context(self) -> int:
        return self.pool.limits.max_context

    @property
    def role(self) -> str:
        """What it serves of the requests that name no model: as configured, else
        "embed" when its GGUF pools (an embedding model), "fim" when it has
        fill-in-the-middle tokens, else "chat"."""
        if self.model.role:
            return self.model.role
        if self.prompter.embedding:
            return "embed"
        return "fim" if self.prompter.fim is not None else "chat"

    @contextmanager
    def use(self) -> Iterator[ModelGroup]:
        self.users += 1
        try:
            yield self
        finally:
            self.users -= 1
            if self.users == 0:
                self._idle.set()
                self._idle = trio.Event()
                if self.retired:
                    self.close()

    async def wait_idle(self) -> None:
        """Until no request holds this group."""
        while self.users:
            await self._idle.wait()

    def retire(self) -> None:
        """Its workers are gone: free its vocabulary and file once no request holds it
        (one may still be tokenizing in a thread)."""
        self.retired = True
        if self.users == 0:
            self.close()

    def close(self) -> None:
        """Idempotent, as the prompter's and the file's own are."""
        self.prompter.close()
        self.file.close()


Stamp = tuple[int, int, int, int]


def file_stamp(path: str) -> Stamp:
    """What tells a new model file at the same path from the old one (a package
    upgrade writes a new file and renames it over the old)."""
    try:
        return _stamp(os.stat(path))
    except OSError:
        return (0, 0, 0, 0)


def _stamp(st: os.stat_result) -> Stamp:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class ModelFile(Closing):
    """A group's model file, held open: its workers load it through the descriptor
    (``/proc/self/fd/N``, which follows the inode), so a worker restarted after a
    package put a new file at the path (a swap refused for memory, say) still loads
    the model the group's vocabulary belongs to."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self.stamp = _stamp(os.fstat(self.fd))

    @property
    def worker_path(self) -> str:
        """The path a worker given ``fd`` (pass_fds keeps its number) opens."""
        return f"/proc/self/fd/{self.fd}"

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Models:
    """The groups: one serving per config place, and those loading or draining."""

    def __init__(self, serving: list[ModelGroup]) -> None:
        for group in serving:
            group.status = "serving"
        self.serving = serving
        self.others: list[ModelGroup] = []
        self._numbers = len(serving)
        # The counters of the groups gone (swapped out, withdrawn, failed to start): the
        # node's totals never go down when one stops.
        self.retired = Totals()

    def next_number(self) -> int:
        self._numbers += 1
        return self._numbers

    @property
    def default(self) -> ModelGroup:
        """The group of requests that name no model: [model]'s."""
        return self.serving[0]

    def all(self) -> list[ModelGroup]:
        return [*self.serving, *self.others]

    def resolve(self, model: str | None, *, fim: bool = False,
                embed: bool | None = False) -> ModelGroup:
        """The serving group ``model`` names; ModelNotFound if none does. None: the
        first whose role fits the request (``fim``: fill-in-the-middle; ``embed``:
        embeddings), else the first generation model: editors send no model name, and
        an appliance serving a chat model and a small FIM model must send each request
        to the right one. An embedding model serves embeddings only, and only it does
        (NotServedHere otherwise); ``embed`` None takes either (tokenizing)."""
        group = self._named(model) if model is not None else self._by_role(
            "embed" if embed else "fim" if fim else "chat")
        if embed is not None and (group.role == "embed") != embed:
            raise NotServedHere(group.model_id, embed)
        return group

    def _named(self, model: str) -> ModelGroup:
        for group in self.serving:
            if model in group.ids:
                return group
        raise ModelNotFound(model)

    def _by_role(self, role: str) -> ModelGroup:
        fits = [g for g in self.serving if g.role == role]
        if fits or role == "embed":
            return fits[0] if fits else self.default  # the default then says why not
        return next((g for g in self.serving if g.role != "embed"), self.default)

    def listed(self, model_id: str) -> ModelGroup:
        """The group listed under ``model_id`` in /v1/models (any status)."""
        for group in self.all():
            if model_id == group.listed_id or (group.status == "serving"
                                               and model_id in group.ids):
                return group
        raise ModelNotFound(model_id)

    @contextmanager
    def use(self, model: str | None, *, fim: bool = False,
            embed: bool | None = False) -> Iterator[ModelGroup]:
        with self.resolve(model, fim=fim, embed=embed).use() as group:
            yield group

    def place_of(self, group: ModelGroup) -> int:
        return self.serving.index(group)

    def loading_for(self, place: int) -> list[ModelGroup]:
        """The group a swap (or addition) loads for ``place``, if one does: loads hold
        the swapper's lock, so no place moves under it."""
        return [g for g in self.others if g.status == "loading" and g.place == place]

    def add_loading(self, group: ModelGroup) -> None:
        self.others.append(group)

    def replace(self, place: int, new: ModelGroup) -> ModelGroup:
        """Route ``place``'s requests to ``new`` from now on; the old group drains. The
        new group answers to the old one's ids too, so that clients that name it keep
        working."""
        old = self.serving[place]
        if new.model_id == old.model_id:
            # The id's counters go on from the old group's: they started from 0 again,
            # which Prometheus reads as a reset. The old group drains as ID@gN, a
            # series of its own from its count now.
            new.carried = added(old.carried, counters_of(old.pool.totals()))
            new.carried_restarts = old.restarts()
        new.ids = [*new.ids, *(i for i in old.ids if i not in new.ids)]
        new.key = old.key
        self.others.remove(new)
        new.status, old.status = "serving", "draining"
        self.serving[place] = new
        self.others.append(old)
        return old

    def add(self, new: ModelGroup) -> None:
        """A new place, after the others: ``new`` (loaded) serves from now on."""
        self.others.remove(new)
        new.status = "serving"
        self.serving.append(new)

    def withdraw(self, group: ModelGroup) -> None:
        """Its place goes (never [model]'s): its ids stop routing, and it drains."""
        assert group is not self.default
        self.serving.remove(group)
        group.status = "draining"
        self.others.append(group)

    def extra(self) -> dict[str, ModelGroup]:
        """The serving groups of [[models]] tables, by their table's id."""
        return {g.key: g for g in self.serving[1:]}

    def remove(self, group: ModelGroup) -> None:
        self.others.remove(group)
        self.retired = added(self.retired, counters_of(group.pool.totals()))

    def memory_in_use(self) -> int:
        return sum(g.memory for g in self.all())

    def disk_folders(self) -> set[Path]:
        """Every worker's folder of saved KV states (EnginePool.disk_folders)."""
        return {f for g in self.all() for f in g.pool.disk_folders()}


def kv_cache_dir(state_dir: str, file: ModelFile, model: ModelConfig) -> Path:
    """Where a model's workers keep saved KV states: one folder per model file (its
    path and its inode) and table (its id, settings, aliases: all of it), so that two
    models served at once (one file may serve as two, a FIM model and a chat model with
    their own settings), or a swap's two (a package upgrade's new file at one path, or
    an edited table of the same file), never share one; a restart of the same config
    finds its folders again."""
    name = Path(file.path).name.removesuffix(".gguf")
    key = (f"{Path(file.path).absolute()}\0{file.stamp[:2]}\0".encode()
           + msgspec.json.encode(model))
    return Path(state_dir) / "kvcache" / f"{name}-{hashlib.sha256(key).hexdigest()[:8]}"


def pick_memory(limit_mib: int, in_use: int) -> float:
    """Bytes a new group may take: the configured budget less what the groups take,
    or, without one, what the kernel says is available."""
    if limit_mib:
        return limit_mib * MIB - in_use
    available = available_bytes()
    return float(available) if available else math.inf
