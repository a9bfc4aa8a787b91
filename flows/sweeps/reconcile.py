"""Answer a paused chat's client-tool calls from the tool ledger (the sweeps' reconciliation).

A chat paused in ``requires_action`` whose effect already committed must not be
interrupted away: the recorded outputs are submitted instead, with the same
crash-recovery code a workflow's own recovery uses.

When the pause is a checkpointed step's crashed attempt within its turn deadline
(``ReconcileRequest.run_unstarted``, decided by
:func:`prefect_coder.flows.sweeps.plan.crashed_attempt_refinement`), a call
with no ledger entry (it never ran) is run through the ledger too, not cut
short — the rule the workflow's own recovery follows
(:func:`coder_chat.core.recovery.crashed_pause_budget`). Cutting it short made the
workflow's rerun resubmit the step, and the model repeated the attempt's earlier,
committed tool calls under new call ids (chaos seeds 14/71, docs/chaos.md).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from coder_chat.core.fields import field
from coder_chat.core.translator import pending_client_calls
from coder_chat.history import fetch_turn
from coder_chat.recovery import RecoveryTimings, TurnRecovery
from coder_chat.rest import ChatClient
from prefect_coder.blocks import StateStore
from prefect_coder.flows.common import registry
from prefect_coder.flows.common.toolset import Toolset, bind_crash_safe
from prefect_coder.flows.observe.run_log import run_logger

__all__ = ["ReconcileRequest", "Reconciler", "reconcile_unavailable", "reconcile_with_ledger"]


@dataclass(frozen=True, slots=True)
class ReconcileRequest:
    """What the pause reconciliation needs (the seam to the crash-recovery code)."""

    client: ChatClient
    store: StateStore
    chat_id: str
    workflow_id: str | None
    tool_modules: tuple[str, ...]
    bound_s: float
    #: The pause is its step's crashed attempt within its turn deadline: a call that
    #: never ran is run through the ledger (never cut short); a pending call of a
    #: tool this worker does not register leaves the pause alone.
    run_unstarted: bool = False
    #: The paused attempt's step's turn timeout (recorded with its journal entry,
    #: else the sweep's): a revival this reconcile journals (``resumed``) records
    #: now + it as its deadline. None: no deadline recorded.
    turn_timeout_s: float | None = None


#: ``"resumed"`` (recorded results submitted: the run continues), ``"cut-short"``
#: (fell back to an interrupt: nothing was committed for some call),
#: ``"nothing"`` (no pending call), ``"unavailable"`` (cannot reconcile here).
Reconciler = Callable[[ReconcileRequest], Awaitable[str]]


async def reconcile_unavailable(req: ReconcileRequest) -> str:
    """Fallback seam: leave the pause alone (never interrupt a committed effect)."""
    return "unavailable"


_MARKER = re.compile(r"\[([A-Za-z0-9][A-Za-z0-9_.:@-]{0,127})/([A-Za-z0-9][A-Za-z0-9_.-]{0,63})\]")


async def _marker_of(req: ReconcileRequest) -> str | None:
    """The step marker of the paused attempt: the chat's journal names it; else the
    newest marked user message in history."""
    entry = await req.store.journal.get(req.chat_id)
    if entry is not None and entry.marker:
        return str(entry.marker)
    page = await req.client.get_messages(req.chat_id, limit=50, timeout=req.bound_s)
    for message in sorted(page.messages, key=lambda m: m.id, reverse=True):
        if message.role != "user":
            continue
        text = "".join(p.text or "" for p in message.content if p.type == "text")
        found = _MARKER.search(text)
        if found and (req.workflow_id is None or found.group(1) == req.workflow_id):
            return found.group(0)
    return None


async def reconcile_with_ledger(req: ReconcileRequest) -> str:
    """Answer a ``requires_action`` pause from the tool ledger with the crash-recovery
    code (``coder_chat.recovery.TurnRecovery.reconcile``): recorded ``done`` outputs
    are submitted, ``committing`` entries re-driven with the same idempotency key,
    and only a call nothing was committed for falls back to an interrupt — unless
    ``req.run_unstarted`` (a crashed attempt within its turn deadline): then that
    call is run through the ledger as well. The verdict is journaled under the
    step's marker, so the workflow's own recovery of that attempt later classifies
    it correctly."""
    marker = await _marker_of(req)
    if marker is None:
        return "unavailable"
    registry.load_tool_modules(list(req.tool_modules))
    # History does not say which calls were client tools: reconciliation only sees
    # the names registered here. A ledgered tool this process does not know would
    # look like "nothing of ours pending" and be interrupted away — leave it paused.
    known = registry.tool_names()
    if any(
        e.tool_name and e.tool_name not in known for e in await req.store.ledger.list(req.chat_id)
    ):
        return "unavailable"
    if req.run_unstarted and await _unknown_pending(req, known):
        # Reconciliation sees only registered names: an unknown pending call would
        # look like "nothing of ours pending" and be interrupted — cutting short
        # the very attempt this rule protects. Its workflow's recovery answers it.
        return "unavailable"
    tools = Toolset(tools=sorted(registry.tool_names())).resolve().tools
    recovery = TurnRecovery(
        req.client,
        req.store,
        req.chat_id,
        marker,
        tools=bind_crash_safe(tools, req.store.ledger),
        timings=RecoveryTimings(probe_bound=req.bound_s, poll_interval=min(1.0, req.bound_s)),
        logger=run_logger(__name__),
        turn_timeout=req.turn_timeout_s,
    )
    attempts = await recovery.attempts(timeout=req.bound_s)
    unstarted = await recovery.reconcile(
        attempts, timeout=req.bound_s, run_unstarted=req.run_unstarted
    )
    return "cut-short" if unstarted else "resumed"


async def _unknown_pending(req: ReconcileRequest, known: frozenset[str] | set[str]) -> bool:
    """Does the pause wait on a call of a tool this worker does not register?"""
    messages = await fetch_turn(req.client, req.chat_id, timeout=req.bound_s)
    named = {
        str(field(p, "tool_name"))
        for m in messages
        if field(m, "role") == "assistant"
        for p in field(m, "content", []) or []
        if field(p, "type") == "tool-call" and field(p, "tool_name")
    }
    _, pending = pending_client_calls(messages, after_id=0, client_tool_names=named)
    return any(call["tool_name"] not in known for call in pending)
