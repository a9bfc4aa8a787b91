"""Journal times on one clock, the store's (issue 30: "deadlines and lease ages compared
across processes use one clock"), on SQLite and PostgreSQL.

A journal entry's ``at`` / ``deadline`` are written by one worker and compared by
another with its own clock (the stuck-turn sweep: is the crashed attempt still within
its turn? recovery: is the commit window over?). The store keeps them on the database
clock and hands them in and back on each process's own (``StateStore(clock=...)``,
``time.time`` in production; here two workers whose clocks disagree by five minutes).
Before, a writer whose clock ran behind made every reader see its live attempt's
deadline long past — the sweep cut a live turn short.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

import pytest

from coder_chat.core.journal import classify_entry
from prefect_coder.blocks.state import JournalEntry, StateStore

SKEW_S = 300.0
TURN_S = 60.0


def _clock(offset: float) -> Callable[[], float]:
    return lambda: time.time() + offset


@pytest.fixture
async def workers(store_url: str, tenant: str) -> AsyncIterator[tuple[StateStore, StateStore]]:
    """A writer whose clock runs five minutes behind, a reader five minutes ahead."""
    behind = StateStore(store_url, tenant=tenant, clock=_clock(-SKEW_S))
    ahead = StateStore(store_url, tenant=tenant, clock=_clock(+SKEW_S))
    yield behind, ahead
    await behind.aclose()
    await ahead.aclose()


def _left(entry: JournalEntry | None, now: float) -> float | None:
    """What the sweep and recovery compute (the pure part): seconds left of the live
    attempt's turn, its send landed (history holds one attempt)."""
    assert entry is not None
    return classify_entry(entry, "[m]", 1, turn_timeout=600).crashed_attempt_left(now)


async def test_a_deadline_written_behind_reads_the_same_ahead(
    workers: tuple[StateStore, StateStore],
) -> None:
    behind, ahead = workers
    sent = JournalEntry.submitting("[m]", 0, turn_timeout=TURN_S, at=behind.clock())
    await behind.journal.set("chat-1", sent)
    got = await ahead.journal.get("chat-1")
    assert got is not None
    # On the reader's clock: written just now, the deadline one turn from now.
    assert abs(got.at - ahead.clock()) < 2.0
    assert got.deadline is not None and got.deadline - got.at == pytest.approx(TURN_S, abs=0.01)
    left = _left(got, ahead.clock())
    assert left is not None and TURN_S - 2.0 < left <= TURN_S
    # And back on the writer's own clock, as it wrote it (a round trip is exact).
    again = await behind.journal.get("chat-1")
    assert again is not None and again.at == pytest.approx(sent.at, abs=1.0)


async def test_store_turns_use_the_same_clock(workers: tuple[StateStore, StateStore]) -> None:
    """The turn's one-trip writes and reads (``store.turns``) convert as the journal does."""
    behind, ahead = workers
    entry = JournalEntry.submitting("[m]", 0, turn_timeout=TURN_S, at=behind.clock())
    await behind.turns.record("wf", "chat-2", None, journal=entry)  # the eager checkpoint
    start = await ahead.turns.begin("wf", "[m]", turn_timeout_s=TURN_S)
    assert not start.journaled and start.journal is not None
    assert abs(start.journal.at - ahead.clock()) < 2.0
    left = _left(start.journal, ahead.clock())
    assert left is not None and TURN_S - 2.0 < left <= TURN_S
    # A write-ahead made by turns.begin of the worker behind, read ahead.
    start = await behind.turns.begin("wf", "[m2]", turn_timeout_s=TURN_S)
    assert start.journaled
    got = await ahead.journal.get("chat-2")
    assert got is not None and got.marker == "[m2]" and abs(got.at - ahead.clock()) < 2.0
    assert got.deadline is not None and got.deadline - got.at == pytest.approx(TURN_S, abs=0.01)
