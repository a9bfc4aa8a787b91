"""One store used from several event loops, as Prefect's worker threads do."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
from pathlib import Path

import asyncpg

from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state import engines


def test_sync_use_from_several_threads_with_own_loops(
    tmp_path: Path, backend: str, store_url: str
) -> None:
    """Prefect runs tasks in worker threads with their own loops: one store, many loops."""
    import asyncio

    store = StateStore(store_url, tenant=f"threads-{os.getpid()}-{backend}")
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        async def run() -> None:
            for j in range(5):
                await store.checkpoints.set(f"wf-{i}", f"chat-{i}", j + 1)
            async with store.lease(f"chat:{i}", ttl=5):
                pass
            await store.aclose()

        try:
            asyncio.run(run())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors

    async def check() -> list[int | None]:
        got = [await store.checkpoints.get(f"wf-{i}") for i in range(4)]
        await store.aclose()
        return [g.last_seen_message_id if g else None for g in got]

    assert asyncio.run(check()) == [5, 5, 5, 5]


def test_closed_loops_do_not_pile_up_engines_or_connections(postgres_url: str) -> None:
    """``asyncio.run()`` per call without aclose(): old loops' pools must be let go."""
    name = f"loops_{os.getpid()}"

    async def admin(sql: str, *args: object) -> int:
        conn = await asyncpg.connect(postgres_url.replace("+asyncpg", ""))
        try:
            return int(await conn.fetchval(sql, *args) or 0)
        finally:
            await conn.close()

    asyncio.run(admin(f'CREATE DATABASE "{name}"'))
    url = postgres_url.rsplit("/", 1)[0] + "/" + name
    store = StateStore(url, tenant="loops")

    def one_call() -> None:
        asyncio.run(store.checkpoints.set("wf", "chat", 1))

    try:
        for _ in range(8):
            t = threading.Thread(target=one_call)
            t.start()
            t.join(30)
        gc.collect()
        # Only the latest loop's engine (and its one pooled connection) may remain.
        per_loop = engines._engines[(os.getpid(), engines.cache_key(store._url, None))]
        assert len(per_loop) <= 1
        sql = "SELECT count(*) FROM pg_stat_activity WHERE datname = $1"
        assert asyncio.run(admin(sql, name)) <= 1
    finally:
        asyncio.run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
