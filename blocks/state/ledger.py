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

An applied call's entry may still say ``committing``: its effect ran but the
``done`` write failed (a store restart), or the effect raised and its outcome is
unknown. Such a call is never repeated as a fresh effect under the new call id:
the new entry is written ``committing`` with ``replay_of`` naming the earlier call,
and the tool re-drives the effect under THAT call's idempotency key
(``coder_chat.crash_safe``) — from an earlier attempt (count-based, as ``done``
entries) or from the same attempt (the model repeating a call whose effect did not
report, e.g. after it raised). Calls still running in this process (``in_flight``)
are never matched: two identical calls of one tool round are two calls.

Entries written by older code (no step attempt or fingerprint: a worker of an
earlier schema still running across a migration) are treated conservatively: one
that cannot be proven to be a different call (another tool, other arguments, or
written before the step's first send was journaled) counts as an applied call of an
earlier attempt of this step — answered from its record when it is ``done`` and
provably identical, else re-driven under its key — never a fresh effect.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection
from dataclasses import dataclass
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


@dataclass(frozen=True, slots=True)
class _Match:
    """An earlier call a new one repeats: answered from ``output_json`` when it is
    ``done`` and provably ``identical``, else re-driven under its key."""

    tool_call_id: str
    state: str
    output_json: str | None
    identical: bool


def _same_call(row: Any, tool_name: str, fp: str) -> bool | None:
    """Whether an unscoped entry (older code) is the same call: True/False when its
    tool name and arguments (or fingerprint) tell, None when they cannot."""
    if row.tool_name is not None and row.tool_name != tool_name:
        return False
    if row.args_fp is not None:
        return bool(row.args_fp == fp)  # the fingerprint covers the tool name
    if row.args_json is None:
        return None
    try:
        row_fp = args_fingerprint(tool_name, json.loads(row.args_json))
    except ValueError:
        return None
    if row_fp != fp:
        return False
    return True if row.tool_name is not None else None


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
        in_flight: Collection[str] = (),
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

        An applied call still ``committing`` (see the module docstring) — of an
        earlier attempt (count-based, as above) or of this attempt (the oldest one
        not ``in_flight``) — makes the new entry ``committing`` with ``replay_of``
        naming it: the caller re-drives the effect under THAT call's key. Entries of
        older code without a fingerprint count as an earlier attempt's calls unless
        proven different. ``in_flight``: call ids of this chat whose effect runs
        right now (never matched); read inside the transaction, when the match is
        taken — pass a live collection (a sibling call that starts while this one
        waits for the write lock must count).
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
                values.update(
                    await self._scope(conn, chat_id, tool_call_id, tool_name, args, in_flight)
                )
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
        self,
        conn: StoreConnection,
        chat_id: str,
        tool_call_id: str,
        tool_name: str,
        args: Any,
        in_flight: Collection[str],
    ) -> dict[str, Any]:
        """The step-attempt columns of a new entry, and — when an earlier call of the
        step applied the same call — its recorded answer or the call to re-drive
        (see :meth:`begin`)."""
        fp = args_fingerprint(tool_name, args)
        jq = sa.select(jt.c.state, jt.c.marker, jt.c.attempt, jt.c.at).where(
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
        # earlier ones', plus the chat's unscoped entries of older code (a handful of
        # rows): the count and the match are taken here. A call id that already has
        # an entry gets no new row (the insert does not land), so what is computed
        # for it is never written.
        # Unscoped: older code's rows (no fingerprint), or rows with this fingerprint
        # but no step attempt (written without a journal entry).
        unscoped = sa.or_(
            t.c.args_fp.is_(None),
            sa.and_(t.c.args_fp == fp, sa.or_(t.c.marker.is_(None), t.c.attempt.is_(None))),
        )
        rows = (
            await conn.execute(
                sa.select(
                    t.c.tool_call_id,
                    t.c.attempt,
                    t.c.state,
                    t.c.replay_of,
                    t.c.output_json,
                    t.c.marker,
                    t.c.args_fp,
                    t.c.tool_name,
                    t.c.args_json,
                    t.c.created_at,
                )
                .where(
                    t.c.tenant == self._ops.tenant,
                    t.c.chat_id == chat_id,
                    t.c.tool_call_id != tool_call_id,
                    sa.or_(
                        sa.and_(t.c.marker == marker, t.c.args_fp == fp, t.c.attempt <= n),
                        unscoped,
                    ),
                )
                .order_by(t.c.created_at, t.c.tool_call_id)
            )
        ).all()
        busy = set(in_flight)
        # The step's first send was journaled after this: an entry written before it
        # belongs to an earlier step (only provable for the first attempt: the entry's
        # `at` is the newest send's).
        step_began = journal.at if journal.state == "submitting" and n == 0 else None
        scoped_rows = [r for r in rows if r.marker is not None and r.attempt is not None]
        k = sum(1 for r in scoped_rows if r.attempt == n and r.args_fp == fp)
        applied: list[_Match] = []
        for r in rows:
            if r.replay_of is not None or r.tool_call_id in busy:
                continue
            if r.marker is not None and r.attempt is not None:
                if r.attempt < n and r.args_fp == fp:
                    applied.append(_Match(r.tool_call_id, r.state, r.output_json, True))
                continue
            same = _same_call(r, tool_name, fp)
            if same is False or (step_began is not None and r.created_at < step_began):
                continue  # proven another call
            applied.append(_Match(r.tool_call_id, r.state, r.output_json, same is True))
        if k < len(applied):
            match: _Match | None = applied[k]
        else:
            # This attempt's own repeat of a call whose effect never reported (it
            # raised, or its `done` write failed): re-drive that call, not a new one.
            match = next(
                (
                    _Match(r.replay_of or r.tool_call_id, "committing", None, True)
                    for r in scoped_rows
                    if r.attempt == n
                    and r.args_fp == fp
                    and r.state == "committing"
                    and not {r.tool_call_id, r.replay_of} & busy
                ),
                None,
            )
        if match is None:
            return scope
        if match.state == "done" and match.identical:
            return {
                **scope,
                "state": "done",
                "output_json": match.output_json,
                "replay_of": match.tool_call_id,
            }
        return {**scope, "replay_of": match.tool_call_id}

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
