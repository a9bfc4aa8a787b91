"""A first turn's orphan is adopted, not sent again (``flows/recovery/orphans.py``).

A crash after the first turn's chat was created (with the step's prompt) but
before its id was checkpointed leaves a chat no checkpoint names. The next
attempt adopts it — checkpointed with the send's write-ahead — and recovers it
as any checkpointed chat: a live run is followed to its end, never interrupted
and never sent again. Every other chat of the workflow is stopped and recorded
stranded. The facts come from the emulator's rows and event log.
"""

from __future__ import annotations

import pytest
from flow_helpers import emu_directive, say, user_messages

from coder_chat.emulator import Emulator
from coder_chat.models import (
    ChatInputPart,
    CreateChatMessageRequest,
    CreateChatRequest,
    DynamicToolDefinition,
)
from coder_chat.rest import ChatClient
from prefect_coder.blocks import CoderCredentials, StateStore
from prefect_coder.blocks.state.leases import workflow_key
from prefect_coder.flows.common.labels import LABEL_WORKFLOW, chat_labels
from prefect_coder.flows.common.params import Step, WorkflowSettings, step_marker
from prefect_coder.flows.demo_tools import Note
from prefect_coder.flows.deployments.agent_workflow import agent_workflow
from prefect_coder.flows.deployments.recover_turn import recover_turn
from prefect_coder.flows.recovery.orphans import adopt_or_strand_orphans


async def _create(
    client: ChatClient,
    emu: Emulator,
    store: StateStore,
    wid: str,
    *texts: str,
    tools: list[DynamicToolDefinition] | None = None,
) -> str:
    """A chat of the workflow as a crashed attempt left it: created with the first
    text (declaring ``tools``), then the others sent in turn (each after the
    previous turn settled)."""
    chat = await client.create_chat(
        CreateChatRequest(
            organization_id=str(emu.organization_id),
            content=[ChatInputPart.text_part(texts[0])],
            labels=chat_labels(store.tenant, wid),
            unsafe_dynamic_tools=tools,
        )
    )
    for text in texts[1:]:
        await emu.await_status(chat.id, "waiting", within=30)
        await client.create_message(
            chat.id, CreateChatMessageRequest(content=[ChatInputPart.text_part(text)])
        )
    return chat.id


def _interrupted(emu: Emulator, chat_id: str) -> bool:
    return any(
        r["chat_id"] == chat_id and r["details"]["path"].endswith("/interrupt")
        for r in emu.event_log(["request"])
    )


async def test_the_newest_chat_holding_only_the_step_is_adopted(
    emu: Emulator, coder_block: str, store: StateStore, workflow_id: str
) -> None:
    creds = await CoderCredentials.aload(coder_block)
    marker = step_marker(workflow_id, "plan")
    other = step_marker(workflow_id, "pay")
    async with creds.get_client() as client:
        older = await _create(client, emu, store, workflow_id, f"{marker} go{say('a')}")
        two_steps = await _create(
            client, emu, store, workflow_id, f"{marker} go{say('a')}", f"{other} on{say('b')}"
        )
        foreign = await _create(client, emu, store, workflow_id, f"{other} on{say('b')}")
        discarded = await _create(client, emu, store, workflow_id, f"{marker} go{say('a')}")
        await store.stranded.record(workflow_id, discarded, "discarded")
        newest = await _create(client, emu, store, workflow_id, f"{marker} go{say('a')}")

        found = await adopt_or_strand_orphans(client, store, workflow_id, marker, turn_timeout=60.0)

    assert found.adopted == newest
    assert sorted(found.stranded) == sorted([older, two_steps, foreign, discarded])
    cp = await store.checkpoints.get(workflow_id)
    assert cp is not None and cp.chat_id == newest and cp.last_seen_message_id is None
    # the write-ahead the crashed attempt's eager checkpoint would have written
    entry = await store.journal.get(newest)
    assert entry is not None
    assert (entry.state, entry.marker, entry.attempt) == ("submitting", marker, 0)
    assert entry.deadline is not None and entry.deadline == pytest.approx(entry.at + 60.0)
    assert not _interrupted(emu, newest)
    stranded = {s.chat_id for s in await store.stranded.list(workflow_id)}
    assert stranded == {older, two_steps, foreign, discarded}


async def test_no_orphan_adopts_nothing(
    coder_block: str, store: StateStore, workflow_id: str
) -> None:
    creds = await CoderCredentials.aload(coder_block)
    async with creds.get_client() as client:
        found = await adopt_or_strand_orphans(
            client, store, workflow_id, step_marker(workflow_id, "plan")
        )
    assert (found.adopted, found.stranded) == (None, [])
    assert await store.checkpoints.get(workflow_id) is None


async def test_a_live_orphan_is_followed_to_its_end_by_the_next_run(
    emu: Emulator,
    coder_block: str,
    settings: WorkflowSettings,
    store: StateStore,
    workflow_id: str,
) -> None:
    """The user's path: a run whose first turn's chat was created, then lost with its
    process; the next run of the workflow finishes that very turn."""
    step = Step(
        name="plan",
        prompt="go" + emu_directive({"text": "slowly " * 20, "deltas": 20, "delay": 0.05}),
    )
    marker = step_marker(workflow_id, "plan")
    creds = await CoderCredentials.aload(coder_block)
    async with creds.get_client() as client:
        # The crashed attempt: its chat, created with the step's prompt, still
        # generating; the attempt held the workflow's lease (an earlier hold).
        orphan = await _create(client, emu, store, workflow_id, f"{marker} {step.prompt}")
    await _earlier_hold(store, workflow_id)

    results = await agent_workflow(
        workflow_id, [step], settings.model_copy(update={"keep_chat": True})
    )

    assert [r.chat_id for r in results] == [orphan]
    assert results[0].text.strip() == ("slowly " * 20).strip()
    chats = [c["id"] for c in emu.chats() if c["labels"].get(LABEL_WORKFLOW) == workflow_id]
    assert chats == [orphan]  # no fresh chat
    assert user_messages(emu, orphan) == [f"{marker} {step.prompt}"]  # never sent again
    assert not _interrupted(emu, orphan)  # followed, not cut short
    turns = [e for e in emu.event_log(["turn_start", "turn_end"]) if e["chat_id"] == orphan]
    assert [e["kind"] for e in turns] == ["turn_start", "turn_end"]


async def test_recover_turn_without_steps_adopts_the_step_the_orphan_names(
    emu: Emulator,
    coder_block: str,
    settings: WorkflowSettings,
    store: StateStore,
    workflow_id: str,
) -> None:
    """``recover-turn`` run from the UI on a bare workflow id: the orphan's own
    marker names its step; the finished attempt is recovered read-only."""
    marker = step_marker(workflow_id, "draft")
    creds = await CoderCredentials.aload(coder_block)
    async with creds.get_client() as client:
        orphan = await _create(client, emu, store, workflow_id, f"{marker} write{say('drafted')}")
    await emu.await_status(orphan, "waiting", within=30)

    report = await recover_turn(workflow_id, resubmit=False, settings=settings)

    assert report.adopted_orphan and report.chat_id == orphan and report.orphans == []
    assert (report.action, report.step) == ("recovered", "draft"), report
    assert report.result is not None and report.result.text == "drafted"
    assert user_messages(emu, orphan) == [f"{marker} write{say('drafted')}"]
    cp = await store.checkpoints.get(workflow_id)
    assert cp is not None and cp.chat_id == orphan


async def _earlier_hold(store: StateStore, workflow_id: str) -> None:
    """The crashed attempt held the workflow's lease: the next run's is not the first
    hold ever, so its first turn looks for orphans (``may_have_orphans``)."""
    assert await store.leases.acquire(workflow_key(workflow_id), "crashed-run", 30.0)
    await store.leases.release(workflow_key(workflow_id), "crashed-run")


async def test_a_paused_orphan_gets_its_call_run_once_and_the_turn_goes_on(
    emu: Emulator,
    coder_block: str,
    settings: WorkflowSettings,
    store: StateStore,
    workflow_id: str,
) -> None:
    """The crashed attempt's chat paused on a client-tool call nobody ran (a tool
    awaits the eager checkpoint first, so none of ours ran): the next run runs it
    once, through the ledger, and the same model turn finishes."""
    script = [
        {"tool_calls": [{"name": "record_note", "args": {"title": "t", "body": "one two"}}]},
        {"text": "noted"},
    ]
    step = Step(name="note", prompt="Note it." + emu_directive(script), tools=["record_note"])
    marker = step_marker(workflow_id, "note")
    tool = DynamicToolDefinition(
        name="record_note", description="Record a note.", input_schema=Note.model_json_schema()
    )
    creds = await CoderCredentials.aload(coder_block)
    async with creds.get_client() as client:
        orphan = await _create(
            client, emu, store, workflow_id, f"{marker} {step.prompt}", tools=[tool]
        )
    await emu.await_status(orphan, "requires_action", within=30)
    await _earlier_hold(store, workflow_id)

    results = await agent_workflow(
        workflow_id, [step], settings.model_copy(update={"keep_chat": True})
    )

    assert [r.chat_id for r in results] == [orphan]
    assert results[0].text.strip() == "noted"
    assert user_messages(emu, orphan) == [f"{marker} {step.prompt}"]
    assert not _interrupted(emu, orphan)
    entries = await store.ledger.list(orphan)
    assert [(e.tool_name, e.state) for e in entries] == [("record_note", "done")]


async def test_an_errored_orphan_is_sent_again_on_its_own_chat(
    emu: Emulator,
    coder_block: str,
    settings: WorkflowSettings,
    store: StateStore,
    workflow_id: str,
) -> None:
    """The crashed attempt's turn failed on the server: nothing to follow or read, so
    the step is resubmitted — on the adopted chat, not in a fresh one."""
    step = Step(name="plan", prompt="Plan it.")
    marker = step_marker(workflow_id, "plan")
    creds = await CoderCredentials.aload(coder_block)
    emu.set_default_script({"fatal": {"message": "boom", "kind": "overloaded"}})
    try:
        async with creds.get_client() as client:
            orphan = await _create(client, emu, store, workflow_id, f"{marker} {step.prompt}")
        await emu.await_status(orphan, "error", within=30)
    finally:
        emu.set_default_script(None)
    await _earlier_hold(store, workflow_id)

    results = await agent_workflow(
        workflow_id, [step], settings.model_copy(update={"keep_chat": True})
    )

    assert [r.chat_id for r in results] == [orphan]
    assert results[0].text == f"Echo: {marker} {step.prompt}"
    assert user_messages(emu, orphan) == [f"{marker} {step.prompt}"] * 2
    assert results[0].attempt == 2
