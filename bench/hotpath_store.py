"""The state-store work of one one-turn fan-out workflow, alone: process CPU and wall per turn.

What a fan-out worker's one-turn workflow asks of the store (SQLite or PostgreSQL),
through the real code paths of the tree it runs from: the workflow lease
(``hold_workflow_lease``'s ``store.lease``), the turn slot (``turn_slot``), the
turn's ``store.turns.begin``, the first turn's eager checkpoint
(``EagerCheckpoint.ensure``), its ``finally`` checkpoint (``_record_after_turn``) and
the archive's store part (``retire_workflow_chat``'s read and clean-up — the one
part called by its pattern, since the real function also talks to the Coder
server: the tree's own calls are used when it has them). No Prefect, no Coder.

Run it once per tree to compare (docs/performance.md, round 7)::

    .venv/bin/python bench/hotpath_store.py [--turns 300] [--store sqlite|pg]
    .venv/bin/python /path/to/other/tree/bench/hotpath_store.py ...
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prefect_coder.blocks import StateStore  # noqa: E402
from prefect_coder.blocks.state import workflow_key  # noqa: E402
from prefect_coder.flows.fleet.slots import turn_slot  # noqa: E402
from prefect_coder.flows.recovery import retire as retire_mod  # noqa: E402
from prefect_coder.flows.recovery.eager_checkpoint import EagerCheckpoint  # noqa: E402
from prefect_coder.flows.turn import durable_turn  # noqa: E402


class _Agent:
    """What ``_record_after_turn`` reads of a finished first turn's agent."""

    def __init__(self, chat_id: str) -> None:
        self.chat_id = chat_id
        self.last_seen_message_id = 2
        self.left_run_live = None
        self.stranded_chat_ids: list[str] = []


async def _archive_store_part(store: StateStore, workflow_id: str) -> None:
    turns: Any = store.turns
    if hasattr(turns, "archive_targets"):
        checkpoint, _ = await turns.archive_targets(workflow_id)
        assert checkpoint is not None
        await turns.forget_tools(checkpoint.chat_id)
        return
    checkpoint = await store.checkpoints.get(workflow_id)
    await store.stranded.list(workflow_id)
    assert checkpoint is not None
    async with store.transaction() as tx:
        await tx.ledger.clear(checkpoint.chat_id)
        await tx.stranded.remove(checkpoint.chat_id)


async def one_workflow(store: StateStore, n: int, cap: int) -> None:
    workflow_id = f"hp-{n}"
    marker = f"[wf:{workflow_id}:s0]"
    async with store.lease(workflow_key(workflow_id), holder=f"h-{n}", ttl=30, wait=30):
        async with turn_slot(store, cap, wait=30, ttl=30, workflow_id=workflow_id):
            await store.turns.begin(workflow_id, marker, turn_timeout_s=600)
            chat_id = str(uuid.uuid4())
            eager = EagerCheckpoint(store, workflow_id, marker, had_chat=False, turn_timeout=600)
            await eager.ensure(chat_id)
            kwargs: dict[str, Any] = {}
            if "eagerly_journaled" in durable_turn._record_after_turn.__code__.co_varnames:
                kwargs["eagerly_journaled"] = eager.written
            await durable_turn._record_after_turn(
                store,
                workflow_id=workflow_id,
                agent=_Agent(chat_id),
                had_chat=False,
                failed=None,
                marker=marker,
                started_at=time.time(),
                turn_timeout=600,
                logger=None,  # type: ignore[arg-type]  # only the stranded path logs
                observer=None,  # type: ignore[arg-type]
                **kwargs,
            )
        await _archive_store_part(store, workflow_id)


async def main(args: argparse.Namespace) -> None:
    if args.store == "sqlite":
        url = f"sqlite+aiosqlite:///{tempfile.mkdtemp(prefix='hotpath-')}/state.db"
    else:
        url = args.pg_url
    store = StateStore(url, tenant=f"hp-{uuid.uuid4().hex[:8]}")
    try:
        for n in range(20):  # warm-up: schema, pool, statement caches
            await one_workflow(store, -n - 1, args.cap)
        walls = []
        t0 = os.times()
        for n in range(args.turns):
            w0 = time.perf_counter()
            await one_workflow(store, n, args.cap)
            walls.append((time.perf_counter() - w0) * 1000)
        t1 = os.times()
    finally:
        await store.aclose()
    cpu = (t1.user + t1.system - t0.user - t0.system) * 1000 / args.turns
    print(
        f"tree {ROOT} (retire from {Path(retire_mod.__file__).parent}): store {args.store}, "
        f"{args.turns} one-turn workflows: process CPU {cpu:.2f} ms/turn, "
        f"wall median {statistics.median(walls):.2f} ms, p90 "
        f"{statistics.quantiles(walls, n=10)[-1]:.2f} ms; load {os.getloadavg()}"
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--turns", type=int, default=300)
    p.add_argument("--cap", type=int, default=50)
    p.add_argument("--store", choices=["sqlite", "pg"], default="sqlite")
    p.add_argument("--pg-url", default=os.environ.get("PREFECT_CODER_BENCH_PG_URL", ""))
    asyncio.run(main(p.parse_args()))
