"""``sweep-stuck-turns``: a run or a pause nobody finishes is interrupted (or
reconciled from the ledger) and announced with a ``coder.chat.stuck`` event."""

from __future__ import annotations

import asyncio
from typing import Any

from sweep_helpers import new_chat, ours, snapshot, wait_status

from coder_chat.emulator import Emulator
from coder_chat.rest import ChatClient
from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state import JournalEntry, workflow_key
from prefect_coder.flows.common.params import WorkflowSettings, step_marker
from prefect_coder.flows.deployments.sweep_settings import SweepSettings
from prefect_coder.flows.deployments.sweep_stuck_turns import sweep_stuck_turns
from prefect_coder.flows.sweeps.options import SweepOptions

SLEEPY = {"sleep": 30, "text": "never gets here"}
NOTE = {
    "tool_calls": [{"name": "record_note", "args": {"title": "t", "body": "b"}, "id": "call-1"}]
}


async def _stuck_events(chat_id: str, want: int = 1) -> list[dict[str, Any]]:
    from prefect import get_client

    flt = {
        "event": {"name": ["coder.chat.stuck"]},
        "any_resource": {"id": [f"coder.chat.{chat_id}"]},
        "order": "ASC",
    }
    events: list[dict[str, Any]] = []
    async with get_client() as pc:
        # Events arrive through the events worker and the server's event persister
        # (it flushes every few seconds): a look every 0.25 s (each read costs the
        # shared test server CPU), bounded at 10 s.
        for _ in range(40):
            resp = await pc._client.post("/events/filter", json={"filter": flt, "limit": 20})
            resp.raise_for_status()
            events = list(resp.json()["events"])
            if len(events) >= want:
                break
            await asyncio.sleep(0.25)
    return events


def _tool_results(emu: Emulator, chat_id: str) -> list[dict[str, Any]]:
    return [
        p
        for m in emu.messages(chat_id, include_system=False)
        for p in m.get("content") or []
        if p.get("type") == "tool-result"
    ]


async def test_a_run_stuck_past_the_turn_budget_is_interrupted_and_announced(
    client: ChatClient,
    settings: WorkflowSettings,
    store: StateStore,
    workflow_id: str,
    tenant: str,
    options: SweepOptions,
) -> None:
    stuck = await new_chat(client, labels=ours(tenant, workflow_id), script=SLEEPY)
    await asyncio.sleep(0.4)
    assert (await client.get_chat(stuck)).status == "running"

    before = await snapshot(client, store, [stuck])
    dry = await sweep_stuck_turns(settings, dry_run=True, turn_budget_s=0.3, options=options)
    assert [r.chat_id for r in dry.rows] == [stuck]
    assert await snapshot(client, store, [stuck]) == before  # a dry run changes nothing

    within = await sweep_stuck_turns(settings, turn_budget_s=60, options=options)
    assert within.rows == [] and within.count("keep") == 1
    report = await sweep_stuck_turns(
        settings, turn_budget_s=0.3, action_budget_s=60, options=options
    )
    rows = {r.chat_id: r for r in report.rows}
    assert rows[stuck].decision == "interrupt" and "turn budget" in rows[stuck].reason
    assert rows[stuck].outcome.startswith("interrupted")
    assert await wait_status(client, stuck, "waiting") == "waiting"
    assert not (await client.get_chat(stuck)).archived  # the chat stays the workflow's
    events = await _stuck_events(stuck, want=2)  # the dry run announced it too
    assert [e["payload"]["dry_run"] for e in events] == [True, False]
    assert events[-1]["payload"]["action"] == "interrupt"
    assert events[-1]["payload"]["status"] == "running"


async def test_a_sweep_journals_cut_short_before_it_interrupts_a_checkpointed_turn(
    client: ChatClient,
    settings: WorkflowSettings,
    store: StateStore,
    workflow_id: str,
    tenant: str,
    options: SweepOptions,
) -> None:
    """The workflow's own recovery must never take the attempt a sweep truncated for
    a finished one: the sweep's interrupt of a checkpointed chat is journaled first."""
    marker = step_marker(workflow_id, "slow")
    stuck = await new_chat(
        client, labels=ours(tenant, workflow_id), prompt=f"{marker} take long", script=SLEEPY
    )
    await wait_status(client, stuck, "running")
    await store.checkpoints.set(workflow_id, stuck)
    await store.journal.set(stuck, JournalEntry(state="submitting", marker=marker, attempt=0, at=0))
    await asyncio.sleep(0.4)
    report = await sweep_stuck_turns(
        settings, turn_budget_s=0.3, action_budget_s=60, options=options
    )
    [row] = report.rows
    assert row.decision == "interrupt" and row.outcome.startswith("interrupted")
    entry = await store.journal.get(stuck)
    assert entry is not None
    assert (entry.state, entry.marker, entry.attempt) == ("cut-short", marker, 1)


async def test_a_pause_nobody_answers_is_interrupted_until_it_stops(
    client: ChatClient,
    settings: WorkflowSettings,
    workflow_id: str,
    tenant: str,
    options: SweepOptions,
) -> None:
    paused = await new_chat(
        client, labels=ours(tenant, workflow_id), tools=["record_note"], script=NOTE
    )
    await wait_status(client, paused, "requires_action")
    within = await sweep_stuck_turns(settings, action_budget_s=60, options=options)
    assert within.count("interrupt") == 0
    await asyncio.sleep(0.3)
    report = await sweep_stuck_turns(settings, action_budget_s=0.2, options=options)
    [row] = report.rows
    assert row.decision == "interrupt" and "nobody answering" in row.reason
    assert await wait_status(client, paused, "waiting") == "waiting"


async def test_a_stuck_pause_with_a_committed_effect_is_reconciled_not_interrupted(
    emu: Emulator,
    client: ChatClient,
    settings: WorkflowSettings,
    store: StateStore,
    workflow_id: str,
    tenant: str,
    options: SweepOptions,
) -> None:
    marker = step_marker(workflow_id, "note")
    paused = await new_chat(
        client,
        labels=ours(tenant, workflow_id),
        tools=["record_note"],
        prompt=f"{marker} write it down",
        script=[NOTE, {"text": "noted"}],
    )
    await wait_status(client, paused, "requires_action")
    # The crashed turn had checkpointed the chat and journaled its send; its tool
    # committed the effect and recorded the output, then the process died.
    await store.checkpoints.set(workflow_id, paused)
    await store.journal.set(paused, JournalEntry(state="submitting", marker=marker, attempt=0))
    await store.ledger.begin(paused, "call-1", tool_name="record_note")
    await store.ledger.complete(paused, "call-1", {"saved": "note-42"})
    await asyncio.sleep(0.3)

    report = await sweep_stuck_turns(settings, action_budget_s=0.2, options=options)
    [row] = report.rows
    assert row.decision == "reconcile", row
    assert row.outcome == "reconciled (resumed)"
    await wait_status(client, paused, "waiting")
    [result] = _tool_results(emu, paused)
    assert result["tool_call_id"] == "call-1"
    assert "note-42" in str(result.get("result")) and not result.get("is_error")
    # the verdict is journaled for the workflow's own recovery of this attempt
    entry = await store.journal.get(paused)
    assert entry is not None and (entry.state, entry.marker) == ("resumed", marker)


async def test_a_live_run_holding_its_workflow_lease_is_reported_not_touched(
    client: ChatClient,
    settings: WorkflowSettings,
    store: StateStore,
    workflow_id: str,
    tenant: str,
    options: SweepOptions,
) -> None:
    running = await new_chat(client, labels=ours(tenant, workflow_id), script=SLEEPY)
    await store.checkpoints.set(workflow_id, running)
    await asyncio.sleep(0.3)
    async with store.lease(workflow_key(workflow_id), ttl=10, wait=1):
        report = await sweep_stuck_turns(settings, turn_budget_s=0.2, options=options)
    [row] = report.rows
    assert row.decision == "busy" and "holds its lease" in row.reason
    assert (await client.get_chat(running)).status == "running"
    [event] = await _stuck_events(running)
    assert event["payload"]["action"] == "busy"  # automations still hear about it
    await client.interrupt_chat(running)


async def test_chats_of_others_are_never_stuck_for_this_sweep(
    emu: Emulator,
    client: ChatClient,
    settings: WorkflowSettings,
    workflow_id: str,
    options: SweepOptions,
) -> None:
    other = await new_chat(client, labels={"team": "x"}, script=SLEEPY)
    await asyncio.sleep(0.3)
    report = await sweep_stuck_turns(settings, turn_budget_s=0.1, options=options)
    assert report.listed == 0 and report.rows == []
    assert (await client.get_chat(other)).status == "running"
    await client.interrupt_chat(other)


async def test_a_transient_failure_of_the_listing_is_read_again_not_the_end_of_the_sweep(
    client: ChatClient,
    settings: WorkflowSettings,
    workflow_id: str,
    tenant: str,
    options: SweepOptions,
    emu: Emulator,
) -> None:
    """Two 503s on the listing (e.g. the deployment restarting, chaos seeds 40/88):
    the page is read again after a backoff and the stuck run is still interrupted,
    instead of the sweep run failing and sweeping nothing until its next tick."""
    stuck = await new_chat(client, labels=ours(tenant, workflow_id), script=SLEEPY)
    await asyncio.sleep(0.4)
    seen = len(emu.event_log(["fault"]))
    emu.faults.fail_rest(2, status=503, method="GET", path="/api/v2/chats")
    try:
        report = await sweep_stuck_turns(
            SweepSettings.model_validate(settings),
            turn_budget_s=0.3,
            action_budget_s=60,
            options=options,
        )
    finally:
        emu.faults.clear()
    fired = emu.event_log(["fault"])[seen:]
    # both failures met the listing (the sweep's first requests), none anything else
    assert [(e["details"]["fault"], e["details"]["path"]) for e in fired] == [
        ("fail", "/api/v2/chats"),
        ("fail", "/api/v2/chats"),
    ], fired
    rows = {r.chat_id: r for r in report.rows}
    assert rows[stuck].decision == "interrupt" and rows[stuck].ok, rows[stuck]
    assert await wait_status(client, stuck, "waiting") == "waiting"
