"""Settle-wait and following: :class:`TurnRecovery` stops what the crash left behind
and waits until the chat settles — or re-attaches to the crashed attempt's live run —
then runs the stages in order (:meth:`TurnRecovery.run`)."""

from __future__ import annotations

import asyncio
import time

from coder_chat.agent import NoTurnToFollowError
from coder_chat.core.journal import JournalView, classify_entry
from coder_chat.core.recovery import (
    SettleAction,
    crashed_pause_budget,
    cut_short_after_interrupt,
    follows_crashed_attempt,
    horizon_remaining,
    pin_after_horizon,
    poll_verdict,
    scope_journal,
    settle_action,
)
from coder_chat.errors import (
    CoderAgentError,
    CoderChatError,
    CoderError,
    CoderRecoveryError,
    CoderStreamError,
    CoderTransportError,
)

from .contract import RecoveryOutcome, SettleResult
from .reconcile import Reconcile
from .result_check import ResultCheck
from .shell import Paused

__all__ = ["TurnRecovery"]

#: Re-follows of a live attempt after transient follow failures, per recovery pass.
_MAX_REFOLLOWS = 3


def _own_deadline(exc: BaseException) -> bool:
    """The follow ran out of its own time — the attempt's turn deadline, or a segment's
    ``request_timeout`` (as a ``generate()`` would have): the run did not settle within
    it. A request's timeout (``CoderTimeoutError``) is a transport failure, not this."""
    if isinstance(exc, CoderChatError):
        return exc.kind == "timeout"
    return isinstance(exc, TimeoutError) and not isinstance(exc, CoderError)


class TurnRecovery(Reconcile, ResultCheck):
    """Recovery of one step's attempt on ``chat_id`` (identified by ``marker``).

    Args:
        client: a REST client for the chat's deployment.
        store: journal + ledger (:class:`RecoveryStore`).
        tools: the step's client tools, as the live loop registers them. Their
            names restrict which history calls count as client calls (history
            does not record which calls were client tools), cut the recovered
            text, and name the re-drive path of each ledgered tool.
        known_failure: recovery follows a known timeout/abort of the attempt
            (not a hard crash): pins ``cut_short`` in the result check.
        output_model: for structured-output steps, recover the last validating
            ``structured_tool_name`` input instead of the text.
        follower: re-attach with this agent (:class:`Follower`) when the live
            run is this step's crashed attempt, instead of interrupting it (see
            :func:`coder_chat.core.recovery.follows_crashed_attempt`). Without
            one, such a run is cut short and resubmitted, as in the seed design.
        turn_timeout: the step's turn timeout. Every send (a resubmission's
            write-ahead) and every revival (``resumed``) this recovery journals
            records its turn deadline (``at`` + this; a revival of an attempt whose
            entry recorded one: + that attempt's own timeout), which the stuck-turn
            sweep honours instead of its own turn timeout. None: no deadline
            recorded. Following a crashed attempt is bounded by the deadline its
            entry recorded; without one, by ``timings.settle_budget``.
    """

    def _can_follow(self) -> bool:
        return self.follower is not None and not self._follow_off

    def _pause_budget(self, entry: JournalView | None, attempts: int) -> float | None:
        """How long recovery may answer (and then follow) this pause itself; None:
        cut calls that never ran short (see ``crashed_pause_budget``)."""
        if not self._can_follow() or self.known_failure or entry is None:
            return None
        recorded = self._note_attempt_turn(entry)
        # Without a recorded deadline: the settle budget (our own turn timeout).
        turn_s = self.timings.settle_budget
        reading = classify_entry(entry, self.marker, attempts, turn_timeout=turn_s)
        return crashed_pause_budget(reading, self.clock(), revived_s=recorded or turn_s)

    def _follow_revived(
        self, seen: str, attempts: int, budget: float | None = None
    ) -> SettleResult:
        """Recorded results revived the step's own run: follow it to its settle
        rather than only polling it, so a NEW client-tool pause of it is answered
        with the step's tools (through the ledger) as the dead process would have —
        instead of cutting the attempt short and resubmitting the whole step,
        whose earlier rounds the model would then run again under new call ids.
        ``budget``: the crashed attempt's own turn deadline when known."""
        budget = self.timings.settle_budget if budget is None else budget
        self._decide(
            "settle",
            seen,
            f"follow the revived run (≤ {budget:.1f}s)",
            "an answered pause revived this step's own attempt: let it finish, "
            "answering its next pauses",
        )
        return SettleResult("running", False, attempts, 0.0, follow_s=budget)

    async def settle(self) -> SettleResult:
        """Stop what the crash left behind, then wait until the chat settles.

        Except when the live run is this step's crashed attempt and a
        :attr:`follower` is set: then nothing is stopped, and the result says
        how long to follow it (:attr:`SettleResult.follow_s`).
        """
        t = self.timings
        probe_deadline = time.monotonic() + t.probe_bound

        def probe_left() -> float:
            return max(0.001, probe_deadline - time.monotonic())

        # Did an interrupt stop a live run? A 409 means there was nothing to stop.
        cut_short = True
        probed = (await self.client.get_chat(self.chat_id, timeout=probe_left())).status
        entry: JournalView | None = await self.store.journal.get(self.chat_id)
        attempts = await self.attempts(timeout=probe_left())
        journaled = scope_journal(entry, self.marker, attempts)
        action = settle_action(probed, journaled)
        seen = (
            f"status {probed}, {attempts} attempt(s), journal "
            + (f"{entry.state}/{entry.attempt}" if entry is not None else "none")
            + ("" if entry is None else (" (this attempt)" if journaled else " (not this attempt)"))
        )
        if (
            self._can_follow()
            and not self.known_failure
            and follows_crashed_attempt(probed, entry, self.marker, attempts)
        ):
            assert entry is not None
            # The attempt's own turn deadline bounds the follow: a crash never
            # extends a turn (recorded with its send, else from it + our turn timeout).
            self._note_attempt_turn(entry)
            budget = classify_entry(
                entry, self.marker, attempts, turn_timeout=t.settle_budget
            ).left(self.clock())
            if budget > 0:
                self._decide(
                    "settle",
                    seen,
                    f"follow (≤ {budget:.1f}s)",
                    "the live run is this step's crashed attempt (its send landed): "
                    "re-attach to it; cutting it short would waste its work and let the "
                    "model repeat tool calls under new ids",
                )
                return SettleResult(probed, False, attempts, 0.0, follow_s=budget)
            self._decide(
                "settle",
                seen,
                "do not follow",
                "the crashed attempt's turn deadline has passed: stop it",
            )
        if action is SettleAction.RECONCILE:
            answer_budget = self._pause_budget(entry, attempts)
            self._decide(
                "settle",
                seen,
                "reconcile",
                "client-tool pause: reconcile, never interrupt"
                + (
                    f"; this step's crashed attempt (≤ {answer_budget:.1f}s left): "
                    "calls that never ran are run, not cut short"
                    if answer_budget is not None
                    else ""
                ),
            )
            cut_short = await self.reconcile(
                attempts, timeout=probe_left(), run_unstarted=answer_budget is not None
            )
            if not cut_short and self._can_follow():
                return self._follow_revived(
                    f"status {probed}, reconciled", attempts, budget=answer_budget
                )
        elif action is SettleAction.LET_FINISH:
            cut_short = False
            if self._can_follow():
                return self._follow_revived(seen, attempts)
            self._decide("settle", seen, "let it finish", "an earlier pass revived the run")
        elif action is SettleAction.REDRIVE_INTERRUPT:
            try:
                _, landed = await self._stop(probe_left(), stop_a_pause=False)
            except Paused:
                # A pause appeared since the probe: it is the pending record of
                # tool calls — reconcile it, never interrupt it away.
                self._decide("settle", seen, "reconcile", "the run paused meanwhile")
                cut_short = await self.reconcile(attempts, timeout=probe_left())
            else:
                self._decide(
                    "settle",
                    seen,
                    "re-drive interrupt" + (" (accepted)" if landed else " (nothing running)"),
                    "journaled cut-short records intent, not a landed interrupt; verdict stands",
                )
        else:
            # Beyond the seed design: journal the interrupt's intent BEFORE it, and
            # the "not cut short" conclusion of a 409 after it. Otherwise a pass
            # dying between an accepted interrupt and the resubmission write-ahead
            # leaves nothing behind, and the next pass's own 409 would classify
            # the truncated attempt as finished. A matching "submitting" entry is
            # kept as is: its commit-horizon rule must survive a crash here.
            journal_intent = journaled is None
            try:
                stopped, landed = await self._stop(
                    probe_left(),
                    journal_cut_short=attempts if journal_intent else None,
                    stop_a_pause=False,
                )
            except Paused:
                # The run paused on a client tool between the probe and the stop:
                # that pause is the pending record of tool calls — reconcile it.
                self._decide("settle", seen, "reconcile", "the run paused meanwhile")
                stopped, landed = None, False
                cut_short = await self.reconcile(attempts, timeout=probe_left())
            if stopped is not None:
                cut_short = cut_short_after_interrupt(landed, probed)
                if journal_intent:
                    # "resumed" = this attempt was not cut short: let it finish.
                    # "cut-short" again for an attempt an earlier interrupt was
                    # truncating (no interrupt of ours journaled it).
                    await self._journal("cut-short" if cut_short else "resumed", attempts)
                self._decide(
                    "settle",
                    seen,
                    f"stop: {stopped.interrupts} interrupt(s) accepted; cut_short={cut_short}",
                    "a live run was stopped"
                    if landed
                    else (
                        "an earlier interrupt was already truncating the attempt"
                        if cut_short
                        else "nothing was running"
                    ),
                )
        # The crashed attempt's own send may still land: sleep out its commit
        # window, then recount.
        slept = horizon_remaining(journaled, self.clock(), t.commit_horizon)
        if journaled is not None and journaled.state == "submitting":
            if slept > 0:
                self._decide(
                    "settle",
                    f"journaled send of attempt {journaled.attempt}",
                    f"sleep {slept:.2f}s",
                    "the send may still commit within its horizon",
                )
                await asyncio.sleep(slept)
            attempts = await self.attempts(timeout=t.settle_budget)
            if pin_after_horizon(journaled, attempts):
                cut_short = True
                self._decide(
                    "settle",
                    f"still {attempts} attempt(s) after the horizon",
                    "cut_short pinned",
                    "an unlanded resubmission over an existing, unfinished attempt",
                )
        # Turn-scale budget: a reconciled pause revives a full model/tool continuation.
        settle_deadline = time.monotonic() + t.settle_budget
        waited_from: float | None = None
        while True:
            status = (
                await self.client.get_chat(
                    self.chat_id, timeout=max(0.001, settle_deadline - time.monotonic())
                )
            ).status
            verdict = poll_verdict(status, cut_short)
            if verdict != "wait":
                break
            if waited_from is None:
                waited_from = time.monotonic()
                self._mark(f"settle wait: status {status}, polling")
            if time.monotonic() + t.poll_interval > settle_deadline:
                raise TimeoutError(
                    f"chat {self.chat_id} still {status} after the {t.settle_budget:.0f}s "
                    "settle budget"
                )
            await asyncio.sleep(t.poll_interval)  # acknowledged ≠ settled
        self._decide(
            "settle",
            f"status {status}"
            + ("" if waited_from is None else f" after {time.monotonic() - waited_from:.1f}s"),
            verdict,
            f"cut_short={cut_short}",
        )
        return SettleResult(
            status, cut_short, attempts, slept, covered_user_id=self.counted_user_id
        )

    async def run(self) -> RecoveryOutcome:
        """Settle-wait → result check, reconciling again while the run pauses anew;
        or, when the live run is this step's crashed attempt, follow it."""
        slept = 0.0
        self._mark(f"starts ({self.marker})")
        for _ in range(self.timings.max_rounds):
            settled = await self.settle()
            slept += settled.horizon_slept_s
            if settled.follow_s is not None:
                outcome = await self.follow(settled)
            else:
                outcome = await self.check_result(settled)
            if outcome is not None:
                outcome.horizon_slept_s = slept
                self._mark(f"ends: {outcome.classification}")
                return outcome
        raise CoderRecoveryError(
            f"chat {self.chat_id} kept pausing on client tools (or taking new sends "
            f"under recovery's reads) for {self.timings.max_rounds} rounds"
        )

    async def _follower_quiet(self) -> None:
        """Wait (bounded) for the follower's background requests — the best-effort
        interrupt a failed follow's teardown fired — when it has any
        (:meth:`coder_chat.agent.CoderAgent.wait_background`)."""
        wait = getattr(self.follower, "wait_background", None)
        if wait is not None:
            await wait(self.timings.probe_bound)

    async def follow(self, settled: SettleResult) -> RecoveryOutcome | None:
        """Re-attach to the crashed attempt's live run and follow it to its settle.

        The follower answers any client-tool pause with the step's tools (a
        crash-safe call whose effect committed is answered from the ledger), so
        the result is the one the dead process's ``generate()`` would have
        returned. ``None``: settle again the ordinary way — there was no turn
        to follow after all, or a failed follow left the chat paused on tools
        (reconciled, never interrupted away). When the follow ends before the
        run settles the attempt is cut short — journaled "cut-short", stopped,
        and resubmitted — if the follow's own deadline passed or the follower's
        teardown interrupted the run; a follower that left the run alone
        (``left_run_live``: a transient failure, or a durable turn's follower
        after any failure) is settled again instead, so an attempt that
        finished meanwhile is recovered, never sent again (chaos seed 519).
        Either way the follower's background requests end first.
        """
        assert self.follower is not None and settled.follow_s is not None
        self._mark(f"follow begins (≤ {settled.follow_s:.1f}s)")
        try:
            gen = await self.follower.follow(marker=self.marker, timeout=settled.follow_s)
        except NoTurnToFollowError as exc:
            self._follow_off = True
            self._decide("follow", str(exc), "settle instead", "no turn to follow")
            return None
        except (
            CoderAgentError,
            CoderStreamError,
            CoderTransportError,
            TimeoutError,
            OSError,
        ) as exc:
            why = f"{type(exc).__name__}: {str(exc)[:200]}"
            # An interrupt the follower's teardown fired runs in its background: let it
            # end before anything is read, stopped or sent again. Still on its way, it
            # stopped the step's NEXT attempt (chaos seed 519: that attempt's first
            # words were returned as the step's answer).
            await self._follower_quiet()
            left_alone = getattr(self.follower, "left_run_live", None) is not None
            if left_alone and not _own_deadline(exc):
                # The follower fired no interrupt (a transient failure — a tool-results
                # POST that landed but whose response was lost — or a durable turn's
                # follower, which leaves every failure to recovery): the run is as the
                # failure found it, maybe finished meanwhile (a lost stream says nothing
                # of the run). Cutting it short now would resubmit a finished attempt, or
                # let the resubmitted step repeat its committed calls under new ids;
                # settle and follow it again (a few times), else leave it for a later
                # pass. Settling again recovers a finished one.
                self._refollows += 1
                if self._refollows > _MAX_REFOLLOWS:
                    self._decide("follow", why, "raise", "the run stays live for a later pass")
                    raise
                self._decide(
                    "follow", why, "settle again", "the follower left the run alone (no interrupt)"
                )
                return None
            # The follow's own deadline passed, or the follower's teardown fired a
            # best-effort interrupt (as the dead generate() would have): the attempt is
            # cut short. Journal that before bringing the chat to rest (recovery's own
            # interrupt of a run the follower left alone comes after it), so no later
            # pass trusts a 409.
            self._follow_off = True
            await self._journal("cut-short", settled.attempts)
            try:
                stopped, _ = await self._stop(
                    self.timings.probe_bound,
                    journal_cut_short=settled.attempts,
                    stop_a_pause=False,
                )
            except Paused:
                # Left paused (e.g. the deadline hit while a tool ran): the pause
                # may be the only record of a committed effect — reconcile it.
                self._decide("follow", why, "settle again", "the chat is paused on tools")
                return None
            self._decide(
                "follow",
                why,
                f"cut short; stopped ({stopped.status})",
                "the follow ended before the run settled: resubmit",
            )
            return RecoveryOutcome(
                classification="resubmit",
                chat_id=self.chat_id,
                marker=self.marker,
                status=stopped.status or "unknown",
                cut_short=True,
                attempts=settled.attempts,
                recovered=None,
                reason="the followed attempt did not settle within its turn deadline",
                decisions=self.decisions,
            )
        await self._raise_lost_outcomes(
            (c.tool_call_id, c.tool_name, c.output, c.is_error) for c in gen.client_tool_calls
        )
        self._decide(
            "follow",
            f"settled: finish {gen.finish_reason}, {len(gen.steps)} step(s), "
            f"{len(gen.client_tool_calls)} client call(s)",
            "followed",
            "the crashed attempt finished under the follower: its result, nothing sent",
        )
        return RecoveryOutcome(
            classification="followed",
            chat_id=self.chat_id,
            marker=self.marker,
            status="waiting",
            cut_short=False,
            attempts=settled.attempts,
            recovered=None,
            reason="followed the crashed attempt's live run to its settle",
            decisions=self.decisions,
            followed=gen,
        )
