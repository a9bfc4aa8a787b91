"""An earlier, unfinished attempt of a step: recover it before the step sends.

``run_turn`` calls :func:`recover_before_send` on a checkpointed chat before the
step's send. If the journal shows this step already sent (an unfinished attempt:
a crash, a failure, a rerun), it runs the durable design's recovery
(:class:`coder_chat.recovery.TurnRecovery`: settle-wait, ledger reconcile,
result check) and either returns the recovered result — nothing is sent — or
journals the resubmission write-ahead. So a plain retry or rerun of a crashed
flow run is safe. After a *known* failure,
:func:`prefect_coder.flows.recovery.send_journal.note_failed_attempt` journals the
attempt "cut-short" for whichever recovery comes next.

Unless the journal names an EARLIER step of the workflow (``earlier``: the markers
of the steps before it, which ``run_steps`` hands each turn in
``TurnResources.earlier_steps``), the step looks for its marker in history first
(:mod:`prefect_coder.flows.recovery.from_history`: a result lost while the
workflow went on, an archived chat). Which of the three ways a send starts — the
common send, a look in history, a recovery — is :func:`send_route`'s choice (pure,
tabled in ``tests/recovery/test_send_route.py``).

Each recovery decision is logged and published as a table artifact (what was
seen, what was decided, why: :func:`prefect_coder.flows.recovery.recovered.publish_recovery`).

Test seam: :func:`coder_chat.crash_safe.crash_point` names points
(``recovery.*``) where the crash-matrix tests SIGKILL the process.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import Any

from coder_chat.crash_safe import crash_point
from coder_chat.recovery import Follower, RecoveryTimings, TurnRecovery
from coder_chat.rest import ChatClient
from coder_chat.tools import ClientTool, StructuredOutput
from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state import JournalEntry
from prefect_coder.flows.common.params import Step
from prefect_coder.flows.observe.run_log import run_logger
from prefect_coder.flows.recovery.chat_state import chat_archived
from prefect_coder.flows.recovery.from_history import StepSend, look_in_history
from prefect_coder.flows.recovery.recovered import (
    Finished,
    Found,
    Running,
    Unsent,
    publish_recovery,
    recovered_result,
    turn_history,
)
from prefect_coder.flows.recovery.send_journal import send_entry

__all__ = ["SendRoute", "recover_before_send", "send_route"]


class SendRoute(Enum):
    """Which way a step's send on a checkpointed chat starts (:func:`send_route`)."""

    #: The journal names an EARLIER step: the common send, unless the chat is archived
    #: — ask (free when this process knows the chat, else one read), then route again.
    ASK_ARCHIVED = "ask whether the chat is archived"
    #: The step never sent: write its write-ahead (unless begin did) and send attempt 1.
    COMMON_SEND = "the common send"
    #: The step's marker may be in history (a result lost, an archived chat): look first.
    LOOK_FIRST = "look in history"
    #: The journal names this step: an earlier attempt sent; look, then recover it.
    RECOVER = "recover"


def send_route(
    before: JournalEntry | None,
    marker: str,
    earlier: frozenset[str] | None,
    *,
    archived: bool | None = None,
) -> SendRoute:
    """The way a send of the step ``marker`` starts, from the journal entry before its
    write-ahead (``before``), the markers of the steps before it (``earlier``; None:
    the order is unknown) and whether the chat is archived (None: not asked). Pure.

    * The entry names this step ⇒ :attr:`~SendRoute.RECOVER`: an attempt of it sent
      (a crash, a failure, a rerun) — never sent again beside it.
    * The entry names an earlier step ⇒ this step never sent (its own write-ahead would
      name it): :attr:`~SendRoute.COMMON_SEND`, no history read — once the chat is
      known to take messages (:attr:`~SendRoute.ASK_ARCHIVED` first); an archived one
      (a failure handler's or an operator's archive) looks in history, never a 400.
    * Anything else ⇒ :attr:`~SendRoute.LOOK_FIRST`: no entry (an archived chat's
      records were dropped), a LATER step's (this step's result was lost while the
      workflow went on), or the order unknown (``agent-turn``, ``recover-turn``): the
      step's marker may be in history.
    """
    if before is not None and before.marker == marker:
        return SendRoute.RECOVER
    if before is not None and before.marker in (earlier or ()):
        if archived is None:
            return SendRoute.ASK_ARCHIVED
        return SendRoute.LOOK_FIRST if archived else SendRoute.COMMON_SEND
    return SendRoute.LOOK_FIRST


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
    replaced: JournalEntry | None = None,
    earlier: frozenset[str] | None = None,
) -> Found:
    """Run before every send of ``step`` on a checkpointed chat; what it found
    (:data:`~prefect_coder.flows.recovery.recovered.Found`): the step unsent (the
    attempt to send, its write-ahead journaled), an earlier attempt finished (its
    result) or still running (followed to its settle), or the chat archived.

    ``entry``/``journaled``: what ``store.turns.begin`` read and wrote in the
    turn's first transaction (``journaled``: it wrote this send's write-ahead);
    without them the journal is read (and the write-ahead written) here.
    ``replaced``: the entry begin's write-ahead replaced (None: there was none, or
    not told — either way a journaled send is checked against history).

    ``earlier``: the markers of the steps that run BEFORE this one in its workflow
    (None: the order is unknown — ``agent-turn``, ``recover-turn``). It is what keeps
    the common send cheap: a journal naming an EARLIER step proves this step never
    sent (its own write-ahead would name it), so no history read is needed. Any other
    entry — none, or a LATER step's (a finished step whose result was lost while the
    workflow went on) — makes the step look for its marker in history first.

    No journal entry for this step's marker proves no send of it ever started
    (every send is journaled first, a first turn's with its checkpoint), so the
    first send only writes its write-ahead. Otherwise an earlier attempt is
    unfinished: recover it — following it with ``follower`` when it is still
    running (:class:`coder_chat.recovery.TurnRecovery`).
    """
    send = StepSend(client, store, workflow_id, step, chat_id, tools, answer, timings, artifacts)
    marker = send.marker
    if journaled:
        # begin wrote this step's write-ahead over ``replaced``.
        before = replaced
    else:
        if entry is None:
            entry = await store.journal.get(chat_id)
        before = entry
    way = send_route(before, marker, earlier)
    if way is SendRoute.ASK_ARCHIVED:
        # Free when this process knows the chat (chat_state.py).
        archived = await chat_archived(client, chat_id, bound_s=timings.probe_bound)
        way = send_route(before, marker, earlier, archived=archived)
    if way is SendRoute.COMMON_SEND:
        if not journaled:
            # Write-ahead BEFORE the send. The count before this step's first send is
            # 0 (an earlier send would have journaled this marker).
            await store.journal.set(chat_id, send_entry(marker, 0, timings.settle_budget))
        return Unsent(1)
    if way is SendRoute.LOOK_FIRST:
        found = await look_in_history(send, before=before, wrote=journaled)
        if found is not None:
            return found
        # This step's attempt is the chat's newest turn under a journal that does
        # not name it: the ordinary recovery below settles it.
        entry = await store.journal.get(chat_id)
    else:
        entry = before
        # The recovery path: an archived chat, or a later step sent after this
        # one's attempt, is found in history before anything is stopped or sent.
        found = await look_in_history(send, before=before, wrote=False, journal_names_step=True)
        if found is not None:
            return found
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
        assert outcome.followed is not None  # set with the classification
        return Running(max(1, outcome.attempts), outcome.followed)
    if outcome.classification == "recovered":
        assert outcome.recovered is not None
        history = await turn_history(
            client, chat_id, outcome.recovered.user_message_id, bound_s=timings.probe_bound
        )
        return Finished(
            max(1, outcome.attempts),
            recovered_result(workflow_id, step, outcome, tools, history),
        )
    crash_point("recovery.before_resubmit")
    await recovery.journal_resubmission(outcome.attempts)
    # At least the second try: the journal proves an earlier send of this step
    # started, even when it never landed.
    return Unsent(max(2, outcome.attempts + 1))
