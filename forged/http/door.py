"""The door's CPU work, off the event loop.

Work that grows with a request (decoding a large JSON body, tokenizing, rendering a
chat template, converting and checking a grammar, listing token pieces) runs in a
thread, at most ``server.door_threads`` at once. Few threads on purpose: such work holds
the GIL, and every thread that wants it delays the event loop's turn, which is what
every held stream and every health probe waits on. A request waits at most
``server.door_timeout`` for a thread, then gets a 503 it can retry.

It runs after the request's per-key limits (forged.http.keylimits), so a key at its
limit costs nobody this work.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

import trio

from forged import errors as e

T = TypeVar("T")


async def in_thread(limiter: trio.CapacityLimiter, wait_s: float, retry_after: int,
                    fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` in a thread of ``limiter``, waiting at most ``wait_s`` for one.

    Error handling: a wait past ``wait_s`` is an Overloaded (503 with Retry-After);
    once the thread runs, the call is not abandoned (a cancelled caller waits for it),
    so the thread's limiter place is never held by orphaned work."""
    try:
        with trio.fail_after(wait_s):
            await limiter.acquire()
    except trio.TooSlowError as exc:
        raise e.Overloaded("the server is busy preparing other requests; retry",
                           retry_after) from exc
    try:
        return await trio.to_thread.run_sync(fn, *args, limiter=_UNBOUNDED)
    finally:
        limiter.release()


# to_thread's own limiter for the door's calls: never a wait (the caller's limiter is
# the bound; to_thread's default one, 40 threads shared by the process, is not).
_UNBOUNDED = trio.CapacityLimiter(math.inf)
