"""Best-effort side work (turn artifacts, turn events) kept off a turn's critical path.

Creating a markdown artifact is one API call that took ≈ 40 ms on a local
server — more than the rest of a durable turn's overhead together — and building
and queueing a Prefect event costs the loop a millisecond or two. Neither changes
anything durable, so a turn hands them over here and returns:

* :func:`spawn` starts a coroutine in the background now;
* :func:`defer` queues work for this loop's next *batch*: one flusher task runs
  everything queued within ``PREFECT_CODER_BATCH_S`` (default 1 s) together
  (bounded concurrency), in the context each item was queued from (so a Prefect
  event still names its own task run). A 20-turn run on a fast model then makes
  one burst of artifact calls instead of racing its turns for the loop with 20.

The end of every flow in this package waits for both (:func:`drain`, which also
flushes the batch at once), so nothing is lost when the flow-run process exits.
A workflow's end waits only for its own items (:func:`scope`): in a fan-out
shard many workflows share the loop, and one workflow's end must not wait on
(or flush early) its neighbours' artifacts and events.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any

__all__ = ["BATCH_ENV", "Scope", "batch_delay_s", "defer", "drain", "scope", "spawn"]

#: Environment variable: the longest a deferred item waits for its batch (seconds).
BATCH_ENV = "PREFECT_CODER_BATCH_S"
DEFAULT_BATCH_S = 1.0
#: A batch this large is flushed at once (a busy fan-out process).
MAX_BATCH = 64
#: Items of one batch in flight at a time (API calls racing the turns otherwise).
CONCURRENCY = 8

_log = logging.getLogger(__name__)
_pending: set[asyncio.Task[Any]] = set()

Deferred = Callable[[], Awaitable[Any] | None]


def batch_delay_s() -> float:
    """``PREFECT_CODER_BATCH_S`` (default 1 s; 0 flushes on the next loop iteration)."""
    raw = os.environ.get(BATCH_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_BATCH_S
    except ValueError:
        return DEFAULT_BATCH_S
    return value if value >= 0 else DEFAULT_BATCH_S


class Scope:
    """The background items started or queued inside one :func:`scope` (one workflow)."""

    __slots__ = ("items",)

    def __init__(self) -> None:
        #: Spawned tasks, and one future per deferred item (done once it ran).
        self.items: set[asyncio.Future[Any]] = set()

    def _add(self, item: asyncio.Future[Any]) -> None:
        self.items.add(item)
        item.add_done_callback(self.items.discard)


_scope: contextvars.ContextVar[Scope | None] = contextvars.ContextVar(
    "prefect_coder_background_scope", default=None
)


@contextlib.contextmanager
def scope() -> Iterator[Scope]:
    """Collect the background items started in this context (and in tasks and items
    it starts), so that ``drain(only=...)`` waits for just those."""
    mine = Scope()
    token = _scope.set(mine)
    try:
        yield mine
    finally:
        _scope.reset(token)


def _done(task: asyncio.Task[Any]) -> None:
    _pending.discard(task)
    if not task.cancelled() and task.exception() is not None:
        _log.warning("background %s failed: %r", task.get_name(), task.exception())


def spawn(coro: Coroutine[Any, Any, Any], *, name: str) -> None:
    """Run ``coro`` in the background of the current event loop."""
    task = asyncio.get_running_loop().create_task(coro, name=name)
    _pending.add(task)
    task.add_done_callback(_done)
    owner = _scope.get()
    if owner is not None:
        owner._add(task)


_Item = tuple[str, contextvars.Context, Deferred, "asyncio.Future[None] | None"]


class _Batch:
    def __init__(self) -> None:
        self.items: list[_Item] = []
        self.wake = asyncio.Event()
        self.flusher: asyncio.Task[None] | None = None


_batches: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Batch] = weakref.WeakKeyDictionary()


def defer(fn: Deferred, *, name: str) -> None:
    """Call ``fn()`` (and await what it returns) in this loop's next batch, in the
    current context. Failures are logged, never raised."""
    loop = asyncio.get_running_loop()
    batch = _batches.get(loop)
    if batch is None:
        batch = _batches[loop] = _Batch()
    owner = _scope.get()
    ran: asyncio.Future[None] | None = None
    if owner is not None:
        ran = loop.create_future()
        owner._add(ran)
    batch.items.append((name, contextvars.copy_context(), fn, ran))
    if batch.flusher is None:
        batch.wake = asyncio.Event()  # a drain of an empty batch may have set the old one
        task = loop.create_task(_flush_later(batch), name="background batch")
        batch.flusher = task
        _pending.add(task)
        task.add_done_callback(_done)
    if len(batch.items) >= MAX_BATCH:
        batch.wake.set()


async def _flush_later(batch: _Batch) -> None:
    try:
        async with asyncio.timeout(batch_delay_s()):
            await batch.wake.wait()
    except TimeoutError:
        pass
    # Items queued from here on start the next batch (and its own flusher).
    items, batch.items, batch.flusher = batch.items, [], None
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(
        name: str, ctx: contextvars.Context, fn: Deferred, ran: asyncio.Future[None] | None
    ) -> None:
        try:
            async with gate:
                result = ctx.run(fn)
                if result is not None:
                    # The awaitable runs in the item's own context too.
                    await asyncio.get_running_loop().create_task(_awaited(result), context=ctx)
        except Exception as exc:
            _log.warning("background %s failed: %r", name, exc)
        finally:
            if ran is not None and not ran.done():
                ran.set_result(None)

    await asyncio.gather(*(one(*item) for item in items))


async def _awaited(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


async def drain(bound_s: float = 30.0, *, only: Scope | None = None) -> None:
    """Flush this loop's batch now and wait (bounded) for its background work;
    failures are only logged.

    ``only``: wait just for the items of that :func:`scope` (the batch is flushed
    only if it holds one of them); otherwise for everything on this loop."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound_s
    # Rounds: a flushed item may queue more work (a live view's final publish).
    while True:
        batch = _batches.get(loop)
        if batch is not None and batch.flusher is not None:
            if only is None or any(item[3] in only.items for item in batch.items):
                batch.wake.set()
        if only is None:
            mine: list[asyncio.Future[Any]] = [
                t for t in _pending if t.get_loop() is loop and not t.done()
            ]
        else:
            mine = [t for t in only.items if not t.done()]
        left = deadline - loop.time()
        if not mine or left <= 0:
            return
        await asyncio.wait(mine, timeout=left)
