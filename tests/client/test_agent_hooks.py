"""``AgentHooks.before_interrupt`` and ``AgentHooks.leave_landed_runs``: what a
durable caller changes about a failed segment's interrupt (``before_send`` has
its own file, test_before_send.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from coder_chat import (
    AgentHooks,
    AgentTimings,
    CoderAgent,
    CoderChatError,
    CoderTransportError,
    StreamOptions,
)
from coder_chat.emulator.script import Script
from coder_chat.emulator.server import Emulator

pytestmark = pytest.mark.chatd_emulator(delta_delay=0.0005)


@pytest.fixture
def emu(chatd_emulator: Emulator) -> Emulator:
    return chatd_emulator


def make(emu: Emulator, **kw: Any) -> CoderAgent:
    kw.setdefault("request_timeout", 10)
    return CoderAgent(
        base_url=emu.base_url,
        token=emu.token,
        organization_id=emu.organization_id,
        stream_options=StreamOptions(backoff_initial_ms=10, backoff_cap_ms=40),
        timings=AgentTimings(action_grace=0.2, settle_deadline=2.0, settle_retry_delay=0.05),
        **kw,
    )


def interrupts(emu: Emulator, chat_id: str) -> int:
    return sum(
        1
        for e in emu.event_log(["request"])
        if e["chat_id"] == chat_id
        and e["details"]["method"] == "POST"
        and e["details"]["path"].endswith("/interrupt")
    )


def long_running(seconds: float) -> str:
    return f"go #emu {json.dumps(Script.long_running(seconds).to_json())}"


async def test_before_interrupt_runs_before_the_teardown_interrupt(emu: Emulator) -> None:
    seen: list[tuple[str, int]] = []

    async def journal(chat_id: str) -> None:
        seen.append((chat_id, interrupts(emu, chat_id)))  # interrupts sent so far

    agent = make(emu, request_timeout=0.3, hooks=AgentHooks(before_interrupt=journal))
    with pytest.raises(CoderChatError) as info:
        await agent.generate(long_running(2))
    assert info.value.kind == "timeout"
    chat_id = agent.chat_id
    assert chat_id is not None
    await agent.wait_background()
    assert seen == [(chat_id, 0)]  # journaled first, before any interrupt went out
    assert interrupts(emu, chat_id) == 1
    await agent.aclose()


async def test_a_failing_before_interrupt_sends_no_interrupt(emu: Emulator) -> None:
    async def refuse(chat_id: str) -> None:
        raise RuntimeError("the journal is unreachable")

    agent = make(emu, request_timeout=0.3, hooks=AgentHooks(before_interrupt=refuse))
    with pytest.raises(CoderChatError):
        await agent.generate(long_running(1))
    chat_id = agent.chat_id
    assert chat_id is not None
    await agent.wait_background()
    assert interrupts(emu, chat_id) == 0  # left for the caller's recovery
    assert emu.chat(chat_id)["status"] == "running"
    await agent.aclose()


@pytest.mark.parametrize("leave", [True, False])
async def test_leave_landed_runs_keeps_a_transiently_failed_run_live(
    emu: Emulator, leave: bool
) -> None:
    first = make(emu)
    chat_id = (await first.generate("first")).chat_id
    await first.aclose()
    # The prompt lands and its run starts; only the POST's response is lost.
    emu.faults.drop_response(1, method="POST", path="/messages")
    agent = make(emu, chat_id=chat_id, hooks=AgentHooks(leave_landed_runs=leave))
    with pytest.raises(CoderTransportError):
        await agent.generate(long_running(1))
    await agent.wait_background()
    if leave:
        assert agent.left_run_live == chat_id
        assert interrupts(emu, chat_id) == 0
    else:  # the plain SDK stops what nobody reads
        assert agent.left_run_live is None
        assert interrupts(emu, chat_id) == 1
    await agent.aclose()
