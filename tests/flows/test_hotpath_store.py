"""The one-trip store calls of a fan-out's hot path (docs/performance.md, round 7), on a
real SQLite file and the real PostgreSQL: they must say and write exactly what the
call-by-call versions they replace did."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state import JournalEntry


@pytest.fixture(params=["sqlite", "postgresql"])
async def hot_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[StateStore]:
    if request.param == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path}/state.db"
    else:
        url = str(request.getfixturevalue("postgres_url"))
    s = StateStore(url, tenant=f"hot-{uuid.uuid4().hex[:10]}", connect_timeout=10.0)
    yield s
    await s.aclose()


async def test_record_with_journal_writes_both(hot_store: StateStore) -> None:
    entry = JournalEntry(state="submitting", marker="[m]", attempt=0, at=100.0, deadline=130.0)
    saved = await hot_store.turns.record("wf", "chat-1", None, journal=entry)
    assert saved.chat_id == "chat-1" and saved.updated_at is not None
    cp = await hot_store.checkpoints.get("wf")
    assert cp is not None and (cp.chat_id, cp.last_seen_message_id) == ("chat-1", None)
    got = await hot_store.journal.get("chat-1")
    assert got is not None
    assert (got.state, got.marker, got.attempt, got.at, got.deadline) == (
        "submitting",
        "[m]",
        0,
        pytest.approx(100.0, abs=1.0),  # kept on the database clock: exact to latency
        pytest.approx(130.0, abs=1.0),
    )
    # Again with a cursor and attempt 1: both rows are overwritten together.
    again = entry.model_copy(update={"attempt": 1})
    await hot_store.turns.record("wf", "chat-1", 7, journal=again)
    cp = await hot_store.checkpoints.get("wf")
    got = await hot_store.journal.get("chat-1")
    assert cp is not None and cp.last_seen_message_id == 7
    assert got is not None and got.attempt == 1


async def test_record_with_invalid_cursor_writes_neither(hot_store: StateStore) -> None:
    entry = JournalEntry(state="submitting", marker="[m]", attempt=0, at=1.0)
    with pytest.raises(ValidationError):
        await hot_store.turns.record("wf", "chat-1", 0, journal=entry)  # cursor must be > 0
    assert await hot_store.checkpoints.get("wf") is None
    assert await hot_store.journal.get("chat-1") is None


async def test_archive_targets_reads_checkpoint_and_stranded(hot_store: StateStore) -> None:
    assert await hot_store.turns.archive_targets("wf") == (None, [])
    await hot_store.stranded.record("wf", "s-b", "discarded")
    await hot_store.stranded.record("wf", "s-a", "discarded")
    await hot_store.stranded.record("other-wf", "s-x", "discarded")
    cp, stranded = await hot_store.turns.archive_targets("wf")
    assert cp is None
    assert stranded == [s.chat_id for s in await hot_store.stranded.list("wf")] == ["s-b", "s-a"]
    await hot_store.checkpoints.set("wf", "chat-1", 5)
    cp, stranded = await hot_store.turns.archive_targets("wf")
    expected = await hot_store.checkpoints.get("wf")
    assert cp == expected
    assert stranded == ["s-b", "s-a"]


async def test_forget_tools_clears_ledger_and_stranded_only(hot_store: StateStore) -> None:
    await hot_store.checkpoints.set("wf", "chat-1", 5)
    await hot_store.journal.set(
        "chat-1", JournalEntry(state="submitting", marker="[m]", attempt=0, at=1.0)
    )
    await hot_store.ledger.begin("chat-1", "call-1", tool_name="add", args={"a": 1})
    await hot_store.ledger.begin("chat-2", "call-1", tool_name="add", args={"a": 1})
    await hot_store.stranded.record("wf", "chat-1", "discarded")
    await hot_store.turns.forget_tools("chat-1")
    assert await hot_store.ledger.list("chat-1") == []
    assert len(await hot_store.ledger.list("chat-2")) == 1
    assert await hot_store.stranded.list("wf") == []
    # The checkpoint and the journal entry stay: a rerun recovers from them.
    assert await hot_store.checkpoints.get("wf") is not None
    assert await hot_store.journal.get("chat-1") is not None
