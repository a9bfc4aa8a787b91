"""Bad input fails at the edge — naming the field and the fix — before any chat exists."""

from __future__ import annotations

import pytest
from flow_helpers import say

from coder_chat.emulator import Emulator
from prefect_coder.blocks import CoderCredentials
from prefect_coder.flows.common.errors import WorkflowParameterError
from prefect_coder.flows.common.params import Step, WorkflowSettings
from prefect_coder.flows.deployments.agent_turn import agent_turn
from prefect_coder.flows.deployments.agent_workflow import agent_workflow

GOOD = Step(name="s", prompt="hello" + say("hi"))


@pytest.mark.parametrize(
    ("steps", "update", "field"),
    [
        ([Step(name="s", prompt="x", tools=["no_such_tool"])], {}, "steps[0].tools[0]"),
        ([Step(name="s", prompt="x", output_model="NoSuchModel")], {}, "steps[0].output_model"),
        ([], {}, "steps"),
        ([GOOD], {"credentials_block": "no-such-block"}, "settings.credentials_block"),
        ([GOOD], {"store_block": "no-such-store"}, "settings.store_block"),
        ([GOOD], {"tool_modules": ["no_such_module_abc"]}, "settings.tool_modules[0]"),
    ],
)
async def test_bad_parameters_fail_before_any_chat(
    emu: Emulator,
    settings: WorkflowSettings,
    workflow_id: str,
    steps: list[Step],
    update: dict[str, object],
    field: str,
) -> None:
    chats = len(emu.chats())
    with pytest.raises(WorkflowParameterError) as info:
        await agent_workflow(workflow_id, steps, settings.model_copy(update=update))
    assert info.value.field == field
    assert "Fix: " in str(info.value)
    assert len(emu.chats()) == chats


async def test_bad_workflow_id_fails_before_any_chat(
    emu: Emulator, settings: WorkflowSettings
) -> None:
    chats = len(emu.chats())
    with pytest.raises(WorkflowParameterError, match=r"^workflow_id: "):
        await agent_turn("bad/id", GOOD, settings)
    assert len(emu.chats()) == chats


async def test_bad_url_fails_before_any_chat(
    emu: Emulator,
    settings: WorkflowSettings,
    workflow_id: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    chats = len(emu.chats())
    # Credentials from the worker environment, with a URL that is not http(s).
    monkeypatch.setenv("CODER_URL", "ftp://coder.example.com")
    monkeypatch.setenv("CODER_SESSION_TOKEN", "whatever-token")
    monkeypatch.setenv("CODER_ORG_ID", emu.organization_id)
    with pytest.raises(WorkflowParameterError) as info:
        await agent_workflow(
            workflow_id, [GOOD], settings.model_copy(update={"credentials_block": None})
        )
    assert info.value.field in {"CODER_URL", "settings.credentials_block"}
    assert "whatever-token" not in str(info.value)
    assert len(emu.chats()) == chats


async def test_bad_url_in_a_saved_block_fails_before_any_chat(
    emu: Emulator, settings: WorkflowSettings, workflow_id: str
) -> None:
    chats = len(emu.chats())
    try:
        block = CoderCredentials(
            base_url="localhost:3000", organization_id=emu.organization_id, token="t-bad-url"
        )
    except ValueError:
        return  # the block itself refuses such a URL: nothing can be saved, fine
    await block.save("flows-test-bad-url", overwrite=True)
    with pytest.raises(WorkflowParameterError) as info:
        await agent_workflow(
            workflow_id,
            [GOOD],
            settings.model_copy(update={"credentials_block": "flows-test-bad-url"}),
        )
    assert info.value.field.startswith("settings.credentials_block")
    assert len(emu.chats()) == chats


async def test_bad_parameters_never_archive_the_workflows_live_chat(
    emu: Emulator, settings: WorkflowSettings, workflow_id: str
) -> None:
    first = await agent_turn(workflow_id, GOOD, settings)
    with pytest.raises(WorkflowParameterError):
        await agent_workflow(
            workflow_id, [GOOD, Step(name="t", prompt="x", tools=["typo_tool"])], settings
        )
    # the failure handler saw a parameter error: the chat stays resumable
    assert emu.chat(first.chat_id)["archived"] is False
