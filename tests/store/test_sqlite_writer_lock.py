"""The SQLite pool's in-process writer lock: writers of one process queue on it before
``BEGIN IMMEDIATE`` (instead of SQLite's sleeping busy handler), and it is never leaked.

A leaked lock would stop every later write of the process: each case below ends with
a write that must complete well inside the store's ``connect_timeout``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state.errors import StoreUnavailableError

#: Short, so that a leaked lock fails the check fast instead of hanging.
TIMEOUT_S = 1.0


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[StateStore]:
    # A file of its own: the pool (and its timeout) is per process and file.
    s = StateStore(
        f"sqlite+aiosqlite:///{tmp_path}/lock/state.db",
        pool_size=3,
        connect_timeout=TIMEOUT_S,
        transient_retry_s=0,  # one attempt: a stuck writer fails after the timeout
    )
    await s.checkpoints.set("wf", "chat", 1)
    yield s
    await s.aclose()


async def _write_promptly(store: StateStore, value: int) -> None:
    # Within the timeout: a write that had to wait out a leaked lock would fail.
    await asyncio.wait_for(store.checkpoints.set("wf", "chat", value), TIMEOUT_S * 0.9)
    got = await store.checkpoints.get("wf")
    assert got is not None and got.last_seen_message_id == value


async def test_released_after_commit_and_rollback(store: StateStore) -> None:
    for i in range(3):
        await _write_promptly(store, 10 + i)
    with pytest.raises(RuntimeError):
        async with store.transaction() as tx:
            await tx.checkpoints.set("wf", "chat", 99)
            raise RuntimeError("boom")
    got = await store.checkpoints.get("wf")
    assert got is not None and got.last_seen_message_id == 12  # rolled back
    await _write_promptly(store, 20)


async def test_released_when_the_caller_is_cancelled_mid_transaction(store: StateStore) -> None:
    inside = asyncio.Event()

    async def hold() -> None:
        async with store.transaction() as tx:
            await tx.checkpoints.set("wf", "chat", 98)
            inside.set()
            await asyncio.Event().wait()  # until cancelled, holding the write lock

    task = asyncio.create_task(hold())
    await inside.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _write_promptly(store, 30)


async def test_a_writer_waits_its_turn_and_a_stuck_one_times_out(store: StateStore) -> None:
    # A second writer while the first holds the lock: it waits and then goes through.
    order: list[str] = []

    async def first() -> None:
        async with store.transaction() as tx:
            await tx.checkpoints.set("wf", "chat", 40)
            await asyncio.sleep(0.2)
            order.append("first committed")

    async def second() -> None:
        await asyncio.sleep(0.05)
        await store.checkpoints.set("wf", "chat", 41)
        order.append("second committed")

    await asyncio.gather(first(), second())
    assert order == ["first committed", "second committed"]
    # A writer nested in an open write transaction of the same task can never get
    # the lock: it fails after the timeout as SQLite's own busy wait would (no hang).
    async with store.transaction() as tx:
        await tx.checkpoints.set("wf", "chat", 42)
        with pytest.raises(StoreUnavailableError, match="database is locked"):
            await store.checkpoints.set("other", "chat", 1)
    await _write_promptly(store, 43)


async def test_many_concurrent_writers_all_commit(store: StateStore) -> None:
    await asyncio.gather(*(store.checkpoints.set(f"wf-{i}", "c", i + 1) for i in range(60)))
    got = await asyncio.gather(*(store.checkpoints.get(f"wf-{i}") for i in range(60)))
    assert [g.last_seen_message_id if g else None for g in got] == list(range(1, 61))
