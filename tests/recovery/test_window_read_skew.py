"""The read-skew window of ``TurnRecovery``'s verdict, through the emulator's sockets.

A crashed process's ``POST /messages`` can commit later than its journaled commit
horizon. Recovery then reads the chat's status BEFORE that commit (``waiting``:
nothing ran) and the history AFTER it (the step's user message, no answer yet).
Taking that pair at face value classified the attempt "finished" and returned an
EMPTY answer, while the late turn went on running. The emulator's ``hold_commit``
fault orders the late commit exactly between recovery's last status read and its
history read; recovery must follow the late turn to its answer instead.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from coder_chat.agent import CoderAgent
from coder_chat.emulator import Emulator
from coder_chat.models import ChatInputPart, CreateChatMessageRequest
from coder_chat.recovery import RecoveryTimings, TurnRecovery
from coder_chat.rest import ChatClient
from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state import JournalEntry

FAST = RecoveryTimings(probe_bound=5.0, settle_budget=10.0, poll_interval=0.02, commit_horizon=0.5)
LATE_ANSWER = "The late answer."


def _directive(script: Any) -> str:
    return " #emu " + json.dumps(script)


@pytest.fixture
async def skew_emu() -> AsyncIterator[Emulator]:
    """An emulator of this file's own: the test arms a fault and reads its request log."""
    async with Emulator(delta_delay=0.0) as emu:
        yield emu


@pytest.fixture
async def skew_store(tmp_path: Path) -> AsyncIterator[StateStore]:
    s = StateStore(f"sqlite+aiosqlite:///{tmp_path / 'state.db'}", tenant=uuid.uuid4().hex[:8])
    yield s
    await s.aclose()


def _held(emu: Emulator) -> bool:
    """The server took the hold_commit fault: the send is held, not committed."""
    return any(e["details"].get("fault") == "hold_commit" for e in emu.event_log(["fault"]))


def _requests(emu: Emulator, chat_id: str) -> list[tuple[str, str]]:
    """(method, path) of the chat's requests and the hold's release, in server order."""
    out = []
    for e in emu.event_log(["request", "fault"]):
        d = e["details"]
        if e["kind"] == "fault" and d.get("fault") == "hold_commit_released":
            out.append(("COMMIT", d["path"]))
        elif e["kind"] == "request" and chat_id in d.get("path", ""):
            out.append((d["method"], d["path"].split("?")[0]))
    return out


async def test_a_send_committed_between_the_status_and_the_history_read_is_followed(
    skew_emu: Emulator, skew_store: StateStore
) -> None:
    emu, store = skew_emu, skew_store
    async with ChatClient(emu.base_url, emu.token, organization_id=emu.organization_id) as client:
        first = CoderAgent(client=client, request_timeout=5.0)
        done = await first.generate("[wf/plan] Plan." + _directive({"text": "A plan."}))
        assert done.text == "A plan."
        chat_id = first.chat_id
        assert chat_id is not None
        marker = "[wf/answer]"
        # The crashed process journaled its send (attempt 0) longer ago than the
        # commit horizon: recovery sleeps nothing and trusts its reads.
        await store.journal.set(
            chat_id,
            JournalEntry(state="submitting", marker=marker, attempt=0, at=time.time() - 5.0),
        )
        history = f"/chats/{chat_id}/messages"
        # The server holds the send until recovery's third history read (the count
        # in settle, the recount after the horizon, the result check's read) and
        # commits it right before serving that read: every status read before it
        # saw the chat at rest.
        emu.faults.hold_commit(
            path=history, method="POST", until_method="GET", until_path=history, until_count=3
        )
        before = len(_requests(emu, chat_id))
        script = {"text": LATE_ANSWER, "deltas": 6, "delay": 0.05}
        late = asyncio.create_task(
            client.create_message(
                chat_id,
                CreateChatMessageRequest(
                    content=[ChatInputPart.text_part(f"{marker} Answer." + _directive(script))]
                ),
                timeout=30.0,
            )
        )
        for _ in range(500):
            if _held(emu):
                break
            await asyncio.sleep(0.01)
        assert _held(emu), "the send was not held"
        follower = CoderAgent(client=client, chat_id=chat_id, request_timeout=5.0)
        try:
            outcome = await TurnRecovery(
                client,
                store,
                chat_id,
                marker,
                timings=FAST,
                follower=follower,
                turn_timeout=10.0,
            ).run()
        finally:
            await follower.aclose()
            await first.aclose()
        await late
        seen = _requests(emu, chat_id)[before:]
        decisions = "\n".join(
            f"{d.stage}: {d.seen} -> {d.decided} ({d.why})" for d in outcome.decisions
        )
        # The window really was hit: the last status read before the commit, a
        # history read right after it.
        commit = next(i for i, r in enumerate(seen) if r[0] == "COMMIT")
        status_reads = [p for m, p in seen[:commit] if m == "GET" and p.endswith(chat_id)]
        after = [p for m, p in seen[commit + 1 :] if m == "GET"]
        assert status_reads and after and after[0].endswith("/messages"), seen
        # ...and recovery did not take the unanswered user message for a finished,
        # empty attempt: it followed the late turn to its answer.
        assert outcome.classification == "followed", decisions
        assert outcome.followed is not None and outcome.followed.text == LATE_ANSWER, decisions
        assert emu.chat(chat_id)["status"] == "waiting"


def test_the_pure_rules_of_an_unanswered_attempt() -> None:
    from coder_chat.core.recovery import is_answered

    history = [
        {"id": 1, "role": "user"},
        {"id": 2, "role": "assistant"},
        {"id": 3, "role": "user"},
    ]
    assert is_answered(history, 1)
    assert not is_answered(history, 3)  # the newest user message, nothing after it
    assert not is_answered([*history, {"id": 4, "role": "user"}], 3)  # the next turn began
    assert is_answered(list(reversed([*history, {"id": 5, "role": "assistant"}])), 3)
