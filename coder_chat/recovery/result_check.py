"""Result check: after the settle-wait, did the crashed attempt finish the step's work?
Its result is rebuilt from history instead of resubmitting (durable design, "Recover
the result before resubmitting")."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from coder_chat.core.recovery import classify_attempt, is_answered
from coder_chat.history import DynamicToolPart, RecoveredTurn, fetch_turn, recover_turn_result

from .contract import RecoveryOutcome, SettleResult
from .shell import RecoveryShell, newest_user_message_id

__all__ = ["ResultCheck"]


class ResultCheck(RecoveryShell):
    """The result-check stage of :class:`coder_chat.recovery.TurnRecovery`."""

    async def check_result(self, settled: SettleResult) -> RecoveryOutcome | None:
        """Classify the settled attempt; ``None`` means settle again (a pause to
        reconcile, or a turn the settle's reads did not see).

        **A verdict only from a history the status read covered.** The settle
        counted the step's attempts in a history read, then its poll read the status
        at rest; this history read comes after both. A crashed process's send can
        commit later than its commit horizon — after the status read, before this
        read (the window of issue 30, item 5). Its user message, and whatever of
        the turn has committed by then (a first step's narration and server-side
        tool call), are in this history while the turn still runs: returning it
        handed back the first step's narration as the step's result (or an empty
        answer when nothing had committed yet), and the turn ran on unattended.

        The rule: the history must end with the same turn as the count read the
        status read followed — its newest user message must be the one the count
        saw (:attr:`SettleResult.covered_user_id`). Only a landing user message
        starts a turn (a send, a queued prompt's promotion), so with the same
        newest user message and the chat at rest in between, this history is the
        at-rest chat the status read saw. A newer user message is a send that
        landed after the reads: settle again — the settle then finds its turn
        live and follows it (or stops it, by the usual rules), or finished and
        re-derives the attempt count and ``cut_short`` from the new state. The
        check costs no request (the two reads are the ones recovery made anyway).
        Not covered: a turn restarted without a new user message (an operator
        editing the step's prompt in the UI during recovery); the workflows never
        edit.
        """
        # A long turn can commit more than a page after the prompt: page newest-first
        # until the turn's user message is on hand. "Never submitted" must never be
        # concluded from a truncated read.
        messages = await fetch_turn(self.client, self.chat_id, timeout=self.timings.settle_budget)
        newest = newest_user_message_id(messages)
        if newest != settled.covered_user_id:
            self._decide(
                "result",
                f"status {settled.status} after a count whose newest user message was "
                f"{settled.covered_user_id}; the history read after it ends with user "
                f"message {newest}",
                "settle again",
                "a send landed after the settle's reads (a commit later than its horizon): "
                "its turn may still run — follow it, never take its first steps (or its "
                "missing answer) for the result",
            )
            return None
        recovered = self._recover(messages)
        submitted = recovered is not None and recovered.submitted
        if (
            recovered is not None
            and submitted
            and settled.status in ("waiting", "completed")
            and not settled.cut_short
            and not self.known_failure
            and not is_answered(messages, recovered.user_message_id)
        ):
            # The count saw this user message and the status read after it found the
            # chat at rest: its turn ended without any assistant message (nothing
            # was generated, no tool call ran). Never an empty "finished" answer.
            why = (
                "the attempt's user message has no answer and the chat is at rest: "
                "nothing was generated (no tool call ran), resubmit it"
            )
            self._decide(
                "result",
                f"status {settled.status}, the attempt's user message "
                f"{recovered.user_message_id} with no answer",
                "resubmit",
                why,
            )
            return self._outcome("resubmit", replace(settled, cut_short=True), None, why)
        if recovered is not None and settled.status != "requires_action":
            await self._raise_lost_outcomes(
                (p.tool_call_id, p.tool_name, p.error_text, True)
                for p in recovered.parts
                if isinstance(p, DynamicToolPart) and p.state == "output-error"
            )
        classification, why = classify_attempt(
            submitted=submitted,
            cut_short=settled.cut_short,
            status=settled.status,
            known_failure=self.known_failure,
        )
        self._decide(
            "result",
            f"submitted={submitted}, cut_short={settled.cut_short}, status {settled.status}"
            + (", known failure" if self.known_failure else ""),
            classification,
            why,
        )
        if classification == "reconcile":
            return None
        return self._outcome(
            classification, settled, recovered if classification == "recovered" else None, why
        )

    def _recover(self, messages: list[Any]) -> RecoveredTurn | None:
        return recover_turn_result(
            messages,
            client_tool_names=frozenset(self.tools),
            marker=self.marker,
            output_model=self.output_model,
            structured_tool_name=self.structured_tool_name,
        )

    def _outcome(
        self,
        classification: Literal["recovered", "resubmit"],
        settled: SettleResult,
        recovered: RecoveredTurn | None,
        why: str,
    ) -> RecoveryOutcome:
        return RecoveryOutcome(
            classification=classification,
            chat_id=self.chat_id,
            marker=self.marker,
            status=settled.status,
            cut_short=settled.cut_short or self.known_failure,
            attempts=settled.attempts,
            recovered=recovered,
            reason=why,
            decisions=self.decisions,
            horizon_slept_s=settled.horizon_slept_s,
        )
