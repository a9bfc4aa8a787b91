"""A step looked up in its chat's history before it sends (or recovers) anything.

A step the journal does not name may still be in the chat's history — its result
lost while the workflow went on (the journal then names a later step): an attempt
that a later step's prompt follows finished, and is rebuilt from history
(:class:`coder_chat.core.attempts.StepAttempts`). A checkpoint that names an
ARCHIVED chat gives back its finished steps from history; the rest are sent in a
fresh chat, which becomes the checkpoint (:class:`~prefect_coder.flows.recovery.recovered.Archived`,
:func:`archived_tail_finished`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from coder_chat.core.attempts import StepAttempts
from coder_chat.core.journal import Standing, classify_entry
from coder_chat.core.recovery import RecoveryDecision
from coder_chat.crash_safe import crash_point
from coder_chat.errors import CoderRecoveryError
from coder_chat.history import fetch_until, recover_turn_result
from coder_chat.recovery import RecoveryOutcome, RecoveryTimings
from coder_chat.rest import ChatClient
from coder_chat.tools import ClientTool, StructuredOutput
from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state import JournalEntry
from prefect_coder.flows.common.params import Step, step_marker
from prefect_coder.flows.observe.run_log import run_logger
from prefect_coder.flows.recovery.chat_state import note_archived
from prefect_coder.flows.recovery.orphans import adopt_or_strand_orphans
from prefect_coder.flows.recovery.recovered import (
    Archived,
    Finished,
    Unsent,
    publish_recovery,
    recovered_result,
)
from prefect_coder.flows.recovery.send_journal import send_entry

__all__ = [
    "StepSend",
    "archived_tail_finished",
    "look_in_history",
]


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
    standing = classify_entry(entry, marker, attempts).standing
    if entry is None or standing is Standing.OTHER_STEP:
        return False, "no journal entry of the step survives: its last attempt is not trusted"
    if status not in ("waiting", "completed"):
        return False, f"the archived chat ended {status!r}"
    if standing is Standing.LANDED:
        return True, "its send landed and nothing cut it short"
    if standing is Standing.REVIVED:
        return True, "recovery revived it and nothing cut it short"
    return False, f"journal {entry.state}/{entry.attempt} at {attempts} attempt(s): cut short"


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
class StepSend:
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
    send: StepSend,
    *,
    messages: list[Any],
    where: StepAttempts,
    status: str,
    decisions: list[RecoveryDecision],
    reason: str,
    before: JournalEntry | None,
    wrote: bool,
) -> Finished | None:
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
    return Finished(
        max(1, where.attempts),
        recovered_result(send.workflow_id, send.step, outcome, send.tools, messages),
    )


async def _on_archived(
    send: StepSend,
    *,
    status: str,
    before: JournalEntry | None,
    wrote: bool,
    messages: list[Any] | None = None,
) -> Finished | Archived:
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
            lambda ms: StepAttempts.of(ms, marker).found,
            timeout=send.timings.settle_budget,
        )
    where = StepAttempts.of(messages, marker)
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
            if finished and not where.answered:
                # Its send committed, yet nothing answered it (a late commit the
                # archive's run never took up): never an empty "finished" answer.
                finished, why = False, "its last attempt has no answer in history"
        else:
            finished, why = True, "a later step was sent after it: it finished"
        decisions.append(
            RecoveryDecision("archived", seen, "recover" if finished else "fresh chat", why)
        )
        if finished:
            recovered = await _finish_from_history(
                send,
                messages=messages,
                where=where,
                status=status,
                decisions=decisions,
                reason=f"recovered from the archived chat's history: {why}",
                before=before,
                wrote=wrote,
            )
            if recovered is not None:
                return recovered
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
    return Archived(adopted=found.adopted)


async def look_in_history(
    send: StepSend,
    *,
    before: JournalEntry | None,
    wrote: bool,
    journal_names_step: bool = False,
) -> Unsent | Finished | Archived | None:
    """Find the step's marker in history before sending (or recovering) it.

    An archived chat → :func:`_on_archived`. A last attempt that a LATER step's
    prompt follows finished: its result comes from history, nothing is sent or
    stopped (the live run, if any, is the later step's). Returns ``None`` when the
    ordinary recovery must settle the step (its attempt is the chat's newest turn,
    or — ``journal_names_step`` — its journaled send never landed).

    Status and history need not agree here (unlike ``TurnRecovery.check_result``,
    which returns a result only from a history ending with the turn its status read
    covered): a result is taken only when a later step's user message follows the
    attempt — a prompt lands only once the chat accepts a new turn, so history
    alone proves the attempt's turn ended — or from an archived chat, on which
    nothing can land after the status read said archived. A send landing after
    these reads is a newer turn, which neither verdict reads."""
    marker = send.marker
    chat = await send.client.get_chat(send.chat_id, timeout=send.timings.probe_bound)
    messages, _ = await fetch_until(
        send.client,
        send.chat_id,
        lambda ms: StepAttempts.of(ms, marker).found,
        timeout=send.timings.settle_budget,
    )
    if chat.archived:
        note_archived(send.chat_id)
        return await _on_archived(
            send, status=chat.status, before=before, wrote=wrote, messages=messages
        )
    where = StepAttempts.of(messages, marker)
    if where.last_user_message_id is None and journal_names_step:
        return None
    if where.last_user_message_id is None:
        if not wrote:
            # Write-ahead BEFORE the send: the whole history holds no attempt.
            await send.store.journal.set(
                send.chat_id, send_entry(marker, 0, send.timings.settle_budget)
            )
        return Unsent(1)
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
    finished = await _finish_from_history(
        send,
        messages=messages,
        where=where,
        status=chat.status,
        decisions=decisions,
        reason=reason,
        before=before,
        wrote=wrote,
    )
    if finished is None:
        raise CoderRecoveryError(
            f"step {send.step.name!r} of {send.workflow_id!r}: its last attempt on chat "
            f"{send.chat_id} holds no valid structured answer, yet the workflow went on after "
            "it; re-asking now would land after a later step's turn. Decide by hand (rerun "
            "the workflow under a new workflow_id, or archive the chat with "
            "archive-workflow-chat)."
        )
    return finished
