"""The ``finally`` checkpoint on every exit of a turn, and resuming from it in a
new process."""

from __future__ import annotations

import asyncio

import pytest
from flow_helpers import emu_directive, run_child, say, user_messages

from coder_chat.emulator import Emulator
from coder_chat.errors import CoderChatError, CoderStreamError
from prefect_coder.blocks import StateStore
from prefect_coder.flows.common.params import Step, WorkflowSettings, step_marker
from prefect_coder.flows.common.resources import load_resources
from prefect_coder.flows.common.results import TurnResult
from prefect_coder.flows.deployments.agent_turn import agent_turn
from prefect_coder.flows.deployments.agent_workflow import agent_workflow
from prefect_coder.flows.turn.durable_turn import execute_turn


def _chat_of(emu: Emulator, marker: str) -> str:
    chats = [c["id"] for c in emu.chats() if any(marker in m for m in user_messages(emu, c["id"]))]
    assert len(chats) == 1, chats
    return chats[0]


SLOW = emu_directive({"text": "slowly " * 40, "deltas": 40, "delay": 0.1})  # ~4 s


@pytest.mark.parametrize(
    ("bound", "error"),
    [("request_timeout_s", CoderChatError), ("turn_timeout_s", TimeoutError)],
)
async def test_timeout_of_a_first_turn_checkpoints_the_created_chat(
    emu: Emulator,
    settings: WorkflowSettings,
    workflow_id: str,
    store: StateStore,
    bound: str,
    error: type[BaseException],
) -> None:
    s = settings.model_copy(update={bound: 0.6, "keep_chat": True})
    with pytest.raises(error):
        await agent_workflow(workflow_id, [Step(name="slow", prompt="go" + SLOW)], s)
    marker = step_marker(workflow_id, "slow")
    chat_id = _chat_of(emu, marker)
    cp = await store.checkpoints.get(workflow_id)
    assert cp is not None and cp.chat_id == chat_id
    # the first send had no chat to journal under: journaled after the fact, so
    # a retry knows it is a resubmission
    entry = await store.journal.get(chat_id)
    assert entry is not None and (entry.marker, entry.attempt) == (marker, 1)


async def test_stream_loss_on_a_created_chat_checkpoints_it_for_the_retry(
    emu: Emulator, settings: WorkflowSettings, workflow_id: str, store: StateStore
) -> None:
    emu.faults.refuse_upgrades(503)
    try:
        with pytest.raises(CoderStreamError) as info:
            await agent_workflow(
                workflow_id,
                [Step(name="lost", prompt="x" + say("never seen"))],
                settings.model_copy(update={"keep_chat": True}),
            )
    finally:
        emu.faults.clear()
    chat_id = _chat_of(emu, step_marker(workflow_id, "lost"))
    assert info.value.chat_id == chat_id
    # The SDK discarded the session, but the turn may have run there (a tool's effect
    # under that chat's keys): checkpointed with the step's write-ahead, so the retry
    # recovers the step on it; nothing is left stranded (chaos seed 540).
    cp = await store.checkpoints.get(workflow_id)
    assert cp is not None and cp.chat_id == chat_id
    entry = await store.journal.get(chat_id)
    assert entry is not None and entry.marker == step_marker(workflow_id, "lost")
    assert await store.stranded.list(workflow_id) == []


async def test_stream_loss_on_a_resumed_chat_keeps_the_checkpoint(
    emu: Emulator, settings: WorkflowSettings, workflow_id: str, store: StateStore
) -> None:
    first = await agent_turn(workflow_id, Step(name="one", prompt="1" + say("a")), settings)
    emu.faults.refuse_upgrades(503)
    try:
        with pytest.raises(CoderStreamError) as info:
            await agent_turn(workflow_id, Step(name="two", prompt="2" + say("b")), settings)
    finally:
        emu.faults.clear()
    assert not info.value.is_retryable  # resumed chats never auto-retry
    cp = await store.checkpoints.get(workflow_id)
    assert cp is not None and cp.chat_id == first.chat_id
    assert await store.stranded.list(workflow_id) == []


async def test_caller_cancellation_checkpoints_the_created_chat(
    emu: Emulator, settings: WorkflowSettings, workflow_id: str, store: StateStore
) -> None:
    resources = await load_resources(settings)
    step = Step(name="long", prompt="go" + SLOW)
    marker = step_marker(workflow_id, "long")
    turn = asyncio.create_task(execute_turn(workflow_id, step, settings, resources))
    chat_id = None
    for _ in range(500):
        chats = [c for c in emu.chats() if any(marker in m for m in user_messages(emu, c["id"]))]
        if chats and chats[0]["status"] == "running":
            chat_id = chats[0]["id"]
            break
        await asyncio.sleep(0.01)
    assert chat_id is not None
    await asyncio.sleep(0.2)
    turn.cancel()
    with pytest.raises(asyncio.CancelledError):
        await turn
    cp = await store.checkpoints.get(workflow_id)
    assert cp is not None and cp.chat_id == chat_id


async def test_next_step_resumes_in_a_new_process_from_the_checkpoint_only(
    emu: Emulator,
    settings: WorkflowSettings,
    workflow_id: str,
    prefect_env: object,
    warm_python: object,
) -> None:
    first = await agent_turn(
        workflow_id, Step(name="one", prompt="first" + say("first answer")), settings
    )
    second_prompt = "second" + say("second answer")
    code = f"""
import asyncio
from prefect_coder.flows.common.params import Step, WorkflowSettings
from prefect_coder.flows.deployments.agent_turn import agent_turn
settings = WorkflowSettings.model_validate_json({settings.model_dump_json()!r})
step = Step(name="two", prompt={second_prompt!r})
result = asyncio.run(agent_turn({workflow_id!r}, step, settings))
print("RESULT " + result.model_dump_json())
"""
    proc = await asyncio.to_thread(run_child, warm_python, prefect_env, code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    second = TurnResult.model_validate_json(line.removeprefix("RESULT "))

    assert second.chat_id == first.chat_id
    # the resumed turn streamed only its own events
    assert second.text == "second answer"
    sent = [m.split(" ", 1)[0] for m in user_messages(emu, first.chat_id)]
    assert sent == [step_marker(workflow_id, "one"), step_marker(workflow_id, "two")]
