"""The durable turn's pure decision, as a table (like ``coder_chat/core``'s tests): one
row per situation the turn can be in, and the one act each must get. The rows follow
the code paths of the turn before it was a controller: a first turn with or without
an orphan to look for, a checkpointed chat recovered before any send, an archived
checkpoint (adopted chat, fresh chat), a finished attempt returned, a structured answer
re-asked once, a running attempt followed. A property test drives :func:`decide`
through whole turns against arbitrary findings."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coder_chat.core.usage import Usage
from coder_chat.results import GenerateResult
from prefect_coder.flows.common.results import TurnResult
from prefect_coder.flows.turn.decide import (
    Action,
    AfterSends,
    Answered,
    Archived,
    CheckOrphans,
    CheckpointChat,
    CheckpointFirstSend,
    FailStructured,
    Finished,
    Follow,
    Found,
    MoveToChat,
    MoveToFreshChat,
    Reask,
    Recover,
    Return,
    Running,
    Send,
    Settle,
    StandDown,
    StrandChats,
    TurnSnapshot,
    Unsent,
    after_sends,
    decide,
)

PLAIN = TurnResult(
    workflow_id="wf", step="s", marker="[wf/s]", chat_id="c1", text="done", generate_ms=0.0
)
ANSWERED = PLAIN.model_copy(update={"structured": {"ok": True}})
GEN = GenerateResult(
    text="done",
    finish_reason="stop",
    raw_status="completed",
    usage=Usage(),
    steps=[],
    chat_id="c1",
    user_message_id=7,
    message_ids=[8],
    client_tool_calls=[],
    server_tool_calls=[],
    server_tool_results=[],
)


def snap(**kw: Any) -> TurnSnapshot:
    return TurnSnapshot(**kw)


ROWS: list[tuple[str, TurnSnapshot, Action]] = [
    # --- the workflow's lease lost (another run took it over): no act on its chat
    ("lease lost before a first turn's send", snap(fence_lost=True), StandDown()),
    (
        "lease lost before the orphan check",
        snap(orphans_pending=True, fence_lost=True),
        StandDown(),
    ),
    ("lease lost before recovery", snap(chat_id="c1", fence_lost=True), StandDown()),
    (
        "lease lost with the running attempt found: not followed",
        snap(chat_id="c1", found=Running(1, GEN), fence_lost=True),
        StandDown(),
    ),
    (
        "lease lost with a finished attempt found: not returned",
        snap(chat_id="c1", found=Finished(1, PLAIN), fence_lost=True),
        StandDown(),
    ),
    (
        "lease lost after the send settled: the finally's concern, settle",
        snap(chat_id="c1", answered=Answered(), fence_lost=True),
        Settle(1),
    ),
    # --- a first turn: no checkpoint
    (
        "no checkpoint, an earlier hold of the lease: look for the crashed first try's chat",
        snap(orphans_pending=True),
        CheckOrphans(),
    ),
    ("no checkpoint, first hold of the lease: send, creating the chat", snap(), Send(1)),
    (
        "orphan check done, nothing adopted: send (the checkpoint comes with it)",
        snap(orphans_pending=False),
        Send(1),
    ),
    (
        "an orphan adopted (the checkpoint now): recover it, never send it again",
        snap(chat_id="o1", orphans_pending=True),
        Recover("o1"),
    ),
    # --- a checkpointed chat: recovered before any send
    ("checkpointed chat: recover before sending", snap(chat_id="c1"), Recover("c1")),
    (
        "structured step, checkpointed chat: recover before sending",
        snap(chat_id="c1", structured=True),
        Recover("c1"),
    ),
    (
        "journal proves the step never sent: send attempt 1",
        snap(chat_id="c1", found=Unsent(1)),
        Send(1),
    ),
    (
        "earlier attempts cut short and journaled for a resubmission: send attempt 3",
        snap(chat_id="c1", found=Unsent(3)),
        Send(3),
    ),
    (
        "the earlier attempt still runs: follow it, send nothing",
        snap(chat_id="c1", found=Running(2, GEN)),
        Follow(2, GEN),
    ),
    (
        "the earlier attempt finished, its result lost: return it",
        snap(chat_id="c1", found=Finished(2, PLAIN)),
        Return(PLAIN),
    ),
    (
        "structured step, the finished attempt answered: return it",
        snap(chat_id="c1", structured=True, found=Finished(1, ANSWERED)),
        Return(ANSWERED),
    ),
    (
        "structured step, finished without an answer, not the re-ask: re-ask as the next attempt",
        snap(chat_id="c1", structured=True, found=Finished(1, PLAIN), finished_was_reask=False),
        Reask(2),
    ),
    (
        "structured step, the finished re-ask had no answer either: the step fails",
        snap(chat_id="c1", structured=True, found=Finished(2, PLAIN), finished_was_reask=True),
        FailStructured(2),
    ),
    (
        "structured step, finished without an answer, prompt unread: no third prompt on a guess",
        snap(chat_id="c1", structured=True, found=Finished(2, PLAIN)),
        FailStructured(2),
    ),
    # --- an archived checkpoint
    (
        "archived, an earlier fresh chat holds the step: move there and recover it",
        snap(chat_id="c1", found=Archived(adopted="o2")),
        MoveToChat("o2"),
    ),
    (
        "moved to an adopted chat: recover the step there",
        snap(chat_id="o2", moved=True),
        Recover("o2"),
    ),
    (
        "the adopted chat is archived too: a fresh chat, no second adoption",
        snap(chat_id="o2", moved=True, found=Archived(adopted="o3")),
        MoveToFreshChat(1),
    ),
    (
        "archived, no finished attempt, nothing to adopt: a fresh chat",
        snap(chat_id="c1", found=Archived()),
        MoveToFreshChat(1),
    ),
    (
        "in a fresh chat: send attempt 1 (the orphan check ran with the archive's)",
        snap(chat_id=None, moved=False, attempt=1),
        Send(1),
    ),
    # --- after a send (or a followed attempt)
    ("a plain step's send settled: settle", snap(chat_id="c1", answered=Answered()), Settle(1)),
    (
        "a first turn's send settled (no chat before it): settle",
        snap(orphans_pending=True, answered=Answered()),
        Settle(1),
    ),
    (
        "a structured answer validated: settle",
        snap(structured=True, attempt=2, answered=Answered(valid=True)),
        Settle(2),
    ),
    (
        "no valid answer on an idle chat, the prompt was not the re-ask: re-ask once",
        snap(structured=True, attempt=2, answered=Answered(valid=False, was_reask=False)),
        Reask(3),
    ),
    (
        "a followed attempt that was the re-ask: no second re-ask, settle (and fail)",
        snap(structured=True, attempt=2, answered=Answered(valid=False, was_reask=True)),
        Settle(2),
    ),
    (
        "no valid answer, the prompt unread: settle (and fail) rather than guess",
        snap(structured=True, answered=Answered(valid=False)),
        Settle(1),
    ),
    (
        "no valid answer on a busy or paused chat: never re-prompted",
        snap(structured=True, answered=Answered(valid=False, idle=False, was_reask=False)),
        Settle(1),
    ),
    (
        "the re-ask answered nothing either: settle (and fail), never a third prompt",
        snap(
            structured=True,
            attempt=3,
            reasked=True,
            answered=Answered(valid=False, was_reask=False),
        ),
        Settle(3),
    ),
    (
        "a plain step is never re-asked",
        snap(structured=False, answered=Answered(valid=False, was_reask=False)),
        Settle(1),
    ),
]


@pytest.mark.parametrize(("situation", "snapshot", "expected"), ROWS, ids=[r[0] for r in ROWS])
def test_decide(situation: str, snapshot: TurnSnapshot, expected: Action) -> None:
    assert decide(snapshot) == expected, situation


AFTER: list[tuple[str, AfterSends, StrandChats | CheckpointChat | CheckpointFirstSend]] = [
    (
        "the stream was lost on the chat the call created: stranded for the sweep",
        AfterSends(on_chat=False, failed=True),
        StrandChats(),
    ),
    ("a discarded session that did not fail", AfterSends(on_chat=False), StrandChats()),
    (
        "a checkpointed chat's sends were journaled before they left: the cursor only",
        AfterSends(on_chat=True, had_chat=True),
        CheckpointChat(),
    ),
    (
        "a checkpointed chat whose send failed: the cursor only (note_failed_attempt journals)",
        AfterSends(on_chat=True, had_chat=True, failed=True),
        CheckpointChat(),
    ),
    (
        "a first send finished, its entry not written: attempt 0 unless the entry names it",
        AfterSends(on_chat=True),
        CheckpointFirstSend(attempt=0, unless_named=True),
    ),
    (
        "a first send failed: attempt 1, so the retry pins it cut short and resubmits",
        AfterSends(on_chat=True, failed=True),
        CheckpointFirstSend(attempt=1, unless_named=False),
    ),
    (
        "a first send failed transiently and left its run live: attempt 0, the retry follows",
        AfterSends(on_chat=True, failed=True, left_live=True),
        CheckpointFirstSend(attempt=0, unless_named=True),
    ),
    (
        "the eager checkpoint journaled the first send: one trip, no read",
        AfterSends(on_chat=True, eagerly_journaled=True),
        CheckpointChat(),
    ),
    (
        "eagerly journaled, then the send failed: attempt 1 with the checkpoint",
        AfterSends(on_chat=True, failed=True, eagerly_journaled=True),
        CheckpointChat(journal=1),
    ),
    (
        "eagerly journaled, a transient failure left the run live: nothing added",
        AfterSends(on_chat=True, failed=True, left_live=True, eagerly_journaled=True),
        CheckpointChat(),
    ),
]


@pytest.mark.parametrize(("situation", "after", "expected"), AFTER, ids=[r[0] for r in AFTER])
def test_after_sends(
    situation: str,
    after: AfterSends,
    expected: StrandChats | CheckpointChat | CheckpointFirstSend,
) -> None:
    assert after_sends(after) == expected, situation


# --- whole turns against arbitrary findings -------------------------------------------

FINDINGS = st.one_of(
    st.builds(Unsent, st.integers(1, 4)),
    st.builds(Finished, st.integers(1, 4), st.sampled_from([PLAIN, ANSWERED])),
    st.builds(Running, st.integers(1, 4), st.just(GEN)),
    st.builds(Archived, st.sampled_from([None, "o2", "o3"])),
)
ANSWERS = st.builds(Answered, st.booleans(), st.booleans(), st.sampled_from([None, True, False]))


@settings(max_examples=300, deadline=None)
@given(
    chat=st.sampled_from([None, "c1"]),
    orphans=st.booleans(),
    adopted=st.sampled_from([None, "o1"]),
    structured=st.booleans(),
    findings=st.lists(FINDINGS, min_size=3, max_size=3),
    finished_was_reask=st.sampled_from([None, True, False]),
    answers=st.lists(ANSWERS, min_size=3, max_size=3),
    lost_at=st.none() | st.integers(0, 6),
)
def test_a_whole_turn_ends_and_never_sends_beside_an_attempt(
    chat: str | None,
    orphans: bool,
    adopted: str | None,
    structured: bool,
    findings: list[Found],
    finished_was_reask: bool | None,
    answers: list[Answered],
    lost_at: int | None,
) -> None:
    s = TurnSnapshot(chat_id=chat, orphans_pending=chat is None and orphans, structured=structured)
    acts: list[Action] = []
    for i in range(12):
        if lost_at is not None and i >= lost_at:
            s = dataclasses.replace(s, fence_lost=True)
        action = decide(s)
        acts.append(action)
        if s.fence_lost and s.answered is None:
            assert action == StandDown(), acts  # nothing more on another run's chat
        if isinstance(action, CheckOrphans):
            s = TurnSnapshot(chat_id=adopted, structured=structured)
        elif isinstance(action, Recover):
            found = findings.pop(0)
            s = TurnSnapshot(
                chat_id=action.chat_id,
                structured=structured,
                found=found,
                moved=s.moved,
                finished_was_reask=finished_was_reask,
            )
            # What recovery found before a send rules it: a live attempt is followed,
            # a finished one returned, never a send of the step beside it.
            if isinstance(found, Running):
                assert decide(s) == Follow(found.attempt, found.gen)
            if isinstance(found, Finished) and (not structured or found.result.structured):
                assert decide(s) == Return(found.result)
        elif isinstance(action, MoveToChat):
            s = TurnSnapshot(chat_id=action.chat_id, structured=structured, moved=True)
        elif isinstance(action, MoveToFreshChat):
            s = TurnSnapshot(chat_id=None, structured=structured, attempt=action.attempt)
        elif isinstance(action, (Send, Follow, Reask)):
            reasked = s.reasked or isinstance(action, Reask)
            s = TurnSnapshot(
                chat_id=s.chat_id,
                structured=structured,
                attempt=action.attempt,
                answered=answers.pop(0),
                reasked=reasked,
            )
        else:
            break
    assert isinstance(acts[-1], (Return, FailStructured, Settle, StandDown)), acts  # it ends
    assert sum(isinstance(a, (Send, Follow)) for a in acts) <= 1, acts  # one send of the step
    assert sum(isinstance(a, Reask) for a in acts) <= 1, acts  # re-asked once at most
    assert not any(isinstance(a, Reask) for a in acts) or structured, acts
    assert sum(isinstance(a, MoveToChat) for a in acts) <= 1, acts
    assert sum(isinstance(a, CheckOrphans) for a in acts) <= 1, acts
    # The send, if any, comes after the chat's recovery: nothing before it sends.
    first_send = next((i for i, a in enumerate(acts) if isinstance(a, (Send, Reask))), None)
    if first_send is not None and chat is not None:
        assert any(isinstance(a, Recover) for a in acts[:first_send]), acts
    # Attempts never go back.
    numbers = [a.attempt for a in acts if isinstance(a, (Send, Follow, Reask, Settle))]
    assert numbers == sorted(numbers), acts
