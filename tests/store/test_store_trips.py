"""What a one-turn workflow's store work costs SQLite, counted from SQLite itself
(docs/performance.md, round 10a), and that the cheaper form keeps every guarantee.

The count comes from ``sqlite3``'s trace callback on the store's real worker
connections: every statement SQLite ran, ``BEGIN`` and ``COMMIT`` included. The
workflow lease and the turn slot (acquire, release: four lease statements), the
slot's busy read, ``turns.begin`` of a first turn (nothing to write), the
``finally`` checkpoint and the archive's read and clean-up each run as ONE statement
in SQLite's autocommit mode; only the eager checkpoint (a checkpoint and a journal
entry together) is a BEGIN IMMEDIATE … COMMIT. Before: 29 statements, 9 BEGINs.
"""

from __future__ import annotations

import asyncio
import sqlite3
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state import workflow_key
from prefect_coder.blocks.state.errors import StoreUnavailableError
from prefect_coder.blocks.state.records import JournalEntry
from prefect_coder.flows.fleet.slots import turn_slot


def _trace(store: StateStore) -> list[str]:
    """Every statement the store's SQLite workers run from now on (connections opened
    from now on: call before the store's first call)."""
    seen: list[str] = []

    def on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.set_trace_callback(seen.append)

    event.listen(store._sqlite_pool().engine, "connect", on_connect)
    return seen


async def _one_turn_workflow(store: StateStore, n: int, cap: int) -> None:
    """The store calls of a one-turn fan-out workflow, in its order (bench/hotpath_store.py)."""
    workflow_id = f"wf-{n}"
    marker = f"[wf:{workflow_id}:s0]"
    async with store.lease(workflow_key(workflow_id), holder=f"h-{n}", ttl=30, wait=30):
        async with turn_slot(store, cap, wait=30, ttl=30, workflow_id=workflow_id):
            start = await store.turns.begin(workflow_id, marker, turn_timeout_s=600)
            assert start.checkpoint is None and not start.journaled
            chat_id = str(uuid.uuid4())
            entry = JournalEntry(state="submitting", marker=marker, attempt=0)
            await store.turns.record(workflow_id, chat_id, None, journal=entry)  # eager
            await store.turns.record(workflow_id, chat_id, 2)  # finally
        checkpoint, stranded = await store.turns.archive_targets(workflow_id)
        assert checkpoint is not None and checkpoint.chat_id == chat_id and stranded == []
        await store.turns.forget_tools(chat_id)


def _count_hops(store: StateStore) -> list[int]:
    """Counts the store's check-outs of a SQLite worker: one per hop to a worker thread
    (a job and its answer handed between the loop and the thread)."""
    pool = store._sqlite_pool()
    hops = [0]
    checkout = pool.checkout

    async def counted() -> Any:
        hops[0] += 1
        return await checkout()

    pool.checkout = counted  # type: ignore[method-assign]
    return hops


async def test_one_turn_workflow_store_statements(tmp_path: Path) -> None:
    store = StateStore(f"sqlite+aiosqlite:///{tmp_path / 'state.db'}", tenant="t")
    seen = _trace(store)
    try:
        await store.ensure_schema()
        hops = _count_hops(store)
        seen.clear()
        await _one_turn_workflow(store, 0, cap=5)  # first claim: the busy read
        first, first_hops = list(seen), hops[0]
        seen.clear()
        hops[0] = 0
        await _one_turn_workflow(store, 1, cap=5)  # the released slot as hint: no read
        second, second_hops = list(seen), hops[0]
    finally:
        await store.aclose()
    # One hop per store call: the first claim's read and acquire go together (they
    # were two hops).
    assert (first_hops, second_hops) == (9, 9)
    for got in (first, second):
        begins = [s for s in got if s.startswith("BEGIN")]
        commits = [s for s in got if s.startswith("COMMIT")]
        # Only the eager checkpoint's two writes need a transaction around them.
        assert begins == ["BEGIN IMMEDIATE"] and len(commits) == 1, got
    leases = [s for s in second if s.startswith(("INSERT INTO coder_state_leases", "UPDATE"))]
    assert len(leases) == 4, leases  # workflow lease and slot, each acquired + released
    # The write guard (blocks/state/fencing.py): one read inside the eager checkpoint's
    # transaction; the finally checkpoint carries it in its own WHERE (no statement).
    guards = [s for s in second if s.startswith("SELECT (SELECT version")]
    assert len(guards) == 1, second
    finally_checkpoint = [s for s in second if s.startswith("INSERT INTO coder_state_checkpoints")]
    assert "coder_state_schema_version" in finally_checkpoint[-1], finally_checkpoint
    # Before: 29 statements (every call BEGIN … COMMIT), 9 of them BEGIN.
    assert len(second) == 13, second
    assert len(first) == 14, first  # + the slot's busy read


async def test_direct_statements_commit_before_they_return(tmp_path: Path) -> None:
    """A lease statement and a checkpoint run in autocommit are committed (visible to
    another connection, no transaction left open on the worker) when they return —
    and a failed one changed nothing and leaves the worker usable."""
    path = tmp_path / "state.db"
    # A short busy timeout (the pool of a file is per process: set by its first store).
    store = StateStore(
        f"sqlite+aiosqlite:///{path}",
        tenant="t",
        pool_size=1,
        connect_timeout=0.3,
        transient_retry_s=0,  # one attempt: the failure below comes after the busy timeout
    )
    other = sqlite3.connect(path, isolation_level=None)
    try:
        got = await store.leases.acquire("k", "a", 30)
        assert got is not None and (got.holder, got.fence) == ("a", 1)
        row = other.execute("SELECT holder, fence FROM coder_state_leases WHERE key='k'").fetchone()
        assert row == ("a", 1)
        assert await store.leases.acquire("k", "b", 30) is None  # held: no row back
        await store.turns.record("wf", "chat", 3)
        row = other.execute(
            "SELECT last_seen_message_id FROM coder_state_checkpoints WHERE workflow_id='wf'"
        ).fetchone()
        assert row == (3,)

        def open_transaction(conn: sqlite3.Connection, _take_writer: Any) -> bool:
            return conn.in_transaction

        # The one worker ran both statements: no transaction left open on it.
        assert await store.run_direct(open_transaction) is False
        # A writer of another process holds the lock: the statement fails with
        # SQLAlchemy's error after the busy timeout, changes nothing, and the worker
        # then serves the next call.
        other.execute("BEGIN IMMEDIATE")
        with pytest.raises(StoreUnavailableError, match="database is locked"):
            await store.leases.release("k", "a")
        other.execute("ROLLBACK")
        assert await store.leases.release("k", "a") is True
        row = other.execute("SELECT expires_at FROM coder_state_leases WHERE key='k'").fetchone()
        assert row == (0.0,)
    finally:
        other.close()
        await store.aclose()


async def test_leases_queue_on_the_process_writer_lock(tmp_path: Path) -> None:
    """Concurrent lease statements of one process never meet SQLite's busy handler: 40
    acquires and releases at once on 5 workers, a 0.5 s busy timeout, all succeed, and
    exactly one holder wins each key."""
    store = StateStore(
        f"sqlite+aiosqlite:///{tmp_path / 'state.db'}", tenant="t", connect_timeout=5
    )
    try:
        got = await asyncio.gather(
            *(store.leases.acquire(f"k{i % 4}", f"h{i}", 30) for i in range(40))
        )
        winners = [g for g in got if g is not None]
        assert sorted(w.key for w in winners) == ["k0", "k1", "k2", "k3"]
        released = await asyncio.gather(*(store.leases.release(w.key, w.holder) for w in winners))
        assert released == [True] * 4
    finally:
        await store.aclose()


async def test_begin_reads_then_journals_in_one_transaction(store: StateStore) -> None:
    """``turns.begin`` with a checkpoint: the write-ahead is written (and re-read under
    the write lock); a second begin of the same marker writes nothing."""
    await store.turns.record("wf", "chat", 2)
    start = await store.turns.begin("wf", "[wf/s1]", at=5.0, turn_timeout_s=10)
    assert start.journaled and start.journal is not None
    assert (start.journal.marker, start.journal.deadline) == ("[wf/s1]", 15.0)
    again = await store.turns.begin("wf", "[wf/s1]")
    assert not again.journaled and again.journal is not None
    assert again.journal.updated_at == start.journal.updated_at


async def test_forget_tools_deletes_the_ledger_and_stranded_record(store: StateStore) -> None:
    await store.ledger.begin("chat", "call-1", tool_name="t")
    await store.stranded.record("wf", "chat", "discarded")
    await store.stranded.record("wf", "other", "discarded")
    checkpoint, stranded = await store.turns.archive_targets("wf")
    assert checkpoint is None and sorted(stranded) == ["chat", "other"]
    await store.turns.forget_tools("chat")
    assert await store.ledger.list("chat") == []
    assert [s.chat_id for s in await store.stranded.list("wf")] == ["other"]
    await store.turns.forget_tools("chat")  # nothing left: a no-op
    await store.turns.forget_tools("other")
    assert await store.stranded.list("wf") == []
