"""``store.turns``: a durable turn's store work in two short trips instead of four transactions.

A turn reads its checkpoint, reads the chat's journal, journals the send
write-ahead, and writes the ``finally`` checkpoint. Done call by call that is four
transactions (on SQLite two of them fsync'd and ≈ 7 thread hops, on PostgreSQL
≈ 12 round trips). Here:

* ``begin`` reads both and writes the write-ahead only if needed, atomically —
  SQLite: one write transaction run on the worker thread in ONE hop; PostgreSQL:
  ONE statement (a data-modifying CTE) in autocommit, ONE round trip.
* ``record`` writes the checkpoint (SQLite: one hop; PostgreSQL: one upsert in
  autocommit, one round trip), or — with a journal entry — both in one transaction.

The SQL is fixed text run through the driver (no statement building per call:
that was most of the store's CPU per turn); on SQLite straight on the worker's
``sqlite3`` connection, inside the transaction SQLAlchemy began on it (no cursor
result per statement: docs/performance.md, round 9). Every write is acknowledged only
after it committed. Each hop or round trip on a loaded machine waits for the
scheduler (the worker thread, the PostgreSQL backend), so their count is what a
turn's wall time pays.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from functools import cache
from typing import TYPE_CHECKING, Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.dialects import sqlite as sqlite_dialect

from .engines import db_now
from .fencing import Fence, check, gate_sql, guard_condition, guard_params, guard_sql
from .records import Checkpoint, JournalEntry, TurnStart, from_epoch
from .sqlite_pool import driver_execute, driver_rows

if TYPE_CHECKING:
    from .store import StateStore

# The database clock of every other store write (engines.db_now), as the SQL text these
# fixed statements embed: compiled once by each backend's own dialect.
_SQLITE_NOW = str(db_now("sqlite").compile(dialect=sqlite_dialect.dialect()))

# The journal's ``at`` and ``deadline`` are stored on the database clock and read on the
# caller's (journal.py's docstring): ``{off}`` is (database clock - the caller's
# ``time.time()``), the caller's time a parameter.
_RESUME_COLUMNS = (
    "c.workflow_id, c.chat_id, c.last_seen_message_id, c.updated_at, "
    "j.state, j.marker, j.attempt, j.at - {off}, j.updated_at, j.deadline - {off}"
)
_RESUME_FROM = (
    "FROM coder_state_checkpoints c LEFT JOIN coder_state_journal j "
    "ON j.tenant = c.tenant AND j.chat_id = c.chat_id"
)
_JOURNAL_SET = (
    "ON CONFLICT (tenant, chat_id) DO UPDATE SET state = excluded.state, "
    "marker = excluded.marker, attempt = excluded.attempt, at = excluded.at, "
    "deadline = excluded.deadline, updated_at = excluded.updated_at"
)
_CHECKPOINT_SET = (
    "ON CONFLICT (tenant, workflow_id) DO UPDATE SET chat_id = excluded.chat_id, "
    "last_seen_message_id = excluded.last_seen_message_id, updated_at = excluded.updated_at"
)

_SQLITE_OFF = f"({_SQLITE_NOW} - ?3)"
_SQLITE_RESUME = (
    f"SELECT {_RESUME_COLUMNS.format(off=_SQLITE_OFF)} {_RESUME_FROM} "
    "WHERE c.tenant = ?1 AND c.workflow_id = ?2"
)
# Parameters: tenant, chat, state, marker, attempt, at, deadline, the writer's time.
_SQLITE_JOURNAL = (
    "INSERT INTO coder_state_journal "
    "(tenant, chat_id, state, marker, attempt, at, deadline, updated_at) "
    f"VALUES (?1, ?2, ?3, ?4, ?5, ?6 + ({_SQLITE_NOW} - ?8), ?7 + ({_SQLITE_NOW} - ?8), "
    f"{_SQLITE_NOW}) {_JOURNAL_SET} RETURNING updated_at"
)
_SQLITE_CHECKPOINT = (
    "INSERT INTO coder_state_checkpoints "
    "(tenant, workflow_id, chat_id, last_seen_message_id, updated_at) "
    f"VALUES (?, ?, ?, ?, {_SQLITE_NOW}) {_CHECKPOINT_SET} RETURNING updated_at"
)


@cache
def _sqlite_guarded_checkpoint(fences: int) -> str:
    """The checkpoint upsert as ONE statement that writes only through the write guard
    (``fencing``): ``INSERT … SELECT … WHERE guard ON CONFLICT …``."""
    return (
        "INSERT INTO coder_state_checkpoints "
        "(tenant, workflow_id, chat_id, last_seen_message_id, updated_at) "
        f"SELECT ?, ?, ?, ?, {_SQLITE_NOW} WHERE {guard_condition('sqlite', fences)} "
        f"{_CHECKPOINT_SET} RETURNING updated_at"
    )


class _PgStatements(NamedTuple):
    begin: str
    checkpoint: str
    checkpoint_and_journal: str
    forget_tools: str


@cache
def _pg(fences: int = 0) -> _PgStatements:
    """The PostgreSQL statements for a caller holding ``fences`` write fences, built on
    first use: compiling ``db_now`` loads the PostgreSQL dialect, which a SQLite store
    never imports. Each writes only ``FROM gate WHERE gate.ok`` (``fencing.gate_sql``:
    the schema version and the fences, read in the same statement, the lease rows
    ``FOR SHARE``) and returns the gate's columns after its own."""
    from sqlalchemy.dialects import postgresql

    pg_now = str(db_now("postgresql").compile(dialect=postgresql.dialect()))
    # The write-ahead only when the chat's entry does not carry this marker (IS DISTINCT
    # FROM: also when there is no entry). One statement: read and write are atomic
    # together, as the transaction they replace was.
    # $6: the caller's time.time() (the journal's times: database clock, read on the
    # caller's).
    off = f"({pg_now} - $6::double precision)"
    begin = f"""
WITH {gate_sql(fences, 7)}, cp AS (
    SELECT c.workflow_id, c.chat_id, c.last_seen_message_id, c.updated_at,
           j.state AS j_state, j.marker AS j_marker, j.attempt AS j_attempt,
           j.at - {off} AS j_at, j.updated_at AS j_updated_at, j.deadline - {off} AS j_deadline
    {_RESUME_FROM}
    WHERE c.tenant = $1::text AND c.workflow_id = $2::text
), written AS (
    INSERT INTO coder_state_journal
        (tenant, chat_id, state, marker, attempt, at, deadline, updated_at)
    SELECT $1::text, cp.chat_id, 'submitting', $3::text, 0, $4::double precision + {off},
           $5::double precision + {off}, {pg_now}
    FROM cp, gate WHERE gate.ok AND cp.j_marker IS DISTINCT FROM $3::text
    {_JOURNAL_SET}
    RETURNING updated_at
)
SELECT cp.workflow_id, cp.chat_id, cp.last_seen_message_id, cp.updated_at,
       cp.j_state, cp.j_marker, cp.j_attempt, cp.j_at, cp.j_updated_at, cp.j_deadline,
       (SELECT updated_at FROM written) AS written_at, gate.*
FROM cp, gate
"""
    checkpoint = f"""
WITH {gate_sql(fences, 5)}, c AS (
    INSERT INTO coder_state_checkpoints
        (tenant, workflow_id, chat_id, last_seen_message_id, updated_at)
    SELECT $1::text, $2::text, $3::text, $4::bigint, {pg_now} FROM gate WHERE gate.ok
    {_CHECKPOINT_SET}
    RETURNING updated_at
)
SELECT (SELECT updated_at FROM c), gate.* FROM gate
"""
    # A first turn's checkpoint and its journaled send in ONE statement (autocommit): both
    # data-modifying CTEs run, atomically, or neither does.
    off10 = f"({pg_now} - $10::double precision)"
    checkpoint_and_journal = f"""
WITH {gate_sql(fences, 11)}, j AS (
    INSERT INTO coder_state_journal
        (tenant, chat_id, state, marker, attempt, at, deadline, updated_at)
    SELECT $1::text, $3::text, $5::text, $6::text, $7::integer,
           $8::double precision + {off10}, $9::double precision + {off10}, {pg_now}
    FROM gate WHERE gate.ok
    {_JOURNAL_SET}
    RETURNING updated_at
), c AS (
    INSERT INTO coder_state_checkpoints
        (tenant, workflow_id, chat_id, last_seen_message_id, updated_at)
    SELECT $1::text, $2::text, $3::text, $4::bigint, {pg_now} FROM gate WHERE gate.ok
    {_CHECKPOINT_SET}
    RETURNING updated_at
)
SELECT (SELECT updated_at FROM c), (SELECT updated_at FROM j), gate.* FROM gate
"""
    forget_tools = f"""
WITH {gate_sql(fences, 3)}, l AS (
    DELETE FROM coder_state_tool_ledger WHERE tenant = $1::text AND chat_id = $2::text
    AND (SELECT ok FROM gate)
    RETURNING 1
), s AS (
    DELETE FROM coder_state_stranded_chats WHERE tenant = $1::text AND chat_id = $2::text
    AND (SELECT ok FROM gate)
    RETURNING 1
)
SELECT (SELECT count(*) FROM l), (SELECT count(*) FROM s), gate.* FROM gate
"""
    return _PgStatements(begin, checkpoint, checkpoint_and_journal, forget_tools)


def _gate(row: Any, start: int, fences: tuple[Fence, ...]) -> None:
    """Raise unless the gate (``row[start:]``: its columns, ``ok`` last) let the write
    through."""
    if not row[-1]:
        check(row[start:-1], fences)


# The archive's read: the checkpoint and the workflow's stranded chats (oldest first),
# in one statement — a checkpoint row (kind 0) and one row per stranded chat (kind 1).
_ARCHIVE_TARGETS = (
    "SELECT 0 AS kind, chat_id, last_seen_message_id, updated_at, 0.0 AS created_at "
    "FROM coder_state_checkpoints WHERE tenant = {p1} AND workflow_id = {p2} "
    "UNION ALL "
    "SELECT 1 AS kind, chat_id, NULL, updated_at, created_at "
    "FROM coder_state_stranded_chats WHERE tenant = {p1} AND workflow_id = {p2} "
    "ORDER BY 1, 5, 2"
)
_SQLITE_ARCHIVE_TARGETS = _ARCHIVE_TARGETS.format(p1="?1", p2="?2")
_PG_ARCHIVE_TARGETS = _ARCHIVE_TARGETS.format(p1="$1::text", p2="$2::text")

# After archiving a checkpointed chat: its tool ledger and any stranded record go.
_SQLITE_FORGET_TOOLS = (
    "DELETE FROM coder_state_tool_ledger WHERE tenant = ? AND chat_id = ?",
    "DELETE FROM coder_state_stranded_chats WHERE tenant = ? AND chat_id = ?",
)
_SQLITE_ANY_TOOLS = (
    "SELECT 1 FROM coder_state_tool_ledger WHERE tenant = ?1 AND chat_id = ?2 "
    "UNION ALL "
    "SELECT 1 FROM coder_state_stranded_chats WHERE tenant = ?1 AND chat_id = ?2 LIMIT 1"
)


def _guard(conn: sqlite3.Connection, fences: tuple[Fence, ...]) -> None:
    """SQLite: the write guard (``fencing``) inside the open BEGIN IMMEDIATE; a refusal
    raises, and ``run_direct`` rolls the transaction back: nothing written."""
    check(driver_rows(conn, guard_sql("sqlite", len(fences)), guard_params(fences))[0], fences)


def _one_value(rows: list[Any]) -> Any:
    if len(rows) != 1:
        raise sa.exc.NoResultFound(f"expected one row, got {len(rows)}")
    return rows[0][0]


def _checkpoint(row: Any) -> Checkpoint:
    return Checkpoint(
        workflow_id=row[0],
        chat_id=row[1],
        last_seen_message_id=row[2],
        updated_at=from_epoch(row[3]),
    )


def _found(row: Any) -> JournalEntry:
    return JournalEntry(
        state=row[4],
        marker=row[5],
        attempt=row[6],
        at=row[7],
        deadline=row[9],
        updated_at=from_epoch(row[8]),
    )


class Turns:
    """``store.turns``: ``begin`` before a step's send, ``record`` in its ``finally``."""

    def __init__(self, store: StateStore) -> None:
        self._store = store

    async def begin(
        self,
        workflow_id: str,
        marker: str,
        *,
        at: float | None = None,
        turn_timeout_s: float | None = None,
    ) -> TurnStart:
        """Read the checkpoint and its chat's journal; journal the send if it is new.

        Atomically: if the checkpoint names a chat whose journal entry does not carry
        ``marker``, write the write-ahead ``submitting`` entry (attempt 0: no earlier
        send of this marker exists, or it would have journaled it) and return it with
        ``journaled=True``. If the entry carries ``marker``, write nothing and return
        it (``journaled=False``): recover before resending. No checkpoint: nothing
        written (the first turn creates the chat). Call it under the workflow's lease,
        before the send, as the separate calls were. Returns only once the write-ahead
        is committed. ``turn_timeout_s``: the step's turn timeout; the write-ahead
        records ``at`` + it as the attempt's ``deadline`` (None: no deadline recorded).
        """
        clock = self._store.clock
        entry = JournalEntry.submitting(
            marker, 0, turn_timeout=turn_timeout_s, at=clock() if at is None else at
        )
        tenant = self._store.tenant
        fences = self._store.write_fences()
        row: Any
        if self._store.backend == "sqlite":

            def needs_write(row: Any) -> bool:
                return row is not None and not (row[4] is not None and row[5] == marker)

            def body(conn: sqlite3.Connection, take_writer: Callable[[], None]) -> Any:
                # The read alone first (one statement: its own snapshot): a first turn
                # has no checkpoint and a re-run finds its marker journaled — nothing to
                # write, so no write lock, BEGIN or COMMIT (docs/performance.md, round
                # 10a). Otherwise the read again and the write-ahead in ONE write
                # transaction, atomic together as before.
                # The journal's times: the clock offset is taken right here, on the
                # worker, right before each statement (journal.py).
                rows = driver_rows(conn, _SQLITE_RESUME, (tenant, workflow_id, clock()))
                if not needs_write(rows[0] if rows else None):
                    return (rows[0] if rows else None), None
                take_writer()
                driver_execute(conn, "BEGIN IMMEDIATE")
                _guard(conn, fences)
                rows = driver_rows(conn, _SQLITE_RESUME, (tenant, workflow_id, clock()))
                row = rows[0] if rows else None
                written = None
                if row is not None and needs_write(row):
                    written = _one_value(
                        driver_rows(
                            conn,
                            _SQLITE_JOURNAL,
                            (
                                tenant,
                                row[1],
                                entry.state,
                                marker,
                                entry.attempt,
                                entry.at,
                                entry.deadline,
                                clock(),
                            ),
                        )
                    )
                driver_execute(conn, "COMMIT")
                return row, written

            row, written_at = await self._store.run_direct(body)
        else:
            async with self._store.autocommit() as conn:
                row = (
                    await conn.exec_driver_sql(
                        _pg(len(fences)).begin,
                        (
                            tenant,
                            workflow_id,
                            marker,
                            entry.at,
                            entry.deadline,
                            clock(),
                            *guard_params(fences),
                        ),
                    )
                ).first()
            written_at = None if row is None else row[10]
            if row is not None and written_at is None and row[5] != marker:
                _gate(row, 11, fences)  # the write-ahead was due: refused?
        if row is None:
            return TurnStart()
        checkpoint = _checkpoint(row)
        if written_at is None:
            return TurnStart(checkpoint=checkpoint, journal=_found(row), journaled=False)
        written = entry.model_copy(update={"updated_at": from_epoch(written_at)})
        # What the write-ahead replaced (cp's row is read before the write): recovery
        # tells a LATER step's entry — this step's result lost — from an earlier one's.
        replaced = _found(row) if row[4] is not None else None
        return TurnStart(checkpoint=checkpoint, journal=written, journaled=True, replaced=replaced)

    async def record(
        self,
        workflow_id: str,
        chat_id: str,
        last_seen_message_id: int | None = None,
        *,
        journal: JournalEntry | None = None,
    ) -> Checkpoint:
        """The ``finally`` checkpoint, plus ``journal`` for ``chat_id`` if given,
        atomically: both commit or neither does (e.g. a first turn that failed after
        creating its chat: the checkpoint and the journaled send together)."""
        cp = Checkpoint(
            workflow_id=workflow_id, chat_id=chat_id, last_seen_message_id=last_seen_message_id
        )
        tenant = self._store.tenant
        params = (tenant, cp.workflow_id, cp.chat_id, cp.last_seen_message_id)
        fences = self._store.write_fences()
        clock = self._store.clock  # the journal's clock offset, right before the statement
        if self._store.backend == "sqlite":

            def body(conn: sqlite3.Connection, take_writer: Callable[[], None]) -> float:
                take_writer()
                if journal is None:
                    # One statement, the guard in its WHERE (``fencing``): a transaction
                    # of its own (autocommit), committed once it returned its row. No
                    # row: refused — the guard's read says why (same hop).
                    rows = driver_rows(
                        conn, _sqlite_guarded_checkpoint(len(fences)), params + guard_params(fences)
                    )
                    if not rows:
                        _guard(conn, fences)
                        raise AssertionError(
                            "checkpoint not written, guard passed"
                        )  # pragma: no cover
                    return float(rows[0][0])
                # One write transaction, the guard first: still one hop.
                driver_execute(conn, "BEGIN IMMEDIATE")
                _guard(conn, fences)
                updated = _one_value(driver_rows(conn, _SQLITE_CHECKPOINT, params))
                _one_value(
                    driver_rows(
                        conn,
                        _SQLITE_JOURNAL,
                        (
                            tenant,
                            chat_id,
                            journal.state,
                            journal.marker,
                            journal.attempt,
                            journal.at,
                            journal.deadline,
                            clock(),
                        ),
                    )
                )
                driver_execute(conn, "COMMIT")
                return float(updated)

            updated_at = await self._store.run_direct(body)
        elif journal is None:
            async with self._store.autocommit() as conn:
                got = (
                    await conn.exec_driver_sql(
                        _pg(len(fences)).checkpoint, params + guard_params(fences)
                    )
                ).one()
            _gate(got, 1, fences)
            updated_at = got[0]
        else:
            async with self._store.autocommit() as conn:
                got = (
                    await conn.exec_driver_sql(
                        _pg(len(fences)).checkpoint_and_journal,
                        (
                            *params,
                            journal.state,
                            journal.marker,
                            journal.attempt,
                            journal.at,
                            journal.deadline,
                            clock(),
                            *guard_params(fences),
                        ),
                    )
                ).one()
            _gate(got, 2, fences)
            updated_at = got[0]
        return cp.model_copy(update={"updated_at": from_epoch(updated_at)})

    async def archive_targets(self, workflow_id: str) -> tuple[Checkpoint | None, list[str]]:
        """The archive's read, in one trip: the workflow's checkpoint (or None) and the
        ids of the chats it stranded, oldest first (``stranded.list``'s order)."""
        tenant = self._store.tenant
        if self._store.backend == "sqlite":

            def body(conn: sqlite3.Connection, _take_writer: Callable[[], None]) -> list[Any]:
                # One statement, its own read snapshot: no BEGIN / COMMIT around it.
                return driver_rows(conn, _SQLITE_ARCHIVE_TARGETS, (tenant, workflow_id))

            rows = await self._store.run_direct(body)
        else:
            async with self._store.autocommit() as conn:
                rows = list(
                    (await conn.exec_driver_sql(_PG_ARCHIVE_TARGETS, (tenant, workflow_id))).all()
                )
        checkpoint: Checkpoint | None = None
        stranded: list[str] = []
        for row in rows:
            if row[0] == 0:
                checkpoint = Checkpoint(
                    workflow_id=workflow_id,
                    chat_id=row[1],
                    last_seen_message_id=row[2],
                    updated_at=from_epoch(row[3]),
                )
            else:
                stranded.append(row[1])
        return checkpoint, stranded

    async def forget_tools(self, chat_id: str) -> None:
        """After the checkpointed chat was archived: delete its tool ledger and any
        stranded record of it, in one transaction (one trip). Its journal entry and the
        checkpoint stay (a rerun recovers lost results from the archived chat)."""
        tenant = self._store.tenant
        fences = self._store.write_fences()
        if self._store.backend == "sqlite":

            def body(conn: sqlite3.Connection, take_writer: Callable[[], None]) -> None:
                # Most chats have neither (no crash-safe tool ran, nothing stranded): then
                # one read and no write transaction. A row written after that read is
                # ordered after this call, as it was after the transaction it replaces.
                if not driver_rows(conn, _SQLITE_ANY_TOOLS, (tenant, chat_id)):
                    return
                take_writer()
                driver_execute(conn, "BEGIN IMMEDIATE")
                _guard(conn, fences)
                for sql in _SQLITE_FORGET_TOOLS:
                    driver_rows(conn, sql, (tenant, chat_id))
                driver_execute(conn, "COMMIT")

            await self._store.run_direct(body)
        else:
            async with self._store.autocommit() as conn:
                got = (
                    await conn.exec_driver_sql(
                        _pg(len(fences)).forget_tools, (tenant, chat_id, *guard_params(fences))
                    )
                ).one()
            _gate(got, 2, fences)
