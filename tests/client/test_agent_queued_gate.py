"""The queued gate against both kinds of server: builds that stamp a promoted
queue head with ``queued_message_id`` (exact anchor) and builds that do not
(content heuristic). Two jobs queue the *same* prompt behind a busy chat, so
only the anchor rule can tell their turns apart."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import pytest
from pydantic import BaseModel

from coder_chat import AgentTimings, CoderAgent, StreamOptions, ToolContext, client_tool
from coder_chat.emulator.script import Script, ScriptStep, Text
from coder_chat.emulator.server import Emulator

FAST = StreamOptions(backoff_initial_ms=10, backoff_cap_ms=40)
TIMINGS = AgentTimings(action_grace=0.2, settle_deadline=2.0, settle_retry_delay=0.05)


def make(emu: Emulator, **kw: object) -> CoderAgent:
    return CoderAgent(
        base_url=emu.base_url,
        token=emu.token,
        organization_id=emu.organization_id,
        stream_options=FAST,
        timings=TIMINGS,
        request_timeout=10,
        **kw,  # type: ignore[arg-type]
    )


async def _until(check: Callable[[], bool], within: float = 5.0) -> None:
    for _ in range(int(within / 0.005)):
        if check():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached in time")


class Hold(BaseModel):
    pass


async def _run_identical_queued_jobs(emu: Emulator) -> None:
    # The first job holds the chat busy in requires_action until both others are
    # queued: no race against a sleep, however loaded the machine is.
    release = asyncio.Event()

    @client_tool(description="waits for the test")
    async def hold(args: Hold, ctx: ToolContext) -> str:
        await release.wait()
        return "released"

    first = make(emu, tools=[hold])
    busy = Script.client_tool("hold", {}, text="first ", then=ScriptStep((Text("done", deltas=2),)))
    t1 = asyncio.create_task(first.generate(f"go #emu {json.dumps(busy.to_json())}"))
    await _until(lambda: first.chat_id is not None)
    chat_id = first.chat_id
    assert chat_id is not None
    await emu.await_status(chat_id, "requires_action")

    def queued() -> int:
        return sum(e["kind"] == "queue" and e["chat_id"] == chat_id for e in emu.event_log())

    # Both queued jobs send byte-identical content; the default model echoes it.
    a, b = make(emu, chat_id=chat_id), make(emu, chat_id=chat_id)
    ta = asyncio.create_task(a.generate("same prompt"))
    await _until(lambda: queued() >= 1)
    seen = queued()
    tb = asyncio.create_task(b.generate("same prompt"))
    await _until(lambda: queued() > seen)
    release.set()
    r1, ra, rb = await asyncio.gather(t1, ta, tb)

    users = [m for m in emu.messages(chat_id, include_system=False) if m["role"] == "user"]
    assert len(users) == 3
    # Each job anchored on its own promoted user message, in queue order, and the
    # second job's window never absorbed the first job's run (or vice versa).
    assert ra.user_message_id == users[1]["id"] and rb.user_message_id == users[2]["id"]
    assert not set(ra.message_ids) & set(rb.message_ids)
    assert ra.text == rb.text and ra.text  # same echo, each exactly once
    assert r1.text == "done" and r1.steps[0].text == "first "
    for agent in (first, a, b):
        await agent.aclose()


@pytest.mark.chatd_emulator(delta_delay=0.0005)
async def test_queued_jobs_attribute_their_own_runs_on_every_build(
    chatd_era: str, chatd_emulator: Emulator
) -> None:
    """B1 promotes queue heads without ``queued_message_id`` (matched by content);
    B2/B3 stamp them. Either way each job gets exactly its own run."""
    await _run_identical_queued_jobs(chatd_emulator)
    chat_id = chatd_emulator.chats()[0]["id"]
    rows = chatd_emulator.messages(chat_id, include_system=False)
    stamped = [m for m in rows if m["role"] == "user" and "queued_message_id" in m]
    assert len(stamped) == (0 if chatd_era == "b1" else 2)


@pytest.mark.chatd_emulator(delta_delay=0.0005, stamp_queued_message_id=True)
async def test_stamped_server_anchors_on_queued_message_id(chatd_emulator: Emulator) -> None:
    await _run_identical_queued_jobs(chatd_emulator)
    chat_id = chatd_emulator.chats()[0]["id"]
    stamped = [
        m
        for m in chatd_emulator.messages(chat_id, include_system=False)
        if m["role"] == "user" and "queued_message_id" in m
    ]
    assert len(stamped) == 2  # the two promoted heads carry their queue entry ids


@pytest.mark.chatd_emulator(delta_delay=0.0005, stamp_queued_message_id=False)
async def test_unstamped_server_anchors_by_content_and_queue_updates(
    chatd_emulator: Emulator,
) -> None:
    await _run_identical_queued_jobs(chatd_emulator)
    chat_id = chatd_emulator.chats()[0]["id"]
    assert not any(
        "queued_message_id" in m for m in chatd_emulator.messages(chat_id, include_system=False)
    )
