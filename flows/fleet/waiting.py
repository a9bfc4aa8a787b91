"""How a turn waits for a slot: this process's claim queue, and what a waiting turn shows.

Only one coroutine per process and store polls the slots (the head of a FIFO
queue, :class:`Gate`): 50 waiting turns in one worker polling SQLite each made
writes fail with ``database is locked``. A turn that waits on the cap says so:
a log line, a ``coder.turn.waiting_for_slot`` event and its task run shown as
``Running`` named ``WaitingForTurnSlot`` (:class:`WaitingState`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from prefect.client.orchestration import get_client
from prefect.context import FlowRunContext, TaskRunContext
from prefect.states import Running

from prefect_coder.flows.observe.observer import TurnObserver

__all__ = [
    "WAITING_STATE_NAME",
    "Gate",
    "WaitingState",
    "announce",
    "drop_acquire",
    "local_gate",
]

WAITING_STATE_NAME = "WaitingForTurnSlot"
#: How many released slots a gate remembers as claim hints.
HINTS = 64


class Gate:
    """The FIFO queue of this process's claims on one store (per event loop), and
    whether its head is waiting on the cap (found every slot busy)."""

    __slots__ = ("calls", "cap_full", "lock", "released")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.cap_full = False
        #: Slots this process released, newest last (at most ``HINTS``): claim hints.
        self.released: list[int] = []
        #: Queued claims by workflow: the head resolves one with the index of a slot a
        #: gone holder held for that workflow (see ``Claimer._call_own_workflow``).
        self.calls: dict[str, asyncio.Future[int]] = {}

    def call(self, workflow_id: str | None) -> asyncio.Future[int] | None:
        """Register a queued claim of ``workflow_id`` to be called out of the queue."""
        if workflow_id is None:
            return None
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.calls[workflow_id] = fut
        return fut

    def hang_up(self, workflow_id: str | None, fut: asyncio.Future[int] | None) -> None:
        if workflow_id is not None and fut is not None and self.calls.get(workflow_id) is fut:
            del self.calls[workflow_id]

    def hint(self, index: int) -> None:
        """Slot ``index`` was just released by this process: the next claim tries it first."""
        self.released.append(index)
        del self.released[:-HINTS]


_gates: dict[tuple[int, str, str], Gate] = {}


def local_gate(url: str, tenant: str) -> Gate:
    """This process's claim queue on one store (per event loop)."""
    key = (id(asyncio.get_running_loop()), url, tenant)
    gate = _gates.get(key)
    if gate is None:
        gate = _gates[key] = Gate()
    return gate


def drop_acquire(acquiring: asyncio.Future[Any], lock: asyncio.Lock) -> None:
    """Give up a pending ``lock.acquire()`` task: cancel it, or — when it got the lock
    already — release the lock (a cancelled acquire that was just woken hands the
    lock to the next waiter itself: ``asyncio.Lock``)."""
    if acquiring.cancel():
        return
    if not acquiring.cancelled() and acquiring.exception() is None:
        lock.release()


async def _set_task_state(name: str) -> bool:
    """Force the current task run's state to ``Running`` with ``name``; False on failure."""
    ctx = TaskRunContext.get()
    if ctx is None:
        return False
    state: Any = Running(name=name)
    try:
        async with get_client() as client:
            await client.set_task_run_state(ctx.task_run.id, state, force=True)
    except Exception:  # cosmetic: the log line says the same
        logging.getLogger(__name__).debug("could not set state %s", name, exc_info=True)
        return False
    return True


class WaitingState:
    """Shows the task run as ``Running``/``WaitingForTurnSlot`` while it waits (best effort).

    Only once the turn has waited ``show_after`` seconds: a state per briefly queued
    turn was 17% of a fan-out's CPU. In the background and retried: the server
    records a task run from the engine's events, asynchronously, so right at task
    start it may not know the run yet (a fan-out of 50 lost about one state in three
    without the retry).
    """

    def __init__(self, show_after: float) -> None:
        self._show_after = show_after
        self._task: asyncio.Task[None] | None = None
        self._shown = False
        self._stopped = asyncio.Event()

    def start(self) -> None:
        if self._task is None and TaskRunContext.get() is not None:
            self._task = asyncio.create_task(self._show(), name="waiting-state")

    async def _show(self) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopped.wait(), self._show_after)
            return  # got a slot within show_after: nothing to show
        # Retried for as long as the turn still waits: the server may not have
        # recorded the task run yet on a busy machine. An attempt under way when the
        # turn gets its slot is finished, not cancelled (a cancelled request may or
        # may not have landed; then the "Running" below must follow it).
        while True:
            if await _set_task_state(WAITING_STATE_NAME):
                self._shown = True
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopped.wait(), 0.25)
                return

    async def stop(self) -> None:
        self._stopped.set()
        if self._task is not None:
            await self._task
        if self._shown:
            await _set_task_state("Running")


def announce(
    cap: int,
    wait: float,
    workflow_id: str,
    step: str,
    log: logging.Logger | logging.LoggerAdapter[Any],
    ui: WaitingState,
) -> None:
    """The visible "waiting" signals: a log line, an event, a named UI state."""
    log.info(
        "waiting for a turn slot: all %d slots busy (step %s of %s; waits up to %.0fs)",
        cap,
        step,
        workflow_id,
        wait,
    )
    if TaskRunContext.get() is not None or FlowRunContext.get() is not None:
        # Outside a run, emitting would start a temporary Prefect server (seconds).
        TurnObserver(workflow_id=workflow_id, step=step, logger=log).emit(
            "coder.turn.waiting_for_slot", {"cap": cap}
        )
    ui.start()
