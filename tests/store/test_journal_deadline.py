"""``JournalEntry.deadline``, the attempt's turn deadline: written and read back by every
journal path (``journal.set``/``get``, ``turns.begin``, ``turns.record``, a
transaction), never inherited by an entry written without one — on both backends."""

from __future__ import annotations

import pytest

from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state import JournalEntry


async def test_journal_set_get_round_trips_the_deadline_and_never_inherits_it(
    store: StateStore,
) -> None:
    sent = JournalEntry(state="submitting", marker="[wf/s1]", attempt=0, at=100.0, deadline=160.5)
    assert (await store.journal.set("chat", sent)).deadline == 160.5
    got = await store.journal.get("chat")
    assert got is not None and (got.at, got.deadline) == pytest.approx((100.0, 160.5), abs=1.0)
    # A verdict carries no deadline: the row's old one must not survive under it.
    await store.journal.set(
        "chat", JournalEntry(state="cut-short", marker="[wf/s1]", attempt=1, at=101.0)
    )
    got = await store.journal.get("chat")
    assert got is not None and (got.state, got.deadline) == ("cut-short", None)
    async with store.transaction() as tx:
        await tx.journal.set(
            "chat",
            JournalEntry(state="resumed", marker="[wf/s1]", attempt=1, at=102.0, deadline=132.0),
        )
    got = await store.journal.get("chat")
    assert got is not None and (got.state, got.deadline) == (
        "resumed",
        pytest.approx(132.0, abs=1.0),
    )


async def test_begin_records_the_write_aheads_deadline_and_returns_a_stored_one(
    store: StateStore,
) -> None:
    await store.checkpoints.set("wf", "chat", 3)
    start = await store.turns.begin("wf", "[wf/s1]", at=200.0, turn_timeout_s=45.0)
    assert start.journaled and start.journal is not None
    assert (start.journal.at, start.journal.deadline) == pytest.approx((200.0, 245.0), abs=1.0)
    stored = await store.journal.get("chat")
    assert stored is not None and stored.deadline == pytest.approx(245.0, abs=1.0)
    # The same marker again: nothing written, the stored entry (deadline too) comes back.
    again = await store.turns.begin("wf", "[wf/s1]", turn_timeout_s=5.0)
    assert not again.journaled and again.journal is not None
    assert again.journal.deadline == pytest.approx(245.0, abs=1.0)
    # The next step's write-ahead: the entry it replaced keeps its deadline.
    nxt = await store.turns.begin("wf", "[wf/s2]", at=300.0, turn_timeout_s=10.0)
    assert nxt.journal is not None and nxt.journal.deadline == 310.0
    assert nxt.replaced is not None and nxt.replaced.deadline == pytest.approx(245.0, abs=1.0)
    # Without a turn timeout nothing is recorded (and nothing inherited).
    last = await store.turns.begin("wf", "[wf/s3]", at=400.0)
    assert last.journal is not None and last.journal.deadline is None
    stored = await store.journal.get("chat")
    assert stored is not None and (stored.marker, stored.deadline) == ("[wf/s3]", None)


async def test_record_writes_the_first_sends_deadline_with_its_checkpoint(
    store: StateStore,
) -> None:
    first = JournalEntry(state="submitting", marker="[wf/s1]", attempt=0, at=10.0, deadline=40.0)
    await store.turns.record("wf", "chat", None, journal=first)
    got = await store.journal.get("chat")
    assert got is not None and (got.at, got.deadline) == pytest.approx((10.0, 40.0), abs=1.0)
