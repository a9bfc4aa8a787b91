"""An earlier, unfinished attempt of a step: recover it before the step sends.

``run_turn`` calls :func:`recover_before_send` on a checkpointed chat before the
step's send. If the journal shows this step already sent (an unfinished attempt:
a crash, a failure, a rerun), it runs the durable design's recovery
(:class:`coder_chat.recovery.TurnRecovery`: settle-wait, ledger reconcile,
result check) and either returns the recovered result — nothing is sent — or
journals the resubmission write-ahead. So a plain retry or rerun of a crashed
flow run is safe. After a *known* failure, :func:`note_failed_attempt` journals
the attempt "cut-short" for whichever recovery comes next.

A step the journal does not name may still be in the chat's history — its
result lost while the workflow went on (the journal then names a later step).
Unless the journal names an EARLIER step of the workflow (``run_steps`` passes
the order: :func:`earlier_steps`), the step looks for its marker first: an
attempt that a later step's prompt follows finished, and is rebuilt from history
(:func:`locate_step`). A checkpoint that names an ARCHIVED chat gives back its
finished steps from history; the rest are sent in a fresh chat, which becomes
the checkpoint (:attr:`SendPlan.fresh_chat`, :func:`archived_tail_finished`).

Each recovery decision is logged and published as a table artifact (what was
seen, what was decided, why).

Test seam: :func:`coder_chat.crash_safe.crash_point` names points
(``recovery.*``) where the crash-matrix tests SIGKILL the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from collections.abc import Iterable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from types import EllipsisType
from typing import Any

from prefect.artifacts import acreate_table_artifact

from coder_chat.core.fields import field, plain
from coder_chat.core.recovery import RecoveryDecision, is_answered
from coder_chat.core.usage import usage_of_messages
from coder_chat.crash_safe import crash_point
from coder_chat.errors import CoderError, CoderRecoveryError, CoderTransportError
from coder_chat.history import (
    DynamicToolPart,
    count_marker_attempts,
    fetch_until,
    recover_turn_result,
)
from coder_chat.recovery import Follower, RecoveryOutcome, RecoveryTimings, TurnRecovery
from coder_chat.rest import ChatClient
from coder_chat.results import GenerateResult
from coder_chat.tools import ClientTool, StructuredOutput
from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state import JournalEntry
from prefect_coder.flows.common.params import Step, WorkflowSettings, step_marker
from prefect_coder.flows.common.results import ToolCallRecord, TurnResult
from prefect_coder.flows.observe.artifacts import artifact_key
from prefect_coder.flows.observe.run_log import run_logger
from prefect_coder.flows.recovery.orphans import adopt_or_strand_orphans

__all__ = [
    "SendPlan",
    "StepInHistory",
    "archived_tail_finished",
    "earlier_steps",
    "journal_cut_short",
    "journal_send",
    "locate_step",
    "note_failed_attempt",
    "publish_recovery",
    "recover_before_send",
    "recovered_result",
    "recovery_timings",
    "send_entry",
    "turn_fields",
    "turn_history",
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
    #: The checkpointed chat is archived and holds no finished attempt of the
    #: step: send it in a fresh chat (which becomes the checkpoint).
    fresh_chat: bool = False
    #: With ``fresh_chat``: an earlier fresh attempt's chat, created but never
    #: checkpointed, holds only this step — adopted (now the checkpoint): recover
    #: the step there instead of creating another chat.
    adopted: str | None = None


def turn_fields(messages: Iterable[Any], user_message_id: int) -> tuple[list[int], dict[str, Any]]:
    """``message_ids`` and ``usage`` of the turn a user message started, from history.

    As ``generate()`` reports them: the ids of the turn's assistant and tool
    messages (those after the user message, up to the chat's next user message),
    and the wire ``usage`` of its assistant messages summed per message
    (:func:`coder_chat.core.usage.usage_of_messages`). History carries both
    (``ChatMessage.usage``); a message without usage adds nothing. Pure."""
    ordered = sorted(messages, key=lambda m: int(field(m, "id", 0)))
    ids: list[int] = []
    usage: dict[int, dict[str, Any]] = {}
    for m in ordered:
        mid = int(field(m, "id", 0))
        if mid <= user_message_id:
            continue
        role = field(m, "role")
        if role == "user":
            break  # the next turn starts here
        if role not in ("assistant", "tool"):
            continue
        ids.append(mid)
        raw = plain(field(m, "usage")) if role == "assistant" else None
        if isinstance(raw, dict):
            usage[mid] = raw
    total = usage_of_messages(usage)
    summary = {k: v for k, v in dataclasses.asdict(total).items() if k != "raw" and v is not None}
    return ids, summary


def recovered_result(
    workflow_id: str,
    step: Step,
    outcome: RecoveryOutcome,
    tools: Sequence[ClientTool[Any]],
    messages: Iterable[Any] | None = None,
) -> TurnResult:
    """The step's result rebuilt from history (what ``generate()`` would have returned).

    ``messages``: the chat's history from the turn's user message on (at least);
    with it ``message_ids`` and ``usage`` are filled as ``generate()`` fills them
    (:func:`turn_fields`), without it they stay empty."""
    rec = outcome.recovered
    assert rec is not None
    message_ids, usage = (
        turn_fields(messages, rec.user_message_id) if messages is not None else ([], {})
    )
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
        usage=usage,
        user_message_id=rec.user_message_id,
        message_ids=message_ids,
        tool_calls=calls,
        structured=structured,
        attempt=max(1, outcome.attempts),
        generate_ms=0.0,
    )


async def turn_history(
    client: ChatClient, chat_id: str, user_message_id: int, *, bound_s: float
) -> list[Any] | None:
    """The chat's history from the user message ``user_message_id`` on, for
    :func:`recovered_result` (its ``message_ids`` and ``usage``) when the recovery
    that rebuilt the result did not hand its messages over. ``None`` when it cannot
    be read within ``bound_s`` per request: the result then carries both empty —
    its text, calls and answer are already recovered, and a field of record must
    not fail the step."""
    try:
        messages, _ = await fetch_until(
            client,
            chat_id,
            lambda ms: any(int(field(m, "id", 0)) <= user_message_id for m in ms),
            timeout=bound_s,
        )
    except CoderError:
        run_logger(__name__).warning(
            "could not read chat %s's history for the recovered result's message ids and "
            "usage; they stay empty",
            chat_id,
            exc_info=True,
        )
        return None
    return messages


#: Markers of the steps that run BEFORE the current one in its workflow, set by
#: ``run_steps`` around each turn (:func:`earlier_steps`). Unset (``agent-turn``,
#: ``recover-turn``): the step order is unknown here.
_EARLIER: ContextVar[frozenset[str] | None] = ContextVar(
    "prefect_coder_earlier_step_markers", default=None
)


@contextlib.contextmanager
def earlier_steps(markers: Iterable[str]) -> Iterator[None]:
    """Tell :func:`recover_before_send` which steps come before the one about to run.

    It is what keeps the common send cheap: a journal naming an EARLIER step proves
    this step never sent (its own write-ahead would name it), so no history read is
    needed. Any other journal entry — none, or a LATER step's (a finished step whose
    result was lost while the workflow went on) — makes the step look for its
    marker in history first."""
    token = _EARLIER.set(frozenset(markers))
    try:
        yield
    finally:
        _EARLIER.reset(token)


@dataclass(frozen=True, slots=True)
class StepInHistory:
    """Where a step's attempts sit in a chat's history."""

    #: User messages carrying the step's marker in its newest block (its attempts).
    attempts: int
    #: The newest of them (the step's last attempt), None if the marker is absent.
    last_user_message_id: int | None
    #: The last attempt is the chat's newest user message: nothing was sent after it.
    tail: bool


def _text_of(message: Any) -> str:
    return "".join(
        field(p, "text", "") or ""
        for p in field(message, "content", []) or []
        if field(p, "type") == "text"
    )


def locate_step(messages: Iterable[Any], marker: str) -> StepInHistory:
    """Find a step's last attempt in ``messages`` (any order; pure).

    Steps run sequentially on a chat, so a user message of ANOTHER step after the
    step's last attempt means the workflow moved on: that attempt finished (its
    result was handed back), even if its recording was lost since."""
    users = sorted(
        (m for m in messages if field(m, "role") == "user"),
        key=lambda m: int(field(m, "id", 0)),
        reverse=True,
    )
    later = False
    for i, m in enumerate(users):
        if marker not in _text_of(m):
            later = True
            continue
        attempts = 0
        for older in users[i:]:
            if marker not in _text_of(older):
                break
            attempts += 1
        return StepInHistory(attempts, int(field(m, "id")), tail=not later)
    return StepInHistory(0, None, tail=False)


def archived_tail_finished(
    entry: JournalEntry | None, marker: str, attempts: int, status: str
) -> tuple[bool, str]:
    """Did the last attempt of a step that is an ARCHIVED chat's newest turn finish?

    Only positive evidence counts: the journal entry of the step's landed send
    (``submitting`` below the count) or of a run revived by our answers
    (``resumed``), and a chat that ended ``waiting``. The archive journals
    ``cut-short`` before any interrupt of its own, and a failed send journals it
    too, so a truncated attempt never passes; with no entry for the step (an older
    archive dropped it) the attempt is not trusted: an extra turn in a fresh chat,
    never a truncated answer returned as the step's result.
    """
    if entry is None or entry.marker != marker:
        return False, "no journal entry of the step survives: its last attempt is not trusted"
    if status not in ("waiting", "completed"):
        return False, f"the archived chat ended {status!r}"
    if entry.state == "submitting" and entry.attempt < attempts:
        return True, "its send landed and nothing cut it short"
    if entry.state == "resumed" and entry.attempt == attempts:
        return True, "recovery revived it and nothing cut it short"
    return False, f"journal {entry.state}/{entry.attempt} at {attempts} attempt(s): cut short"


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


def _has_step(messages: list[Any], marker: str) -> bool:
    return locate_step(messages, marker).last_user_message_id is not None


async def _restore(store: StateStore, chat_id: str, before: JournalEntry | None) -> None:
    """Put back the entry ``store.turns.begin`` replaced with a write-ahead that was
    not followed by a send: the journal must keep naming the step that sent last,
    or that step's own rerun would take the journal for an earlier step's and
    send itself again."""
    if before is None:
        await store.journal.clear(chat_id)
    else:
        await store.journal.set(chat_id, before)


@dataclass(frozen=True, slots=True)
class _StepSend:
    """The step about to be sent on a checkpointed chat, and what its history
    decisions need: fixed for one :func:`recover_before_send` call. The journal
    state (``before``/``wrote``) is passed on its own: a decision may change it."""

    client: ChatClient
    store: StateStore
    workflow_id: str
    step: Step
    chat_id: str
    tools: Sequence[ClientTool[Any]]
    answer: StructuredOutput[Any] | None
    timings: RecoveryTimings
    artifacts: bool

    @property
    def marker(self) -> str:
        return step_marker(self.workflow_id, self.step.name)


async def _finish_from_history(
    send: _StepSend,
    *,
    messages: list[Any],
    where: StepInHistory,
    status: str,
    decisions: list[RecoveryDecision],
    reason: str,
    before: JournalEntry | None,
    wrote: bool,
) -> SendPlan | None:
    """The step's finished last attempt, rebuilt from history; nothing is sent.
    ``None`` for a structured step whose attempt holds no valid answer."""
    answer = send.answer
    rec = recover_turn_result(
        messages,
        client_tool_names=frozenset(t.name for t in send.tools),
        user_message_id=where.last_user_message_id,
        marker=send.marker,
        output_model=answer.model if answer is not None else None,
        structured_tool_name=answer.name if answer is not None else "structured_output",
    )
    if rec is None or (answer is not None and rec.structured is None):
        return None
    if wrote:
        crash_point("recovery.before_restore")
        await _restore(send.store, send.chat_id, before)
    outcome = RecoveryOutcome(
        classification="recovered",
        chat_id=send.chat_id,
        marker=send.marker,
        status=status,
        cut_short=False,
        attempts=where.attempts,
        recovered=rec,
        reason=reason,
        decisions=[*decisions, RecoveryDecision("result", "finished attempt", "recovered", reason)],
    )
    await publish_recovery(send.workflow_id, send.step.name, outcome, artifacts=send.artifacts)
    return SendPlan(
        attempt=max(1, where.attempts),
        result=recovered_result(send.workflow_id, send.step, outcome, send.tools, messages),
        outcome=outcome,
    )


async def _on_archived(
    send: _StepSend,
    *,
    status: str,
    before: JournalEntry | None,
    wrote: bool,
    messages: list[Any] | None = None,
) -> SendPlan:
    """The checkpointed chat is archived (no message can be sent to it ever again).

    The step's finished attempt, if the chat holds one, is its result (read from
    history); otherwise the step continues in a fresh chat, which its send makes
    the workflow's checkpoint — so every later step continues there too. Never a
    400 on every rerun."""
    marker = send.marker
    if messages is None:
        messages, _ = await fetch_until(
            send.client,
            send.chat_id,
            lambda ms: _has_step(ms, marker),
            timeout=send.timings.settle_budget,
        )
    where = locate_step(messages, marker)
    seen = (
        f"chat archived ({status}); {where.attempts} attempt(s) of the step, "
        + ("the newest turn" if where.tail else "a later step sent after it")
        + ("" if before is None else f"; journal {before.state}/{before.attempt} {before.marker}")
    )
    decisions: list[RecoveryDecision] = []
    why = "the step never landed on the archived chat"
    if where.last_user_message_id is not None:
        if where.tail:
            finished, why = archived_tail_finished(before, marker, where.attempts, status)
            if finished and not is_answered(messages, where.last_user_message_id):
                # Its send committed, yet nothing answered it (a late commit the
                # archive's run never took up): never an empty "finished" answer.
                finished, why = False, "its last attempt has no answer in history"
        else:
            finished, why = True, "a later step was sent after it: it finished"
        decisions.append(
            RecoveryDecision("archived", seen, "recover" if finished else "fresh chat", why)
        )
        if finished:
            plan = await _finish_from_history(
                send,
                messages=messages,
                where=where,
                status=status,
                decisions=decisions,
                reason=f"recovered from the archived chat's history: {why}",
                before=before,
                wrote=wrote,
            )
            if plan is not None:
                return plan
            why = "its attempt holds no valid structured answer (no re-ask on an archived chat)"
    decisions.append(RecoveryDecision("archived", seen, "fresh chat", why))
    log = run_logger(__name__)
    # A crash after an earlier fresh chat was created but before it was checkpointed
    # left an orphan holding this step: adopt it (flows/recovery/orphans.py), as a
    # first turn does, instead of running the step in yet another chat; strand any
    # other (the archived chat is not listed, it is at rest).
    found = await adopt_or_strand_orphans(
        send.client,
        send.store,
        send.workflow_id,
        marker,
        turn_timeout=send.timings.settle_budget,
        bound_s=send.timings.probe_bound,
        logger=log,
    )
    if found.stranded:
        decisions.append(
            RecoveryDecision(
                "archived", f"orphans {found.stranded}", "stranded", "no checkpoint names them"
            )
        )
    if found.adopted is not None:
        decisions.append(
            RecoveryDecision(
                "archived",
                f"orphan {found.adopted}",
                "adopted",
                "an earlier fresh attempt's chat holds only this step: recovered there",
            )
        )
    # The archived chat's records guard nothing now (nothing can run on it); the
    # fresh chat's first send journals with its checkpoint. A crash before that
    # makes the same decision again: only this step's tail verdict read the entry.
    await send.store.forget_chat(send.chat_id)
    outcome = RecoveryOutcome(
        classification="resubmit",
        chat_id=send.chat_id,
        marker=marker,
        status=status,
        cut_short=True,
        attempts=where.attempts,
        recovered=None,
        reason=(
            f"the chat is archived; the step continues in a fresh chat: {why}"
            if found.adopted is None
            else f"the chat is archived ({why}); the step continues on chat "
            f"{found.adopted}, which an earlier fresh attempt created"
        ),
        decisions=decisions,
    )
    await publish_recovery(send.workflow_id, send.step.name, outcome, artifacts=send.artifacts)
    return SendPlan(attempt=1, outcome=outcome, fresh_chat=True, adopted=found.adopted)


async def _look_in_history(
    send: _StepSend,
    *,
    before: JournalEntry | None,
    wrote: bool,
    journal_names_step: bool = False,
) -> SendPlan | None:
    """Find the step's marker in history before sending (or recovering) it.

    An archived chat → :func:`_on_archived`. A last attempt that a LATER step's
    prompt follows finished: its result comes from history, nothing is sent or
    stopped (the live run, if any, is the later step's). Returns ``None`` when the
    ordinary recovery must settle the step (its attempt is the chat's newest turn,
    or — ``journal_names_step`` — its journaled send never landed)."""
    marker = send.marker
    chat = await send.client.get_chat(send.chat_id, timeout=send.timings.probe_bound)
    messages, _ = await fetch_until(
        send.client,
        send.chat_id,
        lambda ms: _has_step(ms, marker),
        timeout=send.timings.settle_budget,
    )
    if chat.archived:
        return await _on_archived(
            send, status=chat.status, before=before, wrote=wrote, messages=messages
        )
    where = locate_step(messages, marker)
    if where.last_user_message_id is None and journal_names_step:
        return None
    if where.last_user_message_id is None:
        if not wrote:
            # Write-ahead BEFORE the send: the whole history holds no attempt.
            await send.store.journal.set(
                send.chat_id, send_entry(marker, 0, send.timings.settle_budget)
            )
        return SendPlan(attempt=1)
    if where.tail:
        return None
    seen = f"{where.attempts} attempt(s) in history, a later step sent after them; journal " + (
        "none" if before is None else f"{before.state}/{before.attempt} {before.marker}"
    )
    if journal_names_step:
        # The later step's own entry was lost (a crash between a write-ahead of
        # this step and its restore): clear the journal, so that step looks in
        # history too instead of taking this step's entry for an earlier one's.
        before, wrote = None, True
    reason = "a later step was sent after its last attempt: it finished, its result was lost"
    decisions = [RecoveryDecision("history", seen, "recover, send nothing", reason)]
    plan = await _finish_from_history(
        send,
        messages=messages,
        where=where,
        status=chat.status,
        decisions=decisions,
        reason=reason,
        before=before,
        wrote=wrote,
    )
    if plan is None:
        raise CoderRecoveryError(
            f"step {send.step.name!r} of {send.workflow_id!r}: its last attempt on chat "
            f"{send.chat_id} holds no valid structured answer, yet the workflow went on after "
            "it; re-asking now would land after a later step's turn. Decide by hand (rerun "
            "the workflow under a new workflow_id, or archive the chat with "
            "archive-workflow-chat)."
        )
    return plan


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
    replaced: JournalEntry | EllipsisType | None = ...,
) -> SendPlan:
    """Run before every send of ``step`` on a checkpointed chat.

    ``entry``/``journaled``: what ``store.turns.begin`` read and wrote in the
    turn's first transaction (``journaled``: it wrote this send's write-ahead);
    without them the journal is read (and the write-ahead written) here.
    ``replaced``: the entry begin's write-ahead replaced (None: there was none);
    without it a journaled send is always checked against history.

    No journal entry for this step's marker proves no send of it ever started
    (every send is journaled first, a first turn's with its checkpoint), so the
    first send only writes its write-ahead. Otherwise an earlier attempt is
    unfinished: recover it — following it with ``follower`` when it is still
    running (:class:`coder_chat.recovery.TurnRecovery`).
    """
    send = _StepSend(client, store, workflow_id, step, chat_id, tools, answer, timings, artifacts)
    marker = send.marker
    if journaled:
        # begin wrote this step's write-ahead over ``replaced`` (Ellipsis: not told).
        before = None if isinstance(replaced, EllipsisType) else replaced
    else:
        if entry is None:
            entry = await store.journal.get(chat_id)
        before = entry
    if before is None or before.marker != marker:
        if before is not None and before.marker in (_EARLIER.get() or ()):
            # The common send: the journal names an EARLIER step of this workflow,
            # which proves this one never sent (its write-ahead would name it).
            if not journaled:
                # Write-ahead BEFORE the send. The count before this step's first
                # send is 0 (an earlier send would have journaled this marker).
                await store.journal.set(chat_id, send_entry(marker, 0, timings.settle_budget))
            return SendPlan(attempt=1)
        # No entry (an archived chat's records were dropped), a LATER step's (this
        # step's result was lost while the workflow went on), or the order is
        # unknown: the step's marker may be in history. Look before sending.
        plan = await _look_in_history(send, before=before, wrote=journaled)
        if plan is not None:
            return plan
        # This step's attempt is the chat's newest turn under a journal that does
        # not name it: the ordinary recovery below settles it.
        entry = await store.journal.get(chat_id)
    else:
        entry = before
        # The recovery path: an archived chat, or a later step sent after this
        # one's attempt, is found in history before anything is stopped or sent.
        plan = await _look_in_history(send, before=before, wrote=False, journal_names_step=True)
        if plan is not None:
            return plan
    if known_failure and entry is not None and entry.state == "submitting":
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
        # recovery_timings' settle budget is the step's turn timeout: the deadline
        # recorded with the sends and revivals this recovery journals.
        turn_timeout=timings.settle_budget,
    )
    outcome = await recovery.run()
    await publish_recovery(workflow_id, step.name, outcome, artifacts=artifacts)
    if outcome.classification == "followed":
        return SendPlan(
            attempt=max(1, outcome.attempts), outcome=outcome, followed=outcome.followed
        )
    if outcome.classification == "recovered":
        assert outcome.recovered is not None
        history = await turn_history(
            client, chat_id, outcome.recovered.user_message_id, bound_s=timings.probe_bound
        )
        return SendPlan(
            attempt=max(1, outcome.attempts),
            result=recovered_result(workflow_id, step, outcome, tools, history),
            outcome=outcome,
        )
    crash_point("recovery.before_resubmit")
    await recovery.journal_resubmission(outcome.attempts)
    # At least the second try: the journal proves an earlier send of this step
    # started, even when it never landed.
    return SendPlan(attempt=max(2, outcome.attempts + 1), outcome=outcome)


def send_entry(marker: str, attempt: int, turn_timeout: float | None) -> JournalEntry:
    """A send's write-ahead: ``submitting`` now, with the attempt's turn deadline
    (now + the step's ``turn_timeout``; None: no deadline recorded). The stuck-turn
    sweep leaves the attempt to its workflow's recovery until that deadline, and
    reads it from here rather than assuming its own turn timeout is the step's."""
    entry = JournalEntry(state="submitting", marker=marker, attempt=attempt)
    if turn_timeout is None:
        return entry
    return entry.model_copy(update={"deadline": entry.at + turn_timeout})


async def journal_send(
    client: ChatClient,
    store: StateStore,
    chat_id: str,
    marker: str,
    *,
    turn_timeout: float | None = None,
) -> int:
    """The write-ahead of a further send of a step on its chat (e.g. a structured
    step's re-ask): ``submitting`` with the step's current attempt count, which
    it returns, and the send's turn deadline (``turn_timeout``: the step's). Every
    send on a checkpointed chat is journaled first."""
    count = await _marker_count(client, chat_id, marker, bound_s=30.0)
    await store.journal.set(chat_id, send_entry(marker, count, turn_timeout))
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
    *,
    left_live: bool = False,
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
    a second time next to it.

    ``left_live``: the agent failed transiently and fired NO interrupt (its
    ``leave_landed_runs``; e.g. a tool-results POST that landed but whose response
    was lost). Nothing cut the attempt short, so nothing is journaled: the
    ``submitting`` write-ahead stays, and the retry follows the live run (or
    recovers its finished answer) instead of interrupting and resubmitting it,
    which would repeat its committed tool calls under new call ids."""
    if not chat_id or left_live:
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
