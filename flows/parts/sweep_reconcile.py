"""Answer a paused chat's client-tool calls from the tool ledger (the sweeps' reconciliation).

A chat paused in ``requires_action`` whose effect already committed must not be
interrupted away: the recorded outputs are submitted instead, with the same
crash-recovery code a workflow's own recovery uses.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from coder_chat.recovery import RecoveryTimings, TurnRecovery
from coder_chat.rest import ChatClient
from prefect_coder.blocks import JournalEntry, StateStore
from prefect_coder.flows.parts import registry
from prefect_coder.flows.parts.run_log import run_logger
from prefect_coder.flows.parts.toolset import Toolset, bind_crash_safe

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
    and only a call nothing was committed for falls back to an interrupt. The
    verdict is journaled under the step's marker, so the workflow's own recovery
    of that attempt later classifies it correctly."""
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
    tools = Toolset(tools=sorted(registry.tool_names())).resolve().tools
    recovery = TurnRecovery(
        req.client,
        req.store,
        req.chat_id,
        marker,
        tools=bind_crash_safe(tools, req.store.ledger),
        journal_entry=JournalEntry,
        timings=RecoveryTimings(probe_bound=req.bound_s, poll_interval=min(1.0, req.bound_s)),
        logger=run_logger(__name__),
    )
    attempts = await recovery.attempts(timeout=req.bound_s)
    unstarted = await recovery.reconcile(attempts, timeout=req.bound_s)
    return "cut-short" if unstarted else "resumed"
