"""The store's share of a fan-out worker (docs/performance.md round 9), on real SQLite:

* a fresh process's first store calls, all at once (a fan-out's workflows start
  together), check the schema ONCE — each used to run its own check, a write
  transaction with a CREATE TABLE IF NOT EXISTS per table;
* BEGIN runs on the driver's connection, yet a read still does not take the write lock,
  a write still does (also on a worker whose last transaction was the other kind), and
  a write lock held by another connection still ends in SQLAlchemy's
  ``OperationalError`` "database is locked" after the connect timeout.
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state.errors import StoreUnavailableError


async def test_concurrent_first_calls_check_the_schema_once(tmp_path: Path) -> None:
    store = StateStore(f"sqlite+aiosqlite:///{tmp_path / 'state.db'}", tenant="t")
    statements: list[str] = []

    def seen(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        statements.append(statement)

    engine = store._sqlite_pool().engine
    event.listen(engine, "before_cursor_execute", seen)
    try:
        got = await asyncio.gather(*(store.checkpoints.get(f"wf-{i}") for i in range(30)))
        assert got == [None] * 30
        creates = [s for s in statements if "CREATE TABLE" in s.upper()]
        table_checks = [s for s in statements if "table_info" in s]
        assert len(creates) == 8, creates  # every table once, by the one check
        assert len(table_checks) <= 2 * 8, len(table_checks)  # not 30 checks' worth
    finally:
        event.remove(engine, "before_cursor_execute", seen)
        await store.aclose()


async def test_begin_on_the_driver_connection_keeps_read_and_write_locks(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    # One worker: every transaction below runs on the same connection, so a stale
    # read/write flag would show.
    store = StateStore(
        f"sqlite+aiosqlite:///{path}",
        tenant="t",
        connect_timeout=0.3,
        pool_size=1,
        transient_retry_s=0,  # one attempt: the write below fails after the busy timeout
    )
    other = sqlite3.connect(path, isolation_level=None)
    try:
        await store.checkpoints.set("wf", "chat", 1)
        other.execute("BEGIN IMMEDIATE")  # another process's writer holds the lock
        got = await store.checkpoints.get("wf")  # a read is not blocked (WAL)
        assert got is not None and got.last_seen_message_id == 1
        with pytest.raises(StoreUnavailableError, match="database is locked"):
            await store.checkpoints.set("wf", "chat", 2)
        got = await store.checkpoints.get("wf")  # right after a write: still a read
        assert got is not None and got.last_seen_message_id == 1
        other.execute("ROLLBACK")
        await store.checkpoints.set("wf", "chat", 3)
        got = await store.checkpoints.get("wf")
        assert got is not None and got.last_seen_message_id == 3
    finally:
        other.close()
        await store.aclose()
