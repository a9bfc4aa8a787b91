"""A step whose send's response was lost, recovered by a follow whose stream cannot be
dialed while the attempt finishes on the server (chaos seed 519).

The window: the first run's ``POST /messages`` of step ``pay`` lands but its response
is lost; the run fails and leaves the attempt live (it pauses on its charge). The
rerun's recovery answers the pause through the ledger and follows the revived run,
but its five stream dials are refused, so the follow fails (``CoderStreamError``, its
redials exhausted) — while the run, its tool result submitted, finishes on the
server. Two things went wrong there:

* the follower's teardown fired a best-effort interrupt in the background, and
  recovery took the attempt for cut short without knowing whether that interrupt
  ever reached a live run: the FINISHED attempt was resubmitted;
* that background interrupt (its journaling first: a store read, a history read, a
  store write) was still on its way when the turn sent the step again, and it
  stopped the NEW attempt: the turn returned the interrupted attempt's partial
  text as the step's answer (``'Charg'``).

Reproduced with the emulator's fault API, no timing: ``refuse_upgrades`` fails the
follow's five dials, ``hold_commit`` holds any interrupt of the chat until the test
releases it — once the step was sent again and its turn streams its first words and
sleeps (a scripted ``sleep`` the test ends). Fixed: the durable turn's follower
leaves the run alone when its follow fails (no interrupt from its teardown), and
recovery settles again: the finished attempt is followed to its answer.

The same rule at ``TurnRecovery``'s level, with the follower the turn builds
(``flows/turn/follower.py``): a live run whose follow lost its stream is followed
again, never interrupted; at the follow's own deadline recovery still cuts the
attempt short, with its own journaled interrupt.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from crash_matrix import STEPS, directive, run_workflow, workflow_chat
from payments import Payments
from test_crash_followups import _interrupts, _transcript, _user_turns, assert_finished_once

from coder_chat.agent import AgentHooks, CoderAgent
from coder_chat.emulator import Emulator
from coder_chat.models import ChatInputPart, CreateChatRequest
from coder_chat.recovery import RecoveryOutcome, RecoveryTimings, TurnRecovery
from coder_chat.rest import ChatClient
from coder_chat.stream import StreamOptions
from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state import JournalEntry
from prefect_coder.flows.common.params import Step, WorkflowSettings, step_marker
from prefect_coder.flows.recovery.send_journal import journal_cut_short
from prefect_coder.flows.turn.follower import FollowGate, RecoveryFollower

#: What an interrupted attempt of ``pay`` commits: its first words, streamed before
#: the sleep.
PARTIAL = "Charg"
#: ``pay``: its first words, a sleep the test ends, the rest, then a charge.
PAY = Step(
    name="pay",
    prompt="Charge the rest."
    + directive(
        {
            "steps": [
                {
                    "parts": [
                        {"type": "text", "text": PARTIAL},
                        {"type": "sleep", "seconds": 60},
                        {"type": "text", "text": "ing the rest now."},
                        {
                            "type": "client_tool",
                            "name": "charge_card",
                            "args": {"amount_cents": 250},
                        },
                    ]
                }
            ]
        }
    ),
    tools=["charge_card"],
)
#: The releasing request of the held interrupt: a route nothing else here calls.
RELEASE_PATH = "/api/v2/buildinfo"


async def _until(what: str, pred: Any, bound: float = 60.0) -> None:
    deadline = time.monotonic() + bound
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def _fault_seen(emu: Emulator, name: str, mark: int) -> bool:
    return any(
        e["kind"] == "fault" and e["details"].get("fault") == name for e in emu.event_log()[mark:]
    )


async def test_a_finished_attempt_whose_follow_lost_its_stream_is_recovered_not_resent(
    settings: WorkflowSettings,
    workflow_id: str,
    emu: Emulator,
    payments: Payments,
) -> None:
    steps = [STEPS[0], PAY]
    marker = step_marker(workflow_id, "pay")
    # plan creates the chat (POST /chats); pay's POST /messages lands, its response is
    # lost: the run fails and leaves the attempt live.
    emu.faults.drop_response(1, method="POST", path="/messages")
    try:
        with pytest.raises(Exception):  # noqa: B017 - the transient failure, whatever its type
            await run_workflow(workflow_id, steps, settings)
    finally:
        emu.faults.clear()
    chat = await workflow_chat(emu, workflow_id)
    assert _interrupts(emu, chat) == 0, _transcript(emu, chat)

    # The attempt goes on: past its sleep, it pauses on its charge (nobody answers).
    def paused() -> bool:
        emu.end_sleeps(chat)
        return bool(emu.chat(chat)["status"] == "requires_action")

    await _until("the attempt to pause on its charge", paused)

    # The rerun: recovery answers the pause through the ledger and follows the revived
    # run, whose five stream dials are refused; any interrupt of the chat is held.
    emu.faults.refuse_upgrades(503, count=5, chat_id=chat)
    emu.faults.hold_commit(
        method="POST",
        path=f"/chats/{chat}/interrupt",
        until_method="GET",
        until_path=RELEASE_PATH,
        max_seconds=60.0,
    )
    mark = len(emu.event_log())
    rerun = asyncio.create_task(run_workflow(workflow_id, steps, settings))
    try:
        # Either the rerun ends, or an interrupt is held while the step was sent again
        # and its new turn streamed its first words and sleeps: release the interrupt
        # onto that turn (the order the chaos run met by timing).
        def resent_under_held_interrupt() -> bool:
            return (
                _fault_seen(emu, "hold_commit", mark)
                and len(_user_turns(emu, chat, marker)) == 2
                and bool(emu.chat(chat)["sleeping"])
            )

        await _until(
            "the rerun's end or a resend", lambda: rerun.done() or resent_under_held_interrupt()
        )
        if not rerun.done():
            async with httpx.AsyncClient(base_url=emu.base_url) as raw:
                await raw.get(RELEASE_PATH)
        results = await rerun
    finally:
        emu.faults.clear()
        emu.end_sleeps(chat)
        if not rerun.done():
            rerun.cancel()
    transcript = "\n".join(_transcript(emu, chat))
    # Never the interrupted attempt's partial text as the step's answer ...
    assert results[1].text != PARTIAL, transcript
    # ... but the finished attempt's: its charge's result.
    assert results[1].text.startswith("Results: charge_card"), (results[1].text, transcript)
    assert [c.name for c in results[1].tool_calls] == ["charge_card"], transcript
    # The finished attempt was not sent again, nothing was interrupted, and plan's and
    # pay's charges each applied once under their own call id's key.
    await assert_finished_once(emu, payments, chat, marker, calls=2)


# --- the same rule at the recovery's level: TurnRecovery with the turn's follower -------


@pytest.fixture
async def sqlite(tmp_path: Path) -> AsyncIterator[StateStore]:
    s = StateStore(f"sqlite+aiosqlite:///{tmp_path / 'state.db'}", tenant="failed-follow")
    yield s
    await s.aclose()


async def _recover_live_run(
    emu: Emulator, store: StateStore, timings: RecoveryTimings, *, refused: int, wake: bool
) -> tuple[RecoveryOutcome, str]:
    """A live run of the step (sleeping) under a landed send's write-ahead, recovered
    with a follower built as the durable turn builds it (its interrupts journaled
    cut-short first, refused while recovery follows); ``refused`` stream dials fail.
    ``wake``: the run's sleep ends once a follower's stream is on it (else never)."""
    marker = f"[wf-{uuid.uuid4().hex[:8]}/s]"
    async with ChatClient(emu.base_url, emu.token, organization_id=emu.organization_id) as client:
        chat = await client.create_chat(
            CreateChatRequest(
                organization_id=emu.organization_id,
                content=[
                    ChatInputPart.text_part(
                        f"{marker} go" + directive({"sleep": 60, "text": "finished late"})
                    )
                ],
            )
        )
        await emu.await_status(chat.id, "running")
        await store.journal.set(chat.id, JournalEntry(state="submitting", marker=marker, attempt=0))
        gate = FollowGate()

        async def before_interrupt(cid: str) -> None:
            gate.check(cid)
            await journal_cut_short(client, store, cid)

        agent = CoderAgent(
            client=client,
            chat_id=chat.id,
            request_timeout=5.0,
            # The turn's short redial backoff: the five refused dials fail the follow
            # well inside its segment budget.
            stream_options=StreamOptions(backoff_initial_ms=20),
            hooks=AgentHooks(before_interrupt=before_interrupt, leave_landed_runs=True),
        )
        if refused:
            emu.faults.refuse_upgrades(503, count=refused, chat_id=chat.id)
        mark = len(emu.event_log())
        recovery = asyncio.create_task(
            TurnRecovery(
                client,
                store,
                chat.id,
                marker,
                timings=timings,
                follower=RecoveryFollower(agent, gate, wait_s=timings.probe_bound),
            ).run()
        )
        try:
            await _until(
                "a follower on the stream, or the verdict",
                lambda: (
                    recovery.done()
                    or (
                        wake
                        and any(
                            e["kind"] == "ws_connect" and e["chat_id"] == chat.id
                            for e in emu.event_log()[mark:]
                        )
                    )
                ),
            )
            emu.end_sleeps(chat.id)
            return await recovery, chat.id
        finally:
            emu.faults.clear()
            emu.end_sleeps(chat.id)
            await agent.aclose()


def _accepted_interrupts(emu: Emulator, chat_id: str) -> int:
    return sum(
        1
        for e in emu.event_log(["status"])
        if e["chat_id"] == chat_id and e["details"]["new"] == "interrupting"
    )


async def test_a_live_run_whose_follow_lost_its_stream_is_followed_again(
    emu: Emulator, sqlite: StateStore
) -> None:
    """The follow's five dials are refused while the run still generates: nothing is
    interrupted, recovery settles again and follows the run to its answer (before:
    the follower's teardown interrupt cut it short and the step was resubmitted)."""
    timings = RecoveryTimings(
        probe_bound=5.0, settle_budget=30.0, poll_interval=0.02, commit_horizon=0.5
    )
    outcome, chat = await _recover_live_run(emu, sqlite, timings, refused=5, wake=True)
    decisions = [f"{d.stage}: {d.seen} -> {d.decided} ({d.why})" for d in outcome.decisions]
    assert outcome.classification == "followed", decisions
    assert outcome.followed is not None and outcome.followed.text == "finished late"
    assert any(d.decided == "settle again" for d in outcome.decisions), decisions
    assert _accepted_interrupts(emu, chat) == 0, decisions


async def test_at_the_follows_deadline_recovery_stops_the_run_itself(
    emu: Emulator, sqlite: StateStore
) -> None:
    """The follow's own deadline passes while the run sleeps: the attempt is cut short
    as before — journaled, then stopped by recovery's own interrupt (the follower's
    was refused) — and resubmitted."""
    timings = RecoveryTimings(
        probe_bound=5.0, settle_budget=0.5, poll_interval=0.02, commit_horizon=0.5
    )
    outcome, chat = await _recover_live_run(emu, sqlite, timings, refused=0, wake=False)
    decisions = [f"{d.stage}: {d.seen} -> {d.decided} ({d.why})" for d in outcome.decisions]
    assert outcome.classification == "resubmit" and outcome.cut_short, decisions
    assert _accepted_interrupts(emu, chat) >= 1, decisions
    assert emu.chat(chat)["status"] == "waiting"
    entry = await sqlite.journal.get(chat)
    assert entry is not None and (entry.state, entry.attempt) == ("cut-short", 1)
