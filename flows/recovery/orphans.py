"""A first turn's orphan check: adopt the crashed attempt's chat, strand the rest.

A crash after a first turn's chat was created (with the step's prompt) but
before its id was checkpointed leaves an orphan that may still be generating.
Every chat carries the workflow's label, so the check finds every orphan.

:func:`adopt_or_strand_orphans` (the turn's check) adopts the newest orphan
that holds only this step's prompt: it writes the checkpoint and the first
send's write-ahead the crashed attempt did not get to write, and the turn then
recovers it as it recovers any checkpointed chat — a live run is followed, a
finished one read from history. The design seed interrupts the orphan and
sends the step again in a fresh chat: the model ran the turn twice, and a
turn cut mid-generation was wasted. Adoption closes that on every build, with
no empty create (B1 refuses one). Every other orphan is interrupted and
recorded stranded (the workflow's archive retires it).

The turn runs the check on a workflow without a checkpoint — unless
:func:`may_have_orphans` proves there can be none — and when its checkpointed
chat was archived before the step finished (the fresh chat an earlier attempt
made); ``recover-turn`` runs it on a workflow without a checkpoint. With a
checkpoint, ``recover-turn`` strands every other chat of the workflow
(:func:`strand_workflow_orphans`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import TypeVar

from coder_chat.history import fetch_until
from coder_chat.models import Chat, ChatMessage
from coder_chat.rest import ChatClient
from coder_chat.stop import stop_chat
from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state import HeldLease, JournalEntry
from prefect_coder.flows.common.labels import (
    LABEL_WORKFLOW,
    label_value,
    of_another_store,
    owned_by,
    scope_labels,
)
from prefect_coder.flows.common.params import leading_marker
from prefect_coder.flows.common.retry import is_retryable_failure
from prefect_coder.flows.observe.run_log import RunLogger, run_logger

__all__ = ["OrphanCheck", "adopt_or_strand_orphans", "may_have_orphans", "strand_workflow_orphans"]

_T = TypeVar("_T")

#: Backoffs between attempts of the whole check on a transient failure (a 503 on the
#: chat listing failed a whole ``recover-turn`` run; the chaos test's seed 89).
RETRY_BACKOFF_S = (0.5, 1.0, 2.0)


@dataclass(frozen=True)
class OrphanCheck:
    """What :func:`adopt_or_strand_orphans` did."""

    #: The chat now checkpointed as the workflow's, to recover (None: none adoptable).
    adopted: str | None = None
    #: The chats stopped and recorded stranded.
    stranded: list[str] = field(default_factory=list)


def may_have_orphans(lease: HeldLease, *, retried: bool) -> bool:
    """Whether a first turn must list the workflow's chats for orphans.

    Not when this is the first hold ever of the workflow's lease (fence 1: the
    store keeps released lease rows, and every other acquisition — a new run, a
    retry of the flow run, a takeover — bumps the fence) and the turn is not a
    retry within it: every chat of a workflow is created by a turn under that
    lease, so no earlier turn can have left one. A fan-out of fresh workflows
    then makes no listing per workflow (it was ≈ 2 % of a shard's loop and one
    ``GET /chats`` per workflow on the Coder server).

    Window: a store whose lease rows were wiped while chats of its tenant live
    on — those are found by the ``sweep-orphans`` deployment, not here.
    """
    return retried or lease.fence != 1


async def strand_workflow_orphans(
    client: ChatClient,
    store: StateStore,
    workflow_id: str,
    *,
    keep: str | None = None,
    bound_s: float = 15.0,
    logger: RunLogger | None = None,
) -> list[str]:
    """Interrupt every live chat of the workflow no checkpoint accounts for, and
    record it stranded so the archive retires it. Returns their ids.

    Widened as the design asks: regardless of status (an orphaned first turn may
    settle on its own and then sit live and unarchived forever), and every
    orphan, not just the first.

    A transient failure (5xx, 429, a reset connection) re-runs the whole check
    after a short backoff, a few times: every part of it is idempotent (listing,
    stopping a stopped chat, re-recording a stranded one).
    """
    log = logger or run_logger(__name__)
    return await _retrying(
        lambda: _strand(client, store, workflow_id, keep, bound_s, log), workflow_id, log
    )


async def adopt_or_strand_orphans(
    client: ChatClient,
    store: StateStore,
    workflow_id: str,
    marker: str | None,
    *,
    turn_timeout: float | None = None,
    bound_s: float = 15.0,
    logger: RunLogger | None = None,
) -> OrphanCheck:
    """A first turn's orphan check: adopt one orphan, strand the others.

    Adoptable: a chat of the workflow, not recorded stranded, whose history holds
    at least one user message and only user messages that start with one step's
    marker — ``marker`` (this step's prompt, maybe its re-ask), or with
    ``marker=None`` any one step of the workflow (``recover-turn`` without the
    workflow's steps): what a first turn that crashed before its checkpoint
    leaves. Of several, the newest (``created_at``) is adopted. It is adopted by
    writing its checkpoint with its step's ``submitting`` write-ahead (attempt 0,
    now, deadline now + ``turn_timeout``), exactly what the eager checkpoint
    writes at the stream's dial; the caller then recovers it as a checkpointed
    chat.

    Every other chat of the workflow is stopped and recorded stranded FIRST: a
    crash between that and the adoption finds the same adoptable chat again (a
    stranded chat is never adopted), and one after the adoption leaves a
    checkpoint, so no later check runs. Transient failures re-run the whole check
    (every part is idempotent).
    """
    log = logger or run_logger(__name__)
    return await _retrying(
        lambda: _adopt(client, store, workflow_id, marker, turn_timeout, bound_s, log),
        workflow_id,
        log,
    )


async def _retrying(check: Callable[[], Awaitable[_T]], workflow_id: str, log: RunLogger) -> _T:
    for backoff in (*RETRY_BACKOFF_S, None):
        try:
            return await check()
        except Exception as exc:
            if backoff is None or not is_retryable_failure(exc):
                raise
            log.warning(
                "orphan check of %s failed (%s); retrying in %.1fs", workflow_id, exc, backoff
            )
            await asyncio.sleep(backoff)
    raise AssertionError("unreachable")


def _labels(store: StateStore, workflow_id: str) -> dict[str, str]:
    return {**scope_labels(store.tenant), LABEL_WORKFLOW: label_value(workflow_id)}


_MIXED = ""  # several markers, or a user message carrying none: never adopted


def _lone_marker(messages: list[ChatMessage], workflow_id: str) -> str | None:
    """The one step marker of ``workflow_id`` every user message starts with
    (``_MIXED`` when they differ or one has none; None: no user message)."""
    found: str | None = None
    for message in messages:
        if message.role != "user":
            continue
        text = "".join(p.text or "" for p in message.content if p.type == "text")
        marker = leading_marker(text, workflow_id) or _MIXED
        if marker == _MIXED or (found is not None and marker != found):
            return _MIXED
        found = marker
    return found


async def _step_of(
    client: ChatClient, chat_id: str, workflow_id: str, bound_s: float
) -> str | None:
    """The marker of the one step the chat's whole history holds, else None."""
    messages, whole = await fetch_until(
        client,
        chat_id,
        # stop paging at the first user message that disqualifies the chat
        lambda ms: _lone_marker(ms, workflow_id) == _MIXED,
        timeout=bound_s,
    )
    marker = _lone_marker(messages, workflow_id)
    return marker if marker and whole else None


def _created(chat: Chat) -> float:
    try:
        return datetime.fromisoformat(chat.created_at or "").timestamp()
    except ValueError:
        return float("-inf")


async def _adopt(
    client: ChatClient,
    store: StateStore,
    workflow_id: str,
    marker: str | None,
    turn_timeout: float | None,
    bound_s: float,
    log: RunLogger,
) -> OrphanCheck:
    stranded = {s.chat_id for s in await store.stranded.list(workflow_id)}
    store_id = await store.identity()
    candidates: list[tuple[Chat, str]] = []
    others: list[Chat] = []
    async for chat in client.iter_chats(labels=_labels(store, workflow_id), timeout=bound_s):
        # Re-checked: a server that ignored the filter must never make us touch
        # someone else's chat — nor a chat another store checkpoints (same tenant and
        # workflow id on another database: its own workflow drives it).
        if not owned_by(chat.labels, store.tenant) or of_another_store(chat.labels, store_id):
            continue
        step = (
            None if chat.id in stranded else await _step_of(client, chat.id, workflow_id, bound_s)
        )
        if step is not None and (marker is None or step == marker):
            candidates.append((chat, step))
        else:
            others.append(chat)
    # Newest first (a stable sort keeps the listing's order among equal times).
    candidates.sort(key=lambda c: _created(c[0]), reverse=True)
    left = [chat.id for chat in [*(c for c, _ in candidates[1:]), *others]]
    for chat_id in left:
        await _stop_and_record(client, store, workflow_id, chat_id, bound_s, log)
    if not candidates:
        return OrphanCheck(stranded=left)
    adopted, marker = candidates[0][0].id, candidates[0][1]
    # A sweep that interrupted the orphan journaled its attempt cut-short (under the
    # workflow's lease, which this run holds now): keep that verdict, so recovery
    # resubmits the step instead of returning the interrupted attempt as its answer.
    earlier = await store.journal.get(adopted)
    kept = earlier is not None and earlier.marker == marker and earlier.state == "cut-short"
    await store.turns.record(
        workflow_id,
        adopted,
        None,
        journal=None if kept else JournalEntry.submitting(marker, 0, turn_timeout=turn_timeout),
    )
    log.warning(
        "orphan chat %s of workflow %s holds this step's prompt: adopted and checkpointed; "
        "its attempt is recovered (followed if still running), not sent again",
        adopted,
        workflow_id,
    )
    return OrphanCheck(adopted=adopted, stranded=left)


async def _strand(
    client: ChatClient,
    store: StateStore,
    workflow_id: str,
    keep: str | None,
    bound_s: float,
    log: RunLogger,
) -> list[str]:
    found: list[str] = []
    store_id = await store.identity()
    async for chat in client.iter_chats(labels=_labels(store, workflow_id), timeout=bound_s):
        # Re-checked: a server that ignored the filter must never make us touch
        # someone else's chat, nor one of another store.
        if (
            chat.id == keep
            or not owned_by(chat.labels, store.tenant)
            or of_another_store(chat.labels, store_id)
        ):
            continue
        found.append(chat.id)
        await _stop_and_record(client, store, workflow_id, chat.id, bound_s, log)
    return found


async def _stop_and_record(
    client: ChatClient,
    store: StateStore,
    workflow_id: str,
    chat_id: str,
    bound_s: float,
    log: RunLogger,
) -> None:
    # Stopped, not interrupted once: an interrupt of a client-tool pause makes the
    # server resume the model, which a single interrupt leaves running.
    await stop_chat(client, chat_id, timeout=bound_s)
    await store.stranded.record(workflow_id, chat_id, "orphan: no checkpoint names it")
    log.warning(
        "orphan chat %s of workflow %s interrupted, recorded for the archive",
        chat_id,
        workflow_id,
    )
