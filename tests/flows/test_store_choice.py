"""One store for every deployment, chosen once: the credentials block names it
(``CoderCredentials.store_block``), every run that loads those credentials — the
workflows, ``recover-turn``, the sweeps, the reconciler — uses it, and a run whose
settings name another store fails at the edge before any chat exists (issue 31 §1).
A run on a local SQLite store of a pool with several workers online says so loudly."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import pytest
from flow_helpers import TOKEN, say

from coder_chat.emulator import Emulator
from prefect_coder.blocks import ChatStateStore, CoderCredentials
from prefect_coder.flows.common.errors import WorkflowParameterError
from prefect_coder.flows.common.params import Step, WorkflowSettings
from prefect_coder.flows.common.resources import load_store, warn_if_local_store_is_shared
from prefect_coder.flows.deployments.agent_workflow import agent_workflow


@pytest.fixture
async def chosen(emu: Emulator, tmp_path: Path, prefect_env: object) -> tuple[str, str]:
    """A credentials block that names its store, and that store's block name."""
    store_name = f"chosen-store-{uuid.uuid4().hex[:8]}"
    await ChatStateStore(url=f"sqlite+aiosqlite:///{tmp_path / 'chosen.db'}").save(store_name)
    creds_name = f"chosen-coder-{uuid.uuid4().hex[:8]}"
    await CoderCredentials(
        base_url=emu.base_url,
        organization_id=emu.organization_id,
        token=TOKEN,
        request_timeout=15.0,
        turn_timeout=30.0,
        store_block=store_name,
    ).save(creds_name)
    return creds_name, store_name


async def test_a_run_keeps_its_state_in_the_store_its_credentials_name(
    chosen: tuple[str, str], settings: WorkflowSettings, workflow_id: str
) -> None:
    creds, store_name = chosen
    run_settings = settings.model_copy(
        update={"credentials_block": creds, "store_block": None, "keep_chat": True}
    )
    (result,) = await agent_workflow(
        workflow_id, [Step(name="s", prompt="hi" + say("hello"))], run_settings
    )
    assert result.text == "hello"
    store = (await ChatStateStore.aload(store_name)).get_store()
    try:
        # The workflow's checkpoint is in the credentials' store (kept: keep_chat).
        checkpoint = await store.checkpoints.get(workflow_id)
        assert checkpoint is not None and checkpoint.chat_id == result.chat_id
    finally:
        await store.aclose()
    # And a sweep's settings resolve to the same store without naming it.
    loaded = await load_store(WorkflowSettings(credentials_block=creds))
    try:
        assert loaded.url == store.url
    finally:
        await loaded.aclose()


async def test_settings_naming_another_store_fail_before_any_chat(
    chosen: tuple[str, str],
    emu: Emulator,
    settings: WorkflowSettings,
    sqlite_block: str,
    workflow_id: str,
) -> None:
    creds, store_name = chosen
    chats = len(emu.chats())
    other = settings.model_copy(update={"credentials_block": creds, "store_block": sqlite_block})
    with pytest.raises(WorkflowParameterError) as info:
        await agent_workflow(workflow_id, [Step(name="s", prompt="hi" + say("x"))], other)
    assert info.value.field == "settings.store_block"
    assert store_name in str(info.value) and "Fix: " in str(info.value)
    assert len(emu.chats()) == chats
    # Repeating the credentials' own store is fine.
    same = await load_store(
        settings.model_copy(update={"credentials_block": creds, "store_block": store_name})
    )
    await same.aclose()


async def test_a_sweep_naming_another_store_than_its_credentials_does_nothing(
    chosen: tuple[str, str], emu: Emulator, sqlite_block: str
) -> None:
    # The case of issue 31: a sweep reading another store than the workflows would
    # take their live chats for orphans. It fails at its edge, before listing a chat.
    from prefect_coder.flows.deployments.sweep_orphans import sweep_orphans
    from prefect_coder.flows.deployments.sweep_settings import SweepSettings

    creds, store_name = chosen
    archived = [c for c in emu.chats() if c.get("archived")]
    with pytest.raises(WorkflowParameterError) as info:
        await sweep_orphans(
            settings=SweepSettings(credentials_block=creds, store_block=sqlite_block),
            grace_s=0,
        )
    assert info.value.field == "settings.store_block" and store_name in str(info.value)
    assert [c for c in emu.chats() if c.get("archived")] == archived


async def test_a_local_store_on_a_pool_of_several_workers_is_reported(
    prefect_env: object, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    pool = f"store-check-{uuid.uuid4().hex[:8]}"
    async with get_client() as client:
        await client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
        store = ChatStateStore(url=f"sqlite+aiosqlite:///{tmp_path / 's.db'}").get_store()
        try:
            await client.send_worker_heartbeat(pool, "machine-a", heartbeat_interval_seconds=30)
            with caplog.at_level(logging.WARNING):
                assert await warn_if_local_store_is_shared(store, pool) == 1
            assert "LOCAL STATE STORE" not in caplog.text  # one worker: nothing to say

            other = f"{pool}-b"
            await client.create_work_pool(WorkPoolCreate(name=other, type="process"))
            for worker in ("machine-a", "machine-b"):
                await client.send_worker_heartbeat(other, worker, heartbeat_interval_seconds=30)
            with caplog.at_level(logging.WARNING):
                assert await warn_if_local_store_is_shared(store, other) == 2
            assert "LOCAL STATE STORE ON A SHARED POOL" in caplog.text
            assert "CoderCredentials.store_block" in caplog.text
        finally:
            await store.aclose()
