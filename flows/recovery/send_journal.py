"""The send journal's writes around a step's sends on a checkpointed chat: the
write-ahead of a further send, and the ``cut-short`` verdict after a known failure or
before somebody else's interrupt (entries: :class:`coder_chat.core.journal.JournalEntry`)."""

from __future__ import annotations

import asyncio
import contextlib

from coder_chat.core.fields import field
from coder_chat.core.journal import Standing, classify_entry
from coder_chat.errors import CoderTransportError
from coder_chat.history import fetch_turn, marker_attempts
from coder_chat.rest import ChatClient
from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state import JournalEntry
from prefect_coder.flows.common.params import leading_marker
from prefect_coder.flows.observe.run_log import run_logger

__all__ = [
    "journal_cut_short",
    "journal_send",
    "note_failed_attempt",
    "send_entry",
]


def send_entry(marker: str, attempt: int, turn_timeout: float | None) -> JournalEntry:
    """A send's write-ahead: ``submitting`` now, with the attempt's turn deadline
    (now + the step's ``turn_timeout``; None: no deadline recorded). The stuck-turn
    sweep leaves the attempt to its workflow's recovery until that deadline, and
    reads it from here rather than assuming its own turn timeout is the step's."""
    return JournalEntry.submitting(marker, attempt, turn_timeout=turn_timeout)


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
    count = await marker_attempts(client, chat_id, marker, timeout=30.0)
    await store.journal.set(chat_id, send_entry(marker, count, turn_timeout))
    return count


async def journal_cut_short(client: ChatClient, store: StateStore, chat_id: str) -> bool:
    """Before somebody else's interrupt of a workflow's chat (a sweep), journal the
    step's tail attempt ``cut-short``; returns whether a step was journaled.

    Without it, the workflow's own recovery later sends an interrupt of its own,
    gets 409 (the sweep already stopped the run) and would take the truncated
    attempt for a finished one, returning it as the step's answer.

    A chat with no journal entry yet — a first turn's orphan, created before its
    checkpoint — is journaled under the step marker of its newest prompt: the next
    run ADOPTS such a chat (flows/recovery/orphans.py) and keeps this verdict, so it
    resubmits the step rather than return the interrupted attempt (chaos seed 149: a
    stuck-turn sweep interrupted an orphan parked on a tool call; the adopting rerun
    returned "Tool execution interrupted by user" as the answer and the charge never
    ran)."""
    entry = await store.journal.get(chat_id)
    marker = entry.marker if entry is not None else await _newest_marker(client, chat_id)
    if marker is None:
        return False
    count = await marker_attempts(client, chat_id, marker, timeout=5.0)
    await store.journal.set(chat_id, JournalEntry.cut_short(marker, count))
    return True


async def _newest_marker(client: ChatClient, chat_id: str) -> str | None:
    """The step marker (``[<workflow>/<step>]``) the chat's newest prompt starts with."""
    for message in reversed(await fetch_turn(client, chat_id, timeout=5.0)):
        if field(message, "role") != "user":
            continue
        return leading_marker(
            "".join(
                field(p, "text", "") or ""
                for p in field(message, "content", None) or ()
                if field(p, "type") == "text"
            )
        )
    return None


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
        count = await marker_attempts(client, chat_id, marker, timeout=5.0)
        if _may_still_land(failure):
            entry = await store.journal.get(chat_id)
            if classify_entry(entry, marker, count).standing is Standing.UNSENT:
                run_logger(__name__).info(
                    "the send of %s may still land on chat %s: its write-ahead stays, "
                    "a retry waits out its commit window",
                    marker,
                    chat_id,
                )
                return
        await store.journal.set(chat_id, JournalEntry.cut_short(marker, count))
    except Exception:
        run_logger(__name__).warning(
            "could not journal the failed attempt on chat %s", chat_id, exc_info=True
        )
