# The per-call `timeout=` parameter is part of the module contract (docs/architecture.md).
# ruff: noqa: ASYNC109
"""Ledger reconcile: a ``requires_action`` pause answered from the crash-safe tools'
ledger (durable design, "Make client tools crash-safe")."""

from __future__ import annotations

import asyncio
from typing import Any

from coder_chat.core.recovery import LedgerAction, batch_verdict, ledger_action
from coder_chat.core.translator import pending_client_calls
from coder_chat.crash_safe import CrashSafeTool, PureTool, crash_point
from coder_chat.errors import CoderApiError, CoderRecoveryError, CoderTransportError, is_transient
from coder_chat.history import fetch_turn
from coder_chat.models import ToolResult
from coder_chat.tools import StructuredOutput, ToolContext

from .shell import RecoveryShell

__all__ = ["SUBMIT_ATTEMPTS", "Reconcile"]

#: Tries of a pause's tool-results submission whose response is lost (each one
#: after a history read shows the calls still pending).
SUBMIT_ATTEMPTS = 3


class Reconcile(RecoveryShell):
    """The reconcile stage of :class:`coder_chat.recovery.TurnRecovery`."""

    async def reconcile(
        self, attempts: int, *, timeout: float, run_unstarted: bool = False
    ) -> bool:
        """Answer a ``requires_action`` pause from the ledger; returns ``unstarted``.

        ``unstarted`` (→ ``cut_short``) is True only when this fell back to
        interrupting: after a submission with no unstarted call nothing was cut
        short, and the result check must classify the resumed run's finish as a
        completed attempt, not resubmit it.

        ``run_unstarted``: the pause is this step's crashed attempt (see
        :func:`coder_chat.core.recovery.crashed_pause_budget`): a call that never ran
        is run now, through the tool's ledger under its stable key, instead of
        being cut short.
        """
        messages = await fetch_turn(self.client, self.chat_id, timeout=timeout)
        # Pending = the last assistant message's client (non-provider-executed,
        # step-registered) calls, minus ids answered by a later tool result. A
        # server/MCP call must never reach the ledger as "unstarted", hence the
        # restriction to the names this step registers.
        _, pending = pending_client_calls(
            messages, after_id=0, client_tool_names=frozenset(self.tools)
        )
        plan: list[tuple[dict[str, Any], LedgerAction, Any]] = []
        for call in pending:
            entry = await self.store.ledger.get(self.chat_id, call["tool_call_id"])
            tool = self.tools[call["tool_name"]]
            action = ledger_action(
                None if entry is None else entry.state,
                replayable=isinstance(tool, StructuredOutput | PureTool),
            )
            why = {
                LedgerAction.SUBMIT_RECORDED: "effect committed, result stranded",
                LedgerAction.REDRIVE: "ambiguous write-ahead: re-drive with the same key",
                LedgerAction.REPLAY: "pure tool: answering it has no effect",
                LedgerAction.UNSTARTED: "the tool never ran: interrupting loses nothing",
            }[action]
            if action is LedgerAction.UNSTARTED and run_unstarted:
                # The crashed attempt's own next call: run it as the dead process
                # would have (ledger write-ahead, the call id's stable key).
                action = LedgerAction.REPLAY
                why = (
                    "the tool never ran and the pause is this step's crashed attempt: "
                    "run it through the ledger (stable key) instead of cutting the attempt short"
                )
            plan.append((call, action, entry))
            self._decide(
                "reconcile",
                f"pending {call['tool_name']} {call['tool_call_id']}: ledger "
                f"{'none' if entry is None else entry.state}",
                "run" if why.startswith("the tool never ran and") else action.value,
                why,
            )
        verdict = batch_verdict(a for _, a, _ in plan)
        if verdict is None:
            # Every call of the pause is already answered in history: a submission
            # (ours or an earlier pass's) is committing and the pause is clearing.
            # Re-probe once before concluding it is a pause nothing of ours answers.
            await asyncio.sleep(min(self.timings.poll_interval, timeout))
            status = (await self.client.get_chat(self.chat_id, timeout=timeout)).status
            if status != "requires_action":
                self._decide(
                    "reconcile",
                    "requires_action, every pending call already answered",
                    "let it finish",
                    f"the pause cleared ({status}): a submission had landed",
                )
                return False
            self._decide(
                "reconcile",
                "requires_action with no pending client call of this step",
                "interrupt",
                "nothing of ours to answer; the pause would hold the chat forever",
            )
            await self._journal("cut-short", attempts)
            await self._stop(timeout)
            return True
        # ONE write-ahead with the batch's FINAL verdict, before any network call:
        # every crash then either re-reconciles the stable pause or re-drives the
        # journaled intent.
        await self._journal(verdict, attempts)
        self._decide(
            "reconcile", f"{len(plan)} pending call(s)", f"journal {verdict}", "write-ahead"
        )
        crash_point("recovery.after_verdict")
        results: list[ToolResult] = []
        unstarted = False
        for call, action, entry in plan:
            ctx = ToolContext(
                tool_call_id=call["tool_call_id"], chat_id=self.chat_id, tool_name=call["tool_name"]
            )
            tool = self.tools[call["tool_name"]]
            if action is LedgerAction.SUBMIT_RECORDED:
                results.append(ToolResult(tool_call_id=ctx.tool_call_id, output=entry.output))
            elif action is LedgerAction.REDRIVE:
                if not isinstance(tool, CrashSafeTool):
                    raise CoderRecoveryError(f"no re-drive path for tool {tool.name!r}")
                output = await tool.redrive(call["args"], ctx)
                results.append(ToolResult(tool_call_id=ctx.tool_call_id, output=output))
            elif action is LedgerAction.REPLAY:
                outcome = await tool.run(call["args"], ctx)
                results.append(
                    ToolResult(
                        tool_call_id=ctx.tool_call_id,
                        output=outcome.output,
                        is_error=outcome.is_error,
                    )
                )
            else:
                unstarted = True
        if results:
            # Submitting answers the pause; it does not revive a tool loop here:
            # the turn resumes server-side and its output lands only in history.
            await self._submit(results, timeout)
            crash_point("recovery.after_submit")
        if unstarted:
            # Only interrupt when the ledger shows no committed effect for the call;
            # submitted siblings' outcomes stay recorded in history. Stopped, not
            # just interrupted once: the interrupt resumes the model, which may
            # pause again on a new call (the verdict is already journaled).
            await self._stop(timeout)
        return unstarted

    async def _submit(self, results: list[ToolResult], timeout: float) -> None:
        """Submit a pause's answers, telling a lost response from a lost request.

        The POST may land and its response be lost (a reset, a 502 from a proxy).
        Raising then failed the whole recovery although the run had resumed; a
        blind re-send would be refused (the calls are answered). So history
        decides: when it answers every submitted call the submission landed and
        the run goes on; otherwise the same answers — already recorded in the
        ledger, no tool runs again — are sent once more, a bounded number of times.
        """
        ids = {r.tool_call_id for r in results}
        for attempt in range(SUBMIT_ATTEMPTS):
            try:
                await self.client.submit_tool_results(self.chat_id, results, timeout=timeout)
                return
            except (CoderTransportError, CoderApiError) as exc:
                if not is_transient(exc) or attempt == SUBMIT_ATTEMPTS - 1:
                    raise
                await asyncio.sleep(min(self.timings.poll_interval, timeout))
                messages = await fetch_turn(self.client, self.chat_id, timeout=timeout)
                _, pending = pending_client_calls(
                    messages, after_id=0, client_tool_names=frozenset(self.tools)
                )
                if not ids & {c["tool_call_id"] for c in pending}:
                    self._decide(
                        "reconcile",
                        f"tool-results submit failed ({type(exc).__name__})",
                        "let it finish",
                        "history answers every submitted call: the submission landed",
                    )
                    return
                self._decide(
                    "reconcile",
                    f"tool-results submit failed ({type(exc).__name__})",
                    "submit again",
                    "the calls are still pending: the request never landed",
                )
