"""The orphan check of a retried first turn leaves a chat of ANOTHER store alone
(issue 31 §1): the same tenant and workflow id on another database is that store's
own workflow, never an orphan of this one — not adopted, not stopped, not recorded.

A fresh run never lists orphans (its lease is the workflow's first hold), so the
run here is a real task retry: the first attempt's chat creation gets a 503 (a
retryable failure before any chat exists) and the retry runs the orphan check.
Its own stale chat (another step's prompt) is stranded — proof the check ran —
while the other store's chat, holding this very step's prompt (the adoptable kind),
is left alone and the turn runs on a fresh chat."""

from __future__ import annotations

import time
from pathlib import Path

from flow_helpers import say, user_messages

from coder_chat.emulator import Emulator
from coder_chat.models import ChatInputPart, CreateChatRequest
from coder_chat.stop import stop_chat
from prefect_coder.blocks import ChatStateStore, CoderCredentials, StateStore
from prefect_coder.flows.common.labels import chat_labels
from prefect_coder.flows.common.params import Step, WorkflowSettings, step_marker
from prefect_coder.flows.deployments.agent_workflow import agent_workflow


async def _chat(creds: CoderCredentials, emu: Emulator, text: str, labels: dict[str, str]) -> str:
    async with creds.get_client() as client:
        chat = await client.create_chat(
            CreateChatRequest(
                organization_id=str(emu.organization_id),
                content=[ChatInputPart.text_part(text)],
                labels=labels,
            )
        )
    await emu.await_status(chat.id, "waiting", within=30)
    return chat.id


async def _tidy(creds: CoderCredentials, *chat_ids: str) -> None:
    """Archive the test's chats: the session's emulator and tenant are shared, and a
    live chat of another store makes every later run of the tenant warn."""
    async with creds.get_client() as client:
        for chat_id in chat_ids:
            await stop_chat(client, chat_id, timeout=10, archive=True, poll_interval=0.05)


def _interrupted(emu: Emulator, chat_id: str) -> bool:
    return any(
        e["chat_id"] == chat_id and e["details"]["path"].endswith("/interrupt")
        for e in emu.event_log(["request"])
    )


async def test_a_retried_first_turn_leaves_another_stores_chat_alone(
    emu: Emulator,
    coder_block: str,
    settings: WorkflowSettings,
    store: StateStore,
    workflow_id: str,
    tmp_path: Path,
) -> None:
    creds = await CoderCredentials.aload(coder_block)
    theirs_store: StateStore = ChatStateStore(
        url=f"sqlite+aiosqlite:///{tmp_path / 'theirs.db'}", tenant=store.tenant
    ).get_store()
    theirs_id = await theirs_store.identity()
    assert theirs_id != await store.identity()
    step = Step(name="plan", prompt="Plan it." + say("mine"))
    marker = step_marker(workflow_id, "plan")
    # The other store's workflow of the same id: its chat holds this step's prompt.
    theirs = await _chat(
        creds,
        emu,
        f"{marker} Plan it.{say('theirs')}",
        chat_labels(store.tenant, workflow_id, None, theirs_id),
    )
    # A stale chat of this store's own workflow (another step's prompt): stranded.
    own_stale = await _chat(
        creds,
        emu,
        f"{step_marker(workflow_id, 'other')} old{say('old')}",
        chat_labels(store.tenant, workflow_id, None, await store.identity()),
    )

    # The first attempt's chat creation fails (503: retryable, no chat made).
    t0 = time.time()
    emu.faults.fail_rest(1, status=503, method="POST", path="/chats")
    try:
        (result,) = await agent_workflow(
            workflow_id,
            [step],
            settings.model_copy(update={"retries": 1, "retry_delay_s": 0, "keep_chat": True}),
        )
    finally:
        emu.faults.clear()

    faults = [e["details"] for e in emu.event_log(["fault"]) if e["time"] >= t0]
    assert any(d.get("method") == "POST" and d["path"].endswith("/chats") for d in faults)
    stranded = {s.chat_id for s in await store.stranded.list(workflow_id)}
    assert own_stale in stranded  # the retry's orphan check ran
    assert result.text == "mine" and result.attempt == 1
    assert result.chat_id not in (theirs, own_stale)  # a fresh chat, not theirs adopted
    assert theirs not in stranded
    assert not _interrupted(emu, theirs)
    assert user_messages(emu, theirs) == [f"{marker} Plan it.{say('theirs')}"]
    assert not emu.chat(theirs)["archived"]
    await _tidy(creds, theirs, own_stale, result.chat_id)
    await theirs_store.aclose()


async def test_recover_turn_strands_no_chat_of_another_store(
    emu: Emulator,
    coder_block: str,
    settings: WorkflowSettings,
    store: StateStore,
    workflow_id: str,
    tmp_path: Path,
) -> None:
    """A checkpointed workflow's recovery strands every chat its checkpoint does not
    name — of its own store only."""
    from prefect_coder.flows.deployments.recover_turn import recover_turn

    kept = settings.model_copy(update={"keep_chat": True})
    (done,) = await agent_workflow(workflow_id, [Step(name="s", prompt="hi" + say("ok"))], kept)
    creds = await CoderCredentials.aload(coder_block)
    theirs_store = ChatStateStore(
        url=f"sqlite+aiosqlite:///{tmp_path / 'theirs.db'}", tenant=store.tenant
    ).get_store()
    theirs = await _chat(
        creds,
        emu,
        f"{step_marker(workflow_id, 's')} hi{say('theirs')}",
        chat_labels(store.tenant, workflow_id, None, await theirs_store.identity()),
    )
    own_stale = await _chat(
        creds,
        emu,
        f"{step_marker(workflow_id, 's')} again{say('stale')}",
        chat_labels(store.tenant, workflow_id, None, await store.identity()),
    )

    report = await recover_turn(workflow_id, resubmit=False, settings=kept)

    assert report.chat_id == done.chat_id
    assert report.orphans == [own_stale]  # the check ran, on its own store's chats
    assert not _interrupted(emu, theirs) and not emu.chat(theirs)["archived"]
    assert theirs not in {s.chat_id for s in await store.stranded.list(workflow_id)}
    await _tidy(creds, theirs, own_stale, done.chat_id)
    await theirs_store.aclose()
