"""Redial budget: 1 s doubling to a 30 s cap, no jitter, 5 consecutive endings."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coder_chat.core.backoff import BackoffPolicy, RedialBudget


def test_default_schedule_fails_on_fifth_ending() -> None:
    budget = RedialBudget()
    waits = []
    for _ in range(4):
        decision = budget.connection_ended(progressed=False)
        assert not decision.give_up
        waits.append(decision.backoff_ms)
    assert waits == [1000, 2000, 4000, 8000]
    final = budget.connection_ended(progressed=False)
    assert final.give_up and final.consecutive_failures == 5


def test_cap_and_reset_on_progress() -> None:
    budget = RedialBudget(BackoffPolicy(max_consecutive_failures=100))
    waits = [budget.connection_ended(progressed=False).backoff_ms for _ in range(8)]
    assert waits == [1000, 2000, 4000, 8000, 16000, 30000, 30000, 30000]
    budget.progress()
    assert budget.consecutive_failures == 0 and budget.next_backoff_ms == 1000
    # a connection that progressed and then dropped waits the initial backoff and
    # counts as the outage's first failure
    decision = budget.connection_ended(progressed=True)
    assert (decision.give_up, decision.consecutive_failures, decision.backoff_ms) == (
        False,
        1,
        1000,
    )


def test_outage_after_progress_fails_on_fifth_ending_after_15_s() -> None:
    """As the reference SDK: the drop that starts an outage is ending #1, so a dead
    network after a healthy stream costs 1 + 2 + 4 + 8 = 15 s, not 31 s."""
    budget = RedialBudget()
    budget.progress()  # events flowed on the connection that now drops
    waits = []
    decision = budget.connection_ended(progressed=True)
    while not decision.give_up:
        waits.append(decision.backoff_ms)
        decision = budget.connection_ended(progressed=False)
    assert waits == [1000, 2000, 4000, 8000] and sum(waits) == 15_000
    assert decision.consecutive_failures == 5


def test_invalid_policies_rejected() -> None:
    with pytest.raises(ValueError):
        BackoffPolicy(initial_ms=10, cap_ms=5)
    with pytest.raises(ValueError):
        BackoffPolicy(max_consecutive_failures=0)


@given(st.lists(st.booleans(), max_size=60))
def test_gives_up_on_the_fifth_ending_since_progress(outcomes: list[bool]) -> None:
    policy = BackoffPolicy(initial_ms=1, cap_ms=16, max_consecutive_failures=5)
    budget = RedialBudget(policy)
    run = 0
    for progressed in outcomes:
        if progressed:
            budget.progress()
            run = 0
        run += 1  # every ending counts, the progressing one included
        decision = budget.connection_ended(progressed=progressed)
        assert decision.give_up == (run >= 5)
        if decision.give_up:
            return
        assert 1 <= decision.backoff_ms <= 16
        assert decision.consecutive_failures == run
