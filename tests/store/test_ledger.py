"""Tool ledger: write-ahead, first-done-wins, compare-and-set under concurrency."""

from __future__ import annotations

import asyncio

import pytest

from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state import LedgerEntry


async def test_begin_is_write_ahead_and_never_overwrites(store: StateStore) -> None:
    assert await store.ledger.get("chat", "call-1") is None
    entry, created = await store.ledger.begin(
        "chat", "call-1", tool_name="charge_card", args={"amount_cents": 500}
    )
    assert created is True
    assert (entry.state, entry.tool_name, entry.args, entry.output) == (
        "committing",
        "charge_card",
        {"amount_cents": 500},
        None,
    )
    # A re-drive after a crash sees the ambiguous entry, does not create one.
    again, created = await store.ledger.begin("chat", "call-1", tool_name="x", args={"other": 1})
    assert created is False and again == entry

    done = await store.ledger.complete("chat", "call-1", {"receipt": "r-1"})
    assert (done.state, done.output, done.args, done.tool_name) == (
        "done",
        {"receipt": "r-1"},
        {"amount_cents": 500},
        "charge_card",
    )
    # "committing" must never overwrite "done": begin returns the done entry untouched.
    after, created = await store.ledger.begin("chat", "call-1", tool_name="charge_card")
    assert created is False and after.state == "done" and after.output == {"receipt": "r-1"}
    # ...and the first done wins over a later complete.
    second = await store.ledger.complete("chat", "call-1", {"receipt": "r-2"})
    assert second.output == {"receipt": "r-1"}
    assert await store.ledger.get("chat", "call-1") == second


async def test_complete_without_begin_and_json_outputs(store: StateStore) -> None:
    for i, output in enumerate(["charged: receipt 9", None, 0, [1, {"a": "ü"}], {"n": 1.5}]):
        e = await store.ledger.complete("chat", f"call-{i}", output, tool_name="t")
        assert e.state == "done" and e.output == output
        assert (await store.ledger.get("chat", f"call-{i}")) == e
    with pytest.raises(ValueError, match="JSON"):
        await store.ledger.complete("chat", "bad", {"x": object()})
    with pytest.raises(ValueError, match="JSON"):
        await store.ledger.complete("chat", "bad", float("nan"))
    assert await store.ledger.get("chat", "bad") is None


async def test_key_is_chat_plus_call_id(store: StateStore, store_url: str) -> None:
    await store.ledger.complete("chat-a", "call-1", "a's result")
    # Same call id in another chat is a different call.
    assert await store.ledger.get("chat-b", "call-1") is None
    _, created = await store.ledger.begin("chat-b", "call-1")
    assert created is True
    other_tenant = StateStore(store_url, tenant=store.tenant + "-x")
    assert await other_tenant.ledger.get("chat-a", "call-1") is None
    assert store.ledger.idempotency_key("chat-a", "call-1") == f"{store.tenant}/chat-a/call-1"
    assert other_tenant.ledger.idempotency_key("chat-a", "call-1") != store.ledger.idempotency_key(
        "chat-a", "call-1"
    )
    with pytest.raises(ValueError, match="tool_call_id"):
        await store.ledger.begin("chat-a", "")


async def test_list_by_chat_in_order(store: StateStore) -> None:
    for call in ("c3", "c1", "c2"):
        await store.ledger.begin("chat", call, tool_name="t")
    await store.ledger.begin("other", "c9")
    await store.ledger.complete("chat", "c1", "ok")
    listed = await store.ledger.list("chat")
    assert [e.tool_call_id for e in listed] == ["c3", "c1", "c2"]
    assert [e.state for e in listed] == ["committing", "done", "committing"]
    assert await store.ledger.clear("chat") == 3
    assert await store.ledger.list("chat") == []
    assert len(await store.ledger.list("other")) == 1


async def test_concurrent_begin_exactly_one_creator(store: StateStore) -> None:
    results = await asyncio.gather(
        *(store.ledger.begin("chat", "call", tool_name="t", args={"i": i}) for i in range(16))
    )
    creators = [entry for entry, created in results if created]
    assert len(creators) == 1
    # Everybody sees the creator's write-ahead, not their own args.
    assert all(entry.args == creators[0].args for entry, _ in results)


async def test_concurrent_complete_first_done_wins(store: StateStore) -> None:
    await store.ledger.begin("chat", "call", tool_name="t")
    results = await asyncio.gather(
        *(store.ledger.complete("chat", "call", {"by": i}) for i in range(16))
    )
    outputs = {repr(e.output) for e in results}
    assert len(outputs) == 1, outputs  # every caller got the same, single recorded outcome
    final = await store.ledger.get("chat", "call")
    assert final is not None and final.state == "done" and repr(final.output) in outputs


async def test_concurrent_begin_and_complete_never_regress_done(store: StateStore) -> None:
    # Writers racing "committing" against "done": once done, it stays done.
    await store.ledger.complete("chat", "call", "the outcome")
    results = await asyncio.gather(
        *(store.ledger.begin("chat", "call") for _ in range(10)),
        *(store.ledger.complete("chat", "call", "later") for _ in range(5)),
    )
    for r in results:
        entry = r[0] if isinstance(r, tuple) else r
        assert isinstance(entry, LedgerEntry)
        assert entry.state == "done" and entry.output == "the outcome"
