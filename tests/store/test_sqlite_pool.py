"""The SQLite worker pool: bounded connections shared by all loops, never leaked.

Each test uses a real file; the pool is the process-wide one ``StateStore`` uses.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import sqlalchemy as sa

from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state import engines


def _workers() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("prefect-coder-sqlite")}


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path}/pool/state.db"


async def test_many_callers_share_a_bounded_pool(sqlite_url: str) -> None:
    before = _workers()
    store = StateStore(sqlite_url, pool_size=3)
    try:
        await asyncio.gather(
            *(store.checkpoints.set(f"wf-{i}", f"c-{i}", i + 1) for i in range(40))
        )
        got = await asyncio.gather(*(store.checkpoints.get(f"wf-{i}") for i in range(40)))
        assert [g.last_seen_message_id if g else None for g in got] == list(range(1, 41))
        assert len(_workers() - before) <= 3
    finally:
        await store.aclose()


async def test_cancelled_and_failed_calls_return_their_worker(sqlite_url: str) -> None:
    store = StateStore(sqlite_url, pool_size=1)
    try:
        await store.checkpoints.set("wf", "chat", 1)
        # A failing statement rolls back; the single worker serves the next call.
        with pytest.raises(sa.exc.IntegrityError):
            async with store.transaction() as tx:
                await tx.checkpoints.set("wf", "chat", 2)
                await tx.connection.execute(
                    sa.text(
                        "INSERT INTO coder_state_checkpoints (tenant, workflow_id, chat_id, updated_at)"
                        " VALUES ('default', 'wf2', '', 0)"
                    )
                )
        got = await store.checkpoints.get("wf")
        assert got is not None and got.last_seen_message_id == 1
        # Callers cancelled while waiting for, or while using, the only worker.
        for _ in range(5):
            tasks = [asyncio.create_task(store.checkpoints.set("wf", "chat", 3)) for _ in range(4)]
            await asyncio.sleep(0)
            for t in tasks[1:]:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        assert await asyncio.wait_for(store.checkpoints.get("wf"), 5) is not None
    finally:
        await store.aclose()


def test_loops_in_several_threads_share_one_pool(sqlite_url: str) -> None:
    store = StateStore(sqlite_url, pool_size=2)
    before = _workers()
    errors: list[BaseException] = []

    def run(i: int) -> None:
        async def body() -> None:
            for j in range(10):
                await store.checkpoints.set(f"wf-{i}", "chat", j + 1)
                await store.checkpoints.get(f"wf-{i}")

        try:
            asyncio.run(body())  # each thread's loop closes without aclose()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert len(_workers() - before) <= 2  # not one set per loop
    assert all(t.daemon for t in threading.enumerate() if t.name in _workers())

    async def close() -> None:
        await store.aclose()

    asyncio.run(close())


async def test_aclose_lets_in_flight_calls_finish_and_stops_workers(sqlite_url: str) -> None:
    before = _workers()
    store = StateStore(sqlite_url, pool_size=2)
    await store.checkpoints.set("wf", "chat", 1)
    writes = [asyncio.create_task(store.checkpoints.set(f"wf-{i}", "c", 1)) for i in range(6)]
    await asyncio.sleep(0)
    await store.aclose()
    await asyncio.gather(*writes)
    for _ in range(100):
        if not (_workers() - before):
            break
        await asyncio.sleep(0.02)
    assert not (_workers() - before)
    assert (await store.checkpoints.get("wf-5")) is not None  # a new call makes a new pool
    await store.aclose()


async def test_cancel_as_the_worker_arrives_is_not_swallowed(sqlite_url: str) -> None:
    """A waiter cancelled in the very iteration its worker arrives must still end
    cancelled (and pass the worker on): asyncio.wait_for on 3.11 swallowed that
    cancellation, and a cancelled lease renewer then never stopped."""
    store = StateStore(sqlite_url, pool_size=1)
    await store.ensure_schema()
    pool = engines.get_sqlite_pool(sqlite_url.split("///", 1)[1], connect_timeout=10, pool_size=1)
    try:
        held = await pool.checkout()
        waiter = asyncio.create_task(pool.checkout())
        await asyncio.sleep(0)  # the waiter queues
        pool.checkin(held)  # schedules the hand-over to the waiter
        await asyncio.sleep(0)  # the hand-over ran; the waiter has not resumed yet
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        # The worker was passed back: the next check-out gets it at once.
        again = await asyncio.wait_for(pool.checkout(), 1)
        pool.checkin(again)
    finally:
        await store.aclose()
