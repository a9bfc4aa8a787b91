"""The sweeps on a PostgreSQL state store (a private throwaway cluster): the same
decisions, leases and forgetting as on SQLite."""

from __future__ import annotations

import pytest
from sweep_helpers import new_chat, ours, wait_status

from coder_chat.rest import ChatClient
from prefect_coder.blocks import ChatStateStore, StateStore
from prefect_coder.blocks.state import workflow_key
from prefect_coder.flows.common.params import WorkflowSettings
from prefect_coder.flows.deployments.sweep_orphans import sweep_orphans
from prefect_coder.flows.deployments.sweep_stuck_turns import sweep_stuck_turns
from prefect_coder.flows.sweeps.options import SweepOptions


@pytest.fixture
async def pg_settings(
    settings: WorkflowSettings, postgres_url: str, tenant: str
) -> WorkflowSettings:
    name = f"sweeps-pg-{tenant}"
    await ChatStateStore(url=postgres_url, tenant=tenant).save(name, overwrite=True)
    return settings.model_copy(update={"store_block": name})


async def test_both_sweeps_on_a_postgresql_store(
    client: ChatClient,
    pg_settings: WorkflowSettings,
    postgres_url: str,
    tenant: str,
    workflow_id: str,
    options: SweepOptions,
) -> None:
    store = StateStore(postgres_url, tenant=tenant)
    try:
        kept = await new_chat(client, labels=ours(tenant, workflow_id), script={"text": "a"})
        orphan = await new_chat(client, labels=ours(tenant, workflow_id), script={"text": "b"})
        stranded = await new_chat(client, labels=None, script={"text": "c"})
        busy = await new_chat(
            client, labels=ours(tenant, f"{workflow_id}-live"), script={"sleep": 30}
        )
        for cid in (kept, orphan, stranded):
            await wait_status(client, cid, "waiting")
        await store.checkpoints.set(workflow_id, kept)
        await store.stranded.record(f"{workflow_id}-x", stranded, "discarded")

        async with store.lease(workflow_key(f"{workflow_id}-live"), ttl=10, wait=1):
            report = await sweep_orphans(pg_settings, grace_s=0, options=options)
        decisions = {r.chat_id: r.decision for r in report.rows}
        assert decisions == {orphan: "retire", stranded: "retire", busy: "busy"}
        assert report.failed == 0
        for cid, archived in ((kept, False), (orphan, True), (stranded, True), (busy, False)):
            assert (await client.get_chat(cid)).archived is archived
        assert await store.stranded.list() == []

        stuck = await sweep_stuck_turns(pg_settings, turn_budget_s=0.05, options=options)
        assert [(r.chat_id, r.decision) for r in stuck.rows] == [(busy, "interrupt")]
        await wait_status(client, busy, "waiting")
    finally:
        await store.aclose()
