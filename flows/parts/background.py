"""Best-effort side work (turn artifacts) kept off a turn's critical path.

Creating a markdown artifact is one API call that took ≈ 40 ms on a local
server — more than the rest of a durable turn's overhead together. It changes
nothing durable, so a turn spawns it here and moves on; the next turn and the
end of every flow in this package wait for it (:func:`drain`), so nothing is
lost when the flow-run process exits.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

__all__ = ["drain", "spawn"]

_log = logging.getLogger(__name__)
_pending: set[asyncio.Task[Any]] = set()


def _done(task: asyncio.Task[Any]) -> None:
    _pending.discard(task)
    if not task.cancelled() and task.exception() is not None:
        _log.warning("background %s failed: %r", task.get_name(), task.exception())


def spawn(coro: Coroutine[Any, Any, Any], *, name: str) -> None:
    """Run ``coro`` in the background of the current event loop."""
    task = asyncio.get_running_loop().create_task(coro, name=name)
    _pending.add(task)
    task.add_done_callback(_done)


async def drain(bound_s: float = 30.0) -> None:
    """Wait (bounded) for this loop's background work; failures are only logged."""
    loop = asyncio.get_running_loop()
    mine = [t for t in _pending if t.get_loop() is loop and not t.done()]
    if mine:
        await asyncio.wait(mine, timeout=bound_s)
