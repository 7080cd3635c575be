"""Model groups' lives: open one, run it, swap one for another, add one and withdraw
one, under live traffic.

A swap (a reload whose ``model.path`` or [[models]] table changed, or whose file was
replaced at the same path; or ``forged model swap PATH`` on the admin listener) runs
these steps, and a failure at any of them leaves the old model serving and says why
(an addition, a new [[models]] table, runs steps 1-4 and then takes requests; a
withdrawal, a table gone, runs step 5's drain):

1. load the new model's vocabulary and chat template (the file is checked first);
2. check memory: the new weights and KV caches must fit beside the groups running
   (``engine.memory_mib``, or what the kernel reports available);
3. start the new group's workers, listed as ``loading`` in /v1/models;
4. run one request through it (one step, one token), so that it is known to decode;
5. route the old group's ids to it; the old group drains: its streams finish, within
   ``server.drain_timeout``; then its workers stop and its vocabulary is freed.

Resource handling: every group's pool runs in the daemon's engine nursery, in the
group's own cancel scope, so a swap stops exactly the group it replaced. Requests
hold their group (``Models.use``) for their whole life; the drain waits for them.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import trio

from forged import config as fc
from forged.daemon.startup import model_key, named_path, open_prompter
from forged.engine.groups import (
    MIB,
    ModelFile,
    ModelGroup,
    Models,
    file_stamp,
    kv_cache_dir,
    memory_bytes,
    pick_memory,
)
from forged.engine.pool import EnginePool
from forged.engine.request import Request, Sampling
from forged.errors import ForgedError, SwapRefused, Unavailable, sole_fault

log = logging.getLogger("forged")
# The nice value a swap's new model loads at, beside the serving one (frames.Init.nice).
LOAD_NICE = 10


def open_group(config_path: Path, cfg: fc.Config, place: int, model: fc.ModelConfig,
               number: int, *, test_hooks: bool, given: bool = False) -> ModelGroup:
    """A group for ``model`` (not running yet): its vocabulary is loaded, so a bad
    file is a ConfigError here (``given``: its path was given to ``forged model
    swap``, see named_path). Its workers get [engine] with the model's own engine
    settings over it. Blocking: run it in a thread. Its caller closes it (it is a
    context manager), or hands it to the swapper, which does when it is retired."""
    cfg = cfg.placed(place, model)
    threads_why = cfg.threads_why(model)
    cfg = cfg.for_model(model)
    key = model_key(place)
    with contextlib.ExitStack() as opened:  # closed unless the group is made
        prompter = opened.enter_context(open_prompter(config_path, model, key, given=given))
        try:
            # After the vocabulary, so that open_prompter says what is wrong with a bad
            # file. A file replaced in the moment between the two would go unnoticed.
            file = opened.enter_context(ModelFile(model.path))
        except OSError as exc:
            raise fc.ConfigError(f"{named_path(config_path, key, model.path, given=given)}: "
                                 f"cannot open: {exc.strerror}") from exc
        pool = EnginePool(cfg, model, prompter.n_ctx_train, test_hooks=test_hooks,
                          cache_dir=kv_cache_dir(cfg.server.state_dir, file, model),
                          model_fd=file.fd, embedding=prompter.embedding,
                          threads_why=threads_why)
        group = ModelGroup(number, model, prompter, pool, file,
                           memory=memory_bytes(prompter, model.path, cfg.engine), place=place)
        opened.pop_all()  # the group closes them now
        return group



async def run_group(group: ModelGroup, *,
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Run the group's workers until its scope is cancelled; ``started()`` once every
    worker has loaded the model."""
    try:
        with group.scope:
            await group.pool.run(task_status=task_status)
    finally:
        group.stopped.set()


async def warm_up(group: ModelGroup) -> None:
    """One greedy token (an embedding model: one embedding) through the group: its
    workers load, compute and answer."""
    if group.pool.embedding:
        prompt = group.prompter.tokenize("Hello", add_special=True, parse_special=False)
        request = Request(prompt=prompt, max_tokens=0, inputs=[len(prompt)])
    else:
        prompt = group.prompter.encode_completion("Hello") or [0]
        request = Request(prompt=prompt, max_tokens=1, sampling=Sampling(temperature=0.0),
                          cache=False)
    async with group.pool.open_request(request) as rs:
        try:
            while not rs.finished:
                await rs.receive()
            rs.raise_failure()
        except ForgedError as exc:
            raise Unavailable(f"its first request failed: {exc}", 1) from exc


# What ends a new group's start that is a refusal, not a bug: a worker that did not
# start, a failed first request, or the deadline.
_START_FAULTS = (RuntimeError, ForgedError, trio.TooSlowError)


class Swapper:
    """Swaps the model of a config place; one swap at a time: a swap asked for while
    another runs is refused (``wait``: it waits its turn, as a reload's does)."""

    def __init__(self, models: Models, engine: trio.Nursery, config_path: Path, *,
                 test_hooks: bool) -> None:
        self.models = models
        self.engine = engine
        self.config_path = config_path
        self.test_hooks = test_hooks
        self._lock = trio.Lock()

    async def swap(self, cfg: fc.Config, place: int, model: fc.ModelConfig, *,
                   wait: bool = False, given: bool = False) -> ModelGroup:
        """Serve ``model`` in ``place`` instead of its current group; the new group
        once it serves (the old one drains in the background). SwapRefused if not.
        ``given``: its path was given to ``forged model swap``, in no config file."""
        if self._lock.locked() and not wait:
            raise SwapRefused("a model swap is already under way")
        async with self._lock:
            self._check_ids(place, model)
            self._check_not_serving(place, model)
            new = await self._start(cfg, place, model, given=given)
            if self.models.default.pool.draining:  # a stop began while it loaded
                await self._stop(new)
                raise SwapRefused("the server is shutting down")
        new.pool.renice(0)
        old = self.models.replace(place, new)
        log.info("model swap: %s (%s) serves; %s drains", new.model_id, new.model.path,
                 old.listed_id)
        self.engine.start_soon(self._retire, old, cfg.server.drain_timeout,
                               cfg.limits.retry_after)
        return new

    async def add(self, cfg: fc.Config, model: fc.ModelConfig) -> ModelGroup:
        """Serve ``model`` in a new place, as a swap loads one (steps 1-4); the new
        group once it serves. SwapRefused if not."""
        async with self._lock:
            place = len(self.models.serving)
            self._check_ids(place, model)
            new = await self._start(cfg, place, model)
            if self.models.default.pool.draining:
                await self._stop(new)
                raise SwapRefused("the server is shutting down")
        new.pool.renice(0)
        self.models.add(new)
        log.info("model added: %s (%s) serves", new.model_id, new.model.path)
        return new

    async def withdraw(self, cfg: fc.Config, key: str) -> None:
        """Stop routing to the group of the [[models]] table ``key`` (removed from the
        config); it drains as a swapped-out group does. Looked up under the lock: a
        swap may have put another group in its place meanwhile."""
        async with self._lock:
            group = self.models.extra().get(key)
            if group is None:
                return
            self.models.withdraw(group)
        log.info("model removed: %s drains", group.listed_id)
        self.engine.start_soon(self._retire, group, cfg.server.drain_timeout,
                               cfg.limits.retry_after)

    def _check_ids(self, place: int, model: fc.ModelConfig) -> None:
        """The new model may not take an id another model answers to."""
        for other, group in enumerate(self.models.serving):
            taken = set(model.ids) & set(group.ids)
            if other != place and taken:
                raise SwapRefused(f"the model id {sorted(taken)[0]!r} is taken by the "
                                  f"model {group.model_id!r}; set its name")

    def _check_not_serving(self, place: int, model: fc.ModelConfig) -> None:
        """A swap to what the place serves (the same table, the same file at its path)
        changes nothing, and would run two groups on one folder of saved states: the
        old one's stop writes its files beside the new one's, which never indexed them.
        An edited table of the same file is a swap (a folder of its own)."""
        serving = self.models.serving[place]
        if serving.model == model and serving.file.stamp == file_stamp(model.path):
            raise SwapRefused(f"{model.path} is the file {serving.model_id} serves now, "
                              "with these settings; a restart loads it again")

    async def _start(self, cfg: fc.Config, place: int, model: fc.ModelConfig, *,
                     given: bool = False) -> ModelGroup:
        number = self.models.next_number()
        try:
            new = await trio.to_thread.run_sync(
                lambda: open_group(self.config_path, cfg, place, model, number,
                                   test_hooks=self.test_hooks, given=given))
        except (fc.ConfigError, OSError) as exc:  # OSError: its file gone or unreadable
            raise SwapRefused(f"the new model cannot be loaded: {exc}") from exc
        self._check_memory(cfg, new)
        new.pool.nice = LOAD_NICE
        self.models.add_loading(new)
        log.info("loading %s (%s) beside the models serving", model.model_id, model.path)
        try:
            with trio.fail_after(new.pool.cfg.engine.group_start_s):
                await self.engine.start(run_group, new)
                await warm_up(new)
        except BaseException as exc:
            # Whatever ends the load (a fault, or the admin's client leaving): the new
            # group goes, and the old one serves on.
            await self._stop(new)
            fault = sole_fault(exc, _START_FAULTS)
            if fault is None:
                raise
            raise SwapRefused(f"the new model failed to start: {fault}") from exc
        return new

    def _check_memory(self, cfg: fc.Config, new: ModelGroup) -> None:
        room = pick_memory(cfg.engine.memory_mib, self.models.memory_in_use())
        if new.memory > room:
            new.close()
            source = ("engine.memory_mib less the models running" if cfg.engine.memory_mib
                      else "available memory (MemAvailable)")
            raise SwapRefused(
                f"not enough memory to load {new.model.path} beside the running "
                f"model: it needs about {new.memory / MIB:.0f} MiB (weights and "
                f"{cfg.engine.workers} KV caches), {source} is {room / MIB:.0f} MiB")

    async def _retire(self, old: ModelGroup, deadline: float, retry_after: int) -> None:
        """Let the old group's streams finish (until ``deadline`` seconds), then stop it."""
        with trio.move_on_after(deadline):
            await old.wait_idle()
        if old.users:
            log.warning("model swap: %d requests on %s passed the drain deadline; "
                        "ending them", old.users, old.listed_id)
        old.pool.fail_all(Unavailable("the model was replaced, and this request did not "
                                      "finish within the swap's drain deadline",
                                      retry_after))
        await self._stop(old)
        log.info("%s stopped", old.listed_id)

    async def _stop(self, group: ModelGroup) -> None:
        """Stop the group's workers and forget it; its vocabulary and file are freed
        once no request holds it (ModelGroup.retire)."""
        group.scope.cancel()
        with trio.CancelScope(shield=True), trio.move_on_after(60):
            await group.stopped.wait()  # STOP_GRACE per worker, in parallel
        if not group.stopped.is_set():
            log.error("model swap: the workers of %s did not stop within 60 s",
                      group.listed_id)
        self.models.remove(group)
        group.retire()
