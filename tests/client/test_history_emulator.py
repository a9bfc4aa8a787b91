"""History paging and crash-recovery reads against the real emulator."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel

from coder_chat import (
    AgentTimings,
    CoderAgent,
    ToolContext,
    client_tool,
    rehydrate,
    structured_output,
)
from coder_chat.emulator.script import Script, ScriptStep, ServerToolCall, Text
from coder_chat.emulator.server import Emulator
from coder_chat.history import fetch_turn, fetch_until, marker_attempts, recover_turn_result

# The emulator runs on its own loop in another thread (the chatd_emulator fixture),
# like a real server: the client loop never shares work with it.
pytestmark = pytest.mark.chatd_emulator(delta_delay=0.0002)


@pytest.fixture
def emu(chatd_emulator: Emulator) -> Emulator:
    return chatd_emulator


class Add(BaseModel):
    a: int
    b: int


@client_tool(description="add")
async def add(args: Add, ctx: ToolContext) -> int:
    return args.a + args.b


class Answer(BaseModel):
    value: int


def directive(script: Script, text: str = "go") -> str:
    return f"{text} #emu {json.dumps(script.to_json())}"


def agent_for(emu: Emulator, **kw: Any) -> CoderAgent:
    return CoderAgent(
        base_url=emu.base_url,
        token=emu.token,
        organization_id=emu.organization_id,
        timings=AgentTimings(action_grace=0.2),
        **kw,
    )


async def test_recovery_reads_match_what_generate_returned(chatd_era: str, emu: Emulator) -> None:
    answer = structured_output(Answer)
    agent = agent_for(emu, tools=[add, answer])
    await agent.generate("[wf/0] first step")
    script = Script.of(
        ScriptStep((Text("Checking. "), ServerToolCall("execute", {"cmd": "ls"}, {"out": "x"}))),
        ScriptStep((Text("Adding. "), *Script.client_tool("add", {"a": 2, "b": 2}).steps[0].parts)),
    )
    r1 = await agent.generate(directive(script, "[wf/1] attempt one"))
    r2 = await agent.generate(
        directive(Script.client_tool("add", {"a": 1, "b": 1}), "[wf/1] attempt two")
    )
    chat_id = r2.chat_id
    client = agent.client

    # paging newest-first with a tiny page still finds the turn's user message
    turn = await fetch_turn(client, chat_id, page_size=2)
    rec = recover_turn_result(turn, client_tool_names=agent.client_tool_names, marker="[wf/1]")
    assert rec is not None and rec.submitted
    assert rec.user_message_id == r2.user_message_id
    assert rec.text == r2.text
    every, complete = await fetch_until(client, chat_id, lambda ms: False, page_size=3)
    assert complete and len({m.id for m in every}) == len(every)
    assert sorted(m.id for m in every) == [
        m["id"] for m in emu.messages(chat_id, include_system=False)
    ]
    rec1 = recover_turn_result(
        every, client_tool_names=agent.client_tool_names, user_message_id=r1.user_message_id
    )
    assert rec1 is not None and rec1.text == r1.text
    # narration before the server-side tool survives in the earlier step's history
    assert any(p.type == "dynamic-tool" and p.tool_name == "execute" for p in rec1.parts)

    assert await marker_attempts(client, chat_id, "[wf/1]", page_size=2) == 2
    assert await marker_attempts(client, chat_id, "[wf/0]") == 0
    transcript = rehydrate(every)
    assert [m.role for m in transcript].count("user") == 3

    got = await agent.generate_structured(
        answer, directive(Script.structured_output({"value": 7}), "[wf/2]")
    )
    assert got.value == Answer(value=7)
    turn = await fetch_turn(client, chat_id)
    rec3 = recover_turn_result(
        turn, client_tool_names=agent.client_tool_names, output_model=Answer, marker="[wf/2]"
    )
    assert rec3 is not None and rec3.structured == Answer(value=7) and rec3.text == got.result.text
    await agent.aclose()
