"""Issue 30: internal exception text never goes to the Coder server or the model.

A tool raising with a database URL (user, password, host) in its message, through a
real ``CoderAgent`` turn against the emulator: what the server stored as the tool's
result says the tool failed and gives an error id; the run's log (logger
``coder_chat.tools``) has the same id with the exception. A ``ToolError``'s message,
written for the model, is passed on."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import pytest
from pydantic import BaseModel

from coder_chat.agent import CoderAgent
from coder_chat.agent_options import AgentTimings
from coder_chat.emulator.script import Script, ScriptStep, Text
from coder_chat.emulator.server import Emulator
from coder_chat.rest import ChatClient
from coder_chat.tools import ToolContext, ToolError, client_tool

pytestmark = pytest.mark.chatd_emulator(delta_delay=0.0005)

DB_URL = "postgresql://coder:hunter2@db.internal.example:5432/coder_state"


class Query(BaseModel):
    sql: str


@client_tool(description="Look something up.")
async def lookup(args: Query, ctx: ToolContext) -> Any:
    raise RuntimeError(f"could not connect to {DB_URL}")


@client_tool(description="Charge.")
async def charge(args: Query, ctx: ToolContext) -> Any:
    raise ToolError("card declined: insufficient funds")


async def test_a_raising_tool_reaches_the_model_as_an_error_id(
    chatd_emulator: Emulator, caplog: pytest.LogCaptureFixture
) -> None:
    emu = chatd_emulator
    caplog.set_level(logging.ERROR, logger="coder_chat.tools")
    script = Script.client_tools([("lookup", {"sql": "x"}), ("charge", {"sql": "y"})])
    script = Script((*script.steps, ScriptStep((Text("done"),))))
    async with ChatClient(emu.base_url, emu.token, organization_id=emu.organization_id) as c:
        agent = CoderAgent(
            client=c,
            tools=[lookup, charge],
            timings=AgentTimings(action_grace=0.2, settle_deadline=2.0),
            request_timeout=20,
        )
        result = await agent.generate(f"go #emu {json.dumps(script.to_json())}")
        await agent.aclose()
    stored = {
        p["tool_name"]: p
        for m in emu.messages(result.chat_id)
        if m["role"] == "tool"
        for p in m["content"]
    }
    assert stored["lookup"].get("is_error") and stored["charge"].get("is_error")
    received = json.dumps([emu.event_log(), emu.messages(result.chat_id)], default=str)
    for leak in (DB_URL, "hunter2", "db.internal", "RuntimeError", "could not connect"):
        assert leak not in received
    found = re.search(r"error id (tool-err-[0-9a-f]{8})", str(stored["lookup"]["result"]))
    assert found is not None
    logged = [r for r in caplog.records if found.group(1) in r.getMessage()]
    assert len(logged) == 1 and DB_URL in str(logged[0].exc_info[1])  # type: ignore[index]
    assert stored["charge"]["result"] == "Tool failed: card declined: insufficient funds"
