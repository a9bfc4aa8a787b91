"""The client-tool ledger: write-ahead ``committing``, then ``done`` with the output.

Keyed by tenant + chat id + tool call id: call ids are only unique within a
chat, so a store shared across workflows must never let one chat's ``done``
answer another chat's call.

A resubmitted attempt of a step (the seed design resubmits a step cut short past
its turn deadline) lets the model call an already-applied tool again under a NEW
call id — a new key, so the key alone would run the effect twice. With
``begin(..., match_earlier_attempts=True)`` the write-ahead also records which step
attempt made the call (the chat's journal entry at that moment: every send is
journaled before it leaves, so the entry names the attempt whose run makes the
call) and a fingerprint of (tool name, canonical JSON arguments); the k-th call of
an attempt with a given fingerprint is answered from the k-th call with that
fingerprint that an EARLIER attempt of the step applied (``done``), if there is one.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import sqlalchemy as sa

from ._ops import Ops, StoreConnection
from .engines import upsert
from .records import LedgerEntry, from_epoch
from .schema import journal as jt
from .schema import tool_ledger as t


def args_fingerprint(tool_name: str, args: Any) -> str:
    """sha256 of the call's canonical JSON ``{"tool": name, "args": args}`` (sorted keys,
    no whitespace): two calls with the same tool and the same arguments match."""
    canonical = json.dumps(
        {"tool": tool_name, "args": args},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


def attempt_index(journal_state: str, journal_attempt: int) -> int:
    """The 0-based attempt a call belongs to, from the chat's journal entry at its
    write-ahead: a ``submitting`` entry carries the count BEFORE its send (= the new
    attempt's index); ``resumed``/``cut-short`` carry the count of landed attempts,
    the newest of which is the one that runs (index count - 1)."""
    if journal_state == "submitting":
        return journal_attempt
    return max(0, journal_attempt - 1)


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
        marker=row.marker,
        attempt=row.attempt,
        replay_of=row.replay_of,
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
        self,
        chat_id: str,
        tool_call_id: str,
        *,
        tool_name: str | None = None,
        args: Any = None,
        match_earlier_attempts: bool = False,
    ) -> tuple[LedgerEntry, bool]:
        """Write-ahead ``committing`` BEFORE the effect; never overwrites an existing entry.

        Returns ``(entry, created)``: ``created`` is True only for the one caller whose
        insert landed. If ``entry.state == "done"`` the effect already committed: use
        ``entry.output`` and do not run the tool again. If it is ``committing`` and not
        created, an earlier attempt crashed mid-effect: re-drive with the same
        idempotency key.

        ``match_earlier_attempts`` (needs ``tool_name``): record the step attempt that
        makes the call (from the chat's journal entry, read under a lock in the same
        transaction) and its (tool, arguments) fingerprint. If this is the k-th call
        with that fingerprint in its attempt and an EARLIER attempt of the same step
        applied at least k+1 such calls (``done``, not themselves answered this way),
        the new entry is written ``done`` at once with the k+1-th one's output and
        ``replay_of`` naming it: the effect is not run again. Calls within one attempt
        never match each other. Without a journal entry nothing is matched.
        """
        _require(chat_id, tool_call_id)
        now = self._ops.now()
        values: dict[str, Any] = {
            "tenant": self._ops.tenant,
            "chat_id": chat_id,
            "tool_call_id": tool_call_id,
            "state": "committing",
            "tool_name": tool_name,
            "args_json": None if args is None else _dump(args),
            "output_json": None,
            "created_at": now,
            "updated_at": now,
        }
        async with self._ops.write() as conn:
            if match_earlier_attempts and tool_name is not None:
                values.update(await self._scope(conn, chat_id, tool_name, args))
            stmt = (
                upsert(self._ops.backend, t)
                .values(**values)
                .on_conflict_do_nothing(index_elements=[t.c.tenant, t.c.chat_id, t.c.tool_call_id])
                .returning(t.c.tool_call_id)
            )
            created = (await conn.execute(stmt)).first() is not None
            row = (await conn.execute(sa.select(t).where(self._where(chat_id, tool_call_id)))).one()
        return _row(row), created

    async def _scope(
        self, conn: StoreConnection, chat_id: str, tool_name: str, args: Any
    ) -> dict[str, Any]:
        """The step-attempt columns of a new entry, and — when an earlier attempt of
        the step applied the same call — the recorded answer (see :meth:`begin`)."""
        fp = args_fingerprint(tool_name, args)
        jq = sa.select(jt.c.state, jt.c.marker, jt.c.attempt).where(
            jt.c.tenant == self._ops.tenant, jt.c.chat_id == chat_id
        )
        if self._ops.backend == "postgresql":
            # Serialise the chat's matching begins: READ COMMITTED would let two
            # concurrent identical calls both count k and both take the same match.
            # (SQLite's writers already are serial: BEGIN IMMEDIATE.)
            jq = jq.with_for_update()
        journal = (await conn.execute(jq)).one_or_none()
        if journal is None:
            return {"args_fp": fp}
        marker, n = journal.marker, attempt_index(journal.state, journal.attempt)
        scope = {"marker": marker, "attempt": n, "args_fp": fp}
        # One read of the step's calls with this fingerprint, this attempt's and the
        # earlier ones' (a handful of rows): the count and the match are taken here.
        # A call id that already has an entry gets no new row (the insert does not
        # land), so what is computed for it is never written.
        rows = (
            await conn.execute(
                sa.select(t.c.tool_call_id, t.c.attempt, t.c.state, t.c.replay_of, t.c.output_json)
                .where(
                    t.c.tenant == self._ops.tenant,
                    t.c.chat_id == chat_id,
                    t.c.marker == marker,
                    t.c.args_fp == fp,
                    t.c.attempt <= n,
                )
                .order_by(t.c.created_at, t.c.tool_call_id)
            )
        ).all()
        k = sum(1 for r in rows if r.attempt == n)
        applied = [r for r in rows if r.attempt < n and r.state == "done" and r.replay_of is None]
        if k >= len(applied):
            return scope
        match = applied[k]
        return {
            **scope,
            "state": "done",
            "output_json": match.output_json,
            "replay_of": match.tool_call_id,
        }

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
