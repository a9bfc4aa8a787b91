"""Issue 29, case 2, through deployments: a fan-out shard whose host is lost.

The ``agent-fanout`` run lives on worker A; its one ``agent-fanout-shard`` run on worker
B. B is SIGKILLed with its children (a lost host) while a turn of the shard runs:
nothing reports the shard, which stays Running — and the fan-out, attached to it,
would wait for ever (heartbeats are off here, as in every test; in production the
zombie automation would crash it ≈ 90 s later, now that the shard's flow is in
``PRODUCT_FLOWS``). The reconciler sees the shard's record: Running in Prefect while
nobody renews its workflows' leases, and marks it Crashed (before any lease ttl plus
heartbeat timeout); the live fan-out restarts the crashed shard on worker C, the new
shard recovers its workflows from the store and their chats, and the fan-out
completes by itself: one user message per (workflow, step), every chat archived.
"""

from __future__ import annotations

import time
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
    runs_of,
    start_worker,
    stop_worker,
    undeploy,
    until,
    user_messages_per_step,
)
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from prefect.deployments import run_deployment
from reconcile_env import FAST, tick_until
from warm_python import WarmPython

from coder_chat.emulator import Emulator
from prefect_coder.flows.common.params import step_marker
from prefect_coder.flows.deployments.reconcile_workflows import ReconcileRow

STEPS = ("plan", "do")
WORKFLOWS = 2
#: The live fan-out restarts a crashed shard itself within seconds: the reconciler
#: leaves a Crashed run to it (and the triggers) this long.
OPTIONS = FAST.model_copy(update={"crashed_grace_s": 20.0})


async def test_a_shard_on_a_lost_host_is_crashed_and_the_fanout_completes(
    prefect_harness: Any, warm_python: WarmPython, emu: Emulator, tmp_path: Path
) -> None:
    store_url = f"sqlite+aiosqlite:///{tmp_path / 'state.db'}"
    pool = f"reconcile-shard-{uuid.uuid4().hex[:6]}"
    env = child_env(prefect_harness.api_url, prefect_harness.results_dir, query_s=WORKER_QUERY_S)
    settings = await fanout_settings(emu, store_url, None)
    deployed = await deploy(pool)
    items = fanout_items(uuid.uuid4().hex[:6], WORKFLOWS, STEPS, 2.0)
    workers = [await start_worker(pool, f"{pool}-a", env, tmp_path / "a.log", limit=1)]
    seen: list[ReconcileRow] = []
    fanout_dep = deployment_id(deployed, "agent-fanout")
    shard_dep = deployment_id(deployed, "agent-fanout-shard")
    try:
        async with get_client() as client:
            fanout = await run_deployment(  # type: ignore[misc]
                "agent-fanout/agent-fanout",
                parameters={
                    "workflows": [i.model_dump(mode="json") for i in items],
                    "settings": settings.model_dump(mode="json"),
                    "max_parallel": WORKFLOWS,
                    "shard_size": WORKFLOWS,
                },
                timeout=0,
            )

            async def fanout_running() -> bool:
                state = (await client.read_flow_run(fanout.id)).state
                return state is not None and state.type == StateType.RUNNING

            await until("the fan-out on worker A", 240, fanout_running)
            # Worker A is full (--limit 1): the shard waits for worker B.
            workers.append(await start_worker(pool, f"{pool}-b", env, tmp_path / "b.log", limit=1))

            def turn_running() -> bool:
                return bool(emu.event_log(["turn_start"]))

            await until("a turn of the shard on worker B", 240, _local(turn_running), every_s=0.1)
            workers[1].kill_with_children()
            await workers[1].proc.wait()
            killed_at = time.monotonic()
            [lost] = await runs_of(client, shard_dep, pool=pool)
            assert lost.state is not None and lost.state.type == StateType.RUNNING
            workers.append(await start_worker(pool, f"{pool}-c", env, tmp_path / "c.log", limit=2))

            async def shard_crashed() -> bool:
                state = (await client.read_flow_run(lost.id)).state
                return state is not None and state.type == StateType.CRASHED

            await tick_until(
                "the lost shard to be crashed", 120, settings, shard_crashed, OPTIONS, seen
            )
            detected_s = time.monotonic() - killed_at

            async def fanout_done() -> bool:
                state = (await client.read_flow_run(fanout.id)).state
                return state is not None and state.is_final()

            await tick_until("the fan-out to finish", 240, settings, fanout_done, OPTIONS, seen)
            final = await client.read_flow_run(fanout.id)
            shards = await runs_of(client, shard_dep, pool=pool)
            fanouts = await runs_of(client, fanout_dep, pool=pool)
            crashed = await client.read_flow_run(lost.id)
    finally:
        for w in workers:
            await stop_worker(w)
        await undeploy(deployed)
    logs = "\n".join(w.log.read_text(errors="replace")[-2000:] for w in workers)
    assert final.state is not None and final.state.type == StateType.COMPLETED, (final.state, logs)
    assert [f.id for f in fanouts] == [fanout.id]  # the fan-out itself lived on
    assert crashed.state is not None and "reconcile-workflows" in (crashed.state.message or "")
    assert "lease" in (crashed.state.message or "")
    assert sorted(s.state_type for s in shards if s.state_type) == sorted(
        [StateType.COMPLETED, StateType.CRASHED]
    ), [(s.name, s.state_name) for s in shards]
    assert "mark-crashed" in {r.action for r in seen}, seen
    counts = user_messages_per_step(emu, items, STEPS)
    assert counts == {step_marker(i.workflow_id, s): 1 for i in items for s in STEPS}, counts
    assert all(c["archived"] for c in emu.chats()), emu.chats()
    print(f"\nshard host lost: kill -> shard Crashed by the reconciler in {detected_s:.1f}s")


def _local(check: Any) -> Any:
    async def wrapped() -> bool:
        return bool(check())

    return wrapped
