"""Stranded chats: orphans a workflow lost track of, waiting for the sweep."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from ._ops import Ops
from .engines import upsert
from .records import StrandedChat, from_epoch
from .schema import stranded_chats as t


def _row(row: Any) -> StrandedChat:
    return StrandedChat(
        chat_id=row.chat_id,
        workflow_id=row.workflow_id,
        reason=row.reason,
        created_at=from_epoch(row.created_at),
        updated_at=from_epoch(row.updated_at),
    )


class StrandedChats:
    """``store.stranded``: record / list / remove chats for the reconciliation sweep."""

    def __init__(self, ops: Ops) -> None:
        self._ops = ops

    async def record(self, workflow_id: str | None, chat_id: str, reason: str) -> StrandedChat:
        """Record (or re-record, updating workflow and reason) a stranded chat."""
        if not chat_id:
            raise ValueError("chat_id: required; record the stranded chat's id")
        now = self._ops.now()
        stmt = upsert(self._ops.backend, t).values(
            tenant=self._ops.tenant,
            chat_id=chat_id,
            workflow_id=workflow_id,
            reason=reason,
            created_at=now,
            updated_at=now,
        )
        stmt = stmt.on_conflict_do_update(
            index_elements=[t.c.tenant, t.c.chat_id],
            set_={
                "workflow_id": sa.func.coalesce(stmt.excluded.workflow_id, t.c.workflow_id),
                "reason": stmt.excluded.reason,
                "updated_at": stmt.excluded.updated_at,
            },
        ).returning(*t.c)
        async with self._ops.write() as conn:
            return _row((await conn.execute(stmt)).one())

    async def list(self, workflow_id: str | None = None) -> list[StrandedChat]:
        """Stranded chats of this tenant (optionally of one workflow), oldest first."""
        q = sa.select(t).where(t.c.tenant == self._ops.tenant)
        if workflow_id is not None:
            q = q.where(t.c.workflow_id == workflow_id)
        async with self._ops.read() as conn:
            rows = (await conn.execute(q.order_by(t.c.created_at, t.c.chat_id))).all()
        return [_row(r) for r in rows]

    async def remove(self, chat_id: str) -> bool:
        """Forget a stranded chat (after the sweep retired it); True if it was recorded."""
        async with self._ops.write() as conn:
            res = await conn.execute(
                sa.delete(t)
                .where(t.c.tenant == self._ops.tenant, t.c.chat_id == chat_id)
                .returning(t.c.chat_id)
            )
            return res.first() is not None
