"""Real OS processes: exactly one lease winner, mutual exclusion, SIGKILL expiry, and
writes that a SIGKILL cannot tear or lose once acknowledged."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefect_coder.blocks import StateStore

WORKER = str(Path(__file__).with_name("lease_worker.py"))
N_CONTENDERS = 3
N_HOLDERS = 2  # one SIGKILL test per backend


class Pool:
    """Worker processes started together once per module (imports dominate their cost)."""

    def __init__(self) -> None:
        self.contenders = [self._spawn() for _ in range(N_CONTENDERS)]
        self.holders = [self._spawn() for _ in range(N_HOLDERS)]
        self._ready: set[int] = set()

    @staticmethod
    def _spawn() -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, WORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=str(Path(__file__).parents[2]),
        )

    async def readline(self, proc: subprocess.Popen[str], limit: float = 30) -> str:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), limit)
        if not line:
            assert proc.stderr is not None
            raise AssertionError(f"worker exited {proc.wait()}: {proc.stderr.read()}")
        if proc.pid not in self._ready:
            assert line.strip() == "READY"
            self._ready.add(proc.pid)
            return await self.readline(proc, limit)
        return line.strip()

    @staticmethod
    def send(proc: subprocess.Popen[str], text: str) -> None:
        assert proc.stdin is not None
        proc.stdin.write(text + "\n")
        proc.stdin.flush()

    def close(self) -> None:
        for p in self.contenders + self.holders:
            if p.poll() is None:
                p.kill()
            p.wait()
            for f in (p.stdin, p.stdout, p.stderr):
                if f is not None:
                    f.close()


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    p = Pool()
    yield p
    p.close()


async def test_processes_contend_exactly_one_holder(
    store: StateStore, store_url: str, pool: Pool
) -> None:
    cmd: dict[str, object] = {"op": "contend", "url": store_url, "tenant": store.tenant}
    cmd |= {"key_once": "once", "key_cm": "cm", "hold": 0.05}
    for p in pool.contenders:
        pool.send(p, json.dumps(cmd))
    for p in pool.contenders:
        assert await pool.readline(p) == "ARMED"
    for p in pool.contenders:  # release them as close together as we can
        pool.send(p, "go")
    results = [json.loads(await pool.readline(p)) for p in pool.contenders]

    assert sum(r["won"] for r in results) == 1
    live = await store.leases.get("once")
    assert live is not None and live[0].holder == next(r["holder"] for r in results if r["won"])
    # Hold intervals of the waited lease never overlap: one holder at a time.
    spans = sorted((r["enter"], r["leave"]) for r in results)
    for (_, prev_leave), (next_enter, _) in itertools.pairwise(spans):
        assert next_enter >= prev_leave
    # Every hand-over to a different holder bumped the fence.
    assert sorted(r["fence"] for r in results) == list(range(1, N_CONTENDERS + 1))


async def test_sigkilled_holder_loses_lease_after_ttl_and_keeps_its_writes(
    store: StateStore, store_url: str, backend: str, pool: Pool
) -> None:
    """A step process holds the lease and writes checkpoints; SIGKILL lands mid-write."""
    ttl = 0.5
    proc = pool.holders.pop()
    cmd = {"op": "hold", "url": store_url, "tenant": store.tenant, "key": "chat:c", "ttl": ttl}
    pool.send(proc, json.dumps(cmd))
    held = (await pool.readline(proc)).split()
    assert held[0] == "HELD"
    holder = held[2]
    # Alive and renewing: still held well past one ttl.
    acked = 0
    deadline = time.monotonic() + ttl * 1.5
    while time.monotonic() < deadline:
        acked = int(await pool.readline(proc))
    assert await store.leases.acquire("chat:c", "next", ttl=5) is None
    live = await store.leases.get("chat:c")
    assert live is not None and live[0].holder == holder
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.stdout is not None
    for line in proc.stdout.read().split():  # acknowledgements still in the pipe
        acked = max(acked, int(line))

    # No finally ran: the row still names the dead holder until it lapses. Order
    # facts come from the database clock, not from this process's wall time (a
    # loaded machine may deschedule the test for longer than the ttl): the row's
    # last expiry, read after the kill (no renewal can land any more), is the
    # earliest moment another holder may take it.
    dead = await store.leases.get("chat:c")
    last_expiry = dead[0].expires_at if dead is not None else None
    if dead is not None:
        assert dead[0].holder == holder and dead[0].fence == 1
    got = await store.leases.acquire("chat:c", "next", ttl=5)
    deadline = time.monotonic() + ttl + 30  # liveness bound only, generous for load
    while got is None and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
        got = await store.leases.acquire("chat:c", "next", ttl=5)
    assert got is not None and got.holder == "next" and got.fence == 2
    # ...and is taken over only once it lapsed: never while the dead holder's
    # last renewal still covered it.
    if last_expiry is not None:
        assert got.acquired_at >= last_expiry, (got.acquired_at, last_expiry)

    # The writes: nothing acknowledged is lost (at most the in-flight one also landed),
    # and the chat id and cursor always come from the same write.
    assert acked >= 3
    cp = await store.checkpoints.get("wf")
    assert cp is not None and cp.last_seen_message_id in (acked, acked + 1)
    assert cp.chat_id == f"chat-{cp.last_seen_message_id}"
    if backend == "sqlite":
        import sqlalchemy as sa
        from sqlalchemy.ext.asyncio import create_async_engine

        engine = create_async_engine(store_url)
        async with engine.connect() as conn:
            assert (await conn.execute(sa.text("PRAGMA integrity_check"))).scalar() == "ok"
        await engine.dispose()
