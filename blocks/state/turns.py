"""``store.turns``: a durable turn's store work in two transactions instead of four.

A turn reads its checkpoint, reads the chat's journal, journals the send
write-ahead, and writes the ``finally`` checkpoint. Done call by call that is four
transactions (on SQLite two of them fsync'd, on PostgreSQL four round trips plus
BEGIN/COMMIT each). ``begin`` does the first three in one write transaction (one
joined SELECT, then the upsert only if needed) and ``record`` writes the checkpoint
together with an optional journal entry, so they commit or vanish together.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from .records import Checkpoint, JournalEntry, TurnStart, from_epoch
from .schema import checkpoints as cp_t
from .schema import journal as j_t

if TYPE_CHECKING:
    from .store import StateStore


def _resume_query(tenant: str, workflow_id: str) -> sa.Select[Any]:
    return (
        sa.select(
            cp_t.c.workflow_id,
            cp_t.c.chat_id,
            cp_t.c.last_seen_message_id,
            cp_t.c.updated_at,
            j_t.c.state.label("j_state"),
            j_t.c.marker.label("j_marker"),
            j_t.c.attempt.label("j_attempt"),
            j_t.c.at.label("j_at"),
            j_t.c.updated_at.label("j_updated_at"),
        )
        .select_from(
            cp_t.outerjoin(
                j_t, sa.and_(j_t.c.tenant == cp_t.c.tenant, j_t.c.chat_id == cp_t.c.chat_id)
            )
        )
        .where(cp_t.c.tenant == tenant, cp_t.c.workflow_id == workflow_id)
    )


class Turns:
    """``store.turns``: ``begin`` before a step's send, ``record`` in its ``finally``."""

    def __init__(self, store: StateStore) -> None:
        self._store = store

    async def begin(self, workflow_id: str, marker: str, *, at: float | None = None) -> TurnStart:
        """Read the checkpoint and its chat's journal; journal the send if it is new.

        In ONE write transaction: if the checkpoint names a chat whose journal entry
        does not carry ``marker``, write the write-ahead ``submitting`` entry (attempt
        0: no earlier send of this marker exists, or it would have journaled it) and
        return it with ``journaled=True``. If the entry carries ``marker``, write
        nothing and return it (``journaled=False``): recover before resending. No
        checkpoint: nothing written (the first turn creates the chat). Call it under
        the workflow's lease, right before the send, as the separate calls were.
        """
        async with self._store.transaction() as tx:
            conn = tx.connection
            row = (await conn.execute(_resume_query(self._store.tenant, workflow_id))).one_or_none()
            if row is None:
                return TurnStart()
            checkpoint = Checkpoint(
                workflow_id=row.workflow_id,
                chat_id=row.chat_id,
                last_seen_message_id=row.last_seen_message_id,
                updated_at=from_epoch(row.updated_at),
            )
            found = None
            if row.j_state is not None:
                found = JournalEntry(
                    state=row.j_state,
                    marker=row.j_marker,
                    attempt=row.j_attempt,
                    at=row.j_at,
                    updated_at=from_epoch(row.j_updated_at),
                )
            if found is not None and found.marker == marker:
                return TurnStart(checkpoint=checkpoint, journal=found, journaled=False)
            entry = JournalEntry(state="submitting", marker=marker, attempt=0)
            if at is not None:
                entry = entry.model_copy(update={"at": at})
            written = await tx.journal.set(checkpoint.chat_id, entry)
            return TurnStart(checkpoint=checkpoint, journal=written, journaled=True, replaced=found)

    async def record(
        self,
        workflow_id: str,
        chat_id: str,
        last_seen_message_id: int | None = None,
        *,
        journal: JournalEntry | None = None,
    ) -> Checkpoint:
        """The ``finally`` checkpoint, plus ``journal`` for ``chat_id`` if given, in ONE
        write transaction: both commit or neither does (e.g. a first turn that failed
        after creating its chat: the checkpoint and the journaled send together)."""
        async with self._store.transaction() as tx:
            saved = await tx.checkpoints.set(workflow_id, chat_id, last_seen_message_id)
            if journal is not None:
                await tx.journal.set(chat_id, journal)
            return saved
