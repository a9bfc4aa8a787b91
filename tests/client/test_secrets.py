"""The session token never appears in a log record, transport event, error,
result or repr — across a turn with tools, a stream drop, a timeout, API errors
and cleanup, with every logger at DEBUG."""

from __future__ import annotations

import dataclasses
import json
import logging
import pickle
from typing import Any

import pytest
from pydantic import BaseModel

from coder_chat import (
    AgentTimings,
    CoderAgent,
    CoderAgentError,
    CoderStreamError,
    StreamOptions,
    ToolContext,
    client_tool,
)
from coder_chat.emulator.script import Script
from coder_chat.emulator.server import Emulator

TOKEN = "secret-token-7d41b9e0c2aa4f7e"
SERVER_LOGGERS = ("websockets.server", "coder_chat.emulator")


# The emulator runs on its own loop in another thread (the chatd_emulator fixture),
# like a real server: the client loop never shares work with it.
pytestmark = pytest.mark.chatd_emulator(tokens=[TOKEN], delta_delay=0.0005)


@pytest.fixture
def emu(chatd_emulator: Emulator) -> Emulator:
    return chatd_emulator


class Add(BaseModel):
    a: int
    b: int


@client_tool(description="add")
async def add(args: Add, ctx: ToolContext) -> int:
    logging.getLogger("user.tool").debug("ctx=%r", ctx)
    return args.a + args.b


def _dump(obj: Any) -> str:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        parts = [repr(obj)]
        for f in dataclasses.fields(obj):
            parts.append(_dump(getattr(obj, f.name)))
        return " ".join(parts)
    dump = getattr(obj, "model_dump_json", None)
    if callable(dump):
        return str(dump())
    if isinstance(obj, dict | list | tuple):
        return json.dumps(obj, default=repr)
    return repr(obj)


async def test_token_never_leaks(emu: Emulator, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    logging.getLogger().setLevel(logging.DEBUG)
    seen: list[Any] = []
    texts: list[str] = []

    def make(**kw: Any) -> CoderAgent:
        return CoderAgent(
            base_url=emu.base_url,
            token=TOKEN,
            organization_id=emu.organization_id,
            tools=[add],
            on_transport_event=seen.append,
            stream_options=StreamOptions(backoff_initial_ms=10, backoff_cap_ms=20),
            timings=AgentTimings(action_grace=0.1, settle_deadline=1, settle_retry_delay=0.05),
            **kw,
        )

    agent = make(request_timeout=5)
    emu.faults.drop_next_stream(after_frames=4)
    script = Script.client_tool("add", {"a": 1, "b": 2})
    result = await agent.generate(f"go #emu {json.dumps(script.to_json())}")
    texts += [_dump(result), repr(agent), repr(agent.client)]

    failures: list[BaseException] = []
    slow = make(chat_id=result.chat_id, request_timeout=0.2)
    try:
        await slow.generate(f"go #emu {json.dumps(Script.long_running(2).to_json())}")
    except CoderAgentError as exc:
        failures.append(exc)
    emu.faults.refuse_upgrades(503)
    fresh = make(request_timeout=5)
    try:
        await fresh.generate("doomed")
    except CoderStreamError as exc:
        failures.append(exc)
    emu.faults.clear()
    unknown = make(chat_id="00000000-0000-4000-8000-00000000beef")
    try:
        await unknown.generate("x")
    except CoderAgentError as exc:
        failures.append(exc)
    for a in (agent, slow, fresh, unknown):
        await a.wait_background()
        try:
            await a.archive()
        except CoderAgentError as exc:
            failures.append(exc)
        await a.aclose()

    assert len(failures) >= 3
    for failure in failures:
        texts += [str(failure), repr(failure), repr(getattr(failure, "__cause__", None))]
        texts.append(repr(pickle.loads(pickle.dumps(failure))))
    texts += [_dump(e) for e in seen]
    # The emulator (the *server*, in-process here) logs the upgrade headers it
    # received through websockets.server; a real chatd is another process. Every
    # other record — client, httpx, httpcore, websockets.client, asyncio — counts.
    client_records = [r for r in caplog.records if not r.name.startswith(SERVER_LOGGERS)]
    texts += [
        r.getMessage() + " " + repr(r.args) + " " + (r.exc_text or "") for r in client_records
    ]
    assert seen and caplog.records
    blob = "\n".join(texts)
    assert "segment:settle" in blob and "ws:event" in blob
    assert TOKEN not in blob
