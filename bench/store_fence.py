"""What the store's write guard costs per write (blocks/state/fencing.py; issue 30, items
4 and 7), on SQLite and PostgreSQL: the same writes with and without it, interleaved.

* ``checkpoints.set`` and ``ledger.begin`` (one write transaction each): without the
  guard (a store whose ``write_fences`` is None: the code path before it), with the
  schema check alone (no lease held), and inside ``store.lease`` (schema + one fence).
* ``turns.record`` (the ``finally`` checkpoint: one statement, the guard in its WHERE)
  with no fence and with one.
* ``HeldLease.confirm()`` on a lease renewed less than half a ttl ago: now one read of
  the row's holder and fence (before: free, and blind to an immediate takeover).

Rounds alternate the variants so load drift hits them alike; medians per call::

    .venv/bin/python bench/store_fence.py [--calls 300] [--rounds 5] [--store sqlite|pg|both]

PostgreSQL: a private throwaway cluster (bench/pg_cluster.py: fsync off).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from prefect_coder.blocks.state import StateStore, fencing, sqlite_pool, workflow_key  # noqa: E402  # noqa: E402
from prefect_coder.blocks.state.fencing import Fence  # noqa: E402


class Unguarded(StateStore):
    """The store without the write guard: what every write did before it."""

    def write_fences(self) -> Any:
        return None


Call = Callable[[int], Awaitable[Any]]


async def _time(call: Call, n: int) -> float:
    """Median seconds per call over ``n`` calls."""
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        await call(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def bench(url: str, calls: int, rounds: int) -> dict[str, list[float]]:
    tenant = f"b-{uuid.uuid4().hex[:8]}"
    plain = Unguarded(url, tenant=tenant)
    store = StateStore(url, tenant=tenant)
    await store.ensure_schema()
    out: dict[str, list[float]] = {}
    n_ledger = [0]

    def ledger(s: StateStore) -> Call:
        async def call(i: int) -> Any:
            n_ledger[0] += 1
            return await s.ledger.begin("chat", f"c-{n_ledger[0]}", tool_name="t", args={"i": i})

        return call

    async with store.lease(workflow_key("held"), ttl=60) as held:
        fence: tuple[Fence, ...] = store.write_fences()
        assert len(fence) == 1
    for _ in range(rounds):
        variants: list[tuple[str, Call]] = [
            ("checkpoints.set: no guard", lambda i: plain.checkpoints.set("wf", "chat", i + 1)),
            ("checkpoints.set: schema", lambda i: store.checkpoints.set("wf", "chat", i + 1)),
            ("ledger.begin: no guard", ledger(plain)),
            ("ledger.begin: schema", ledger(store)),
            ("turns.record: schema", lambda i: store.turns.record("wf", "chat", i + 1)),
        ]
        for name, call in variants:
            out.setdefault(name, []).append(await _time(call, calls))
        async with store.lease(workflow_key("wf"), ttl=60) as held:
            fenced: list[tuple[str, Call]] = [
                (
                    "checkpoints.set: schema + fence",
                    lambda i: store.checkpoints.set("wf", "c", i + 1),
                ),
                ("ledger.begin: schema + fence", ledger(store)),
                ("turns.record: schema + fence", lambda i: store.turns.record("wf", "c", i + 1)),
                ("confirm (fresh): fence read", lambda i: held.confirm()),
                (
                    "renew (confirm when stale)",
                    lambda i: store.leases.renew(held.key, held.holder, 60),
                ),
            ]
            for name, call in fenced:
                out.setdefault(name, []).append(await _time(call, calls))
    # The guard statement alone, as each write transaction runs it (0 and 1 fence).
    fence1 = (Fence(store.fence_db, tenant, workflow_key("wf"), "h", 1),)
    for n, fences in ((0, ()), (1, fence1)):
        sql = fencing.guard_sql(store.backend, n)
        params = fencing.guard_params(fences)
        if store.backend == "sqlite":

            def body(conn: Any, _tw: Any, sql: str = sql, params: Any = params) -> float:
                t0 = time.perf_counter()
                for _ in range(calls):
                    sqlite_pool.driver_rows(conn, sql, params)
                return (time.perf_counter() - t0) / calls

            per = await store.run_direct(body)
        else:
            async with store.autocommit() as conn:

                async def guard(_i: int, sql: str = sql, params: Any = params) -> Any:
                    return await conn.exec_driver_sql(sql, params or None)

                per = await _time(guard, calls)
        out.setdefault(f"guard statement alone, {n} fence(s)", []).append(per)
    await plain.aclose()
    await store.aclose()
    return out


def report(label: str, out: dict[str, list[float]]) -> None:
    med = {k: statistics.median(v) * 1000 for k, v in out.items()}
    print(f"\n{label}: median ms per call (median of rounds)")
    for k, v in med.items():
        print(f"  {k:36s} {v:8.4f}")
    for op in ("checkpoints.set", "ledger.begin"):
        base = med[f"{op}: no guard"]
        print(
            f"  {op}: schema / no guard = {med[f'{op}: schema'] / base:.2f}, "
            f"schema + fence / no guard = {med[f'{op}: schema + fence'] / base:.2f}"
        )
    print(f"  load: {os.getloadavg()[0]:.2f}")


async def main(args: argparse.Namespace) -> None:
    print(f"load before: {os.getloadavg()}")
    if args.store in ("sqlite", "both"):
        with tempfile.TemporaryDirectory() as d:
            report(
                "SQLite", await bench(f"sqlite+aiosqlite:///{d}/state.db", args.calls, args.rounds)
            )
    if args.store in ("pg", "both"):
        from pg_cluster import private_postgres

        with private_postgres() as url:
            report("PostgreSQL", await bench(url, args.calls, args.rounds))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--store", choices=["sqlite", "pg", "both"], default="both")
    asyncio.run(main(p.parse_args()))
