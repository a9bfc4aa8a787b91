"""``store.workflows``: the reconciler's durable record of every workflow run (issue 29),
on SQLite and PostgreSQL: idempotent starts, a stale run never ends a newer run's
record, compare-and-set attempts and give-up (one winner of two), the snapshot's lease
rows and store clock, a version-3 database upgraded in place, and no secret stored."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from pydantic import SecretStr
from sqlalchemy.ext.asyncio import create_async_engine
from support.pg_databases import fresh_database

from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state import SCHEMA_VERSION
from prefect_coder.blocks.state.leases import workflow_key

TOKEN = "tok-workflows-SECRET-do-not-store"
PARAMS = {
    "workflow_id": "wf-1",
    "steps": [{"name": "s1", "prompt": "hi"}],
    "settings": {"credentials_block": "coder", "store_block": "pg", "lease_ttl_s": 2},
}


async def test_started_is_idempotent_and_keeps_attempts_while_running(store: StateStore) -> None:
    wf = store.workflows
    first = await wf.started(
        "workflow:wf-1",
        deployment="agent-workflow/agent-workflow",
        parameters=PARAMS,
        flow_run_id="run-1",
        workflow_id="wf-1",
        lease_keys=[workflow_key("wf-1")],
    )
    assert (first.state, first.attempts, first.parameters) == ("running", 0, PARAMS)
    assert first.lease_keys == ("workflow:wf-1",)
    assert await wf.claim_attempt(
        "workflow:wf-1", expected_attempts=0, flow_run_id="run-2", reason="lost host"
    )
    # The rerun takes the lease and records itself: attempts are kept.
    again = await wf.started(
        "workflow:wf-1",
        deployment="agent-workflow/agent-workflow",
        parameters=PARAMS,
        flow_run_id="run-2",
        workflow_id="wf-1",
        lease_keys=[workflow_key("wf-1")],
    )
    assert (again.attempts, again.flow_run_id, again.created_at) == (1, "run-2", first.created_at)
    # A stale run never ends the newer run's record; the current one does.
    assert not await wf.finished("workflow:wf-1", flow_run_id="run-1")
    assert await wf.finished("workflow:wf-1", flow_run_id="run-2")
    assert not await wf.finished("workflow:wf-1", flow_run_id="run-2")  # once
    done = await wf.get("workflow:wf-1")
    assert done is not None and done.state == "done"
    # A later run of the same workflow starts afresh.
    fresh = await wf.started(
        "workflow:wf-1",
        deployment="agent-workflow/agent-workflow",
        parameters=PARAMS,
        flow_run_id="run-3",
    )
    assert (fresh.state, fresh.attempts, fresh.reason) == ("running", 0, None)


async def test_one_of_two_concurrent_claims_and_give_ups_wins(store: StateStore) -> None:
    wf = store.workflows
    await wf.started("shard:abc", deployment="d/d", parameters={"x": 1}, flow_run_id="r0")
    wins = await asyncio.gather(
        *(
            wf.claim_attempt("shard:abc", expected_attempts=0, flow_run_id=f"r{i}", reason="x")
            for i in (1, 2)
        )
    )
    assert sorted(wins) == [False, True]
    got = await wf.get("shard:abc")
    assert got is not None and got.attempts == 1 and got.acted_at is not None
    gave = await asyncio.gather(
        *(wf.give_up("shard:abc", expected_attempts=1, reason="exhausted") for _ in range(2))
    )
    assert sorted(gave) == [False, True]
    assert not await wf.claim_attempt("shard:abc", expected_attempts=1, flow_run_id="r", reason="")
    assert [r.key for r in await wf.list("gave-up")] == ["shard:abc"]
    assert (await wf.snapshot()).records == []


async def test_snapshot_has_lease_rows_chat_and_store_clock(store: StateStore) -> None:
    wf = store.workflows
    await store.checkpoints.set("wf-2", "chat-2")
    await wf.started(
        "workflow:wf-2",
        deployment="agent-workflow/agent-workflow",
        parameters={"workflow_id": "wf-2"},
        flow_run_id="run-a",
        workflow_id="wf-2",
        lease_keys=[workflow_key("wf-2")],
    )
    async with store.lease(workflow_key("wf-2"), holder="h@run=x", ttl=30):
        snap = await wf.snapshot()
    [record] = snap.records
    assert record.chat_id == "chat-2"
    got = await wf.get("workflow:wf-2")
    assert got is not None and got.chat_id == "chat-2"
    assert [r.chat_id for r in await wf.list("running")] == ["chat-2"]
    lease = snap.leases["workflow:wf-2"]
    assert lease.holder == "h@run=x"
    assert lease.acquired_at <= snap.now < lease.expires_at <= snap.now + 30.5
    assert abs(record.updated_at - snap.now) < 60


async def test_parameters_must_be_plain_json_so_no_secret_is_stored(
    store: StateStore, store_url: str, backend: str
) -> None:
    with pytest.raises(ValueError, match="plain JSON") as info:
        await store.workflows.started(
            "workflow:x",
            deployment="d/d",
            parameters={"token": SecretStr(TOKEN)},
            flow_run_id=None,
        )
    assert TOKEN not in str(info.value)
    await store.workflows.started(
        "workflow:y", deployment="d/d", parameters=PARAMS, flow_run_id="r"
    )
    # Secret scan: no column of the table holds the token, whatever was written.
    engine = create_async_engine(store_url)
    try:
        async with engine.connect() as conn:
            rows = (await conn.execute(sa.text("SELECT * FROM coder_state_workflows"))).all()
    finally:
        await engine.dispose()
    assert rows and not [r for r in rows if TOKEN in repr(tuple(r))]


@pytest.fixture
async def fresh_url(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[str]:
    if backend == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path}/v3/state.db"
        return
    async with fresh_database(request.getfixturevalue("postgres_url"), "wfv3") as url:
        yield url


async def test_a_version_3_database_gains_the_workflows_table(fresh_url: str, backend: str) -> None:
    from prefect_coder.blocks.state import store as store_mod

    if backend == "sqlite":
        Path(fresh_url.split("///", 1)[1]).parent.mkdir(parents=True)
    engine = create_async_engine(fresh_url)
    async with engine.begin() as conn:
        await conn.execute(
            sa.text(
                "CREATE TABLE coder_state_schema_version (component TEXT PRIMARY KEY, "
                "version INTEGER NOT NULL, updated_at DOUBLE PRECISION NOT NULL)"
            )
        )
        await conn.execute(
            sa.text("INSERT INTO coder_state_schema_version VALUES ('prefect-coder-state', 3, 1.0)")
        )
    await engine.dispose()
    store_mod._schema_ready.clear()
    store = StateStore(fresh_url, tenant="t")
    try:
        await store.workflows.started("k", deployment="d/d", parameters={}, flow_run_id=None)
        assert [r.key for r in await store.workflows.list()] == ["k"]
    finally:
        await store.aclose()
    engine = create_async_engine(fresh_url)
    try:
        async with engine.connect() as conn:
            version = (
                await conn.execute(sa.text("SELECT version FROM coder_state_schema_version"))
            ).scalar_one()
    finally:
        await engine.dispose()
    assert version == SCHEMA_VERSION == 4
