"""Schema fencing for rolling upgrades (issue 30, item 4): a worker process running
today's code keeps running while newer code migrates the store; its next write of
every kind is refused with ``SchemaChangedError`` and writes nothing.

The worker is a real OS process (this file, run as a script) on the real SQLite file
or PostgreSQL database. The migration is what newer code's ``ensure_schema`` does: in
one transaction, ``LOCK TABLE coder_state_schema_version`` (PostgreSQL) and the version
bump. Before the per-write guard (blocks/state/fencing.py) the worker checked the
version once, at its first call, and went on writing.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # the worker: the store alone, without importing Prefect
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import lease_worker  # noqa: F401  (registers bare packages: no Prefect import)

import pytest

from prefect_coder.blocks.state import (
    SCHEMA_VERSION,
    JournalEntry,
    SchemaChangedError,
    SchemaVersionError,
    StateStore,
    workflow_key,
)

WORKER_TIMEOUT_S = 60.0
TABLES = (
    "coder_state_checkpoints",
    "coder_state_journal",
    "coder_state_tool_ledger",
    "coder_state_stranded_chats",
    "coder_state_leases",
    "coder_state_workflows",
    "coder_state_schema_version",
)


# --- the worker (an old-code process) ---------------------------------------------------


async def _worker(url: str, tenant: str) -> None:
    store = StateStore(url, tenant=tenant, transient_retry_s=0)
    await store.checkpoints.set("wf", "chat-1", 1)
    await store.journal.set("chat-1", JournalEntry.submitting("[m]", 0, turn_timeout=60))
    await store.ledger.begin("chat-1", "call-1", tool_name="t", args={"a": 1})
    async with store.lease(workflow_key("wf"), ttl=1.0, renew_interval=0.1) as held:
        print("READY", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # migrated

        async def transaction() -> None:
            async with store.transaction() as tx:
                await tx.checkpoints.set("wf", "chat-1", 3)
                await tx.journal.set("chat-1", JournalEntry.cut_short("[m]", 1))

        writes: dict[str, Any] = {
            "checkpoint": lambda: store.checkpoints.set("wf", "chat-1", 2),
            "journal": lambda: store.journal.set("chat-1", JournalEntry.cut_short("[m]", 1)),
            "ledger.begin": lambda: store.ledger.begin("chat-1", "call-2", tool_name="t"),
            "ledger.complete": lambda: store.ledger.complete("chat-1", "call-1", {"ok": 1}),
            "transaction": transaction,
            "turns.record": lambda: store.turns.record("wf", "chat-1", 4),
            "turns.record+journal": lambda: store.turns.record(
                "wf", "chat-1", 4, journal=JournalEntry.cut_short("[m]", 1)
            ),
            "turns.begin": lambda: store.turns.begin("wf", "[m2]", turn_timeout_s=60),
            "stranded.record": lambda: store.stranded.record("wf", "chat-9", "test"),
            "lease.acquire": lambda: store.leases.acquire("other", "h", 30),
            "lease.renew": lambda: store.leases.renew(held.key, held.holder, 30),
        }
        results: dict[str, Any] = {}
        for name, write in writes.items():
            try:
                await write()
                results[name] = None
            except Exception as exc:
                results[name] = [type(exc).__name__, str(exc), getattr(exc, "found", None)]
        for _ in range(50):  # the background renewal (every 0.1 s) meets the fence too
            if held.lost:
                break
            await asyncio.sleep(0.1)
        results["renewal lost the lease"] = held.lost
        print(json.dumps(results), flush=True)
    await store.aclose()


# --- the test -------------------------------------------------------------------------


@pytest.fixture
async def db_url(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[str]:
    """A database of its own: the migration below must not touch other tests' store."""
    if backend == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path}/state.db"
        return
    from support.pg_databases import fresh_database

    async with fresh_database(request.getfixturevalue("postgres_url"), "fence") as url:
        yield url


async def _migrate(url: str, backend: str) -> None:
    """What newer code's ensure_schema does to a database of this version: the bump, in
    one transaction, with the version table locked (PostgreSQL)."""
    bump = f"UPDATE coder_state_schema_version SET version = {SCHEMA_VERSION + 1}"
    if backend == "sqlite":
        conn = sqlite3.connect(url.split("///", 1)[1], isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(bump)
        conn.execute("COMMIT")
        conn.close()
        return
    import asyncpg

    pg = await asyncpg.connect(url.replace("+asyncpg", ""))
    try:
        async with pg.transaction():
            await pg.execute("LOCK TABLE coder_state_schema_version IN ACCESS EXCLUSIVE MODE")
            await pg.execute(bump)
    finally:
        await pg.close()


async def _dump(url: str, backend: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table, sorted (nothing written shows as no change)."""
    if backend == "sqlite":
        conn = sqlite3.connect(url.split("///", 1)[1])
        try:
            return {t: sorted(conn.execute(f"SELECT * FROM {t}").fetchall()) for t in TABLES}
        finally:
            conn.close()
    import asyncpg

    pg = await asyncpg.connect(url.replace("+asyncpg", ""))
    try:
        return {t: sorted(tuple(r) for r in await pg.fetch(f"SELECT * FROM {t}")) for t in TABLES}
    finally:
        await pg.close()


async def _line(proc: asyncio.subprocess.Process) -> str:
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), WORKER_TIMEOUT_S)
    assert line, "the worker exited early"
    return line.decode().strip()


async def test_old_worker_refuses_every_write_after_a_migration(db_url: str, backend: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        db_url,
        "t-fence",
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert await _line(proc) == "READY"
        await _migrate(db_url, backend)
        before = await _dump(db_url, backend)
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        await proc.stdin.drain()
        results = json.loads(await _line(proc))
        after = await _dump(db_url, backend)
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
    assert results.pop("renewal lost the lease") is True
    for name, got in results.items():
        assert got is not None, f"{name}: written by a worker older than the schema"
        kind, message, found = got
        assert kind == "SchemaChangedError", (name, got)
        assert found == SCHEMA_VERSION + 1
        assert f"migrated to schema version {SCHEMA_VERSION + 1}" in message, message
        assert f"for schema version {SCHEMA_VERSION};" in message, message
        assert (
            "nothing was written" in message and "Upgrade prefect-coder on this worker" in message
        )
    assert after == before  # not one row changed: no write, no renewal, no release


async def test_a_migration_waits_for_a_write_in_flight(db_url: str, backend: str) -> None:
    """The guard reads the version inside the write's transaction: a migration that comes
    while it is open waits for its commit (PostgreSQL: the version table's ACCESS
    EXCLUSIVE lock against the guard's read; SQLite: one writer at a time), so no write
    of older code lands after the bump, and the next one is refused."""
    store = StateStore(db_url, tenant="t-flight", transient_retry_s=0)
    try:
        await store.ensure_schema()
        async with store.transaction() as tx:
            await tx.checkpoints.set("wf", "chat-1", 1)
            if backend == "sqlite":  # sqlite3 blocks: its own thread
                migration = asyncio.ensure_future(
                    asyncio.to_thread(asyncio.run, _migrate(db_url, backend))
                )
            else:
                migration = asyncio.ensure_future(_migrate(db_url, backend))
            await asyncio.sleep(0.3)
            assert not migration.done()  # waits for the write in flight
            await tx.journal.set("chat-1", JournalEntry.submitting("[m]", 0))
        await asyncio.wait_for(migration, 10)
        cp = await store.checkpoints.get("wf")
        assert cp is not None and cp.last_seen_message_id == 1  # committed before the bump
        with pytest.raises(SchemaChangedError):
            await store.checkpoints.set("wf", "chat-1", 2)
    finally:
        await store.aclose()


async def test_an_upgraded_store_accepts_writes_again(store: StateStore) -> None:
    """The guard passes at this code's version (every other store test writes through
    it); the refusal is typed, permanent for the process, and pickles whole (Prefect
    persists a failed run's exception)."""
    cp = await store.checkpoints.set("wf", "chat", 1)
    assert cp.last_seen_message_id == 1
    err = SchemaChangedError(SCHEMA_VERSION + 1, SCHEMA_VERSION)
    assert isinstance(err, SchemaVersionError) and err.retryable is False
    again = pickle.loads(pickle.dumps(err))
    assert (again.found, again.supported, str(again)) == (err.found, err.supported, str(err))


if __name__ == "__main__":
    asyncio.run(_worker(sys.argv[1], sys.argv[2]))
