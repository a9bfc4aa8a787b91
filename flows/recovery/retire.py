"""Retire a workflow's chats: interrupt (bounded), then archive, under its lease.

An archived chat cannot be resumed (the server rejects new messages with a
400), so archiving belongs to the *workflow* — its final step and its failure
handler — never to a step. The archive takes the workflow's lease, so it never
lands in the middle of another run's turn.
"""

from __future__ import annotations

import contextlib
import logging

from pydantic import BaseModel, Field

from coder_chat.errors import CoderApiError, CoderChatError, CoderTransportError
from coder_chat.models import Chat
from coder_chat.rest import ChatClient
from coder_chat.stop import stop_chat
from prefect_coder.blocks import StateStore
from prefect_coder.flows.common.params import WorkflowSettings
from prefect_coder.flows.common.resources import TurnResources, hold_workflow_lease
from prefect_coder.flows.observe.observer import TurnObserver
from prefect_coder.flows.observe.run_log import run_logger
from prefect_coder.flows.recovery.chat_state import note_archived
from prefect_coder.flows.recovery.send_journal import journal_cut_short

__all__ = ["INTERRUPT_BOUND_S", "ArchiveOutcome", "retire_workflow_chat"]

#: Bound of stopping the run before the archive (durable design: 15 s; a 409 is fine).
INTERRUPT_BOUND_S = 15.0
#: Added to it for the archive, which the server refuses (409) while a run winds down.
ARCHIVE_SETTLE_S = 15.0
#: Pause between the polls and archive retries while a run winds down.
POLL_S = 1.0


class ArchiveOutcome(BaseModel):
    """What the archive did."""

    workflow_id: str
    chat_id: str | None = None
    archived: bool = Field(
        default=False, description="The workflow's chat is archived (now or before)."
    )
    archived_chat_ids: list[str] = Field(default_factory=list)


async def _retire_one(
    resources: TurnResources,
    chat_id: str,
    interrupt_bound_s: float,
    poll_s: float,
    store: StateStore | None = None,
    *,
    settled: bool = False,
) -> str:
    """Stop and archive one chat; returns "archived", "already" or "gone".

    ``settled``: the caller's last turn settled on this chat, so it is most likely at
    rest — archive it straight away (one ``PATCH``) instead of reading it first.

    With ``store`` (the checkpointed chat) the first interrupt is journaled
    ``cut-short`` before it is sent: an attempt the archive truncates must never
    be taken for a finished one when a rerun recovers the step from the archived
    chat's history.

    Uses the caller's client when it has one (a workflow's shared client): a client
    per archive cost a fan-out shard a connection pool and a TCP connect per
    workflow."""
    async with contextlib.AsyncExitStack() as stack:
        client = resources.client
        if client is None:
            client = await stack.enter_async_context(resources.credentials.get_client())
        # A crashed step may have left a run live (or a pause, which needs two
        # interrupts): stop_chat brings it to rest, then archives, retrying 409s
        # while the run winds down — all within one bound. Its first read says
        # whether the chat was archived before (a re-run of a finished workflow
        # reaches its final step again) or is gone: no read of our own first.
        bound = interrupt_bound_s + ARCHIVE_SETTLE_S
        if settled:
            verdict = await _archive_at_rest(client, chat_id)
            if verdict is not None:
                if verdict != "gone":
                    note_archived(chat_id)
                return verdict
        journaled = False

        async def before_interrupt(_chat: Chat) -> None:
            nonlocal journaled
            if store is not None and not journaled:
                await journal_cut_short(client, store, chat_id)
                journaled = True

        try:
            stopped = await stop_chat(
                client,
                chat_id,
                timeout=bound,
                archive=True,
                poll_interval=poll_s,
                before_interrupt=before_interrupt,
            )
        except CoderApiError as exc:
            if exc.status == 404:
                return "gone"
            raise
    if stopped.was_archived or stopped.archived:
        note_archived(chat_id)
    if stopped.was_archived:
        return "already"
    if not stopped.archived:
        why = f"; last error: {stopped.last_error}" if stopped.last_error else ""
        raise CoderChatError(
            f"chat {chat_id} was not archived within {bound:g}s "
            f"(last status {stopped.status}){why}",
            kind="archive_incomplete",
            retryable=True,
        )
    return "archived"


async def _archive_at_rest(client: ChatClient, chat_id: str) -> str | None:
    """Archive a chat believed at rest with one ``PATCH``; its verdict, or None when the
    server refused because a run is active (409) or the request failed in transit.

    Saves the ``GET`` that ``stop_chat`` reads first (one REST call per one-turn
    fan-out workflow, docs/performance.md round 6) and changes nothing else: the
    server archives only a chat at rest (chatd-wire §1.9: 409 while a run is active
    or winding down), so a chat with a live run is refused and left to ``stop_chat``,
    which journals "cut short" before it interrupts. "Already archived" is the
    server's 400, a missing chat its 404 — what ``stop_chat``'s first read tells."""
    try:
        await client.archive_chat(chat_id)
    except CoderApiError as exc:
        if exc.status == 404:
            return "gone"
        if exc.status == 400 and "already archived" in exc.message.lower():
            return "already"
        if exc.status == 409:
            return None
        raise
    except CoderTransportError:
        # It may have landed: stop_chat reads the chat and then calls it "already".
        return None
    return "archived"


async def retire_workflow_chat(
    workflow_id: str,
    resources: TurnResources,
    *,
    lease_wait_s: float = 120.0,
    lease_ttl_s: float = 60.0,
    interrupt_bound_s: float = INTERRUPT_BOUND_S,
    settled: bool = False,
) -> ArchiveOutcome:
    """Interrupt and archive the workflow's chat and any chats it stranded.

    Holds the workflow's lease, so it never lands in the middle of a turn.
    ``settled``: the caller's last turn settled on the checkpointed chat (a workflow
    whose steps all finished): that chat is archived with one ``PATCH`` first, and
    only a refusal (a run is active) brings it to rest the long way. Stranded chats
    always go the long way.
    """
    logger = run_logger(__name__)
    store = resources.store
    async with contextlib.AsyncExitStack() as stack:
        if resources.lease is not None:
            resources.lease.raise_if_lost()  # the calling flow holds it
        else:
            await stack.enter_async_context(
                hold_workflow_lease(
                    workflow_id,
                    store,
                    WorkflowSettings(lease_wait_s=lease_wait_s, lease_ttl_s=lease_ttl_s),
                    step="archive",
                )
            )
        # Both in one read (one trip): the checkpointed chat and the stranded ones.
        checkpoint, stranded = await store.turns.archive_targets(workflow_id)
        outcome = ArchiveOutcome(workflow_id=workflow_id)
        if checkpoint is None and not stranded:
            logger.info("workflow %s has no chat to archive", workflow_id)
            return outcome
        outcome.chat_id = checkpoint.chat_id if checkpoint else None
        targets = ([checkpoint.chat_id] if checkpoint else []) + [
            c for c in stranded if c != outcome.chat_id
        ]
        for chat_id in targets:
            checkpointed = chat_id == outcome.chat_id
            verdict = await _retire_one(
                resources,
                chat_id,
                interrupt_bound_s,
                POLL_S,
                store if checkpointed else None,
                settled=settled and checkpointed,
            )
            if checkpointed:
                # The checkpoint still names the chat: keep its journal entry. A
                # rerun whose step results were lost recovers them from the archived
                # chat's history, and the entry is what says whether its newest
                # attempt finished (flows/recovery/before_send.py). The ledger
                # guards nothing on a chat that can never pause again.
                await store.turns.forget_tools(chat_id)
            else:
                await store.forget_chat(chat_id)
            if verdict == "archived":
                outcome.archived_chat_ids.append(chat_id)
                TurnObserver(
                    workflow_id=workflow_id, step="archive", logger=logger, chat_id=chat_id
                ).emit("coder.chat.archived", {"stranded": chat_id != outcome.chat_id})
                # A finished workflow's routine archive (a fan-out's, inline): its
                # coder.chat.archived event says it, and a log record per workflow
                # cost the worker's console and API handlers ≈ 3 % of a fan-out's loop
                # and the server a log row per turn (docs/performance.md, round 7).
                # Every other archive (failure, recovery, stranded chats) logs INFO.
                logger.log(
                    logging.DEBUG if settled and checkpointed else logging.INFO,
                    "archived chat %s of workflow %s",
                    chat_id,
                    workflow_id,
                )
            else:
                logger.info(
                    "chat %s of workflow %s was %s",
                    chat_id,
                    workflow_id,
                    "already archived" if verdict == "already" else "not found",
                )
        outcome.archived = outcome.chat_id is not None
        return outcome
    raise AssertionError("unreachable")  # pragma: no cover
