"""``max_parallel`` holds across a fan-out's shards, on a real process worker.

Six one-step workflows in three ``agent-fanout-shard`` runs of 2, ``max_parallel`` 4:
``cut_shards`` makes that 2 workflows per shard and 2 shards at once (the pure rule is
in test_shards.py). No turn cap, and the worker has room for all three shard runs at
once (``--limit 3``), so only the fan-out's split can keep the running turns to 4.

Measured: the emulator's event log never shows more than 4 running turns, and the
Prefect server never shows more than 2 of the shard runs running at once (from their
start and end times: the third started after one of the first two ended).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from fanout_env import (
    WORKER_QUERY_S,
    child_env,
    deploy,
    deployment_id,
    fanout_items,
    fanout_settings,
    most_at_once,
    runs_of,
    start_worker,
    stop_worker,
    undeploy,
)
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType

from coder_chat.emulator import Emulator
from prefect_coder.flows.deployments.agent_fanout import SHARD_DEPLOYMENT, agent_fanout

WORKFLOWS = 6
SHARD_SIZE = 2
MAX_PARALLEL = 4


async def test_max_parallel_holds_across_shards(
    prefect_harness: Any, emu: Emulator, pg_store: tuple[str, str], tmp_path: Path
) -> None:
    store_url, tenant = pg_store
    settings = await fanout_settings(emu, store_url, None, tenant=tenant)
    pool = f"fanout-par-{uuid.uuid4().hex[:6]}"
    deployed = await deploy(pool)
    env = child_env(prefect_harness.api_url, prefect_harness.results_dir, query_s=WORKER_QUERY_S)
    worker = await start_worker(pool, f"{pool}-w", env, tmp_path / "w.log", limit=3)
    items = fanout_items(uuid.uuid4().hex[:6], WORKFLOWS, ["only"], 2.0)
    try:
        # The fan-out itself runs here (no process start for it); its shards are
        # deployment runs on the worker.
        outcomes = await agent_fanout(
            items,
            settings,
            max_parallel=MAX_PARALLEL,
            shard_size=SHARD_SIZE,
            shard_deployment=SHARD_DEPLOYMENT,
            # Each look at a shard run's state is a read of the server; 1 s of lag
            # before the next shard starts changes no order fact below.
            poll_interval_s=1.0,
        )
        async with get_client() as client:
            shard_runs = await runs_of(
                client, deployment_id(deployed, "agent-fanout-shard"), pool=pool
            )
    finally:
        await stop_worker(worker)
        await undeploy(deployed)
        log = worker.log.read_text(errors="replace")[-4000:]

    assert [o.ok for o in outcomes] == [True] * WORKFLOWS, (outcomes, log)
    assert [r.state_type for r in shard_runs] == [StateType.COMPLETED] * 3, shard_runs
    assert len(emu.event_log(["turn_start"])) == WORKFLOWS
    # The server's own count of running turns: never above max_parallel …
    assert 1 <= emu.max_concurrent_turns() <= MAX_PARALLEL, emu.event_log(["turn_start"])
    # … because never more than max_parallel // per-shard shards ran at once.
    spans = [(r.start_time, r.end_time) for r in shard_runs]
    assert all(s is not None and e is not None for s, e in spans), spans
    assert most_at_once(spans) <= MAX_PARALLEL // SHARD_SIZE, spans
