"""Issue 30, item 1: PostgreSQL goes down while a ledgered tool's effect is in flight.

Real parts only: the thread-hosted emulator over real sockets, a real ``StateStore``
on a private PostgreSQL cluster that is stopped with ``pg_ctl stop -m fast`` exactly
between the effect and the ``done`` write (the ``tool.after_effect`` crash point) and
started again, and a charge tool whose own effect log (a file) counts the charges per
idempotency key.

Before the fix, the dead pooled connection's ``InterfaceError`` — with the store's
``INSERT INTO coder_state_tool_ledger`` SQL — became the tool's result: the model was
told the charge failed (although it went through), the SQL went to the Coder server,
and the row stayed ``committing`` for a re-ask to charge again under a new key.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from faults_effects import EffectLog
from faults_pg import PrivateCluster
from pydantic import BaseModel

from coder_chat.agent import CoderAgent
from coder_chat.agent_options import AgentHooks, AgentTimings
from coder_chat.crash_safe import CrashSafeTool, EffectContext, add_crash_hook, crash_safe_tool
from coder_chat.emulator.script import Script, ScriptStep, Text
from coder_chat.emulator.server import Emulator
from coder_chat.errors import ToolBookkeepingError
from coder_chat.recovery import RecoveryTimings, TurnRecovery
from coder_chat.rest import ChatClient
from coder_chat.stream import StreamOptions
from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state import JournalEntry

pytestmark = pytest.mark.chatd_emulator(delta_delay=0.0005)

FAST_RECOVERY = RecoveryTimings(
    probe_bound=5.0, settle_budget=10.0, poll_interval=0.02, commit_horizon=0.5
)
ANSWER = "The charge went through."


class Charge(BaseModel):
    amount_cents: int


class Note(BaseModel):
    text: str


def charge_tool(log: EffectLog) -> CrashSafeTool[Any]:
    @crash_safe_tool(name="charge_card", description="Charge the customer's card.")
    async def charge_card(args: Charge, ctx: EffectContext) -> dict[str, Any]:
        return log.charge(ctx.idempotency_key, args.amount_cents)

    return charge_card


def directive(script: Script, text: str) -> str:
    return f"{text} #emu {json.dumps(script.to_json())}"


@pytest.fixture
async def client(chatd_emulator: Emulator) -> AsyncIterator[ChatClient]:
    emu = chatd_emulator
    async with ChatClient(emu.base_url, emu.token, organization_id=emu.organization_id) as c:
        yield c


@pytest.fixture
async def pg_store(private_pg: PrivateCluster) -> AsyncIterator[StateStore]:
    # A short transient bound: these tests keep the store down on purpose, and the
    # default (20 s) would only be waited out.
    store = StateStore(
        private_pg.url,
        tenant=f"t-{uuid.uuid4().hex[:8]}",
        connect_timeout=5.0,
        transient_retry_s=2.0,
    )
    yield store
    await store.aclose()


def _received(emu: Emulator, chat_id: str) -> str:
    """Everything the Coder server got and stored for the chat, as text."""
    return json.dumps([emu.event_log(), emu.messages(chat_id), emu.chat(chat_id)], default=str)


async def test_store_down_between_effect_and_done_write_fails_the_turn_not_the_tool(
    chatd_emulator: Emulator,
    client: ChatClient,
    pg_store: StateStore,
    private_pg: PrivateCluster,
    tmp_path: Path,
) -> None:
    emu, store = chatd_emulator, pg_store
    log = EffectLog(tmp_path / "effects.jsonl")
    tool = charge_tool(log).bind(store.ledger, match_earlier_attempts=True)
    agent = CoderAgent(
        client=client,
        tools=[tool],
        hooks=AgentHooks(leave_landed_runs=True),
        timings=AgentTimings(action_grace=0.2, settle_deadline=2.0, settle_retry_delay=0.05),
        stream_options=StreamOptions(backoff_initial_ms=20, backoff_cap_ms=80),
        request_timeout=20,
    )
    # The chat exists (an earlier step), and this step's send is journaled.
    await agent.generate(directive(Script.text("ready"), "hello"))
    chat_id = agent.chat_id
    assert chat_id is not None
    marker = f"[wf-{uuid.uuid4().hex[:8]}/pay]"
    await store.journal.set(chat_id, JournalEntry.submitting(marker, 0))

    def restart_store(point: str) -> None:
        if point == "tool.after_effect" and private_pg.running:
            private_pg.stop()  # the effect ran; the pool's connections are now dead

    remove = add_crash_hook(restart_store)
    try:
        with pytest.raises(ToolBookkeepingError) as info:
            await agent.generate(
                directive(
                    Script.client_tool(
                        "charge_card", {"amount_cents": 700}, then=ScriptStep((Text(ANSWER),))
                    ),
                    f"{marker} pay",
                )
            )
    finally:
        remove()
        private_pg.start()
    err = info.value
    # The turn fails transiently, naming the call — not the store's text.
    assert err.retryable and (err.stage, err.tool_name) == ("complete", "charge_card")
    assert err.__cause__ is not None  # the store's exception, for the run's log
    for leak in ("SQL", "INSERT", "coder_state", str(private_pg.port)):
        assert leak not in str(err)
    call_id = err.tool_call_id
    key = store.ledger.idempotency_key(chat_id, call_id)
    assert log.effects(key) == 1
    # The pause stays unanswered and uninterrupted, for recovery to finish the call.
    assert agent.left_run_live == chat_id
    assert emu.chat(chat_id)["status"] == "requires_action"
    assert not emu.event_log(kinds=["interrupt"])
    received = _received(emu, chat_id)
    for leak in ("InterfaceError", "SQL", "INSERT", "Tool failed", str(private_pg.port)):
        assert leak not in received
    entry = await store.ledger.get(chat_id, call_id)
    assert entry is not None and entry.state == "committing"

    # The next attempt's recover-before-send: the committing row is re-driven under the
    # SAME key (a no-op at the charge service), answered, and the step recovered.
    outcome = await TurnRecovery(
        client, store, chat_id, marker, tools=[tool], timings=FAST_RECOVERY
    ).run()
    assert outcome.classification == "recovered", outcome.decisions
    assert outcome.recovered is not None and outcome.recovered.text == ANSWER
    assert (log.effects(), log.effects(key), log.requests(key)) == (1, 1, 2)
    assert log.keys() == {key}
    entry = await store.ledger.get(chat_id, call_id)
    assert entry is not None and entry.state == "done"
    assert entry.output == {"receipt": f"rcpt-{call_id}", "charged_cents": 700}
    tool_results = [
        p
        for m in emu.messages(chat_id)
        if m["role"] == "tool"
        for p in m["content"]
        if p.get("tool_call_id") == call_id
    ]
    assert len(tool_results) == 1 and not tool_results[0].get("is_error")
    assert tool_results[0]["result"] == entry.output
    assert "InterfaceError" not in _received(emu, chat_id)
    await agent.aclose()


def _agent(client: ChatClient, tools: list[Any]) -> CoderAgent:
    return CoderAgent(
        client=client,
        tools=tools,
        hooks=AgentHooks(leave_landed_runs=True),
        timings=AgentTimings(action_grace=0.2, settle_deadline=2.0, settle_retry_delay=0.05),
        stream_options=StreamOptions(backoff_initial_ms=20, backoff_cap_ms=80),
        request_timeout=20,
    )


async def test_store_down_at_the_write_ahead_runs_no_effect_and_recovery_runs_it_once(
    chatd_emulator: Emulator,
    client: ChatClient,
    pg_store: StateStore,
    private_pg: PrivateCluster,
    tmp_path: Path,
) -> None:
    emu, store = chatd_emulator, pg_store
    log = EffectLog(tmp_path / "effects.jsonl")
    stop_first = {"armed": False}

    async def stop_store_first(ctx: Any) -> None:
        # Right before the write-ahead: the store goes down under the tool.
        if stop_first["armed"] and private_pg.running:
            private_pg.stop()

    tool = charge_tool(log).bind(
        store.ledger, before_effect=stop_store_first, match_earlier_attempts=True
    )
    agent = _agent(client, [tool])
    await agent.generate(directive(Script.text("ready"), "hello"))
    chat_id = agent.chat_id
    assert chat_id is not None
    marker = f"[wf-{uuid.uuid4().hex[:8]}/pay]"
    await store.journal.set(chat_id, JournalEntry.submitting(marker, 0, turn_timeout=60.0))
    stop_first["armed"] = True
    try:
        with pytest.raises(ToolBookkeepingError) as info:
            await agent.generate(
                directive(
                    Script.client_tool(
                        "charge_card", {"amount_cents": 300}, then=ScriptStep((Text(ANSWER),))
                    ),
                    f"{marker} pay",
                )
            )
    finally:
        stop_first["armed"] = False
        private_pg.start()
    assert info.value.stage == "begin" and info.value.retryable
    assert log.effects() == 0  # nothing ran without its write-ahead
    assert emu.chat(chat_id)["status"] == "requires_action"
    assert "Tool failed" not in _received(emu, chat_id)
    # This step's crashed attempt within its turn deadline: recovery runs the call
    # through the ledger (the call id's stable key) — once.
    outcome = await TurnRecovery(
        client,
        store,
        chat_id,
        marker,
        tools=[tool],
        timings=FAST_RECOVERY,
        turn_timeout=60.0,
        follower=agent,
    ).run()
    assert outcome.classification == "followed", "\n".join(map(str, outcome.decisions))
    assert outcome.followed is not None and outcome.followed.text == ANSWER
    key = store.ledger.idempotency_key(chat_id, info.value.tool_call_id)
    assert (log.effects(), log.effects(key)) == (1, 1)
    await agent.aclose()


async def test_siblings_of_a_failed_bookkeeping_finish_before_the_turn_fails(
    chatd_emulator: Emulator,
    client: ChatClient,
    pg_store: StateStore,
    private_pg: PrivateCluster,
    tmp_path: Path,
) -> None:
    emu, store = chatd_emulator, pg_store
    log = EffectLog(tmp_path / "effects.jsonl")
    finished: list[str] = []

    note_started = asyncio.Event()

    @crash_safe_tool(name="slow_note", description="Write a note (slowly).")
    async def slow_note(args: Note, ctx: EffectContext) -> str:
        note_started.set()
        await asyncio.sleep(0.3)
        finished.append(ctx.idempotency_key)
        return "noted"

    @crash_safe_tool(name="charge_card", description="Charge the customer's card.")
    async def charge_card(args: Charge, ctx: EffectContext) -> dict[str, Any]:
        await note_started.wait()  # both effects are under way when the store goes
        return log.charge(ctx.idempotency_key, args.amount_cents)

    def stop_store(point: str) -> None:
        if point == "tool.after_effect" and private_pg.running and not finished:
            private_pg.stop()

    agent = _agent(
        client,
        [
            charge_card.bind(store.ledger, match_earlier_attempts=True),
            slow_note.bind(store.ledger, match_earlier_attempts=True),
        ],
    )
    await agent.generate(directive(Script.text("ready"), "hello"))
    chat_id = agent.chat_id
    assert chat_id is not None
    marker = f"[wf-{uuid.uuid4().hex[:8]}/pay]"
    await store.journal.set(chat_id, JournalEntry.submitting(marker, 0))
    remove = add_crash_hook(stop_store)
    try:
        with pytest.raises(ToolBookkeepingError):
            await agent.generate(
                directive(
                    Script.client_tools(
                        [("charge_card", {"amount_cents": 5}), ("slow_note", {"text": "hi"})]
                    ),
                    f"{marker} pay",
                )
            )
        # The sibling ran to its end before the turn failed: nothing of the round is
        # left running to race the next attempt's re-drive of its call.
        assert len(finished) == 1
    finally:
        remove()
        if not private_pg.running:
            private_pg.start()
    assert emu.chat(chat_id)["status"] == "requires_action"
    await agent.aclose()
