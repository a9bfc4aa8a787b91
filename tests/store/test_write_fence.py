"""Write fencing by the workflow lease (issue 30, item 7), on SQLite and PostgreSQL.

Two holders: the first holds the lease with ``store.lease`` (as a workflow run does),
the second takes it over at once (``take_over``: the first's run was judged over —
marked Crashed while the process is merely cut off from the Prefect API — with no
lapse to wait for). Every write the first then makes — checkpoint, journal, ledger,
a grouped transaction, ``store.turns`` — is refused in its own transaction with
``LeaseLostError`` and writes nothing; ``confirm()`` before a send says the same,
however recently the first renewed. Before the fence, every write landed and
``confirm()`` trusted a renewal younger than half a ttl.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # the cut-off worker: the store alone, without importing Prefect
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import lease_worker  # noqa: F401  (registers bare packages: no Prefect import)

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from coder_chat.crash_safe import EffectContext, crash_safe_tool
from coder_chat.errors import ToolBookkeepingError
from coder_chat.tools import ToolContext
from prefect_coder.blocks.state import (
    HeldLease,
    JournalEntry,
    LeaseLostError,
    StateStore,
    workflow_key,
)

KEY = workflow_key("wf")


class Charge(BaseModel):
    cents: int


#: The "external system": every charge the tool below made, by idempotency key.
CHARGED: list[str] = []


@crash_safe_tool(name="charge", description="Charge the card.")
async def charge(args: Charge, ctx: EffectContext) -> str:
    CHARGED.append(ctx.idempotency_key)
    return ctx.idempotency_key


async def _snapshot(store: StateStore) -> tuple[Any, ...]:
    """What the first holder could have written, read back (the journal entry without
    its ``at``: read back on this process's clock, exact to the statement's latency)."""
    entry = await store.journal.get("chat-1")
    return (
        await store.checkpoints.get("wf"),
        None if entry is None else entry.model_dump(exclude={"at"}),
        await store.ledger.list("chat-1"),
        await store.stranded.list(),
    )


def _writes(store: StateStore) -> dict[str, Callable[[], Awaitable[Any]]]:
    async def transaction() -> None:
        async with store.transaction() as tx:
            await tx.checkpoints.set("wf", "chat-1", 9)
            await tx.journal.set("chat-1", JournalEntry.cut_short("[m]", 3))

    return {
        "checkpoints.set": lambda: store.checkpoints.set("wf", "chat-1", 2),
        "journal.set": lambda: store.journal.set("chat-1", JournalEntry.cut_short("[m]", 1)),
        "ledger.begin": lambda: store.ledger.begin("chat-1", "call-2", tool_name="t", args={}),
        "ledger.complete": lambda: store.ledger.complete("chat-1", "call-1", {"out": 1}),
        "transaction": transaction,
        "turns.begin": lambda: store.turns.begin("wf", "[m2]", turn_timeout_s=60),
        "turns.record": lambda: store.turns.record("wf", "chat-1", 5),
        "turns.record+journal": lambda: store.turns.record(
            "wf", "chat-1", 5, journal=JournalEntry.cut_short("[m]", 2)
        ),
        "stranded.record": lambda: store.stranded.record("wf", "chat-x", "test"),
        "checkpoints.clear": lambda: store.checkpoints.clear("wf"),
    }


async def test_writes_after_an_immediate_takeover_are_refused(
    store: StateStore, store_url: str, tenant: str
) -> None:
    # The second holder: another store object (another worker's), same database.
    other = StateStore(store_url, tenant=tenant)
    try:
        async with store.lease(KEY, holder="first", ttl=30) as held:
            # While it holds the lease, its writes land (the fence is checked and holds).
            await store.checkpoints.set("wf", "chat-1", 1)
            await store.journal.set("chat-1", JournalEntry.submitting("[m]", 0))
            await store.ledger.begin("chat-1", "call-1", tool_name="t", args={})
            await held.confirm()
            taken = await other.leases.take_over(KEY, "first", "second", 30)
            assert taken is not None and taken.fence == held.fence + 1
            before = await _snapshot(other)
            refused = {}
            for name, write in _writes(store).items():
                with pytest.raises(LeaseLostError) as caught:
                    await write()
                refused[name] = caught.value
            assert await _snapshot(other) == before  # nothing written
            for name, err in refused.items():
                assert (err.key, err.holder, err.fence) == (KEY, "first", held.fence), name
                assert "nothing was written" in str(err), name
            # Right before a send: the renewal is seconds younger than half a ttl, and
            # still the row says another holder drives the chat.
            assert time_since_renewal(held) < held.ttl / 2
            with pytest.raises(LeaseLostError):
                await held.confirm()
            assert held.lost
        # Outside the lease block nothing is fenced; the new holder's writes land.
        await store.checkpoints.set("wf", "chat-1", 7)
        assert (await other.checkpoints.get("wf")).last_seen_message_id == 7  # type: ignore[union-attr]
    finally:
        await other.aclose()


def time_since_renewal(held: HeldLease) -> float:
    import time

    return time.monotonic() - held.last_ok


async def test_a_takeover_waits_for_the_holders_write_in_flight(
    store: StateStore, store_url: str, tenant: str
) -> None:
    """The fence is read inside the write's own transaction: a takeover that comes while
    the holder's transaction is open is ordered after it (PostgreSQL: the lease row is
    read FOR SHARE; SQLite: one writer at a time), so the new holder reads that write
    and no write of the old holder lands after the takeover."""
    other = StateStore(store_url, tenant=tenant)
    try:
        async with store.lease(KEY, holder="first", ttl=30):
            async with store.transaction() as tx:
                await tx.checkpoints.set("wf", "chat-1", 1)
                takeover = asyncio.create_task(other.leases.take_over(KEY, "first", "second", 30))
                await asyncio.sleep(0.3)
                assert not takeover.done()  # waits for the write in flight
                await tx.journal.set("chat-1", JournalEntry.submitting("[m]", 0))
            assert (await asyncio.wait_for(takeover, 10)) is not None
            cp = await other.checkpoints.get("wf")
            assert cp is not None and cp.last_seen_message_id == 1
            with pytest.raises(LeaseLostError):
                await store.checkpoints.set("wf", "chat-1", 2)
    finally:
        await other.aclose()


async def test_tasks_started_under_the_lease_are_fenced_too(
    store: StateStore, store_url: str, tenant: str
) -> None:
    """Crash-safe tools write the ledger from tasks the turn starts: they carry the
    fence (a context variable copied into every task)."""
    other = StateStore(store_url, tenant=tenant)
    try:
        async with store.lease(KEY, holder="first", ttl=30):
            await other.leases.take_over(KEY, "first", "second", 30)
            task = asyncio.create_task(store.ledger.begin("chat-1", "call-1", tool_name="t"))
            with pytest.raises(LeaseLostError):
                await task
        assert await other.ledger.get("chat-1", "call-1") is None
    finally:
        await other.aclose()


async def test_the_fence_covers_its_own_database_only(
    store: StateStore, backend: str, tmp_path: Path
) -> None:
    """A write to another database (here: another SQLite file) is not fenced by a lease
    held on this one."""
    elsewhere = StateStore(f"sqlite+aiosqlite:///{tmp_path}/elsewhere/state.db")
    try:
        async with store.lease(KEY, holder="first", ttl=30):
            await store.leases.take_over(KEY, "first", "second", 30)
            await elsewhere.checkpoints.set("wf", "chat-1", 3)
            with pytest.raises(LeaseLostError):
                await store.checkpoints.set("wf", "chat-1", 3)
        assert (await elsewhere.checkpoints.get("wf")) is not None
    finally:
        await elsewhere.aclose()


async def test_a_crash_safe_tool_runs_no_effect_after_the_takeover(
    store: StateStore, store_url: str, tenant: str
) -> None:
    """The effect a cut-off holder would still run: its crash-safe tool's write-ahead is
    refused, so the effect never starts (the turn fails with the ledger's error, whose
    cause is the lost lease) and nothing is recorded."""
    charged = CHARGED
    charged.clear()
    tool = charge.bind(store.ledger, match_earlier_attempts=True)  # as workflows bind it
    other = StateStore(store_url, tenant=tenant)
    try:
        async with store.lease(KEY, holder="first", ttl=30):
            await store.journal.set("chat-1", JournalEntry.submitting("[m]", 0))
            ran = await tool.run({"cents": 5}, ToolContext("call-1", "chat-1", "charge"))
            assert not ran.is_error and len(charged) == 1
            await other.leases.take_over(KEY, "first", "second", 30)
            with pytest.raises(ToolBookkeepingError) as caught:
                await tool.run({"cents": 7}, ToolContext("call-2", "chat-1", "charge"))
            assert isinstance(caught.value.__cause__, LeaseLostError)
        assert len(charged) == 1  # the second effect never started
        assert [e.tool_call_id for e in await other.ledger.list("chat-1")] == ["call-1"]
    finally:
        await other.aclose()


# --- a worker process cut off while another holder takes over -------------------------


async def _cut_off_worker(url: str, tenant: str) -> None:
    """Holds the lease and writes a checkpoint in a loop, printing each acknowledged
    write, until a write is refused; then tries a journal and a ledger write."""
    store = StateStore(url, tenant=tenant)
    async with store.lease(KEY, holder="first", ttl=30) as held:
        print(f"HELD {held.fence}", flush=True)
        i = 0
        while True:
            i += 1
            try:
                await store.checkpoints.set("wf", f"chat-{i}", i)
            except LeaseLostError as exc:
                print(f"REFUSED {i} {exc.fence}", flush=True)
                break
            print(f"OK {i}", flush=True)
            await asyncio.sleep(0.005)
        for name, write in (
            ("journal", store.journal.set("chat-1", JournalEntry.cut_short("[m]", 1))),
            ("ledger", store.ledger.begin("chat-1", "call-9", tool_name="t")),
        ):
            try:
                await write
                print(f"{name} written", flush=True)
            except LeaseLostError:
                print(f"{name} refused", flush=True)
    await store.aclose()


async def test_a_worker_process_taken_over_writes_nothing_after(
    store: StateStore, store_url: str, tenant: str
) -> None:
    import os
    import subprocess

    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        store_url,
        tenant,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    lines: list[str] = []

    async def line() -> str:
        assert proc.stdout is not None
        got = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode().strip()
        assert got, f"the worker exited early: {lines}"
        lines.append(got)
        return got

    try:
        held = await line()
        assert held == "HELD 1", held
        while not (await line()).startswith("OK 3"):
            pass
        # The new holder: its run judged the first one's over, no lapse waited for.
        taken = await store.leases.take_over(KEY, "first", "second", 30)
        assert taken is not None and taken.fence == 2
        seen = await store.checkpoints.get("wf")  # what the new holder recovers from
        assert seen is not None

        async def refused() -> str:
            while not (got := await line()).startswith("REFUSED"):
                pass
            return got

        # Bounded: a worker whose writes are not fenced writes on and on.
        last = await asyncio.wait_for(refused(), 30)
        tail = [await line(), await line()]
        await asyncio.wait_for(proc.wait(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    oks = [int(x.split()[1]) for x in lines if x.startswith("OK ")]
    # Every acknowledged write was ordered before the takeover: the new holder read the
    # last of them, and nothing the old holder wrote landed after it.
    assert seen.last_seen_message_id == oks[-1], (seen, lines)
    assert last == f"REFUSED {oks[-1] + 1} 1", lines
    assert tail == ["journal refused", "ledger refused"], lines
    final = await store.checkpoints.get("wf")
    assert final == seen
    assert await store.journal.get("chat-1") is None
    assert await store.ledger.list("chat-1") == []


if __name__ == "__main__":
    asyncio.run(_cut_off_worker(sys.argv[1], sys.argv[2]))
