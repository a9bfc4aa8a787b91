"""Checkpoints: per workflow id, the chat id and the optional resume cursor."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from ._ops import Ops
from .engines import upsert
from .records import Checkpoint, from_epoch
from .schema import checkpoints as t


def _row(row: Any) -> Checkpoint:
    return Checkpoint(
        workflow_id=row.workflow_id,
        chat_id=row.chat_id,
        last_seen_message_id=row.last_seen_message_id,
        updated_at=from_epoch(row.updated_at),
    )


class Checkpoints:
    """``store.checkpoints``: get / set / clear / list workflow checkpoints."""

    def __init__(self, ops: Ops) -> None:
        self._ops = ops

    async def get(self, workflow_id: str) -> Checkpoint | None:
        """The workflow's checkpoint, or None before its first turn created a chat."""
        async with self._ops.read() as conn:
            row = (
                await conn.execute(
                    sa.select(t).where(
                        t.c.tenant == self._ops.tenant, t.c.workflow_id == workflow_id
                    )
                )
            ).one_or_none()
        return None if row is None else _row(row)

    async def set(
        self, workflow_id: str, chat_id: str, last_seen_message_id: int | None = None
    ) -> Checkpoint:
        """Replace the workflow's checkpoint atomically and return it as stored.

        ``chat_id`` is required: a cursor is never stored without its chat. Passing no
        cursor stores none (as the design's ``finally`` checkpoint does after a turn
        that failed before streaming).
        """
        cp = Checkpoint(
            workflow_id=workflow_id, chat_id=chat_id, last_seen_message_id=last_seen_message_id
        )
        now = self._ops.now()
        stmt = upsert(self._ops.backend, t).values(
            tenant=self._ops.tenant,
            workflow_id=cp.workflow_id,
            chat_id=cp.chat_id,
            last_seen_message_id=cp.last_seen_message_id,
            updated_at=now,
        )
        stmt = stmt.on_conflict_do_update(
            index_elements=[t.c.tenant, t.c.workflow_id],
            set_={
                "chat_id": stmt.excluded.chat_id,
                "last_seen_message_id": stmt.excluded.last_seen_message_id,
                "updated_at": stmt.excluded.updated_at,
            },
        ).returning(*t.c)
        async with self._ops.write() as conn:
            row = (await conn.execute(stmt)).one()
        return _row(row)

    async def clear(self, workflow_id: str) -> bool:
        """Delete the checkpoint; True if there was one."""
        async with self._ops.write() as conn:
            res = await conn.execute(
                sa.delete(t)
                .where(t.c.tenant == self._ops.tenant, t.c.workflow_id == workflow_id)
                .returning(t.c.workflow_id)
            )
            return res.first() is not None

    async def list(self) -> list[Checkpoint]:
        """Every checkpoint of this tenant, by workflow id (for sweeps)."""
        async with self._ops.read() as conn:
            rows = (
                await conn.execute(
                    sa.select(t).where(t.c.tenant == self._ops.tenant).order_by(t.c.workflow_id)
                )
            ).all()
        return [_row(r) for r in rows]
