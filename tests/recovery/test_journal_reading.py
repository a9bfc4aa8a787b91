"""coder_chat.core.journal: the named constructors and the one classification of an
entry against a step, table-driven and pure (no sockets, no store)."""

from __future__ import annotations

import pytest

from coder_chat.core.journal import JournalEntry, Standing, classify_entry
from prefect_coder.blocks.state import JournalEntry as StoredEntry

M = "[wf/s]"


def test_the_store_keeps_the_one_model() -> None:
    assert StoredEntry is JournalEntry


def test_named_constructors() -> None:
    sent = JournalEntry.submitting(M, 2, turn_timeout=30.0, at=100.0)
    assert (sent.state, sent.marker, sent.attempt, sent.at, sent.deadline) == (
        "submitting", M, 2, 100.0, 130.0,
    )  # fmt: skip
    assert JournalEntry.submitting(M, 0, at=5.0).deadline is None
    revived = JournalEntry.resumed(M, 1, turn_timeout=10.0, at=50.0)
    assert (revived.state, revived.deadline) == ("resumed", 60.0)
    cut = JournalEntry.cut_short(M, 1, at=7.0)
    assert (cut.state, cut.attempt, cut.at, cut.deadline) == ("cut-short", 1, 7.0, None)
    # without ``at``: now, and the deadline counts from it
    fresh = JournalEntry.submitting(M, 0, turn_timeout=20.0)
    assert fresh.deadline == pytest.approx(fresh.at + 20.0)


def _e(state: str, attempt: int, marker: str = M, deadline: float | None = None) -> JournalEntry:
    return JournalEntry(
        state=state,  # type: ignore[arg-type]
        marker=marker,
        attempt=attempt,
        at=100.0,
        deadline=deadline,
    )


@pytest.mark.parametrize(
    ("entry", "attempts", "standing"),
    [
        (None, 0, Standing.OTHER_STEP),
        (None, 3, Standing.OTHER_STEP),
        (_e("submitting", 0, "[wf/other]"), 1, Standing.OTHER_STEP),
        (_e("submitting", 0), 0, Standing.UNSENT),  # write-ahead, nothing landed yet
        (_e("submitting", 1), 1, Standing.UNSENT),  # a resubmission not landed
        (_e("submitting", 0), 1, Standing.LANDED),  # the send landed
        (_e("submitting", 1), 3, Standing.LANDED),  # (and a duplicate)
        (_e("submitting", 2), 1, Standing.STALE),  # history shorter than the entry
        (_e("resumed", 1), 1, Standing.REVIVED),
        (_e("resumed", 0), 0, Standing.REVIVED),
        (_e("resumed", 0), 1, Standing.STALE),  # the count moved on
        (_e("cut-short", 1), 1, Standing.CUT_SHORT),
        (_e("cut-short", 1), 2, Standing.STALE),  # a resubmission retired the verdict
    ],
)
def test_standing(entry: JournalEntry | None, attempts: int, standing: Standing) -> None:
    reading = classify_entry(entry, M, attempts)
    assert reading.standing is standing
    assert reading.this_attempt == (
        standing in (Standing.UNSENT, Standing.REVIVED, Standing.CUT_SHORT)
    )


@pytest.mark.parametrize(
    ("deadline", "turn_timeout", "expected"),
    [
        (160.0, 20.0, 160.0),  # recorded: the step's own, not the reader's
        (110.0, 20.0, 110.0),  # a shorter recorded one too
        (None, 20.0, 120.0),  # none recorded: at + the reader's turn timeout
        (90.0, 20.0, 120.0),  # not after the send: ignored
        (None, None, None),  # nothing to go by
    ],
)
def test_deadline_recorded_else_the_readers_fallback(
    deadline: float | None, turn_timeout: float | None, expected: float | None
) -> None:
    reading = classify_entry(
        _e("submitting", 0, deadline=deadline), M, 1, turn_timeout=turn_timeout
    )
    assert reading.deadline == expected


@pytest.mark.parametrize(
    ("state", "attempt", "attempts", "now", "left"),
    [
        ("submitting", 0, 1, 105.0, 55.0),  # landed: deadline - now
        ("submitting", 0, 1, 40.0, 60.0),  # our clock behind the writer's: never more
        ("submitting", 0, 1, 161.0, None),  # past the deadline
        ("resumed", 1, 1, 150.0, 10.0),  # revived: counted from the revival
        ("resumed", 0, 0, 150.0, None),  # no attempt in history: nothing live
        ("submitting", 1, 1, 105.0, None),  # not landed
        ("cut-short", 1, 1, 105.0, None),
    ],
)
def test_crashed_attempt_left(
    state: str, attempt: int, attempts: int, now: float, left: float | None
) -> None:
    reading = classify_entry(_e(state, attempt, deadline=160.0), M, attempts, turn_timeout=5.0)
    got = reading.crashed_attempt_left(now)
    assert got == (None if left is None else pytest.approx(left))


def test_turn_s_is_the_recorded_span_else_the_fallback() -> None:
    assert _e("resumed", 1, deadline=160.0).turn_s(20.0) == 60.0
    assert _e("resumed", 1).turn_s(20.0) == 20.0
