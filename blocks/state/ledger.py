"""The client-tool ledger: write-ahead ``committing``, then ``done`` with the output.

Keyed by tenant + chat id + tool call id: call ids are only unique within a
chat, so a store shared across workflows must never let one chat's ``done``
answer another chat's call.
"""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa

from ._ops import Ops
from .engines import upsert
from .records import LedgerEntry, from_epoch
from .schema import tool_ledger as t


def _dump(value: Any) -> str:
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"ledger values must be JSON-serialisable: {exc}") from None


def _row(row: Any) -> LedgerEntry:
    return LedgerEntry(
        chat_id=row.chat_id,
        tool_call_id=row.tool_call_id,
        state=row.state,
        tool_name=row.tool_name,
        args=None if row.args_json is None else json.loads(row.args_json),
        output=None if row.output_json is None else json.loads(row.output_json),
        created_at=from_epoch(row.created_at),
        updated_at=from_epoch(row.updated_at),
    )


def _require(chat_id: str, tool_call_id: str) -> None:
    if not chat_id:
        raise ValueError("chat_id: required; the ledger is keyed by chat id + tool call id")
    if not tool_call_id:
        raise ValueError("tool_call_id: required; the ledger is keyed by chat id + tool call id")


class ToolLedger:
    """``store.ledger``: begin (write-ahead) / complete / get / list / idempotency_key."""

    def __init__(self, ops: Ops) -> None:
        self._ops = ops

    def idempotency_key(self, chat_id: str, tool_call_id: str) -> str:
        """The key to hand the external system: tenant, chat and call, so no two chats collide."""
        _require(chat_id, tool_call_id)
        return f"{self._ops.tenant}/{chat_id}/{tool_call_id}"

    def _where(self, chat_id: str, tool_call_id: str) -> sa.ColumnElement[bool]:
        return sa.and_(
            t.c.tenant == self._ops.tenant,
            t.c.chat_id == chat_id,
            t.c.tool_call_id == tool_call_id,
        )

    async def begin(
        self, chat_id: str, tool_call_id: str, *, tool_name: str | None = None, args: Any = None
    ) -> tuple[LedgerEntry, bool]:
        """Write-ahead ``committing`` BEFORE the effect; never overwrites an existing entry.

        Returns ``(entry, created)``: ``created`` is True only for the one caller whose
        insert landed. If ``entry.state == "done"`` the effect already committed: use
        ``entry.output`` and do not run the tool again. If it is ``committing`` and not
        created, an earlier attempt crashed mid-effect: re-drive with the same
        idempotency key.
        """
        _require(chat_id, tool_call_id)
        now = self._ops.now()
        stmt = (
            upsert(self._ops.backend, t)
            .values(
                tenant=self._ops.tenant,
                chat_id=chat_id,
                tool_call_id=tool_call_id,
                state="committing",
                tool_name=tool_name,
                args_json=None if args is None else _dump(args),
                output_json=None,
                created_at=now,
                updated_at=now,
            )
            .on_conflict_do_nothing(index_elements=[t.c.tenant, t.c.chat_id, t.c.tool_call_id])
            .returning(t.c.tool_call_id)
        )
        async with self._ops.write() as conn:
            created = (await conn.execute(stmt)).first() is not None
            row = (await conn.execute(sa.select(t).where(self._where(chat_id, tool_call_id)))).one()
        return _row(row), created

    async def complete(
        self,
        chat_id: str,
        tool_call_id: str,
        output: Any,
        *,
        tool_name: str | None = None,
        args: Any = None,
    ) -> LedgerEntry:
        """Record ``done`` with the JSON output; the FIRST ``done`` wins.

        Moves ``committing`` (or no entry) to ``done`` atomically. If the entry is
        already ``done`` it is left untouched and returned, so a concurrent or repeated
        re-drive can never replace a recorded outcome; compare ``entry.output`` with
        yours if that matters.
        """
        _require(chat_id, tool_call_id)
        now = self._ops.now()
        stmt = upsert(self._ops.backend, t).values(
            tenant=self._ops.tenant,
            chat_id=chat_id,
            tool_call_id=tool_call_id,
            state="done",
            tool_name=tool_name,
            args_json=None if args is None else _dump(args),
            output_json=_dump(output),
            created_at=now,
            updated_at=now,
        )
        stmt = stmt.on_conflict_do_update(
            index_elements=[t.c.tenant, t.c.chat_id, t.c.tool_call_id],
            set_={
                "state": "done",
                "output_json": stmt.excluded.output_json,
                "tool_name": sa.func.coalesce(t.c.tool_name, stmt.excluded.tool_name),
                "args_json": sa.func.coalesce(t.c.args_json, stmt.excluded.args_json),
                "updated_at": stmt.excluded.updated_at,
            },
            where=t.c.state == "committing",
        )
        async with self._ops.write() as conn:
            await conn.execute(stmt)
            row = (await conn.execute(sa.select(t).where(self._where(chat_id, tool_call_id)))).one()
        return _row(row)

    async def get(self, chat_id: str, tool_call_id: str) -> LedgerEntry | None:
        """The entry for this call, or None: no entry proves the effect never started."""
        _require(chat_id, tool_call_id)
        async with self._ops.read() as conn:
            row = (
                await conn.execute(sa.select(t).where(self._where(chat_id, tool_call_id)))
            ).one_or_none()
        return None if row is None else _row(row)

    async def list(self, chat_id: str) -> list[LedgerEntry]:
        """Every ledger entry of a chat, oldest first."""
        async with self._ops.read() as conn:
            rows = (
                await conn.execute(
                    sa.select(t)
                    .where(t.c.tenant == self._ops.tenant, t.c.chat_id == chat_id)
                    .order_by(t.c.created_at, t.c.tool_call_id)
                )
            ).all()
        return [_row(r) for r in rows]

    async def clear(self, chat_id: str) -> int:
        """Delete a chat's ledger (after archiving it); returns how many entries went."""
        async with self._ops.write() as conn:
            res = await conn.execute(
                sa.delete(t)
                .where(t.c.tenant == self._ops.tenant, t.c.chat_id == chat_id)
                .returning(t.c.tool_call_id)
            )
            return len(res.all())
