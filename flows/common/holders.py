"""Lease holders that name their Prefect flow run, and "is that holder's run over?".

A workflow lease or turn slot whose holder died keeps blocking others until its
ttl lapses. When the holder id carries the holder's flow-run id, a waiter can
ask Prefect about that run: if it is Crashed, Failed, Cancelled or Completed the
holder is gone for good (a run in a final state never resumes under the same
holder — a retry or recovery is a new attempt with a new holder id) and the
store's ``take_over`` hands the lease over at once. The store stays
Prefect-free: it only gets a ``holder_gone`` callback.

A turn slot's holder also names the workflow whose turn it runs
(``…@run=<flow-run id>@wf=<quoted workflow id>``): a dead holder's turn may go
on running server-side, and the workflow id is how a waiter finds the chats that
turn drives (``slot_takeover``).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from urllib.parse import quote, unquote

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.client.schemas.objects import StateType
from prefect.context import FlowRunContext

from prefect_coder.blocks.state import Lease
from prefect_coder.blocks.state.leases import default_holder

__all__ = [
    "RUN_MARK",
    "WORKFLOW_MARK",
    "holder_over",
    "holder_run_id",
    "holder_run_over",
    "holder_workflow_id",
    "holders_over",
    "run_holder",
]

#: ``<host>:<pid>:<rand>@run=<flow-run id>[@wf=<quoted workflow id>]``
RUN_MARK = "@run="
#: The workflow id is percent-quoted (no ``@`` left in it), so the marks parse back.
WORKFLOW_MARK = "@wf="
_OVER = {StateType.CRASHED, StateType.FAILED, StateType.CANCELLED, StateType.COMPLETED}
#: Seconds an answer about a run is reused: waiters poll every 50-100 ms, and one
#: API call per poll per waiter would load the server for nothing. "Over" answers
#: expire too: a final run can be started again under the same id (a retry from the
#: UI), and its new holders are live.
RECHECK_S = 1.0
#: run id → (monotonic time asked, in a final state then)
_answers: dict[str, tuple[float, bool]] = {}


def _current_run_id() -> str | None:
    ctx = FlowRunContext.get()
    if ctx is not None and ctx.flow_run is not None:
        return str(ctx.flow_run.id)
    # A flow-run process started by a worker (``python -m prefect.engine``) before
    # the flow's context exists, or a task run in a thread without it.
    return os.environ.get("PREFECT__FLOW_RUN_ID") or None


def run_holder(workflow_id: str | None = None) -> str:
    """A holder id for this call that names the current flow run, if there is one,
    and ``workflow_id`` when given (turn slots)."""
    run_id = _current_run_id()
    holder = default_holder()
    if run_id:
        holder += f"{RUN_MARK}{run_id}"
    if workflow_id is not None:
        holder += f"{WORKFLOW_MARK}{quote(workflow_id, safe='')}"
    return holder


def holder_run_id(holder: str) -> uuid.UUID | None:
    """The flow-run id a holder id names, or None (an old holder, or outside a run)."""
    _, mark, rest = holder.partition(RUN_MARK)
    if not mark:
        return None
    try:
        return uuid.UUID(rest.partition("@")[0])
    except ValueError:
        return None


def holder_workflow_id(holder: str) -> str | None:
    """The workflow id a turn slot's holder id names, or None (an older holder)."""
    _, mark, rest = holder.partition(WORKFLOW_MARK)
    return unquote(rest) if mark else None


async def holder_run_over(lease: Lease) -> bool:
    """True when ``lease``'s holder names a flow run that is in a final state.

    Unknown (no run id, run not found, API error) is False: then the lease's ttl
    decides, as before. The ``holder_gone`` callback of ``store.lease``.
    """
    return await holder_over(lease.holder)


async def holder_over(holder: str) -> bool:
    """``holder_run_over`` for a bare holder id."""
    return holder in await holders_over([holder])


async def holders_over(holders: list[str]) -> set[str]:
    """The holder ids among ``holders`` whose flow run is in a final state.

    One API call for all runs not asked about in the last ``RECHECK_S`` (not one per
    holder: a waiter at cap 50 would otherwise read 50 flow runs a second). A run
    the call does not return, or a failed call, counts as not over.
    """
    runs = {h: holder_run_id(h) for h in holders}
    now = time.monotonic()
    ours = _current_run_id()
    ask: dict[str, uuid.UUID] = {}
    for run_id in runs.values():
        # The run this code runs in is not over: no call (an in-process fan-out's
        # turns all hold their slots under the fan-out's run).
        if run_id is not None and str(run_id) != ours:
            answer = _answers.get(str(run_id))
            if answer is None or now - answer[0] >= RECHECK_S:
                ask[str(run_id)] = run_id
    if ask:
        if len(_answers) > 10_000:  # a long-lived worker: forget old answers
            _answers.clear()
        for key in ask:
            _answers[key] = (now, False)
        try:
            async with get_client() as client:
                found = await client.read_flow_runs(
                    flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=list(ask.values()))),
                    limit=len(ask),
                )
        except Exception:
            logging.getLogger(__name__).debug("could not read flow runs", exc_info=True)
            found = []
        for run in found:
            over = run.state is not None and run.state.type in _OVER
            _answers[str(run.id)] = (now, over)
    return {
        h
        for h, run_id in runs.items()
        if run_id is not None and str(run_id) != ours and _answers.get(str(run_id), (0.0, False))[1]
    }
