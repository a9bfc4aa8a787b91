"""Pure recovery decisions (coder_chat.core.recovery), exhaustively, without sockets."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coder_chat.core.journal import JournalEntry, classify_entry
from coder_chat.core.recovery import (
    LedgerAction,
    SettleAction,
    batch_verdict,
    classify_attempt,
    crashed_pause_budget,
    cut_short_after_interrupt,
    follows_crashed_attempt,
    horizon_remaining,
    is_timeout_result,
    ledger_action,
    lost_outcomes,
    pin_after_horizon,
    poll_verdict,
    scope_journal,
    settle_action,
    split_marker,
)

STATUSES = [
    "waiting",
    "pending",
    "running",
    "paused",
    "completed",
    "error",
    "requires_action",
    "interrupting",
]
STATES = ["submitting", "resumed", "cut-short"]


@dataclass(frozen=True)
class Entry:
    state: str
    marker: str
    attempt: int
    at: float = 0.0
    deadline: float | None = None


# ----------------------------------------------------------------------------- scoping


@given(
    st.sampled_from(STATES),
    st.sampled_from(["[wf/a]", "[wf/b]"]),
    st.integers(0, 5),
    st.integers(0, 5),
)
def test_journal_applies_only_to_this_attempt_of_this_step(
    state: str, marker: str, attempt: int, attempts: int
) -> None:
    entry = Entry(state, marker, attempt)
    scoped = scope_journal(entry, "[wf/a]", attempts)
    assert (scoped is entry) == (marker == "[wf/a]" and attempt == attempts)


def test_no_entry_scopes_to_none() -> None:
    assert scope_journal(None, "[wf/a]", 0) is None


def test_a_resubmission_retires_the_earlier_verdict_by_itself() -> None:
    verdict = Entry("cut-short", "[wf/a]", 1)
    assert scope_journal(verdict, "[wf/a]", 1) is verdict
    # the resubmitted prompt landed: the count grew, the verdict no longer applies
    assert scope_journal(verdict, "[wf/a]", 2) is None


# ----------------------------------------------------------------------------- settle branch


@pytest.mark.parametrize(("status", "state"), list(itertools.product(STATUSES, [None, *STATES])))
def test_settle_branch_table(status: str, state: str | None) -> None:
    journaled = None if state is None else Entry(state, "[wf/a]", 1)
    action = settle_action(status, journaled)
    if status == "requires_action":
        # a pause is reconciled, never interrupted — whatever the journal says
        assert action is SettleAction.RECONCILE
    elif state == "resumed":
        assert action is SettleAction.LET_FINISH
    elif state == "cut-short":
        assert action is SettleAction.REDRIVE_INTERRUPT
    else:
        assert action is SettleAction.INTERRUPT


def test_409_means_never_cut_short_unless_an_interrupt_was_in_flight() -> None:
    assert cut_short_after_interrupt(True, "running") is True
    assert cut_short_after_interrupt(True, "waiting") is True
    assert cut_short_after_interrupt(False, "waiting") is False
    assert cut_short_after_interrupt(False, "running") is False
    assert cut_short_after_interrupt(False, "interrupting") is True


# ----------------------------------------------------------------------------- commit horizon


@given(
    st.sampled_from(STATES),
    st.floats(0, 1000),
    st.floats(0, 2000),
    st.floats(0, 600),
)
def test_horizon_is_slept_only_for_a_matching_submitting_entry(
    state: str, at: float, now: float, horizon: float
) -> None:
    entry = Entry(state, "[wf/a]", 1, at)
    left = horizon_remaining(entry, now, horizon)
    if state != "submitting":
        assert left == 0.0
    else:
        assert left == min(horizon, max(0.0, at + horizon - now))
        assert 0.0 <= left <= horizon
    assert horizon_remaining(None, now, horizon) == 0.0


@given(st.sampled_from(STATES), st.integers(0, 4), st.integers(0, 6))
def test_an_unlanded_send_over_an_existing_attempt_pins_cut_short(
    state: str, attempt: int, now_count: int
) -> None:
    entry = Entry(state, "[wf/a]", attempt)
    expected = state == "submitting" and now_count == attempt and attempt > 0
    assert pin_after_horizon(entry, now_count) is expected
    assert pin_after_horizon(None, now_count) is False


def test_first_send_that_never_landed_does_not_pin() -> None:
    # attempt 0: nothing to mistake for a result; "not submitted" resubmits anyway
    assert pin_after_horizon(Entry("submitting", "[wf/a]", 0), 0) is False


# ----------------------------------------------------------------------------- settle poll


@pytest.mark.parametrize(("status", "cut"), list(itertools.product(STATUSES, [True, False])))
def test_poll_exits(status: str, cut: bool) -> None:
    v = poll_verdict(status, cut)
    if status in ("waiting", "completed", "error"):
        assert v == "settled"
    elif status == "requires_action" and not cut:
        assert v == "paused"  # stable pause: a NEW client tool — reconcile again
    else:
        assert v == "wait"


# ----------------------------------------------------------------------------- ledger


def test_ledger_actions() -> None:
    assert ledger_action("done") is LedgerAction.SUBMIT_RECORDED
    assert ledger_action("committing") is LedgerAction.REDRIVE
    assert ledger_action(None) is LedgerAction.UNSTARTED
    assert ledger_action(None, replayable=True) is LedgerAction.REPLAY
    assert ledger_action("done", replayable=True) is LedgerAction.SUBMIT_RECORDED
    with pytest.raises(ValueError):
        ledger_action("bogus")


@given(st.lists(st.sampled_from(list(LedgerAction)), max_size=6))
def test_one_batch_verdict(actions: list[LedgerAction]) -> None:
    verdict = batch_verdict(actions)
    if not actions:
        assert verdict is None
    elif LedgerAction.UNSTARTED in actions:
        # a mixed batch journals cut-short before even its submission
        assert verdict == "cut-short"
    else:
        assert verdict == "resumed"


# ----------------------------------------------------------------------------- result check


@given(
    st.booleans(),
    st.booleans(),
    st.sampled_from(["waiting", "completed", "error", "requires_action"]),
    st.booleans(),
)
def test_classification_table(submitted: bool, cut: bool, status: str, known: bool) -> None:
    cls, why = classify_attempt(
        submitted=submitted, cut_short=cut, status=status, known_failure=known
    )
    assert why
    if status == "requires_action":
        assert cls == "reconcile"
    elif submitted and not cut and not known and status in ("waiting", "completed"):
        assert cls == "recovered"
    else:
        assert cls == "resubmit"


def test_known_failure_pins_cut_short_even_after_a_409() -> None:
    assert classify_attempt(submitted=True, cut_short=False, status="waiting")[0] == "recovered"
    cls, why = classify_attempt(
        submitted=True, cut_short=False, status="waiting", known_failure=True
    )
    assert cls == "resubmit" and "known" in why


def test_split_marker() -> None:
    assert split_marker("[wf/a] do it", "[wf/a]") == "do it"
    assert split_marker("no marker", "[wf/a]") is None
    assert split_marker("[wf/ab] x", "[wf/a]") is None


# ----------------------------------------------------------------------------- following


@pytest.mark.parametrize(
    ("status", "state", "marker", "entry_attempt", "attempts", "follow"),
    [
        ("running", "submitting", "[wf/a]", 0, 1, True),  # first send landed, still running
        ("running", "submitting", "[wf/a]", 1, 2, True),  # a resubmission landed
        ("pending", "submitting", "[wf/a]", 1, 3, True),  # legacy status; a duplicate landed
        ("running", "submitting", "[wf/a]", 1, 1, False),  # the send never landed
        ("running", "submitting", "[wf/b]", 0, 1, False),  # another step's entry
        ("running", "cut-short", "[wf/a]", 0, 1, False),  # a verdict, not a send
        ("running", "resumed", "[wf/a]", 0, 1, False),
        ("requires_action", "submitting", "[wf/a]", 0, 1, False),  # reconciled instead
        ("interrupting", "submitting", "[wf/a]", 0, 1, False),  # somebody stops it
        ("waiting", "submitting", "[wf/a]", 0, 1, False),  # settled: the result check
    ],
)
def test_follow_only_this_steps_landed_live_attempt(
    status: str, state: str, marker: str, entry_attempt: int, attempts: int, follow: bool
) -> None:
    entry = Entry(state, marker, entry_attempt)
    assert follows_crashed_attempt(status, entry, "[wf/a]", attempts) is follow


def test_no_entry_is_never_followed() -> None:
    assert not follows_crashed_attempt("running", None, "[wf/a]", 1)


@given(st.floats(0, 1e6), st.floats(0, 1e6), st.floats(1, 1e4))
def test_follow_budget_is_the_attempts_own_deadline(at: float, now: float, turn: float) -> None:
    landed = JournalEntry.submitting("[wf/a]", 0, at=at)  # no deadline: at + our turn
    left = classify_entry(landed, "[wf/a]", 1, turn_timeout=turn).left(now)
    # a clock running behind never stretches the turn (the deadline is at + turn, so
    # deadline - at is the turn up to a rounding of the sum)
    assert left <= turn or left == pytest.approx(turn)
    assert left == pytest.approx(min(turn, at + turn - now))
    assert (left > 0) == (at + turn - now > 0)


# ----------------------------------------------------------------------------- lost outcomes


@pytest.mark.parametrize(
    ("output", "is_error", "timed_out"),
    [
        ('"Tool execution timed out"', True, True),  # as stored: the JSON string
        ("Tool execution timed out", True, True),
        ({"error": "Tool execution timed out"}, True, True),
        ("Tool execution timed out", False, False),  # not an error: a tool's own text
        ('"Tool execution interrupted by user"', True, False),
        ({"charged_cents": 100}, True, False),
        (None, True, False),
    ],
)
def test_timeout_result(output: object, is_error: bool, timed_out: bool) -> None:
    assert is_timeout_result(output, is_error) is timed_out


def test_lost_outcomes_need_a_timeout_and_a_ledger_effect() -> None:
    t = '"Tool execution timed out"'
    results = [
        ("c1", "charge", t, True),  # done: the effect committed
        ("c2", "charge", t, True),  # committing: it may have
        ("c3", "charge", t, True),  # no entry: it never ran — the timeout is true
        ("c4", "charge", {"ok": 1}, False),  # answered normally
    ]
    states = {"c1": "done", "c2": "committing", "c3": None, "c4": "done"}
    assert lost_outcomes(results, states) == [
        ("c1", "charge", "done"),
        ("c2", "charge", "committing"),
    ]


# --------------------------------------------------------------------------- issue 15 / 11 rules


def _pause_budget(
    state: str | None,
    attempt: int | None,
    attempts: int,
    *,
    now: float = 103.0,
    entry_marker: str = "[w/s]",
) -> object:
    entry = None if state is None else Entry(state, entry_marker, attempt or 0, at=100.0)
    reading = classify_entry(entry, "[w/s]", attempts, turn_timeout=10.0)
    return crashed_pause_budget(reading, now, revived_s=10.0)


def test_a_crashed_attempts_pause_is_answered_within_its_own_deadline() -> None:
    # the landed send of attempt 0: 7 s of its 10 s turn are left
    assert _pause_budget("submitting", 0, 1) == pytest.approx(7.0)
    # a resubmission (count was 1 before it) that landed
    assert _pause_budget("submitting", 1, 2) == pytest.approx(7.0)
    # a writer's clock ahead never stretches the turn
    assert _pause_budget("submitting", 0, 1, now=50.0) == pytest.approx(10.0)
    # an earlier recovery pass revived this very attempt: a turn budget
    assert _pause_budget("resumed", 1, 1) == pytest.approx(10.0)


@pytest.mark.parametrize(
    ("state", "attempt", "attempts", "kw"),
    [
        ("submitting", 0, 1, {"now": 110.0}),  # the deadline passed
        ("submitting", 0, 1, {"now": 200.0}),
        ("submitting", 1, 1, {}),  # the send never landed: the pause is not its
        ("submitting", 0, 0, {}),  # no attempt of the step in history
        ("cut-short", 1, 1, {}),  # a verdict stands
        ("resumed", 0, 1, {}),  # another attempt's verdict
        (None, None, 1, {}),  # no entry
        ("submitting", 0, 1, {"entry_marker": "[w/other]"}),  # another step's entry
    ],
)
def test_a_pause_that_is_not_the_crashed_attempts_own_is_cut_short(
    state: str | None, attempt: int | None, attempts: int, kw: dict[str, Any]
) -> None:
    assert _pause_budget(state, attempt, attempts, **kw) is None


def _msg(mid: int, role: str, text: str) -> dict[str, object]:
    return {"id": mid, "role": role, "content": [{"type": "text", "text": text}]}


def test_step_attempts_find_the_last_attempt_and_whether_the_workflow_moved_on() -> None:
    from coder_chat.core.attempts import StepAttempts

    history = [
        _msg(1, "user", "[w/a] first"),
        _msg(2, "assistant", "A"),
        _msg(3, "user", "[w/b] second"),
        _msg(4, "assistant", "B, cut"),
        _msg(5, "user", "[w/b] second again"),
        _msg(6, "assistant", "B"),
        _msg(7, "user", "[w/c] third"),
    ]
    a = StepAttempts.of(reversed(history), "[w/a]")  # any order
    assert (a.attempts, a.last_user_message_id, a.tail) == (1, 1, False)
    b = StepAttempts.of(history, "[w/b]")
    assert (b.attempts, b.last_user_message_id, b.tail) == (2, 5, False)
    c = StepAttempts.of(history, "[w/c]")
    assert (c.attempts, c.last_user_message_id, c.tail) == (1, 7, True)
    d = StepAttempts.of(history, "[w/d]")
    assert (d.attempts, d.last_user_message_id, d.tail) == (0, None, False)
    assert StepAttempts.of(history[:6], "[w/b]").tail  # b's resubmission is the newest turn


def test_an_archived_chats_newest_attempt_is_trusted_only_on_positive_evidence() -> None:
    from prefect_coder.blocks.state import JournalEntry
    from prefect_coder.flows.recovery.from_history import archived_tail_finished

    def e(state: str, attempt: int, marker: str = "[w/s]") -> JournalEntry:
        return JournalEntry(state=state, marker=marker, attempt=attempt)  # type: ignore[arg-type]

    assert archived_tail_finished(e("submitting", 0), "[w/s]", 1, "waiting")[0]
    assert archived_tail_finished(e("resumed", 1), "[w/s]", 1, "waiting")[0]
    for entry, attempts, status in [
        (e("cut-short", 1), 1, "waiting"),  # the archive (or a failure) cut it short
        (e("submitting", 1), 1, "waiting"),  # an unlanded resubmission over a cut attempt
        (e("submitting", 0), 1, "error"),
        (e("resumed", 0), 1, "waiting"),
        (e("submitting", 0, "[w/other]"), 1, "waiting"),
        (None, 1, "waiting"),  # an older archive dropped the entry: not trusted
    ]:
        finished, why = archived_tail_finished(entry, "[w/s]", attempts, status)
        assert not finished and why, (entry, attempts, status)
