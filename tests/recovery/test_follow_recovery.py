"""``TurnRecovery(follower=…)`` against the real emulator and a real SQLite store: a live
run that is this step's crashed attempt is followed, not cut short — within the
attempt's own turn deadline; past it, or when the follow cannot finish, the attempt
is stopped (``stop_chat``) and resubmitted; a run that is not this step's is stopped."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from coder_chat.agent import CoderAgent
from coder_chat.emulator import Emulator
from coder_chat.models import ChatInputPart, CreateChatRequest
from coder_chat.recovery import RecoveryTimings, TurnRecovery
from coder_chat.rest import ChatClient
from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state import JournalEntry

#: Turn budget of these tests (the follow's bound); the scripted runs are shorter or
#: far longer than it, never close to it.
BUDGET = 4.0
FAST = RecoveryTimings(
    probe_bound=5.0, settle_budget=BUDGET, poll_interval=0.02, commit_horizon=0.5
)


def directive(script: Any) -> str:
    return " #emu " + json.dumps(script)


@pytest.fixture
async def client(emu: Emulator) -> AsyncIterator[ChatClient]:
    async with ChatClient(emu.base_url, emu.token, organization_id=emu.organization_id) as c:
        yield c


@pytest.fixture
async def sqlite(tmp_path: Path) -> AsyncIterator[StateStore]:
    s = StateStore(f"sqlite+aiosqlite:///{tmp_path / 'state.db'}", tenant="follow")
    yield s
    await s.aclose()


async def _live_chat(client: ChatClient, emu: Emulator, marker: str, script: Any) -> str:
    chat = await client.create_chat(
        CreateChatRequest(
            organization_id=emu.organization_id,
            content=[ChatInputPart.text_part(f"{marker} go" + directive(script))],
        )
    )
    await emu.await_status(chat.id, "running")
    return chat.id


def _interrupted(emu: Emulator, chat_id: str) -> bool:
    return any(
        e["chat_id"] == chat_id and e["details"]["new"] == "interrupting"
        for e in emu.event_log(["status"])
    )


async def _run(
    client: ChatClient, store: StateStore, chat_id: str, marker: str, **kw: Any
) -> tuple[Any, CoderAgent]:
    agent = CoderAgent(client=client, chat_id=chat_id, request_timeout=5.0)
    recovery = TurnRecovery(client, store, chat_id, marker, follower=agent, **kw)
    try:
        return await recovery.run(), agent
    finally:
        await agent.aclose()


async def test_the_crashed_attempts_live_run_is_followed(
    client: ChatClient, emu: Emulator, sqlite: StateStore
) -> None:
    marker = f"[wf-{uuid.uuid4().hex[:8]}/s]"
    # The run must still be generating when recovery probes it — on a loaded machine
    # that can be seconds after it started — and finish well inside the follow's
    # turn budget (its own here, not BUDGET) and the agent's 5 s segment timeout.
    sleep_s = 2.0
    chat_id = await _live_chat(
        client, emu, marker, {"sleep": sleep_s, "text": "finished late", "deltas": 3}
    )
    # the crashed process journaled its send (count 0 before it); it landed
    await sqlite.journal.set(chat_id, JournalEntry(state="submitting", marker=marker, attempt=0))
    timings = RecoveryTimings(
        probe_bound=5.0, settle_budget=4 * sleep_s, poll_interval=0.02, commit_horizon=0.5
    )
    outcome, _ = await _run(client, sqlite, chat_id, marker, timings=timings)
    assert outcome.classification == "followed"
    assert outcome.followed is not None and outcome.followed.text == "finished late"
    assert not outcome.cut_short and outcome.attempts == 1
    assert not _interrupted(emu, chat_id)
    assert [d.stage for d in outcome.decisions] == ["settle", "follow"]


async def test_past_its_turn_deadline_the_attempt_is_stopped_and_resubmitted(
    client: ChatClient, emu: Emulator, sqlite: StateStore
) -> None:
    marker = f"[wf-{uuid.uuid4().hex[:8]}/s]"
    chat_id = await _live_chat(client, emu, marker, {"sleep": 30, "text": "too late"})
    sent_at = time.time() - BUDGET - 1  # the attempt's deadline has passed
    await sqlite.journal.set(
        chat_id, JournalEntry(state="submitting", marker=marker, attempt=0, at=sent_at)
    )
    outcome, _ = await _run(client, sqlite, chat_id, marker, timings=FAST)
    assert outcome.classification == "resubmit" and outcome.cut_short
    assert _interrupted(emu, chat_id)
    assert any(d.decided == "do not follow" for d in outcome.decisions)
    entry = await sqlite.journal.get(chat_id)
    assert entry is not None and (entry.state, entry.attempt) == ("cut-short", 1)


async def test_a_follow_that_cannot_finish_cuts_the_attempt_short(
    client: ChatClient, emu: Emulator, sqlite: StateStore
) -> None:
    marker = f"[wf-{uuid.uuid4().hex[:8]}/s]"
    chat_id = await _live_chat(client, emu, marker, {"sleep": 30, "text": "too late"})
    await sqlite.journal.set(chat_id, JournalEntry(state="submitting", marker=marker, attempt=0))
    short = RecoveryTimings(
        probe_bound=5.0, settle_budget=0.5, poll_interval=0.02, commit_horizon=0.5
    )
    outcome, _ = await _run(client, sqlite, chat_id, marker, timings=short)
    assert outcome.classification == "resubmit" and outcome.cut_short
    assert emu.chat(chat_id)["status"] == "waiting"  # stopped, at rest
    entry = await sqlite.journal.get(chat_id)
    assert entry is not None and (entry.state, entry.attempt) == ("cut-short", 1)


async def test_a_run_that_is_not_this_steps_is_stopped(
    client: ChatClient, emu: Emulator, sqlite: StateStore
) -> None:
    marker = f"[wf-{uuid.uuid4().hex[:8]}/s]"
    chat_id = await _live_chat(client, emu, marker, {"sleep": 30, "text": "other"})
    # the journal's send never landed: count 1 is not past attempt 1
    await sqlite.journal.set(chat_id, JournalEntry(state="submitting", marker=marker, attempt=1))
    outcome, _ = await _run(client, sqlite, chat_id, marker, timings=FAST)
    assert outcome.classification == "resubmit"
    assert _interrupted(emu, chat_id)
    assert not any(d.stage == "follow" for d in outcome.decisions)
