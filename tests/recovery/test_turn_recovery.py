"""The recovery shell (coder_chat.recovery.TurnRecovery) against the real emulator and a
real SQLite store: every settle-wait branch, ledger reconcile, and result recovery."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from payment_tools import charge_card
from payments import Payments
from pydantic import BaseModel

from coder_chat.crash_safe import pure
from coder_chat.emulator import Emulator
from coder_chat.models import (
    ChatInputPart,
    CreateChatMessageRequest,
    CreateChatRequest,
    DynamicToolDefinition,
)
from coder_chat.recovery import RecoveryStore, RecoveryTimings, TurnRecovery
from coder_chat.rest import ChatClient
from coder_chat.tools import ClientTool, ToolContext, client_tool, structured_output
from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state import JournalEntry

FAST = RecoveryTimings(probe_bound=5.0, settle_budget=10.0, poll_interval=0.02, commit_horizon=0.5)


def directive(script: Any) -> str:
    return " #emu " + json.dumps(script)


@pytest.fixture
async def client(emu: Emulator) -> AsyncIterator[ChatClient]:
    async with ChatClient(emu.base_url, emu.token, organization_id=emu.organization_id) as c:
        yield c


def _marker() -> str:
    return f"[wf-{uuid.uuid4().hex[:8]}/step]"


async def _create(
    client: ChatClient, emu: Emulator, text: str, tools: list[ClientTool[Any]] | None = None
) -> str:
    req = CreateChatRequest(
        organization_id=emu.organization_id,
        content=[ChatInputPart.text_part(text)],
        unsafe_dynamic_tools=[DynamicToolDefinition(**t.definition()) for t in tools or []] or None,
    )
    chat = await client.create_chat(req)
    return chat.id


def _recovery(
    client: ChatClient,
    store: StateStore,
    chat_id: str,
    marker: str,
    tools: list[ClientTool[Any]],
    **kw: Any,
) -> TurnRecovery:
    return TurnRecovery(
        client,
        store,
        chat_id,
        marker,
        tools=tools,
        timings=kw.pop("timings", FAST),
        **kw,
    )


def _user_count(emu: Emulator, chat_id: str, marker: str) -> int:
    return sum(
        1
        for m in emu.messages(chat_id, include_system=False)
        if m["role"] == "user" and any(marker in (p.get("text") or "") for p in m["content"])
    )


def test_state_store_satisfies_the_recovery_protocols(store: StateStore) -> None:
    # Static check (mypy) and a runtime shape check: coder_chat imports no blocks.
    typed: RecoveryStore = store
    assert typed.journal is store.journal and typed.ledger is store.ledger


async def test_finished_attempt_is_recovered_not_resubmitted(
    client: ChatClient, emu: Emulator, store: StateStore
) -> None:
    marker = _marker()
    chat_id = await _create(client, emu, f"{marker} hi" + directive({"text": "the answer"}))
    await emu.await_status(chat_id, "waiting")
    await store.journal.set(chat_id, JournalEntry(state="submitting", marker=marker, attempt=0))
    outcome = await _recovery(client, store, chat_id, marker, []).run()
    assert outcome.classification == "recovered"
    assert outcome.recovered is not None and outcome.recovered.text == "the answer"
    assert outcome.cut_short is False and outcome.attempts == 1
    assert _user_count(emu, chat_id, marker) == 1
    stages = [d.stage for d in outcome.decisions]
    assert stages[0] == "settle" and stages[-1] == "result"
    # the 409 conclusion was journaled: a crash now cannot turn it into a cut-short
    entry = await store.journal.get(chat_id)
    assert entry is not None and (entry.state, entry.attempt) == ("resumed", 1)


async def test_live_run_is_interrupted_and_resubmitted(
    client: ChatClient, emu: Emulator, store: StateStore
) -> None:
    marker = _marker()
    slow = directive({"text": "never finishes in time", "deltas": 50, "delay": 0.2})
    chat_id = await _create(client, emu, f"{marker} go" + slow)
    await emu.await_status(chat_id, "running")
    outcome = await _recovery(client, store, chat_id, marker, []).run()
    assert outcome.classification == "resubmit" and outcome.cut_short
    assert emu.chat(chat_id)["status"] in ("waiting", "error")
    entry = await store.journal.get(chat_id)
    assert entry is not None and (entry.state, entry.attempt) == ("cut-short", 1)
    # a second pass (crash before the resubmission) keeps the verdict
    again = await _recovery(client, store, chat_id, marker, []).run()
    assert again.classification == "resubmit"


async def test_known_failure_pins_cut_short(
    client: ChatClient, emu: Emulator, store: StateStore
) -> None:
    marker = _marker()
    chat_id = await _create(client, emu, f"{marker} hi" + directive({"text": "partial?"}))
    await emu.await_status(chat_id, "waiting")
    outcome = await _recovery(client, store, chat_id, marker, [], known_failure=True).run()
    assert outcome.classification == "resubmit" and "known" in outcome.reason


async def _paused_on_charge(
    client: ChatClient, emu: Emulator, marker: str, amount: int = 700
) -> tuple[str, str]:
    script = {"tool_calls": [{"name": "charge_card", "args": {"amount_cents": amount}}]}
    chat_id = await _create(client, emu, f"{marker} pay" + directive(script), [charge_card])
    await emu.await_status(chat_id, "requires_action")
    msgs = emu.messages(chat_id, include_system=False)
    call = next(
        p
        for m in msgs
        if m["role"] == "assistant"
        for p in m["content"]
        if p["type"] == "tool-call"
    )
    return chat_id, call["tool_call_id"]


async def test_pause_with_done_entry_submits_the_recorded_output(
    client: ChatClient, emu: Emulator, store: StateStore, payments: Payments
) -> None:
    marker = _marker()
    chat_id, call_id = await _paused_on_charge(client, emu, marker)
    await store.ledger.begin(chat_id, call_id, tool_name="charge_card")
    await store.ledger.complete(chat_id, call_id, {"charged_cents": 700, "status": "charged"})
    key = store.ledger.idempotency_key(chat_id, call_id)
    tool = charge_card.bind(store.ledger)
    outcome = await _recovery(client, store, chat_id, marker, [tool]).run()
    assert outcome.classification == "recovered", outcome.decisions
    assert outcome.recovered is not None and "charged" in outcome.recovered.text
    assert payments.effects.get(key, 0) == 0  # nothing re-executed
    assert emu.chat(chat_id)["status"] == "waiting"
    assert _user_count(emu, chat_id, marker) == 1


async def test_pause_with_committing_entry_is_redriven_with_the_same_key(
    client: ChatClient, emu: Emulator, store: StateStore, payments: Payments
) -> None:
    marker = _marker()
    chat_id, call_id = await _paused_on_charge(client, emu, marker, 900)
    key = store.ledger.idempotency_key(chat_id, call_id)
    # the crashed tool's effect DID commit at the external system, then it died
    payments.charge(key, 900)
    await store.ledger.begin(chat_id, call_id, tool_name="charge_card")
    outcome = await _recovery(
        client, store, chat_id, marker, [charge_card.bind(store.ledger)]
    ).run()
    assert outcome.classification == "recovered"
    assert payments.effects[key] == 1 and payments.requests[key] == 2  # replayed, not re-applied
    entry = await store.ledger.get(chat_id, call_id)
    assert entry is not None and entry.state == "done"


async def test_pause_without_entry_is_interrupted_and_resubmitted(
    client: ChatClient, emu: Emulator, store: StateStore, payments: Payments
) -> None:
    marker = _marker()
    chat_id, call_id = await _paused_on_charge(client, emu, marker)
    outcome = await _recovery(
        client, store, chat_id, marker, [charge_card.bind(store.ledger)]
    ).run()
    assert outcome.classification == "resubmit" and outcome.cut_short
    assert emu.chat(chat_id)["status"] != "requires_action"
    assert payments.effects.get(store.ledger.idempotency_key(chat_id, call_id), 0) == 0
    entry = await store.journal.get(chat_id)
    assert entry is not None and entry.state == "cut-short"


async def test_journaled_resumed_lets_the_run_finish(
    client: ChatClient, emu: Emulator, store: StateStore
) -> None:
    marker = _marker()
    slow = directive({"text": "finishing the step", "deltas": 5, "delay": 0.1})
    chat_id = await _create(client, emu, f"{marker} go" + slow)
    await emu.await_status(chat_id, "running")
    await store.journal.set(chat_id, JournalEntry(state="resumed", marker=marker, attempt=1))
    outcome = await _recovery(client, store, chat_id, marker, []).run()
    assert outcome.classification == "recovered"
    assert outcome.recovered is not None and outcome.recovered.text == "finishing the step"
    assert not any(e["kind"] == "interrupt" for e in emu.event_log() if e["chat_id"] == chat_id)


async def test_unlanded_resubmission_sleeps_the_horizon_then_pins_cut_short(
    client: ChatClient, emu: Emulator, store: StateStore
) -> None:
    marker = _marker()
    chat_id = await _create(client, emu, f"{marker} hi" + directive({"text": "old tail"}))
    await emu.await_status(chat_id, "waiting")
    # a resubmission over attempt 1 was journaled, then the process died before the send
    await store.journal.set(
        chat_id, JournalEntry(state="submitting", marker=marker, attempt=1, at=time.time())
    )
    # A horizon long enough that a loaded machine's probes cannot use it all up
    # before the sleep: what matters is that what remained of it is slept out.
    horizon = 3.0
    timings = RecoveryTimings(
        probe_bound=5.0, settle_budget=10.0, poll_interval=0.02, commit_horizon=horizon
    )
    t0 = time.monotonic()
    outcome = await _recovery(client, store, chat_id, marker, [], timings=timings).run()
    # slept out what remained of the commit horizon
    assert 0.0 < outcome.horizon_slept_s <= horizon
    assert time.monotonic() - t0 >= outcome.horizon_slept_s
    assert outcome.classification == "resubmit" and outcome.cut_short


async def test_late_landing_send_is_seen_after_the_horizon(
    client: ChatClient, emu: Emulator, store: StateStore
) -> None:
    marker = _marker()
    chat_id = await _create(client, emu, f"{marker} first" + directive({"text": "one"}))
    await emu.await_status(chat_id, "waiting")
    await store.journal.set(
        chat_id, JournalEntry(state="submitting", marker=marker, attempt=1, at=time.time())
    )
    # the crashed process's resubmission is still en route and commits late
    emu.faults.delay_commit(0.2, path="/messages")
    import asyncio

    send = asyncio.create_task(
        client.create_message(
            chat_id,
            CreateChatMessageRequest(
                content=[ChatInputPart.text_part(f"{marker} again" + directive({"text": "two"}))]
            ),
        )
    )
    # A horizon a loaded machine's late send still lands in (0.5 s did not at load
    # 12: the send committed after it and recovery resubmitted).
    timings = RecoveryTimings(
        probe_bound=5.0, settle_budget=10.0, poll_interval=0.02, commit_horizon=3.0
    )
    outcome = await _recovery(client, store, chat_id, marker, [], timings=timings).run()
    await send
    # the late turn landed within the horizon: recovery saw it and waited it out
    assert outcome.attempts == 2
    assert outcome.classification == "recovered"
    assert outcome.recovered is not None and outcome.recovered.text == "two"


class Answer(BaseModel):
    verdict: str
    score: int


async def test_structured_step_pause_is_answered_and_the_input_recovered(
    client: ChatClient, emu: Emulator, store: StateStore
) -> None:
    marker = _marker()
    answer = structured_output(Answer)
    script = {
        "steps": [
            {"structured_output": {"verdict": "bad", "score": "x"}},
            {"structured_output": {"verdict": "ok", "score": 3}},
            {"text": "Filed."},
        ]
    }
    chat_id = await _create(client, emu, f"{marker} judge" + directive(script), [answer])
    await emu.await_status(chat_id, "requires_action")
    outcome = await _recovery(client, store, chat_id, marker, [answer], output_model=Answer).run()
    assert outcome.classification == "recovered", [d.row() for d in outcome.decisions]
    assert outcome.recovered is not None
    assert outcome.recovered.structured == Answer(verdict="ok", score=3)
    assert outcome.recovered.text == "Filed."


class Lookup(BaseModel):
    build_id: str


async def test_pause_on_a_pure_tool_is_answered_by_running_it_again(
    client: ChatClient, emu: Emulator, store: StateStore
) -> None:
    calls: list[str] = []

    @client_tool(name="lookup_build", description="Look a build up.")
    async def lookup(args: Lookup, ctx: ToolContext) -> dict[str, str]:
        calls.append(args.build_id)
        return {"build": args.build_id, "status": "failed"}

    tool = pure(lookup)
    marker = _marker()
    script = {"tool_calls": [{"name": "lookup_build", "args": {"build_id": "nightly-7"}}]}
    chat_id = await _create(client, emu, f"{marker} look" + directive(script), [tool])
    await emu.await_status(chat_id, "requires_action")
    outcome = await _recovery(client, store, chat_id, marker, [tool]).run()
    assert outcome.classification == "recovered", [d.row() for d in outcome.decisions]
    assert calls == ["nightly-7"]
    assert outcome.recovered is not None and "nightly-7" in outcome.recovered.text
    assert _user_count(emu, chat_id, marker) == 1
    # the same tool NOT declared pure: the pause is cut short, the step resubmitted
    marker2 = _marker()
    chat2 = await _create(client, emu, f"{marker2} look" + directive(script), [lookup])
    await emu.await_status(chat2, "requires_action")
    again = await _recovery(client, store, chat2, marker2, [lookup]).run()
    assert again.classification == "resubmit" and calls == ["nightly-7"]


async def test_begin_reports_the_entry_its_write_ahead_replaced(store: StateStore) -> None:
    # recover_before_send tells a LATER step's entry (a lost result: look in history)
    # from an earlier one's by what begin's write-ahead replaced.
    wf = f"wf-{uuid.uuid4().hex[:8]}"
    assert (await store.turns.begin(wf, "[x/a]")).checkpoint is None  # no chat yet
    await store.checkpoints.set(wf, "chat-1", None)
    first = await store.turns.begin(wf, "[x/a]")
    assert first.journaled and first.replaced is None  # there was no entry
    later = JournalEntry(state="submitting", marker="[x/b]", attempt=1, at=123.0)
    await store.journal.set("chat-1", later)
    again = await store.turns.begin(wf, "[x/a]")
    assert again.journaled and again.journal is not None and again.journal.marker == "[x/a]"
    assert again.replaced is not None
    assert (again.replaced.state, again.replaced.marker, again.replaced.attempt) == (
        "submitting",
        "[x/b]",
        1,
    )
    assert again.replaced.at == pytest.approx(123.0, abs=1.0)  # database clock, read back
    same = await store.turns.begin(wf, "[x/a]")
    assert not same.journaled and same.replaced is None  # its own entry: nothing written


async def test_the_common_send_reads_no_history_when_the_journal_names_an_earlier_step(
    store: StateStore,
) -> None:
    # A step's send after an earlier step of its workflow must cost no chat read:
    # the journal naming an earlier step proves this one never sent. Against a
    # server that is not there, any read would fail.
    from coder_chat.errors import CoderTransportError
    from prefect_coder.flows.common.params import Step, WorkflowSettings, step_marker
    from prefect_coder.flows.recovery import chat_state
    from prefect_coder.flows.recovery.before_send import recover_before_send
    from prefect_coder.flows.recovery.recovered import Unsent, recovery_timings

    wf = f"wf-{uuid.uuid4().hex[:8]}"
    first, second = Step(name="a", prompt="A"), Step(name="b", prompt="B")
    await store.checkpoints.set(wf, "chat-1", None)
    await store.journal.set(
        "chat-1", JournalEntry(state="submitting", marker=step_marker(wf, "a"), attempt=0)
    )
    start = await store.turns.begin(wf, step_marker(wf, "b"))
    async with ChatClient("http://127.0.0.1:9", "tok", organization_id="o") as nowhere:
        kw: dict[str, Any] = {
            "client": nowhere,
            "store": store,
            "workflow_id": wf,
            "step": second,
            "chat_id": "chat-1",
            "tools": [],
            "answer": None,
            "timings": recovery_timings(WorkflowSettings(settle_wait_s=1), 1.0, 2.0),
            "known_failure": False,
            "artifacts": False,
            "entry": start.journal,
            "journaled": start.journaled,
            "replaced": start.replaced,
        }
        # The earlier step's turn settled on the chat in this process: known live
        # (flows/recovery/chat_state.py), so not even the archived check reads it.
        chat_state.note_live("chat-1")
        try:
            plan = await recover_before_send(**kw, earlier=frozenset({step_marker(wf, first.name)}))
        finally:
            chat_state.forget("chat-1")
        assert plan == Unsent(1)
        # Without the step order (agent-turn, recover-turn) it must look first.
        with pytest.raises(CoderTransportError):
            await recover_before_send(**kw)
