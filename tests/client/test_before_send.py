"""``CoderAgent(hooks=AgentHooks(before_send=...))``: awaited right before every
prompt the agent sends (a chat's creation, a user message), never before tool
results; if it raises, nothing is sent. A durable caller proves there that it
still holds its capacity slot (prefect_coder's ``confirm_turn_slot``). The old
``before_send=`` keyword still reaches the same hook (until the flows pass
``hooks=``)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from sample_tools import add

from coder_chat import AgentHooks, AgentTimings, CoderAgent
from coder_chat.emulator.script import Script
from coder_chat.emulator.server import Emulator
from coder_chat.stream import StreamOptions

pytestmark = pytest.mark.chatd_emulator(delta_delay=0.0005)


class SlotGone(RuntimeError):
    pass


def _agent(emu: Emulator, **kw: Any) -> CoderAgent:
    return CoderAgent(
        base_url=emu.base_url,
        token=emu.token,
        organization_id=emu.organization_id,
        stream_options=StreamOptions(backoff_initial_ms=10, backoff_cap_ms=40),
        timings=AgentTimings(action_grace=0.2, settle_deadline=2.0, settle_retry_delay=0.05),
        request_timeout=10,
        **kw,
    )


def _posts(emu: Emulator) -> list[str]:
    return [
        e["details"]["path"] for e in emu.event_log(["request"]) if e["details"]["method"] == "POST"
    ]


async def test_called_before_each_prompt_not_before_tool_results(
    chatd_emulator: Emulator,
) -> None:
    emu = chatd_emulator
    seen: list[tuple[str | None, int]] = []

    async def before_send(chat_id: str | None) -> None:
        # how many POSTs had gone out when the agent asked
        seen.append((chat_id, len(_posts(emu))))

    script = Script.client_tool("add", {"a": 2, "b": 3}, text="Adding. ")
    async with _agent(emu, tools=[add], hooks=AgentHooks(before_send=before_send)) as agent:
        first = await agent.generate(f"one #emu {json.dumps(script.to_json())}")
        posts_after_first = len(_posts(emu))
        second = await agent.generate("two")
    assert first.client_tool_calls[0].output == 5  # a tool round went through
    assert second.chat_id == first.chat_id
    # Once for the create (no chat yet), once for the second prompt; the tool
    # results of the first turn were submitted without asking.
    assert seen == [(None, 0), (first.chat_id, posts_after_first)]


async def test_a_refusal_sends_nothing(chatd_emulator: Emulator) -> None:
    emu = chatd_emulator

    async def refuse(chat_id: str | None) -> None:
        raise SlotGone("the slot was taken over")

    async with _agent(emu, hooks=AgentHooks(before_send=refuse)) as agent:
        with pytest.raises(SlotGone):
            await agent.generate("never sent")
        assert agent.chat_id is None
    assert _posts(emu) == []
    assert emu.chats() == []


async def test_a_refusal_on_a_resumed_chat_leaves_it_untouched(
    chatd_emulator: Emulator,
) -> None:
    emu = chatd_emulator
    refusing = False

    async def before_send(chat_id: str | None) -> None:
        if refusing:
            raise SlotGone("the slot was taken over")

    async with _agent(emu, hooks=AgentHooks(before_send=before_send)) as agent:
        first = await agent.generate("one")
        posts = _posts(emu)
        refusing = True
        with pytest.raises(SlotGone):
            await agent.generate("two")
        await agent.wait_background()
    # no message, and no interrupt of the chat at rest (nothing was cut short)
    assert _posts(emu) == posts
    assert agent.chat_id == first.chat_id
