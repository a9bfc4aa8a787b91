"""Schema: created on first use (parent dirs too), re-opened intact, versioned."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine
from support.pg_databases import fresh_database

from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state import SCHEMA_VERSION, SchemaVersionError
from prefect_coder.blocks.state.schema import ALL_TABLES


@pytest.fixture
async def fresh_url(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[str]:
    """A URL to a database that does not exist yet (SQLite) or is empty (PostgreSQL)."""
    if backend == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path}/deep/er/state.db"
        return
    async with fresh_database(request.getfixturevalue("postgres_url"), "fresh") as url:
        yield url


def _exists(path: str) -> bool:
    return os.path.exists(path)


async def _tables(url: str) -> set[str]:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            return set(await conn.run_sync(lambda c: sa.inspect(c).get_table_names()))
    finally:
        await engine.dispose()


async def _version(url: str) -> list[tuple[str, int]]:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            rows = await conn.execute(
                sa.text("SELECT component, version FROM coder_state_schema_version")
            )
            return [(r[0], r[1]) for r in rows]
    finally:
        await engine.dispose()


async def test_created_on_first_use_and_reopened(fresh_url: str, backend: str) -> None:
    if backend == "sqlite":
        assert not Path(fresh_url.split("///", 1)[1]).parent.exists()
    store = StateStore(fresh_url)
    await store.checkpoints.set("wf", "chat", 5)  # first use: creates dirs + tables
    if backend == "sqlite":
        # The per-process anchor keeps the WAL between calls (no checkpoint-and-delete
        # of the WAL on every call's close).
        assert _exists(fresh_url.split("///", 1)[1] + "-wal")
    await store.aclose()
    assert {t.name for t in ALL_TABLES} <= await _tables(fresh_url)
    assert await _version(fresh_url) == [("prefect-coder-state", SCHEMA_VERSION)]
    if backend == "sqlite":
        engine = create_async_engine(fresh_url)
        async with engine.connect() as conn:
            assert (await conn.exec_driver_sql("PRAGMA journal_mode")).scalar() == "wal"
        await engine.dispose()

    # Re-open from a new process-level view: forget that this process ensured it.
    from prefect_coder.blocks.state import store as store_mod

    store_mod._schema_ready.clear()
    again = StateStore(fresh_url)
    got = await again.checkpoints.get("wf")
    assert got is not None and got.last_seen_message_id == 5
    await again.ensure_schema()  # idempotent
    assert await _version(fresh_url) == [("prefect-coder-state", SCHEMA_VERSION)]
    await again.aclose()


async def test_newer_schema_is_refused(fresh_url: str) -> None:
    from prefect_coder.blocks.state import store as store_mod

    store = StateStore(fresh_url)
    await store.ensure_schema()
    await store.aclose()
    engine = create_async_engine(fresh_url)
    async with engine.begin() as conn:
        await conn.execute(sa.text("UPDATE coder_state_schema_version SET version = version + 1"))
    await engine.dispose()
    store_mod._schema_ready.clear()
    with pytest.raises(SchemaVersionError, match="upgrade prefect-coder"):
        await StateStore(fresh_url).checkpoints.get("wf")


async def test_concurrent_first_use_creates_schema_once(fresh_url: str) -> None:
    import asyncio

    from prefect_coder.blocks.state import store as store_mod

    store_mod._schema_ready.clear()
    stores = [StateStore(fresh_url, tenant=f"t{i}") for i in range(6)]
    await asyncio.gather(*(s.checkpoints.set("wf", f"c{i}") for i, s in enumerate(stores)))
    assert await _version(fresh_url) == [("prefect-coder-state", SCHEMA_VERSION)]
    for s in stores:
        await s.aclose()


#: The journal table and the version row as schema version 1 wrote them (no deadline).
_V1 = (
    "CREATE TABLE coder_state_schema_version (component TEXT PRIMARY KEY, "
    "version INTEGER NOT NULL, updated_at DOUBLE PRECISION NOT NULL)",
    "CREATE TABLE coder_state_journal (tenant TEXT NOT NULL, chat_id TEXT NOT NULL, "
    "state TEXT NOT NULL, marker TEXT NOT NULL, attempt INTEGER NOT NULL, "
    "at DOUBLE PRECISION NOT NULL, updated_at DOUBLE PRECISION NOT NULL, "
    "PRIMARY KEY (tenant, chat_id))",
    "INSERT INTO coder_state_schema_version VALUES ('prefect-coder-state', 1, 1.0)",
    "INSERT INTO coder_state_journal VALUES ('t', 'old', 'submitting', '[wf/s1]', 0, 50.0, 51.0)",
)


async def test_a_version_1_database_gains_the_journal_deadline_and_keeps_its_rows(
    fresh_url: str, backend: str
) -> None:
    from prefect_coder.blocks.state import JournalEntry
    from prefect_coder.blocks.state import store as store_mod

    if backend == "sqlite":
        Path(fresh_url.split("///", 1)[1]).parent.mkdir(parents=True)
    engine = create_async_engine(fresh_url)
    async with engine.begin() as conn:
        for statement in _V1:
            await conn.execute(sa.text(statement))
    await engine.dispose()
    store_mod._schema_ready.clear()
    store = StateStore(fresh_url, tenant="t")
    try:
        old = await store.journal.get("old")  # first use: migrates
        assert old is not None and (old.state, old.at, old.deadline) == (
            "submitting",
            pytest.approx(50.0, abs=1.0),
            None,
        )
        assert await _version(fresh_url) == [("prefect-coder-state", SCHEMA_VERSION)]
        await store.journal.set(
            "new",
            JournalEntry(state="submitting", marker="[wf/s2]", attempt=0, at=60.0, deadline=90.0),
        )
        new = await store.journal.get("new")
        assert new is not None and new.deadline == pytest.approx(90.0, abs=1.0)
        await store.checkpoints.set("wf", "old")
        start = await store.turns.begin("wf", "[wf/s2]", at=70.0, turn_timeout_s=5.0)
        assert start.replaced is not None and start.replaced.deadline is None  # the old row
        assert start.journal is not None and start.journal.deadline == pytest.approx(75.0, abs=1.0)
    finally:
        await store.aclose()
    # Opened again (another process): already version 2, nothing to migrate.
    store_mod._schema_ready.clear()
    again = StateStore(fresh_url, tenant="t")
    try:
        got = await again.journal.get("old")
        assert got is not None and got.deadline == pytest.approx(75.0, abs=1.0)
    finally:
        await again.aclose()
