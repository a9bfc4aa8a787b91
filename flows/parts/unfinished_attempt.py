"""An earlier, unfinished attempt of a step: recover it before the step sends.

``run_turn`` calls :func:`recover_before_send` on a checkpointed chat before the
step's send. If the journal shows this step already sent (an unfinished attempt:
a crash, a failure, a rerun), it runs the durable design's recovery
(:class:`coder_chat.recovery.TurnRecovery`: settle-wait, ledger reconcile,
result check) and either returns the recovered result — nothing is sent — or
journals the resubmission write-ahead. So a plain retry or rerun of a crashed
flow run is safe. After a *known* failure, :func:`note_failed_attempt` journals
the attempt "cut-short" for whichever recovery comes next.

Each recovery decision is logged and published as a table artifact (what was
seen, what was decided, why).

Test seam: :func:`coder_chat.crash_safe.crash_point` names points
(``recovery.*``) where the crash-matrix tests SIGKILL the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prefect.artifacts import acreate_table_artifact

from coder_chat.crash_safe import crash_point
from coder_chat.errors import CoderTransportError
from coder_chat.history import DynamicToolPart, count_marker_attempts, fetch_until
from coder_chat.recovery import Follower, RecoveryOutcome, RecoveryTimings, TurnRecovery
from coder_chat.rest import ChatClient
from coder_chat.results import GenerateResult
from coder_chat.tools import ClientTool, StructuredOutput
from prefect_coder.blocks import JournalEntry, StateStore
from prefect_coder.flows.parts.artifacts import artifact_key
from prefect_coder.flows.parts.params import Step, WorkflowSettings, step_marker
from prefect_coder.flows.parts.results import ToolCallRecord, TurnResult
from prefect_coder.flows.parts.run_log import run_logger

__all__ = [
    "SendPlan",
    "journal_cut_short",
    "journal_send",
    "note_failed_attempt",
    "publish_recovery",
    "recover_before_send",
    "recovered_result",
    "recovery_timings",
]


def _env_float(name: str) -> float | None:
    raw = os.environ.get(name)
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if value >= 0 else None


def recovery_timings(
    settings: WorkflowSettings, request_timeout: float | None, turn_timeout: float | None
) -> RecoveryTimings:
    """Recovery bounds of a workflow.

    * probe/interrupt bound: ``settings.settle_wait_s`` (15 s);
    * commit horizon: the per-segment ``request_timeout`` — the design's
      conservative horizon for a send still in flight (300 s) — or
      ``PREFECT_CODER_COMMIT_HORIZON_S``;
    * settle budget: the turn's total bound (600 s), turn-scale;
    * poll interval: 1 s, or ``PREFECT_CODER_SETTLE_POLL_S``.
    """
    d = RecoveryTimings()
    horizon = _env_float("PREFECT_CODER_COMMIT_HORIZON_S")
    poll = _env_float("PREFECT_CODER_SETTLE_POLL_S")
    return RecoveryTimings(
        probe_bound=settings.settle_wait_s,
        settle_budget=turn_timeout or d.settle_budget,
        poll_interval=d.poll_interval if poll is None else poll,
        commit_horizon=horizon if horizon is not None else (request_timeout or d.commit_horizon),
    )


@dataclass(frozen=True, slots=True)
class SendPlan:
    """What ``run_turn`` does next on a checkpointed chat."""

    #: 1-based number of the attempt about to be sent (or recovered).
    attempt: int
    #: Set when the crashed attempt finished: return it, send nothing.
    result: TurnResult | None = None
    outcome: RecoveryOutcome | None = None
    #: Set when the crashed attempt was still running and was followed to its
    #: settle: its ``generate()`` result, nothing sent.
    followed: GenerateResult | None = None


def recovered_result(
    workflow_id: str,
    step: Step,
    outcome: RecoveryOutcome,
    tools: Sequence[ClientTool[Any]],
) -> TurnResult:
    """The step's result rebuilt from history (what ``generate()`` would have returned)."""
    rec = outcome.recovered
    assert rec is not None
    names = {t.name for t in tools}
    calls = [
        ToolCallRecord(
            id=p.tool_call_id,
            name=p.tool_name,
            kind="client" if p.tool_name in names else "server",
            args=p.input,
            output=p.output if p.state == "output-available" else p.error_text,
            is_error=p.state == "output-error",
        )
        for p in rec.parts
        if isinstance(p, DynamicToolPart)
    ]
    structured = rec.structured.model_dump(mode="json") if rec.structured is not None else None
    return TurnResult(
        workflow_id=workflow_id,
        step=step.name,
        marker=outcome.marker,
        chat_id=outcome.chat_id,
        text=rec.text,
        finish_reason="stop",
        usage={},
        user_message_id=rec.user_message_id,
        tool_calls=calls,
        structured=structured,
        attempt=max(1, outcome.attempts),
        generate_ms=0.0,
    )


async def publish_recovery(
    workflow_id: str, step_name: str, outcome: RecoveryOutcome, *, artifacts: bool = True
) -> None:
    """Log the verdict and publish the decisions as a table artifact."""
    log = run_logger(__name__)
    log.info(
        "recovery of %s/%s on chat %s: %s (%s); %d decision(s), horizon slept %.2fs",
        workflow_id,
        step_name,
        outcome.chat_id,
        outcome.classification,
        outcome.reason,
        len(outcome.decisions),
        outcome.horizon_slept_s,
    )
    if not artifacts:
        return
    try:
        await acreate_table_artifact(
            key=artifact_key(workflow_id, step_name, kind="recovery", slug_len=70),
            table=[d.row() for d in outcome.decisions],
            description=(
                f"Crash recovery of step `{step_name}` of `{workflow_id}` on chat "
                f"`{outcome.chat_id}`: **{outcome.classification}** — {outcome.reason}"
            ),
        )
    except Exception:
        log.warning("could not publish the recovery artifact", exc_info=True)


async def recover_before_send(
    *,
    client: ChatClient,
    store: StateStore,
    workflow_id: str,
    step: Step,
    chat_id: str,
    tools: Sequence[ClientTool[Any]],
    answer: StructuredOutput[Any] | None,
    timings: RecoveryTimings,
    known_failure: bool,
    artifacts: bool = True,
    follower: Follower | None = None,
    entry: JournalEntry | None = None,
    journaled: bool = False,
) -> SendPlan:
    """Run before every send of ``step`` on a checkpointed chat.

    ``entry``/``journaled``: what ``store.turns.begin`` read and wrote in the
    turn's first transaction (``journaled``: it wrote this send's write-ahead);
    without them the journal is read (and the write-ahead written) here.

    No journal entry for this step's marker proves no send of it ever started
    (every send is journaled first, a first turn's with its checkpoint), so the
    first send only writes its write-ahead. Otherwise an earlier attempt is
    unfinished: recover it — following it with ``follower`` when it is still
    running (:class:`coder_chat.recovery.TurnRecovery`).
    """
    marker = step_marker(workflow_id, step.name)
    if journaled:
        return SendPlan(attempt=1)  # begin wrote the first send's write-ahead
    if entry is None:
        entry = await store.journal.get(chat_id)
    if entry is None or entry.marker != marker:
        # Write-ahead BEFORE the send: no entry proves no send ever started. The
        # count before this step's first send is 0 (an earlier send would have
        # journaled this marker).
        await store.journal.set(chat_id, JournalEntry(state="submitting", marker=marker, attempt=0))
        return SendPlan(attempt=1)
    if known_failure and entry.state == "submitting":
        # The failed attempt left its write-ahead in place: its send was not in
        # history after the failure (note_failed_attempt), so the SDK's
        # best-effort interrupt, fired before that read, cannot have cut a run of
        # it short. A late landing is a whole run: follow or recover it, never pin
        # it cut short (that would resend the step next to it). The journal write
        # itself failing leaves the same entry; then the interrupt's own calls
        # most likely failed with it.
        known_failure = False
    recovery = TurnRecovery(
        client,
        store,
        chat_id,
        marker,
        tools=tools,
        journal_entry=JournalEntry,
        timings=timings,
        known_failure=known_failure,
        output_model=answer.model if answer is not None else None,
        structured_tool_name=answer.name if answer is not None else "structured_output",
        logger=run_logger(__name__),
        follower=follower,
    )
    outcome = await recovery.run()
    await publish_recovery(workflow_id, step.name, outcome, artifacts=artifacts)
    if outcome.classification == "followed":
        return SendPlan(
            attempt=max(1, outcome.attempts), outcome=outcome, followed=outcome.followed
        )
    if outcome.classification == "recovered":
        return SendPlan(
            attempt=max(1, outcome.attempts),
            result=recovered_result(workflow_id, step, outcome, tools),
            outcome=outcome,
        )
    crash_point("recovery.before_resubmit")
    await recovery.journal_resubmission(outcome.attempts)
    # At least the second try: the journal proves an earlier send of this step
    # started, even when it never landed.
    return SendPlan(attempt=max(2, outcome.attempts + 1), outcome=outcome)


async def journal_send(client: ChatClient, store: StateStore, chat_id: str, marker: str) -> int:
    """The write-ahead of a further send of a step on its chat (e.g. a structured
    step's re-ask): ``submitting`` with the step's current attempt count, which
    it returns. Every send on a checkpointed chat is journaled first."""
    count = await _marker_count(client, chat_id, marker, bound_s=30.0)
    await store.journal.set(chat_id, JournalEntry(state="submitting", marker=marker, attempt=count))
    return count


async def _marker_count(client: ChatClient, chat_id: str, marker: str, *, bound_s: float) -> int:
    """How many user messages of the chat carry ``marker`` (history read to the end)."""
    messages, _ = await fetch_until(
        client, chat_id, lambda ms: count_marker_attempts(ms, marker)[1], timeout=bound_s
    )
    return count_marker_attempts(messages, marker)[0]


async def journal_cut_short(client: ChatClient, store: StateStore, chat_id: str) -> bool:
    """Before somebody else's interrupt of a checkpointed chat (a sweep), journal
    the step's tail attempt ``cut-short``; returns whether the chat had a journal.

    Without it, the workflow's own recovery later sends an interrupt of its own,
    gets 409 (the sweep already stopped the run) and would take the truncated
    attempt for a finished one, returning it as the step's answer."""
    entry = await store.journal.get(chat_id)
    if entry is None:
        return False
    count = await _marker_count(client, chat_id, entry.marker, bound_s=5.0)
    await store.journal.set(
        chat_id, JournalEntry(state="cut-short", marker=entry.marker, attempt=count)
    )
    return True


async def note_failed_attempt(
    client: ChatClient,
    store: StateStore,
    chat_id: str | None,
    marker: str,
    failure: BaseException | None = None,
) -> None:
    """After a *known* failure of a send (timeout, abort, error), journal the tail
    attempt "cut-short" so that a later recovery — in another flow run, without
    the reason at hand — cannot trust its own 409: the failure already fired the
    SDK's best-effort interrupt, which may have stopped the run before recovery
    looked. Scoped by (marker, count) like every entry: if the send never landed,
    the verdict applies to the attempt the step was resubmitting over, which was
    cut short or errored anyway. Best-effort and bounded; shielded, because it also
    runs while the turn is being cancelled.

    One exception: a send whose request may still be in flight at the server (a
    transport failure that was not retry-safe: a reset or timed-out POST) and
    that history does not show yet keeps its ``submitting`` write-ahead. Its
    timestamp starts the commit horizon, so the retry sleeps the window out and
    finds the late-landing message (and follows it) instead of sending the step
    a second time next to it."""
    if not chat_id:
        return
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.shield(_note_failed_attempt(client, store, chat_id, marker, failure))


def _may_still_land(failure: BaseException | None) -> bool:
    return isinstance(failure, CoderTransportError) and not failure.retry_safe


async def _note_failed_attempt(
    client: ChatClient,
    store: StateStore,
    chat_id: str,
    marker: str,
    failure: BaseException | None,
) -> None:
    try:
        count = await _marker_count(client, chat_id, marker, bound_s=5.0)
        if _may_still_land(failure):
            entry = await store.journal.get(chat_id)
            if (
                entry is not None
                and entry.marker == marker
                and entry.state == "submitting"
                and entry.attempt == count
            ):
                run_logger(__name__).info(
                    "the send of %s may still land on chat %s: its write-ahead stays, "
                    "a retry waits out its commit window",
                    marker,
                    chat_id,
                )
                return
        await store.journal.set(
            chat_id, JournalEntry(state="cut-short", marker=marker, attempt=count)
        )
    except Exception:
        run_logger(__name__).warning(
            "could not journal the failed attempt on chat %s", chat_id, exc_info=True
        )
