"""Result check: after the settle-wait, did the crashed attempt finish the step's work?
Its result is rebuilt from history instead of resubmitting (durable design, "Recover
the result before resubmitting")."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from coder_chat.core.recovery import classify_attempt, is_answered, unanswered_verdict
from coder_chat.history import DynamicToolPart, RecoveredTurn, fetch_turn, recover_turn_result

from .contract import RecoveryOutcome, SettleResult
from .shell import RecoveryShell

__all__ = ["ResultCheck"]


class ResultCheck(RecoveryShell):
    """The result-check stage of :class:`coder_chat.recovery.TurnRecovery`."""

    async def check_result(self, settled: SettleResult) -> RecoveryOutcome | None:
        """Classify the settled attempt; ``None`` means paused again (reconcile)."""
        # A long turn can commit more than a page after the prompt: page newest-first
        # until the turn's user message is on hand. "Never submitted" must never be
        # concluded from a truncated read.
        messages = await fetch_turn(self.client, self.chat_id, timeout=self.timings.settle_budget)
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
            # Read skew: the status said "at rest", the history (read after it) holds
            # this attempt's user message with no answer — a send that committed
            # later than its horizon, between the two reads. Read the status again.
            status_now = (
                await self.client.get_chat(self.chat_id, timeout=self.timings.probe_bound)
            ).status
            verdict, why = unanswered_verdict(status_now)
            self._decide(
                "result",
                f"status {settled.status}, then the attempt's user message "
                f"{recovered.user_message_id} with no answer; status now {status_now}",
                verdict,
                why,
            )
            if verdict == "settle-again":
                return None
            messages = await fetch_turn(
                self.client, self.chat_id, timeout=self.timings.settle_budget
            )
            recovered = self._recover(messages)
            submitted = recovered is not None and recovered.submitted
            if recovered is not None and not is_answered(messages, recovered.user_message_id):
                why = (
                    "the attempt's user message has no answer and the chat is at rest: "
                    "nothing was generated (no tool call ran), resubmit it"
                )
                self._decide("result", f"status {status_now}, still no answer", "resubmit", why)
                # The late message counts: the resubmission's write-ahead takes the count now.
                attempts = await self.attempts(timeout=self.timings.settle_budget)
                return self._outcome(
                    "resubmit", replace(settled, attempts=attempts, cut_short=True), None, why
                )
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
