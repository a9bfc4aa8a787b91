"""Send journal and stranded chats — on both backends."""

from __future__ import annotations

import time

import pytest
from pydantic import ValidationError

from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state import JournalEntry


async def test_journal_get_set_supersede_clear(store: StateStore) -> None:
    assert await store.journal.get("chat") is None
    before = time.time()
    e1 = await store.journal.set(
        "chat", JournalEntry(state="submitting", marker="[wf/step-2]", attempt=0)
    )
    assert before <= e1.at <= time.time()
    got = await store.journal.get("chat")
    # Journal times are kept on the database clock: a round trip is exact to the
    # statements' latency (blocks/state/journal.py).
    assert got == e1.model_copy(update={"at": pytest.approx(e1.at, abs=1.0)})
    # The ledger reconcile's verdict supersedes the send entry (one entry per chat).
    e2 = await store.journal.set(
        "chat", JournalEntry(state="cut-short", marker="[wf/step-2]", attempt=1, at=123.5)
    )
    got = await store.journal.get("chat")
    assert got == e2.model_copy(update={"at": pytest.approx(e2.at, abs=1.0)})
    assert (got.state, got.attempt, got.at) == ("cut-short", 1, pytest.approx(123.5, abs=1.0))
    assert await store.journal.get("other-chat") is None
    assert await store.journal.clear("chat") is True
    assert await store.journal.get("chat") is None


@pytest.mark.parametrize(
    "bad",
    [
        {"state": "sent", "marker": "m", "attempt": 0},
        {"state": "resumed", "marker": "m", "attempt": -1},
        {"state": "resumed", "marker": "m", "attempt": "1"},
    ],
)
def test_journal_entry_validation(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        JournalEntry(**bad)  # type: ignore[arg-type]


async def test_journal_requires_chat_id(store: StateStore) -> None:
    with pytest.raises(ValueError, match="chat_id"):
        await store.journal.set("", JournalEntry(state="resumed", marker="m", attempt=0))


async def test_stranded_record_list_remove(store: StateStore) -> None:
    assert await store.stranded.list() == []
    a = await store.stranded.record("wf-1", "chat-a", "CoderStreamError on a fresh chat")
    await store.stranded.record(None, "chat-b", "found by sweep")
    again = await store.stranded.record(None, "chat-a", "re-recorded")
    # Re-recording keeps the first sighting and the known workflow.
    assert again.created_at == a.created_at and again.workflow_id == "wf-1"
    assert again.reason == "re-recorded"
    assert [s.chat_id for s in await store.stranded.list()] == ["chat-a", "chat-b"]
    assert [s.chat_id for s in await store.stranded.list(workflow_id="wf-1")] == ["chat-a"]
    assert await store.stranded.remove("chat-a") is True
    assert await store.stranded.remove("chat-a") is False
    assert [s.chat_id for s in await store.stranded.list()] == ["chat-b"]


async def test_forget_chat_drops_journal_ledger_and_stranded(store: StateStore) -> None:
    await store.journal.set("c", JournalEntry(state="resumed", marker="m", attempt=1))
    await store.ledger.begin("c", "call-1", tool_name="t")
    await store.stranded.record("wf", "c", "x")
    await store.checkpoints.set("wf", "c", 1)
    await store.forget_chat("c")
    assert await store.journal.get("c") is None
    assert await store.ledger.list("c") == []
    assert await store.stranded.list() == []
    assert await store.checkpoints.get("wf") is not None  # the workflow owns its checkpoint
