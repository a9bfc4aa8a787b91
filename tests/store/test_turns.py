"""``store.turns``: a turn's begin (checkpoint + journal + write-ahead) and record, on both backends."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state import JournalEntry


async def test_begin_without_checkpoint_writes_nothing(store: StateStore) -> None:
    start = await store.turns.begin("wf", "[wf/s1]")
    assert (start.checkpoint, start.journal, start.journaled) == (None, None, False)
    assert await store.journal.get("chat") is None


async def test_begin_journals_a_new_marker_and_returns_an_existing_one(store: StateStore) -> None:
    await store.checkpoints.set("wf", "chat", 7)
    first = await store.turns.begin("wf", "[wf/s1]", at=123.0)
    assert first.checkpoint is not None
    assert (first.checkpoint.chat_id, first.checkpoint.last_seen_message_id) == ("chat", 7)
    assert first.journaled
    assert first.journal is not None
    assert (first.journal.state, first.journal.marker, first.journal.attempt) == (
        "submitting",
        "[wf/s1]",
        0,
    )
    assert first.journal.at == 123.0
    assert first.journal.updated_at is not None  # stamped by the database clock
    assert first.checkpoint.updated_at is not None
    stored = await store.journal.get("chat")
    assert (
        stored is not None
        and stored.marker == "[wf/s1]"
        and stored.at == pytest.approx(123.0, abs=1.0)
    )

    # Same marker again (a resubmission): nothing written, the entry comes back to recover.
    await store.journal.set(
        "chat", JournalEntry(state="cut-short", marker="[wf/s1]", attempt=2, at=5.0)
    )
    again = await store.turns.begin("wf", "[wf/s1]")
    assert not again.journaled
    assert again.journal is not None
    assert (again.journal.state, again.journal.attempt, again.journal.at) == (
        "cut-short",
        2,
        pytest.approx(5.0, abs=1.0),
    )
    # Both read the row on this process's clock, each exact to its statement's latency.
    assert (await store.journal.get("chat")) == again.journal.model_copy(
        update={"at": pytest.approx(again.journal.at, abs=1.0)}
    )

    # The next step's marker supersedes it (attempt 0).
    nxt = await store.turns.begin("wf", "[wf/s2]")
    assert nxt.journaled and nxt.journal is not None and nxt.journal.marker == "[wf/s2]"


async def test_begin_is_tenant_scoped(store: StateStore, store_url: str, tenant: str) -> None:
    other = StateStore(store_url, tenant=tenant + "-other")
    try:
        await other.checkpoints.set("wf", "chat", 1)
        assert (await store.turns.begin("wf", "[wf/s1]")).checkpoint is None
        assert await store.journal.get("chat") is None
    finally:
        await other.aclose()


async def test_record_writes_checkpoint_and_journal_together(store: StateStore) -> None:
    cp = await store.turns.record("wf", "chat", 9)
    assert (cp.chat_id, cp.last_seen_message_id) == ("chat", 9)
    assert cp.updated_at is not None and cp == await store.checkpoints.get("wf")
    assert await store.journal.get("chat") is None
    entry = JournalEntry(state="submitting", marker="[wf/s1]", attempt=1, at=1.0)
    await store.turns.record("wf", "chat", None, journal=entry)
    got = await store.checkpoints.get("wf")
    assert got is not None and got.last_seen_message_id is None
    j = await store.journal.get("chat")
    assert j is not None and (j.marker, j.attempt) == ("[wf/s1]", 1)


async def test_record_rolls_back_both_when_one_write_fails(store: StateStore) -> None:
    await store.turns.record("wf", "chat", 3)
    bad = JournalEntry.model_construct(state="bogus", marker="m", attempt=0, at=1.0)
    with pytest.raises(sa.exc.IntegrityError):
        await store.turns.record("wf", "chat", 4, journal=bad)
    got = await store.checkpoints.get("wf")
    assert got is not None and got.last_seen_message_id == 3
    assert await store.journal.get("chat") is None


async def test_record_validates_before_writing(store: StateStore) -> None:
    """A cursor is never stored without its chat, nor a non-positive one."""
    with pytest.raises(ValueError):
        await store.turns.record("wf", "", 3)
    with pytest.raises(ValueError):
        await store.turns.record("wf", "chat", 0)
    assert await store.checkpoints.get("wf") is None


async def test_begin_write_ahead_is_committed_when_it_returns(
    store: StateStore, store_url: str, tenant: str
) -> None:
    """What ``begin`` journaled is visible to another connection (another store
    object, as a recovering process would open) the moment it returns."""
    await store.turns.record("wf", "chat", 2)
    start = await store.turns.begin("wf", "[wf/s3]")
    assert start.journaled
    other = StateStore(store_url, tenant=tenant)
    try:
        seen = await other.journal.get("chat")
    finally:
        await other.aclose()
    assert seen is not None and (seen.state, seen.marker, seen.attempt) == (
        "submitting",
        "[wf/s3]",
        0,
    )
