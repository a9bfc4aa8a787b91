"""A crash-safe tool over the real ledger (SQLite and PostgreSQL) never repeats an
unreported effect under a new key (issue 30): the effect of a repeated call runs under
the EARLIER call's idempotency key, live and when recovery re-drives it; two identical
calls of one tool round are still two calls. The "external system" is a charge service
that honours idempotency keys and logs every request to a file."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from pydantic import BaseModel

from coder_chat.crash_safe import CrashSafeTool, EffectContext, crash_safe_tool
from coder_chat.tools import ToolContext, ToolError
from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state import JournalEntry
from prefect_coder.blocks.state.schema import tool_ledger

MARKER = "[wf/charge]"
CHAT = "chat-tool"


class Charge(BaseModel):
    amount_cents: int


class Service:
    """Applies a charge once per idempotency key; every request is logged to a file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fail_after_apply = 0  # raise after applying, this many times
        self.gate: asyncio.Event | None = None
        self.waiting = 0
        self.both_waiting = asyncio.Event()

    def lines(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(x) for x in self.path.read_text().splitlines()]

    def effects(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.lines():
            out[r["key"]] = out.get(r["key"], 0) + (1 if r["applied"] else 0)
        return out

    async def charge(self, key: str, cents: int) -> dict[str, Any]:
        if self.gate is not None:
            self.waiting += 1
            if self.waiting == 2:
                self.both_waiting.set()
            await self.gate.wait()
        applied = not any(r["key"] == key and r["applied"] for r in self.lines())
        with self.path.open("a") as f:
            f.write(json.dumps({"key": key, "applied": applied}) + "\n")
        if self.fail_after_apply:
            self.fail_after_apply -= 1
            raise ToolError("the payment gateway timed out")
        return {"receipt": key.rsplit("/", 1)[-1], "cents": cents}


@pytest.fixture
def service(tmp_path: Path) -> Service:
    return Service(tmp_path / "charges.jsonl")


def bound(service: Service, store: StateStore) -> CrashSafeTool[Any]:
    @crash_safe_tool(name="charge_card", description="Charge the card.")
    async def charge_card(args: Charge, ctx: EffectContext) -> dict[str, Any]:
        return await service.charge(ctx.idempotency_key, args.amount_cents)

    return charge_card.bind(store.ledger, match_earlier_attempts=True)


def ctx(call: str) -> ToolContext:
    return ToolContext(tool_call_id=call, chat_id=CHAT, tool_name="charge_card")


async def test_a_repeat_of_a_call_whose_effect_raised_runs_under_its_key(
    store: StateStore, service: Service
) -> None:
    tool = bound(service, store)
    await store.journal.set(CHAT, JournalEntry.submitting(MARKER, 0))
    service.fail_after_apply = 1  # applied, but the answer was lost: the tool raised
    first = await tool.run({"amount_cents": 900}, ctx("c1"))
    assert first.is_error and first.output == "Tool failed: the payment gateway timed out"
    # The model retries the same charge under a new call id: same key, one charge.
    second = await tool.run({"amount_cents": 900}, ctx("c2"))
    key1 = store.ledger.idempotency_key(CHAT, "c1")
    assert not second.is_error and second.output == {"receipt": "c1", "cents": 900}
    assert service.effects() == {key1: 1}
    c1, c2 = await store.ledger.get(CHAT, "c1"), await store.ledger.get(CHAT, "c2")
    assert c1 is not None and c2 is not None
    assert (c1.state, c2.state, c2.replay_of) == ("done", "done", "c1")
    # Reported now: a further identical call of the attempt is a new charge.
    third = await tool.run({"amount_cents": 900}, ctx("c3"))
    assert third.output == {"receipt": "c3", "cents": 900}
    assert service.effects() == {key1: 1, store.ledger.idempotency_key(CHAT, "c3"): 1}


async def test_a_reask_repeating_an_unrecorded_effect_is_redriven_under_its_key(
    store: StateStore, service: Service
) -> None:
    tool = bound(service, store)
    await store.journal.set(CHAT, JournalEntry.submitting(MARKER, 0))
    # Attempt 0: the write-ahead and the effect happened, the done write did not.
    await store.ledger.begin(
        CHAT, "a0", tool_name="charge_card", args={"amount_cents": 700}, match_earlier_attempts=True
    )
    key0 = store.ledger.idempotency_key(CHAT, "a0")
    await service.charge(key0, 700)
    # The structured re-ask (attempt 1) calls it again.
    await store.journal.set(CHAT, JournalEntry.submitting(MARKER, 1))
    out = await tool.run({"amount_cents": 700}, ctx("a1"))
    assert out.output == {"receipt": "a0", "cents": 700}
    assert service.effects() == {key0: 1} and len(service.lines()) == 2
    a0 = await store.ledger.get(CHAT, "a0")
    assert a0 is not None and a0.state == "done"


async def test_recovery_redrives_a_repeat_under_the_earlier_key(
    store: StateStore, service: Service
) -> None:
    tool = bound(service, store)
    await store.journal.set(CHAT, JournalEntry.submitting(MARKER, 0))
    await store.ledger.begin(
        CHAT, "a0", tool_name="charge_card", args={"amount_cents": 300}, match_earlier_attempts=True
    )
    await store.journal.set(CHAT, JournalEntry.submitting(MARKER, 1))
    # The repeat's write-ahead names a0; the process died before its effect.
    entry, _ = await store.ledger.begin(
        CHAT, "a1", tool_name="charge_card", args={"amount_cents": 300}, match_earlier_attempts=True
    )
    assert (entry.state, entry.replay_of) == ("committing", "a0")
    # Recovery re-drives a1's committing entry: under a0's key, not a1's.
    assert await tool.redrive({"amount_cents": 300}, ctx("a1")) == {"receipt": "a0", "cents": 300}
    assert service.effects() == {store.ledger.idempotency_key(CHAT, "a0"): 1}
    # ...and re-driving a0 itself afterwards changes nothing.
    assert await tool.redrive({"amount_cents": 300}, ctx("a0")) == {"receipt": "a0", "cents": 300}
    assert sum(service.effects().values()) == 1


async def test_identical_calls_of_one_round_are_two_charges(
    store: StateStore, service: Service
) -> None:
    tool = bound(service, store)
    await store.journal.set(CHAT, JournalEntry.submitting(MARKER, 0))
    service.gate = asyncio.Event()  # both calls are in flight before either charges
    runs = [asyncio.create_task(tool.run({"amount_cents": 100}, ctx(c))) for c in ("p1", "p2")]
    await asyncio.wait_for(service.both_waiting.wait(), 10)
    assert len(await store.ledger.list(CHAT)) == 2
    service.gate.set()
    outs = await asyncio.gather(*runs)
    assert [o.output["receipt"] for o in outs] == ["p1", "p2"]
    assert sorted(service.effects().values()) == [1, 1]


class SiblingFirstLedger:
    """The store's ledger (every call delegated) whose write-ahead for ``late`` waits
    until ``early``'s has committed: the order a busy store gives two calls of one
    round when the one that started first waits longer for the write lock."""

    def __init__(self, store: StateStore, late: str, early: str) -> None:
        self.ledger = store.ledger
        self.late, self.early = late, early
        self.early_began = asyncio.Event()
        self.late_waiting = asyncio.Event()

    def idempotency_key(self, chat_id: str, tool_call_id: str) -> str:
        return self.ledger.idempotency_key(chat_id, tool_call_id)

    async def begin(self, chat_id: str, tool_call_id: str, **kw: Any) -> Any:
        if tool_call_id == self.late:
            self.late_waiting.set()
            await asyncio.wait_for(self.early_began.wait(), 10)
        out = await self.ledger.begin(chat_id, tool_call_id, **kw)
        if tool_call_id == self.early:
            self.early_began.set()
        return out

    async def complete(self, chat_id: str, tool_call_id: str, output: Any, **kw: Any) -> Any:
        return await self.ledger.complete(chat_id, tool_call_id, output, **kw)

    async def get(self, chat_id: str, tool_call_id: str) -> Any:
        return await self.ledger.get(chat_id, tool_call_id)


async def test_a_sibling_whose_write_ahead_commits_first_is_still_another_call(
    store: StateStore, service: Service
) -> None:
    # p1 starts first, p2 second; p2's write-ahead commits before p1's. The calls
    # running on the chat are read when p1's match is taken, not when p1 started:
    # before, p1 saw p2's committing row as an unreported repeat and re-drove it
    # under p2's key — one charge for two calls (seen once in CI under load).
    @crash_safe_tool(name="charge_card", description="Charge the card.")
    async def charge_card(args: Charge, ctx: EffectContext) -> dict[str, Any]:
        return await service.charge(ctx.idempotency_key, args.amount_cents)

    ledger = SiblingFirstLedger(store, late="p1", early="p2")
    tool = charge_card.bind(ledger, match_earlier_attempts=True)
    await store.journal.set(CHAT, JournalEntry.submitting(MARKER, 0))
    service.gate = asyncio.Event()  # p2's effect is still running when p1 matches
    first = asyncio.create_task(tool.run({"amount_cents": 100}, ctx("p1")))
    await asyncio.wait_for(ledger.late_waiting.wait(), 10)  # p1 waits at its write-ahead
    second = asyncio.create_task(tool.run({"amount_cents": 100}, ctx("p2")))
    await asyncio.wait_for(service.both_waiting.wait(), 10)
    service.gate.set()
    outs = await asyncio.gather(first, second)
    assert [o.output["receipt"] for o in outs] == ["p1", "p2"]
    assert sorted(service.effects().values()) == [1, 1]
    entries = {e.tool_call_id: e for e in await store.ledger.list(CHAT)}
    assert entries["p1"].replay_of is None and entries["p2"].replay_of is None


async def test_a_repeat_of_an_older_worker_s_call_is_never_a_fresh_charge(
    store: StateStore, service: Service
) -> None:
    tool = bound(service, store)
    await store.journal.set(CHAT, JournalEntry.submitting(MARKER, 0))
    # A worker of the previous schema charged and crashed before its done write.
    await store.ledger.begin(CHAT, "old", tool_name="charge_card", args={"amount_cents": 450})
    key = store.ledger.idempotency_key(CHAT, "old")
    await service.charge(key, 450)
    async with store.write() as conn:
        await conn.execute(
            sa.update(tool_ledger)
            .where(tool_ledger.c.tenant == store.tenant, tool_ledger.c.chat_id == CHAT)
            .values(marker=None, attempt=None, args_fp=None)
        )
    # The new worker's resubmission calls it again.
    await store.journal.set(CHAT, JournalEntry.submitting(MARKER, 1))
    out = await tool.run({"amount_cents": 450}, ctx("new"))
    assert out.output == {"receipt": "old", "cents": 450}
    assert service.effects() == {key: 1}
