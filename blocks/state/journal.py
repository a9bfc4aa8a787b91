"""The per-chat send journal: one entry per chat, the current attempt's verdict.

An entry's ``at`` and ``deadline`` are epoch seconds that one worker writes and
another compares with its own clock (a sweep: is the attempt past its deadline?
recovery: is the commit window over?). So they are stored on ONE clock, the
database's: a write adds (database clock - the writer's ``time.time()``) to them, a
read subtracts (database clock - the reader's), both inside the statement. Each
process then keeps reading and comparing in its own ``time.time()``, and two workers
whose clocks disagree by minutes agree on every deadline (to the statements'
latency). Rows written by earlier releases hold their writer's clock, as before.
"""

from __future__ import annotations

import sqlalchemy as sa

from ._ops import Ops
from .engines import upsert
from .records import JournalEntry, from_epoch
from .schema import journal as t


def _offset(ops: Ops) -> sa.ColumnElement[float]:
    """The database clock minus the caller's, in the statement itself: the caller's
    ``time.time()`` is taken when the statement's parameters are, right before it runs
    (SQLite: on the worker thread), so the pair is exact to the statement's latency."""
    return ops.now() - sa.bindparam("local_clock", callable_=ops.clock, type_=sa.Double)


class Journal:
    """``store.journal``: get / set / clear the chat's journal entry."""

    def __init__(self, ops: Ops) -> None:
        self._ops = ops

    async def get(self, chat_id: str) -> JournalEntry | None:
        """The chat's latest journal entry, or None if nothing was ever journaled."""
        # Stored on the database clock; handed back on this process's (module docstring).
        offset = _offset(self._ops)
        async with self._ops.read() as conn:
            row = (
                await conn.execute(
                    sa.select(
                        t.c.state,
                        t.c.marker,
                        t.c.attempt,
                        (t.c.at - offset).label("at"),
                        (t.c.deadline - offset).label("deadline"),
                        t.c.updated_at,
                    ).where(t.c.tenant == self._ops.tenant, t.c.chat_id == chat_id)
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
        offset = _offset(self._ops)
        stmt = upsert(self._ops.backend, t).values(
            tenant=self._ops.tenant,
            chat_id=chat_id,
            state=entry.state,
            marker=entry.marker,
            attempt=entry.attempt,
            at=sa.literal(entry.at, sa.Double) + offset,
            deadline=None
            if entry.deadline is None
            else sa.literal(entry.deadline, sa.Double) + offset,
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
