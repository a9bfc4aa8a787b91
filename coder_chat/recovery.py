# The per-call `timeout=` parameter is part of the module contract (docs/architecture.md).
# ruff: noqa: ASYNC109
"""Crash recovery of one step's turn: settle-wait, ledger reconcile, result recovery.

A hard crash (OOM kill, host loss, SIGKILL) runs no ``finally`` block. When the
step runs again on its checkpointed chat it must not just resubmit:

1. **Settle-wait** — stop what the crash left behind and wait until the chat
   actually settles (:meth:`TurnRecovery.settle`). A client-tool pause is
   reconciled, never interrupted away; anything else is interrupted and polled
   to a terminal status.
2. **Ledger reconcile** — a ``requires_action`` pause is answered from the
   crash-safe tools' ledger (:meth:`TurnRecovery.reconcile`).
3. **Result check** — the crashed attempt may already have finished the step's
   work: recover its result from history instead of resubmitting
   (:meth:`TurnRecovery.check_result`).

The pure decisions live in :mod:`coder_chat.core.recovery`; this module only
does the I/O and records every decision (:attr:`RecoveryOutcome.decisions`:
what was seen, what was decided, why).

``coder_chat`` imports no store: anything shaped like :class:`RecoveryStore`
works — ``blocks.StateStore`` does, with ``journal_entry=blocks.JournalEntry``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from pydantic import BaseModel

from coder_chat.agent import NoTurnToFollowError
from coder_chat.core.follow import crashed_pause_budget
from coder_chat.core.recovery import (
    JournalView,
    LedgerAction,
    RecoveryDecision,
    SettleAction,
    batch_verdict,
    classify_attempt,
    cut_short_after_interrupt,
    follow_budget,
    follows_crashed_attempt,
    horizon_remaining,
    is_answered,
    ledger_action,
    lost_outcomes,
    pin_after_horizon,
    poll_verdict,
    scope_journal,
    settle_action,
    unanswered_verdict,
)
from coder_chat.core.translator import pending_client_calls
from coder_chat.crash_safe import CrashSafeTool, PureTool, ToolLedgerStore, crash_point
from coder_chat.errors import (
    CoderAgentError,
    CoderApiError,
    CoderRecoveryError,
    CoderStreamError,
    CoderTransportError,
    is_transient,
)
from coder_chat.history import (
    PAGE_SIZE,
    DynamicToolPart,
    RecoveredTurn,
    count_marker_attempts,
    fetch_turn,
    fetch_until,
    recover_turn_result,
)
from coder_chat.models import Chat, ToolResult
from coder_chat.rest import ChatClient
from coder_chat.results import GenerateResult
from coder_chat.stop import StopResult, stop_chat
from coder_chat.tools import ClientTool, StructuredOutput, ToolContext

__all__ = [
    "Follower",
    "JournalRecord",
    "JournalStore",
    "RecoveryOutcome",
    "RecoveryStore",
    "RecoveryTimings",
    "SettleResult",
    "ToolOutcomeLostError",
    "TurnRecovery",
    "recorded_turn_s",
    "timeline_origin",
]

_log = logging.getLogger(__name__)

#: Wall-clock time (``time.time()``) the ``+N.Ns`` of recovery's log lines counts
#: from, so one recovery's timeline reads straight off its run's logs: the
#: ``recover-turn`` flow sets its run's start. Unset: each recovery's own start.
timeline_origin: ContextVar[float | None] = ContextVar("recovery_timeline_origin", default=None)


#: Tries of a pause's tool-results submission whose response is lost (each one
#: after a history read shows the calls still pending).
SUBMIT_ATTEMPTS = 3


@dataclass(frozen=True, slots=True)
class RecoveryTimings:
    """Time constants of recovery (seconds); tests shorten them.

    ``probe_bound``: the status probe + interrupt bound (15 s) — a stalled
    deployment must fail the step, not hang it. ``settle_budget``: the settle
    poll and the history reads after it (600 s): turn-scale, because a
    reconciled pause revives a full model/tool continuation.
    ``poll_interval``: 1 s — acknowledged is not settled. ``commit_horizon``:
    how long a journaled send may still land (300 s = ``request_timeout``).
    ``max_rounds``: reconcile → settle rounds before giving up (each round is
    one NEW client-tool pause of the revived run).
    """

    probe_bound: float = 15.0
    settle_budget: float = 600.0
    poll_interval: float = 1.0
    commit_horizon: float = 300.0
    max_rounds: int = 64


class JournalStore(Protocol):
    """The per-chat send journal (``blocks.StateStore().journal`` fits)."""

    async def get(self, chat_id: str) -> Any: ...
    async def set(self, chat_id: str, entry: Any) -> Any: ...


class RecoveryStore(Protocol):
    """Journal + tool ledger (``blocks.StateStore`` fits)."""

    @property
    def journal(self) -> JournalStore: ...
    @property
    def ledger(self) -> ToolLedgerStore: ...


@dataclass(frozen=True, slots=True)
class JournalRecord:
    """Default journal entry type (pass ``journal_entry=blocks.JournalEntry`` for blocks)."""

    state: Literal["submitting", "resumed", "cut-short"]
    marker: str
    attempt: int
    at: float
    #: The attempt's turn deadline (epoch seconds), when the writer knew the step's
    #: turn timeout; see :attr:`TurnRecovery.turn_timeout`.
    deadline: float | None = None


def recorded_turn_s(entry: Any) -> float | None:
    """The step's turn timeout as a journal entry recorded it (``deadline - at``),
    or None: no deadline recorded (an entry from before the field, a verdict, a
    writer that did not know the step's timeout)."""
    deadline = getattr(entry, "deadline", None)
    at = getattr(entry, "at", None)
    if deadline is None or at is None:
        return None
    span = float(deadline) - float(at)
    return span if span > 0 else None


JournalEntryFactory = Callable[..., Any]


#: Re-follows of a live attempt after transient follow failures, per recovery pass.
_MAX_REFOLLOWS = 3


class Follower(Protocol):
    """What recovery re-attaches with (``coder_chat.CoderAgent`` fits): an agent on
    the step's chat with the step's client tools (crash-safe ones bound to the
    ledger, so a pause whose effect already committed is answered from it)."""

    async def follow(
        self,
        *,
        timeout: float | None = None,
        user_message_id: int | None = None,
        marker: str | None = None,
    ) -> GenerateResult: ...


class ToolOutcomeLostError(CoderRecoveryError):
    """The server closed a client tool call as "Tool execution timed out" although
    the ledger shows its effect committed (``done``) or may have (``committing``).

    chatd does that when nobody answers a ``requires_action`` pause in time (five
    minutes): the model is told the tool failed and answers on that basis. The
    attempt's answer is therefore not returned, and the step is not resubmitted
    either: a resubmitted prompt lets the model call the tool again under a NEW
    call id, i.e. a new ledger key, and the effect would be applied twice. The
    step fails with this error (Prefect does not retry it); an operator decides.

    ``calls``: ``(tool_call_id, tool_name, ledger_state, recorded_output)``.
    """

    def __init__(self, chat_id: str, marker: str, calls: list[tuple[str, str, str, Any]]) -> None:
        names = ", ".join(f"{name} {call_id} (ledger {state})" for call_id, name, state, _ in calls)
        super().__init__(
            f"chat {chat_id}, step {marker}: the server recorded {names} as "
            "'Tool execution timed out' but the ledger shows the effect committed (done) or "
            "may have (committing); the attempt's answer rests on a failure that did not "
            "happen, so it is not returned, and the step is not resubmitted (the model "
            "could apply the effect again under a new call id). Decide by hand: the "
            "recorded outputs are on this error's .calls."
        )
        self.chat_id = chat_id
        self.marker = marker
        self.calls = calls


@dataclass(frozen=True, slots=True)
class SettleResult:
    """Where the settle-wait left the chat."""

    status: str
    cut_short: bool
    attempts: int
    horizon_slept_s: float
    #: Set when the live run is this step's crashed attempt: follow it for this
    #: many seconds instead of cutting it short (nothing was interrupted).
    follow_s: float | None = None


@dataclass(slots=True)
class RecoveryOutcome:
    """What recovery concluded for one step's attempt.

    ``followed``: the crashed attempt was still running and was followed to its
    settle (:attr:`followed` holds what its ``generate()`` would have returned);
    ``recovered``: it had finished, its result is rebuilt from history;
    ``resubmit``: it never finished (or was cut short): send the step again.
    """

    classification: Literal["recovered", "resubmit", "followed"]
    chat_id: str
    marker: str
    status: str
    cut_short: bool
    #: Committed attempts of the step (user messages carrying the marker).
    attempts: int
    recovered: RecoveredTurn | None
    reason: str
    decisions: list[RecoveryDecision] = field(default_factory=list)
    #: Time spent sleeping out a journaled send's commit window (deliberate).
    horizon_slept_s: float = 0.0
    #: The followed attempt's result (``classification == "followed"``).
    followed: GenerateResult | None = None


class _Paused(Exception):
    """A stop found the chat paused on client tools before its first interrupt."""


class TurnRecovery:
    """Recovery of one step's attempt on ``chat_id`` (identified by ``marker``).

    Args:
        client: a REST client for the chat's deployment.
        store: journal + ledger (:class:`RecoveryStore`).
        tools: the step's client tools, as the live loop registers them. Their
            names restrict which history calls count as client calls (history
            does not record which calls were client tools), cut the recovered
            text, and name the re-drive path of each ledgered tool.
        journal_entry: builds a journal entry from ``state, marker, attempt, at``
            (and ``deadline``, passed only when one is known).
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

    def __init__(
        self,
        client: ChatClient,
        store: RecoveryStore,
        chat_id: str,
        marker: str,
        *,
        tools: Sequence[ClientTool[Any]] = (),
        journal_entry: JournalEntryFactory = JournalRecord,
        timings: RecoveryTimings | None = None,
        known_failure: bool = False,
        output_model: type[BaseModel] | None = None,
        structured_tool_name: str = "structured_output",
        clock: Callable[[], float] = time.time,
        logger: logging.Logger | logging.LoggerAdapter[Any] | None = None,
        follower: Follower | None = None,
        turn_timeout: float | None = None,
    ) -> None:
        self.client = client
        self.store = store
        self.chat_id = chat_id
        self.marker = marker
        self.tools: Mapping[str, ClientTool[Any]] = {t.name: t for t in tools}
        self.journal_entry = journal_entry
        self.timings = timings or RecoveryTimings()
        self.known_failure = known_failure
        self.output_model = output_model
        self.structured_tool_name = structured_tool_name
        self.clock = clock
        self.log = logger or _log
        self.follower = follower
        self.turn_timeout = turn_timeout
        #: The step's turn timeout as the crashed attempt's entry recorded it.
        self._attempt_turn_s: float | None = None
        self.decisions: list[RecoveryDecision] = []
        # Set once following found no turn: settle the ordinary way from then on.
        self._follow_off = False
        self._refollows = 0
        self._t0 = timeline_origin.get() or time.time()

    # ------------------------------------------------------------------ helpers

    def _decide(self, stage: str, seen: str, decided: str, why: str) -> None:
        d = RecoveryDecision(stage, seen, decided, why)
        self.decisions.append(d)
        self.log.info(
            "recovery [%s] %s: saw %s → %s (%s) +%.1fs",
            self.chat_id, stage, seen, decided, why, self._elapsed(),
        )  # fmt: skip

    def _elapsed(self) -> float:
        return time.time() - self._t0

    def _mark(self, what: str) -> None:
        """A timeline line (``+N.Ns`` since :data:`timeline_origin`): where the time went."""
        self.log.info("recovery [%s] %s +%.1fs", self.chat_id, what, self._elapsed())

    async def attempts(self, *, timeout: float | None = None) -> int:
        """Committed attempts of the step: user messages carrying the marker.

        Steps run sequentially, so they sit contiguous at the tail of history:
        page newest-first and stop at the first user message without the marker.
        """
        messages, _ = await fetch_until(
            self.client,
            self.chat_id,
            lambda ms: count_marker_attempts(ms, self.marker)[1],
            page_size=PAGE_SIZE,
            timeout=timeout,
        )
        return count_marker_attempts(messages, self.marker)[0]

    async def _journal(self, state: Literal["resumed", "cut-short", "submitting"], n: int) -> None:
        at = self.clock()
        # A send is bounded by this process's turn timeout; a revived run by its
        # attempt's (recorded with the crashed send), this process's if unknown.
        # A verdict (cut-short) bounds nothing.
        span = {
            "submitting": self.turn_timeout,
            "resumed": self._attempt_turn_s or self.turn_timeout,
        }.get(state)
        extra = {} if span is None else {"deadline": at + span}
        await self.store.journal.set(
            self.chat_id,
            self.journal_entry(state=state, marker=self.marker, attempt=n, at=at, **extra),
        )

    def _turn_budget(self, entry: Any) -> float:
        """The crashed attempt's turn timeout: recorded with its entry, else the
        settle budget (the turn timeout of the process recovering it)."""
        recorded = recorded_turn_s(entry)
        if recorded is not None:
            self._attempt_turn_s = recorded
            return recorded
        return self.timings.settle_budget

    async def _stop(
        self,
        timeout: float,
        *,
        journal_cut_short: int | None = None,
        stop_a_pause: bool = True,
    ) -> tuple[StopResult, bool]:
        """Bring the chat to rest with the one stop primitive (``stop_chat``).

        An interrupt of a ``requires_action`` pause makes chatd close the pending
        calls with synthetic errors and RESUME the model; ``stop_chat`` interrupts
        that run again instead of leaving it to call a tool anew. With
        ``journal_cut_short`` (the attempt count) every interrupt is preceded by
        a "cut-short" journal write, so a crash right after an accepted
        interrupt leaves the verdict behind. ``stop_a_pause=False``: a pause that
        appears before the first interrupt is not interrupted (:class:`_Paused`
        is raised): it is the pending record of tool calls, reconcile it.

        Returns the stop result and whether an interrupt may have landed
        (accepted, or sent and its answer lost).
        """
        sent = 0

        async def before(chat: Chat) -> None:
            nonlocal sent
            if not stop_a_pause and sent == 0 and chat.status == "requires_action":
                raise _Paused
            if journal_cut_short is not None:
                await self._journal("cut-short", journal_cut_short)
                crash_point("recovery.before_interrupt")
            sent += 1

        result = await stop_chat(
            self.client,
            self.chat_id,
            timeout=max(0.001, timeout),
            before_interrupt=before,
            poll_interval=self.timings.poll_interval,
        )
        landed = result.interrupts > 0 or (sent > 0 and result.last_error is not None)
        return result, landed

    # ------------------------------------------------------------------ reconcile

    async def reconcile(
        self, attempts: int, *, timeout: float, run_unstarted: bool = False
    ) -> bool:
        """Answer a ``requires_action`` pause from the ledger; returns ``unstarted``.

        ``unstarted`` (→ ``cut_short``) is True only when this fell back to
        interrupting: after a submission with no unstarted call nothing was cut
        short, and the result check must classify the resumed run's finish as a
        completed attempt, not resubmit it.

        ``run_unstarted``: the pause is this step's crashed attempt (see
        :func:`coder_chat.core.follow.crashed_pause_budget`): a call that never ran
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

    # ------------------------------------------------------------------ settle-wait

    def _can_follow(self) -> bool:
        return self.follower is not None and not self._follow_off

    def _pause_budget(self, entry: JournalView | None, attempts: int) -> float | None:
        """How long recovery may answer (and then follow) this pause itself; None:
        cut calls that never ran short (see ``crashed_pause_budget``)."""
        if not self._can_follow() or self.known_failure or entry is None:
            return None
        return crashed_pause_budget(
            state=entry.state,
            entry_marker=entry.marker,
            entry_attempt=entry.attempt,
            entry_at=entry.at,
            marker=self.marker,
            attempts=attempts,
            now=self.clock(),
            turn_budget=self._turn_budget(entry),
        )

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
            budget = follow_budget(entry.at, self.clock(), self._turn_budget(entry))
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
            except _Paused:
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
            except _Paused:
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
        return SettleResult(status, cut_short, attempts, slept)

    # ------------------------------------------------------------------ result check

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
            f"chat {self.chat_id} kept pausing on client tools for "
            f"{self.timings.max_rounds} reconcile rounds"
        )

    async def follow(self, settled: SettleResult) -> RecoveryOutcome | None:
        """Re-attach to the crashed attempt's live run and follow it to its settle.

        The follower answers any client-tool pause with the step's tools (a
        crash-safe call whose effect committed is answered from the ledger), so
        the result is the one the dead process's ``generate()`` would have
        returned. ``None``: settle again the ordinary way — there was no turn
        to follow after all, or a failed follow left the chat paused on tools
        (reconciled, never interrupted away). When the follow ends before the
        run settles (its turn deadline, a stream failure) the attempt is cut
        short: journaled "cut-short", stopped, and resubmitted.
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
            if getattr(self.follower, "left_run_live", None) is not None:
                # A transient failure (e.g. a tool-results POST that landed but whose
                # response was lost) and the follower fired no interrupt: the run is
                # still this attempt's own. Cutting it short now would let the
                # resubmitted step repeat its committed calls under new ids; settle
                # and follow it again (a few times), else leave it for a later pass.
                self._refollows += 1
                if self._refollows > _MAX_REFOLLOWS:
                    self._decide("follow", why, "raise", "the run stays live for a later pass")
                    raise
                self._decide("follow", why, "settle again", "transient: the run was left live")
                return None
            # The follower's teardown already fired a best-effort interrupt (as the
            # dead generate() would have): the attempt is cut short. Journal that
            # before bringing the chat to rest, so no later pass trusts a 409.
            self._follow_off = True
            await self._journal("cut-short", settled.attempts)
            try:
                stopped, _ = await self._stop(
                    self.timings.probe_bound,
                    journal_cut_short=settled.attempts,
                    stop_a_pause=False,
                )
            except _Paused:
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

    async def _raise_lost_outcomes(self, results: Any) -> None:
        """Raise :class:`ToolOutcomeLostError` when history says a client call timed
        out although the ledger shows its effect ran (see the error's docstring)."""
        rows = list(results)
        states: dict[str, str | None] = {}
        entries: dict[str, Any] = {}
        for call_id, _, _output, is_error in rows:
            if not is_error or call_id in states:
                continue
            entry = await self.store.ledger.get(self.chat_id, call_id)
            states[call_id] = None if entry is None else entry.state
            entries[call_id] = entry
        lost = lost_outcomes(rows, states)
        if not lost:
            return
        calls = [
            (call_id, name, state, getattr(entries[call_id], "output", None))
            for call_id, name, state in lost
        ]
        self._decide(
            "result",
            "; ".join(f"{n} {c}: 'timed out' in history, ledger {st}" for c, n, st in lost),
            "fail the step",
            "an applied effect recorded as a failure: neither return nor resubmit",
        )
        raise ToolOutcomeLostError(self.chat_id, self.marker, calls)

    async def journal_resubmission(self, attempts: int) -> None:
        """Write-ahead of a resubmission: ``submitting`` with the current count.

        It supersedes the "cut-short" verdict it acts on — safely: an unlanded
        send over an existing attempt makes the next settle-wait pin cut_short
        right back.
        """
        await self._journal("submitting", attempts)
        self._decide("resubmit", f"{attempts} attempt(s)", "journal submitting", "write-ahead")
