"""A late send whose FIRST STEP commits between recovery's status read and its history
read, through the emulator's sockets (issue 30, item 5).

A crashed process's ``POST /messages`` can commit later than its journaled commit
horizon. When it commits after the settle poll saw the chat at rest (``waiting``)
and the model commits its first step (narration + a server-side tool call) before
the history read is served, that history holds the step's user message AND an
assistant message after it. Taking "status at rest" and that history together
returned the first step's narration as the step's result while the turn was still
running. Recovery now takes a verdict only from a history that ends with the turn
the status read covered (the newest user message its count read saw); here the
history ends with a newer one, so recovery settles again and follows the late
turn to its final answer (or, without a follower, cuts it short and counts it).

The window is produced with the emulator's fault API, no timing: ``hold_commit``
holds the send until recovery's third history read (the count in the settle, the
recount after the horizon, the result check's read) and commits it right before
that read; a second ``hold_commit`` holds that very read until the test has seen
the narration committed (``delay_commit(0, count=2)`` lets the first two history
reads through untouched). The turn's second step is a scripted sleep the test ends
only once the follower is on the stream (``end_sleeps``).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from coder_chat.agent import CoderAgent
from coder_chat.emulator import Emulator
from coder_chat.models import ChatInputPart, CreateChatMessageRequest
from coder_chat.recovery import RecoveryOutcome, RecoveryTimings, TurnRecovery
from coder_chat.rest import ChatClient
from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state import JournalEntry

FAST = RecoveryTimings(probe_bound=5.0, settle_budget=20.0, poll_interval=0.02, commit_horizon=0.5)
MARKER = "[wf/answer]"
NARRATION = "Let me read the build log first."
FINAL = "The build fails because the cache key changed."
#: The late turn: narration and a server-side tool call, then (after a sleep the test
#: ends) the final answer.
SCRIPT = {
    "steps": [
        {
            "parts": [
                {"type": "text", "text": NARRATION},
                {"type": "server_tool", "name": "read_file", "args": {"path": "ci.log"}},
            ]
        },
        {"parts": [{"type": "sleep", "seconds": 60}, {"type": "text", "text": FINAL}]},
    ]
}
#: The releasing request of the second hold: a route nothing else in the test calls.
RELEASE_PATH = "/api/v2/buildinfo"


def _directive(script: Any) -> str:
    return " #emu " + json.dumps(script)


@pytest.fixture
async def late_emu() -> AsyncIterator[Emulator]:
    """An emulator of this file's own: the test arms faults and reads its event log."""
    async with Emulator(delta_delay=0.0) as emu:
        yield emu


@pytest.fixture
async def late_store(tmp_path: Path) -> AsyncIterator[StateStore]:
    s = StateStore(f"sqlite+aiosqlite:///{tmp_path / 'state.db'}", tenant=uuid.uuid4().hex[:8])
    yield s
    await s.aclose()


def _fault_seen(emu: Emulator, name: str) -> bool:
    return any(e["details"].get("fault") == name for e in emu.event_log(["fault"]))


def _since(emu: Emulator, mark: int, kinds: list[str]) -> list[dict[str, Any]]:
    return [e for e in emu.event_log()[mark:] if e["kind"] in kinds]


def _decisions(outcome: RecoveryOutcome) -> str:
    return "\n".join(f"{d.stage}: {d.seen} -> {d.decided} ({d.why})" for d in outcome.decisions)


async def _until(what: str, pred: Any, bound: float = 10.0) -> None:
    deadline = time.monotonic() + bound
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def _first_turn(client: ChatClient) -> tuple[CoderAgent, str]:
    first = CoderAgent(client=client, request_timeout=5.0)
    done = await first.generate("[wf/plan] Plan." + _directive({"text": "A plan."}))
    assert done.text == "A plan."
    assert first.chat_id is not None
    return first, first.chat_id


async def _recover_across_the_window(
    emu: Emulator, store: StateStore, *, follow: bool
) -> tuple[RecoveryOutcome, str, int, bool]:
    """Run recovery with the late send's first step committed between its status read
    and its history read. Returns the outcome, the chat id, the event-log mark taken
    before the send, and whether recovery returned while the late turn still ran."""
    async with ChatClient(emu.base_url, emu.token, organization_id=emu.organization_id) as client:
        first, chat_id = await _first_turn(client)
        # The crashed process journaled its send (attempt 0) longer ago than the
        # commit horizon: recovery sleeps nothing and trusts its reads.
        await store.journal.set(
            chat_id,
            JournalEntry(state="submitting", marker=MARKER, attempt=0, at=time.time() - 2.0),
        )
        history = f"/chats/{chat_id}/messages"
        emu.faults.hold_commit(
            path=history, method="POST", until_method="GET", until_path=history, until_count=3
        )
        emu.faults.delay_commit(0.0, count=2, method="GET", path=history)
        emu.faults.hold_commit(path=history, method="GET", until_path=RELEASE_PATH)
        mark = len(emu.event_log())
        late = asyncio.create_task(
            client.create_message(
                chat_id,
                CreateChatMessageRequest(
                    content=[ChatInputPart.text_part(f"{MARKER} Why?" + _directive(SCRIPT))]
                ),
                timeout=30.0,
            )
        )
        await _until("the send to be held", lambda: _fault_seen(emu, "hold_commit"))
        follower = CoderAgent(client=client, chat_id=chat_id, request_timeout=5.0)
        recovery = asyncio.create_task(
            TurnRecovery(
                client,
                store,
                chat_id,
                MARKER,
                timings=FAST,
                follower=follower if follow else None,
                turn_timeout=20.0,
            ).run()
        )
        try:
            # The send committed and the model committed its first step while
            # recovery's history read is still held: now let that read be served.
            def narrated() -> bool:
                return any(
                    m["role"] == "assistant" and NARRATION in json.dumps(m)
                    for m in emu.messages(chat_id, include_system=False)
                )

            await _until("the late turn's first step to commit", narrated)
            assert emu.chat(chat_id)["status"] == "running"
            async with httpx.AsyncClient(base_url=emu.base_url) as raw:
                await raw.get(RELEASE_PATH)

            # Model time: the second step sleeps until the follower is on the
            # stream, or recovery interrupted the turn, or returned.
            def moved() -> bool:
                return recovery.done() or any(
                    e["chat_id"] == chat_id for e in _since(emu, mark, ["ws_connect"])
                )

            await _until("the follower, the interrupt or the verdict", moved)
            returned_while_running = recovery.done() and emu.chat(chat_id)["status"] == "running"
            emu.end_sleeps(chat_id)
            outcome = await recovery
        finally:
            emu.end_sleeps(chat_id)
            await late
            await follower.aclose()
            await first.aclose()
    # The window was hit: recovery's third history read was served only after the
    # late send and its first step (the narration) committed.
    events = _since(emu, mark, ["request", "message"])
    narration_at = next(
        i
        for i, e in enumerate(events)
        if e["kind"] == "message" and e["details"]["role"] == "assistant"
    )
    reads = [
        i
        for i, e in enumerate(events)
        if e["kind"] == "request"
        and e["details"]["method"] == "GET"
        and e["details"]["path"].endswith(history)
    ]
    assert len(reads) >= 3 and reads[2] > narration_at, events
    return outcome, chat_id, mark, returned_while_running


async def test_a_late_send_whose_first_step_committed_before_the_history_read_is_followed(
    late_emu: Emulator, late_store: StateStore
) -> None:
    emu = late_emu
    outcome, chat_id, mark, returned_while_running = await _recover_across_the_window(
        emu, late_store, follow=True
    )
    decisions = _decisions(outcome)
    returned = outcome.recovered.text if outcome.recovered is not None else None
    assert not returned_while_running, (
        f"{outcome.classification} ({returned!r}) while the late turn ran:\n{decisions}"
    )
    # The late turn was followed to its final answer: not cut short, not
    # resubmitted, and its narration was not taken for the result.
    assert outcome.classification == "followed", decisions
    assert outcome.followed is not None, decisions
    assert outcome.followed.text.endswith(FINAL), (outcome.followed.text, decisions)
    # Counts from the server's own log: one user message of the step, one turn,
    # which completed, and no interrupt accepted.
    user_msgs = [e for e in _since(emu, mark, ["message"]) if e["details"]["role"] == "user"]
    assert len(user_msgs) == 1, user_msgs
    turns = [e for e in _since(emu, mark, ["turn_start"]) if e["chat_id"] == chat_id]
    assert len(turns) == 1, turns
    ends = [e["details"].get("outcome") for e in _since(emu, mark, ["turn_end"])]
    assert ends == ["completed"], ends
    interrupts = [
        e
        for e in _since(emu, mark, ["request"])
        if e["details"]["path"].endswith("/interrupt") and e["details"]["status"] < 300
    ]
    assert interrupts == [], interrupts
    assert emu.chat(chat_id)["status"] == "waiting"


async def test_without_a_follower_the_late_turn_is_cut_short_and_counted(
    late_emu: Emulator, late_store: StateStore
) -> None:
    """No follower (the seed design's recovery): the live late turn is stopped and the
    step resubmitted — never its narration returned — and the resubmission's
    write-ahead counts the late attempt (the outcome's ``attempts``)."""
    emu = late_emu
    outcome, chat_id, mark, returned_while_running = await _recover_across_the_window(
        emu, late_store, follow=False
    )
    decisions = _decisions(outcome)
    assert not returned_while_running, decisions
    assert outcome.classification == "resubmit" and outcome.cut_short, decisions
    assert outcome.recovered is None, decisions
    assert outcome.attempts == 1, decisions
    interrupts = [
        e
        for e in _since(emu, mark, ["request"])
        if e["details"]["path"].endswith("/interrupt") and e["details"]["status"] < 300
    ]
    assert len(interrupts) >= 1, decisions
    assert emu.chat(chat_id)["status"] == "waiting"


async def test_a_finished_attempt_costs_no_extra_request(
    late_emu: Emulator, late_store: StateStore
) -> None:
    """The common case: the crashed attempt finished long ago (its result was lost).
    The rule compares two reads recovery makes anyway: no request is added."""
    emu, store = late_emu, late_store
    async with ChatClient(emu.base_url, emu.token, organization_id=emu.organization_id) as client:
        first, chat_id = await _first_turn(client)
        await store.journal.set(
            chat_id,
            JournalEntry(state="submitting", marker=MARKER, attempt=0, at=time.time() - 2.0),
        )
        sent = await first.generate(f"{MARKER} Why?" + _directive({"text": FINAL}))
        assert sent.text == FINAL
        mark = len(emu.event_log())
        try:
            outcome = await TurnRecovery(client, store, chat_id, MARKER, timings=FAST).run()
        finally:
            await first.aclose()
    assert outcome.classification == "recovered", _decisions(outcome)
    assert outcome.recovered is not None and outcome.recovered.text == FINAL
    seen = [
        (e["details"]["method"], e["details"]["path"].removeprefix(f"/api/v2/chats/{chat_id}"))
        for e in _since(emu, mark, ["request"])
    ]
    # Probe, count, the stop's read, the settle poll, the result check's history
    # read: five requests, as before the rule (measured on the code before it).
    assert sorted(seen) == [("GET", "")] * 3 + [("GET", "/messages")] * 2, seen
    assert seen[-1] == ("GET", "/messages"), seen


def test_the_newest_user_message_of_a_read() -> None:
    from coder_chat.recovery.shell import newest_user_message_id

    history = [
        {"id": 1, "role": "user"},
        {"id": 2, "role": "assistant"},
        {"id": 3, "role": "user"},
        {"id": 4, "role": "assistant"},
        {"id": 5, "role": "tool"},
    ]
    assert newest_user_message_id(history) == 3
    assert newest_user_message_id(list(reversed(history))) == 3  # any order
    assert newest_user_message_id(history[1:2]) is None
    assert newest_user_message_id([]) is None
