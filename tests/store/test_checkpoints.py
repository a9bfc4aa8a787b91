"""Checkpoints: get/set/clear/list, cursor rules, tenant scoping — on both backends."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest
from pydantic import ValidationError

from prefect_coder.blocks import StateStore


async def test_get_missing_is_none(store: StateStore) -> None:
    assert await store.checkpoints.get("wf-1") is None


async def test_set_get_roundtrip_with_and_without_cursor(store: StateStore) -> None:
    cp = await store.checkpoints.set("wf-1", "chat-a", 17)
    assert (cp.workflow_id, cp.chat_id, cp.last_seen_message_id) == ("wf-1", "chat-a", 17)
    assert cp.updated_at is not None
    assert abs(cp.updated_at - datetime.now(UTC)) < timedelta(seconds=5)
    assert await store.checkpoints.get("wf-1") == cp
    # A turn that failed before streaming has no cursor: set replaces the whole checkpoint.
    cp2 = await store.checkpoints.set("wf-1", "chat-a")
    assert cp2.last_seen_message_id is None
    assert (await store.checkpoints.get("wf-1")) == cp2
    assert cp2.updated_at is not None and cp2.updated_at >= cp.updated_at


async def test_large_cursor_fits(store: StateStore) -> None:
    big = 2**62
    await store.checkpoints.set("wf-big", "chat", big)
    got = await store.checkpoints.get("wf-big")
    assert got is not None and got.last_seen_message_id == big


@pytest.mark.parametrize(
    ("chat_id", "cursor"),
    [("", 5), ("", None), ("chat", 0), ("chat", -3), ("chat", True), ("chat", "7")],
)
async def test_cursor_without_chat_or_bad_cursor_is_rejected(
    store: StateStore, chat_id: str, cursor: object
) -> None:
    with pytest.raises(ValidationError):
        await store.checkpoints.set("wf", chat_id, cursor)  # type: ignore[arg-type]
    assert await store.checkpoints.get("wf") is None


async def test_clear_and_list(store: StateStore) -> None:
    assert await store.checkpoints.list() == []
    await store.checkpoints.set("wf-b", "chat-b", 2)
    await store.checkpoints.set("wf-a", "chat-a")
    listed = await store.checkpoints.list()
    assert [(c.workflow_id, c.chat_id, c.last_seen_message_id) for c in listed] == [
        ("wf-a", "chat-a", None),
        ("wf-b", "chat-b", 2),
    ]
    assert await store.checkpoints.clear("wf-a") is True
    assert await store.checkpoints.clear("wf-a") is False
    assert [c.workflow_id for c in await store.checkpoints.list()] == ["wf-b"]


async def test_tenants_never_see_each_other(store: StateStore, store_url: str) -> None:
    other = StateStore(store_url, tenant=store.tenant + "-other")
    await store.checkpoints.set("wf", "mine", 1)
    assert await other.checkpoints.get("wf") is None
    assert await other.checkpoints.list() == []
    await other.checkpoints.set("wf", "theirs", 9)
    got = await store.checkpoints.get("wf")
    assert got is not None and got.chat_id == "mine"
    assert await other.checkpoints.clear("wf") is True
    assert await store.checkpoints.get("wf") is not None


async def test_concurrent_sets_leave_one_whole_checkpoint(store: StateStore) -> None:
    # 20 writers race; the survivor must be one writer's complete (chat, cursor) pair.
    await asyncio.gather(*(store.checkpoints.set("wf", f"chat-{i}", i + 1) for i in range(20)))
    got = await store.checkpoints.get("wf")
    assert got is not None
    assert got.chat_id == f"chat-{got.last_seen_message_id - 1}"  # type: ignore[operator]


async def test_transaction_commits_together_or_not_at_all(store: StateStore) -> None:
    from prefect_coder.blocks.state import JournalEntry

    async with store.transaction() as tx:
        await tx.checkpoints.set("wf", "chat", 3)
        await tx.journal.set("chat", JournalEntry(state="submitting", marker="m", attempt=1))
    assert await store.checkpoints.get("wf") is not None
    assert await store.journal.get("chat") is not None

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        async with store.transaction() as tx:
            await tx.checkpoints.set("wf", "chat", 4)
            await tx.checkpoints.set("wf-2", "chat-2", 1)
            raise Boom
    got = await store.checkpoints.get("wf")
    assert got is not None and got.last_seen_message_id == 3
    assert await store.checkpoints.get("wf-2") is None
