"""A sweep acts only on chats of its own store (issue 31 §1): a chat's labels carry the
identity of the store that checkpoints it, and a sweep whose store is another one —
the same tenant on another database, e.g. a worker's local SQLite file beside the
shared PostgreSQL store — reports the chat and leaves it alone instead of retiring a
live workflow's chat as an orphan."""

from __future__ import annotations

import uuid
from pathlib import Path

from flow_helpers import say

from coder_chat.emulator import Emulator
from coder_chat.rest import ChatClient
from prefect_coder.blocks import ChatStateStore, StateStore
from prefect_coder.flows.common.labels import LABEL_STORE
from prefect_coder.flows.common.params import Step, WorkflowSettings
from prefect_coder.flows.deployments.agent_workflow import agent_workflow
from prefect_coder.flows.deployments.sweep_orphans import sweep_orphans
from prefect_coder.flows.sweeps.options import SweepOptions


async def test_a_sweep_of_another_store_leaves_the_workflows_chat_alone(
    emu: Emulator,
    client: ChatClient,
    settings: WorkflowSettings,
    store: StateStore,
    options: SweepOptions,
    tenant: str,
    workflow_id: str,
    tmp_path: Path,
) -> None:
    kept = settings.model_copy(update={"keep_chat": True})
    (result,) = await agent_workflow(
        workflow_id, [Step(name="s", prompt="hi" + say("hello"))], kept
    )
    chat = await client.get_chat(result.chat_id)
    assert (chat.labels or {}).get(LABEL_STORE) == await store.identity()

    # Another database, the same tenant: it has no checkpoint for the chat.
    other = f"other-store-{uuid.uuid4().hex[:8]}"
    await ChatStateStore(url=f"sqlite+aiosqlite:///{tmp_path / 'other.db'}", tenant=tenant).save(
        other
    )
    elsewhere = settings.model_copy(update={"store_block": other})
    report = await sweep_orphans(elsewhere, grace_s=0, options=options)
    assert not (await client.get_chat(result.chat_id)).archived
    assert report.count("retire") == 0
    rows = [r for r in report.rows if r.chat_id == result.chat_id]
    assert all(r.decision == "ignore" and "another state store" in r.reason for r in rows), rows

    # Its own store's sweep accounts for it (checkpointed): kept, too.
    own = await sweep_orphans(settings, grace_s=0, options=options)
    assert own.count("retire") == 0
    assert not (await client.get_chat(result.chat_id)).archived
