"""A run says loudly at its start when another state store serves its tenant (issue 31
§1): the Coder server lists live chats of the tenant labelled with another store's
identity — e.g. one worker on its local SQLite default while the others share
PostgreSQL. Two real stores (two SQLite databases, one tenant) and the emulator."""

from __future__ import annotations

import asyncio
import logging
import uuid
from pathlib import Path

import pytest
from flow_helpers import say
from prefect import get_client
from prefect.client.schemas.sorting import LogSort

from coder_chat.emulator import Emulator
from coder_chat.models import ChatInputPart, CreateChatRequest
from prefect_coder.blocks import ChatStateStore, CoderCredentials, StateStore
from prefect_coder.flows.common.labels import chat_labels
from prefect_coder.flows.common.params import Step, WorkflowSettings
from prefect_coder.flows.common.resources import warn_if_another_store_in_use

WARNING = "ANOTHER STATE STORE SERVES THIS TENANT"


async def _store(tmp_path: Path, name: str, tenant: str) -> tuple[str, StateStore]:
    """A saved ChatStateStore block of its own database, and its store."""
    block = ChatStateStore(url=f"sqlite+aiosqlite:///{tmp_path / name}.db", tenant=tenant)
    saved = f"other-store-{name}-{uuid.uuid4().hex[:8]}"
    await block.save(saved, overwrite=True)
    return saved, block.get_store()


async def _live_chat(creds: CoderCredentials, emu: Emulator, labels: dict[str, str]) -> str:
    async with creds.get_client() as client:
        chat = await client.create_chat(
            CreateChatRequest(
                organization_id=str(emu.organization_id),
                content=[ChatInputPart.text_part("hi" + say("hello"))],
                labels=labels,
            )
        )
    return chat.id


async def test_a_run_warns_once_when_another_store_serves_its_tenant(
    emu: Emulator, coder_block: str, settings: WorkflowSettings, workflow_id: str, tmp_path: Path
) -> None:
    from prefect_coder.flows.deployments.agent_workflow import agent_workflow

    tenant = f"two-stores-{uuid.uuid4().hex[:8]}"
    mine_block, mine = await _store(tmp_path, "mine", tenant)
    _, theirs = await _store(tmp_path, "theirs", tenant)
    theirs_id, mine_id = await theirs.identity(), await mine.identity()
    assert theirs_id != mine_id
    creds = await CoderCredentials.aload(coder_block)
    # A live workflow chat of the other store, labelled as its turn labels it.
    await _live_chat(creds, emu, chat_labels(tenant, "wf-of-theirs", None, theirs_id))

    run_settings = settings.model_copy(update={"store_block": mine_block})
    (result,) = await agent_workflow(
        workflow_id, [Step(name="s", prompt="hi" + say("done"))], run_settings
    )
    assert result.text == "done"
    async with get_client() as client:
        # The harness ships WARNING and up to the server, in batches.
        for _ in range(40):
            logs = await client.read_logs(limit=200, sort=LogSort.TIMESTAMP_DESC)
            lines = [
                log.message for log in logs if WARNING in log.message and tenant in log.message
            ]
            if lines:
                break
            await asyncio.sleep(0.25)
    assert len(lines) == 1, lines
    assert theirs_id in lines[0] and mine_id in lines[0]
    assert "CoderCredentials.store_block" in lines[0] and "docs/deploy.md" in lines[0]
    # Once per process: the next run with this store does not list again.
    assert await warn_if_another_store_in_use(creds, mine) is None
    await mine.aclose()
    await theirs.aclose()


async def test_own_and_unlabelled_chats_are_no_warning(
    emu: Emulator, coder_block: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tenant = f"one-store-{uuid.uuid4().hex[:8]}"
    _, mine = await _store(tmp_path, "mine", tenant)
    creds = await CoderCredentials.aload(coder_block)
    await _live_chat(creds, emu, chat_labels(tenant, "wf-a", None, await mine.identity()))
    await _live_chat(creds, emu, chat_labels(tenant, "wf-b"))  # before stores had labels
    # Another tenant's store is another collection's business (the sweeps' scope too).
    _, elsewhere = await _store(tmp_path, "elsewhere", f"{tenant}-x")
    await _live_chat(
        creds, emu, chat_labels(f"{tenant}-x", "wf-c", None, await elsewhere.identity())
    )
    with caplog.at_level(logging.WARNING):
        assert await warn_if_another_store_in_use(creds, mine) == []
    assert WARNING not in caplog.text
    await mine.aclose()
    await elsewhere.aclose()


async def test_a_failed_listing_never_fails_the_run(
    emu: Emulator, coder_block: str, tmp_path: Path
) -> None:
    _, mine = await _store(tmp_path, "mine", f"no-list-{uuid.uuid4().hex[:8]}")
    creds = await CoderCredentials.aload(coder_block)
    emu.faults.fail_rest(1, status=503, method="GET", path="/chats")
    try:
        assert await warn_if_another_store_in_use(creds, mine) is None
    finally:
        emu.faults.clear()
    await mine.aclose()
