"""The per-chat send journal: one entry per chat, the current attempt's verdict."""

from __future__ import annotations

import sqlalchemy as sa

from ._ops import Ops
from .engines import upsert
from .records import JournalEntry, from_epoch
from .schema import journal as t


class Journal:
    """``store.journal``: get / set / clear the chat's journal entry."""

    def __init__(self, ops: Ops) -> None:
        self._ops = ops

    async def get(self, chat_id: str) -> JournalEntry | None:
        """The chat's latest journal entry, or None if nothing was ever journaled."""
        async with self._ops.read() as conn:
            row = (
                await conn.execute(
                    sa.select(t).where(t.c.tenant == self._ops.tenant, t.c.chat_id == chat_id)
                )
            ).one_or_none()
        if row is None:
            return None
        return JournalEntry(
            state=row.state,
            marker=row.marker,
            attempt=row.attempt,
            at=row.at,
            deadline=row.deadline,
            updated_at=from_epoch(row.updated_at),
        )

    async def set(self, chat_id: str, entry: JournalEntry) -> JournalEntry:
        """Replace the chat's entry atomically (last write wins; write it BEFORE acting).

        Entries are scoped by (marker, attempt) by their readers, so a newer attempt's
        write simply supersedes an older verdict; no clear step is needed. Every
        column is replaced, ``deadline`` too: an entry without one never inherits
        the previous entry's.
        """
        if not chat_id:
            raise ValueError("chat_id: required; the journal is keyed by chat id")
        stmt = upsert(self._ops.backend, t).values(
            tenant=self._ops.tenant,
            chat_id=chat_id,
            state=entry.state,
            marker=entry.marker,
            attempt=entry.attempt,
            at=entry.at,
            deadline=entry.deadline,
            updated_at=self._ops.now(),
        )
        stmt = stmt.on_conflict_do_update(
            index_elements=[t.c.tenant, t.c.chat_id],
            set_={
                c: stmt.excluded[c]
                for c in (
                    "state",
                    "marker",
                    "attempt",
                    "at",
                    "deadline",
                    "updated_at",
                )
            },
        ).returning(t.c.updated_at)
        async with self._ops.write() as conn:
            updated = (await conn.execute(stmt)).scalar_one()
        return entry.model_copy(update={"updated_at": from_epoch(updated)})

    async def clear(self, chat_id: str) -> bool:
        """Delete the chat's entry; True if there was one."""
        async with self._ops.write() as conn:
            res = await conn.execute(
                sa.delete(t)
                .where(t.c.tenant == self._ops.tenant, t.c.chat_id == chat_id)
                .returning(t.c.chat_id)
            )
            return res.first() is not None
