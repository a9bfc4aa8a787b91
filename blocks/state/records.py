"""Typed records the state store reads and writes.

Times the store stamps (``updated_at`` and friends) come from the *database*
clock, so workers on several machines agree on them; they are returned as
timezone-aware UTC datetimes.

The send journal's entry is :class:`coder_chat.core.journal.JournalEntry` (its one
home: its constructors and how an entry is read live there), stored as is.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from coder_chat.core.journal import JournalEntry, JournalState

NonEmptyStr = Annotated[str, Field(min_length=1, max_length=512)]
MessageId = Annotated[int, Field(strict=True, gt=0)]

__all__ = [
    "Checkpoint",
    "JournalEntry",
    "JournalState",
    "Lease",
    "LedgerEntry",
    "StrandedChat",
    "TurnStart",
    "from_epoch",
]

LedgerState = Literal["committing", "done"]


def from_epoch(value: float | None) -> datetime | None:
    """Database epoch seconds -> aware UTC datetime."""
    return None if value is None else datetime.fromtimestamp(value, tz=UTC)


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Checkpoint(_Record):
    """Where a workflow's chat stands between steps: the chat id and the resume cursor.

    A cursor without its chat id cannot be expressed: ``chat_id`` is required and
    non-empty, and ``last_seen_message_id`` must be a positive integer or None.
    """

    workflow_id: NonEmptyStr
    chat_id: NonEmptyStr
    last_seen_message_id: MessageId | None = None
    updated_at: datetime | None = None


class LedgerEntry(_Record):
    """One client tool invocation: write-ahead ``committing``, then ``done`` with its output.

    ``marker`` / ``attempt`` (schema version 3): the step attempt that made the call,
    as the chat's journal named it at the write-ahead (``attempt`` is 0-based: the
    step's first send is 0); None when the call was not scoped (``begin`` without
    ``match_earlier_attempts``, no journal entry, or a row from an older version).
    ``replay_of``: set when this call repeated an applied call of the step (same tool,
    same arguments) — the id of that call. On a ``done`` entry its recorded output is
    this entry's and the effect did not run again; on a ``committing`` entry the
    earlier call's outcome is unknown and the tool re-drives the effect under THAT
    call's idempotency key (blocks/state/ledger.py).
    """

    chat_id: NonEmptyStr
    tool_call_id: NonEmptyStr
    state: LedgerState
    tool_name: str | None = None
    args: Any = None
    output: Any = None
    created_at: datetime | None = None
    updated_at: datetime | None = None
    marker: str | None = None
    attempt: int | None = None
    replay_of: str | None = None


class StrandedChat(_Record):
    """A chat a workflow lost track of (orphan) and that a sweep must retire."""

    chat_id: NonEmptyStr
    workflow_id: str | None = None
    reason: str
    created_at: datetime | None = None
    updated_at: datetime | None = None


class Lease(_Record):
    """A time-bounded exclusive claim on a key (a chat or a workflow).

    ``fence`` grows by one every time a *different* holder takes the key over, so a
    downstream system can reject writes from a holder whose lease was taken away.
    """

    key: NonEmptyStr
    holder: NonEmptyStr
    fence: int
    acquired_at: datetime
    expires_at: datetime

    @field_validator("fence")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v < 1:
            raise ValueError("fence starts at 1")
        return v


class TurnStart(_Record):
    """What ``store.turns.begin`` found (and wrote) before a step's send.

    ``checkpoint`` is None before the workflow's first turn created a chat. ``journal``
    is the checkpointed chat's entry as it stands now; ``journaled`` is True when
    ``begin`` itself wrote it (the write-ahead of a first send of this marker), False
    when an entry for this marker already existed: an earlier attempt of this step
    sent (or may have sent) and recorded no result, so the caller must recover it
    before it resends.
    """

    checkpoint: Checkpoint | None = None
    journal: JournalEntry | None = None
    journaled: bool = False
    #: When ``begin`` wrote: the entry its write-ahead replaced (None: there was
    #: none). Recovery needs it: an entry of a LATER step means this step's result
    #: was lost after it sent, so its marker must be looked up in history.
    replaced: JournalEntry | None = None
