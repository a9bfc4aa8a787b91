"""Issue 29, case 4, through deployments: an ``agent-workflow`` run whose worker is
SIGKILLed (with its children) while the run is still Pending — picked up, its process
starting — is never reported by anyone and stays Pending for ever. The reconciler
adopts it from Prefect (it never took its lease, so it has no record yet), marks it
Crashed (Pending past the grace, no lease, no heartbeat), reruns the deployment with
all its parameters on a new worker, and the workflow completes: one user message per
step, counted from the emulator's event log; every chat archived.

No Crashed trigger is deployed here (``recover-turn`` untriggered): the reconciler
alone must finish the workflow. The run's process is Prefect's default launch (its
start is seconds of imports), so the kill lands while the run is Pending.
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
    start_worker,
    stop_worker,
    undeploy,
    until,
)
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from reconcile_env import FAST, one_message_per_step, start_workflow, tick_until
from warm_python import WarmPython

from coder_chat.emulator import Emulator
from prefect_coder.blocks import StateStore
from prefect_coder.flows.common.params import step_marker
from prefect_coder.flows.deployments.reconcile_workflows import ReconcileRow
from prefect_coder.flows.liveness.track import workflow_record_key

STEPS = ("plan", "do")


async def test_a_run_lost_while_pending_is_adopted_crashed_and_rerun(
    prefect_harness: Any, warm_python: WarmPython, emu: Emulator, tmp_path: Path
) -> None:
    store_url = f"sqlite+aiosqlite:///{tmp_path / 'state.db'}"
    pool = f"reconcile-pending-{uuid.uuid4().hex[:6]}"
    env = child_env(prefect_harness.api_url, prefect_harness.results_dir, query_s=WORKER_QUERY_S)
    settings = await fanout_settings(emu, store_url, None)
    deployed = await deploy(
        pool, untriggered=("recover-turn", "agent-fanout"), default_launch=["agent-workflow"]
    )
    [item] = fanout_items(uuid.uuid4().hex[:6], 1, STEPS, 0.2)
    workers = [await start_worker(pool, f"{pool}-w1", env, tmp_path / "w1.log", limit=1)]
    store = StateStore(store_url)
    seen: list[ReconcileRow] = []
    try:
        async with get_client() as client:
            run = await start_workflow(
                client, deployment_id(deployed, "agent-workflow"), item, settings
            )

            async def pending() -> bool:
                state = (await client.read_flow_run(run.id)).state
                return state is not None and state.type == StateType.PENDING

            await until("the worker to pick the run up", 120, pending, every_s=0.05)
            workers[0].kill_with_children()  # the host, with the run's starting process
            await workers[0].proc.wait()
            lost = await client.read_flow_run(run.id)
            assert lost.state is not None and lost.state.type == StateType.PENDING
            assert not emu.event_log(["message"])  # it never got to its first turn

            workers.append(
                await start_worker(pool, f"{pool}-w2", env, tmp_path / "w2.log", limit=1)
            )

            async def marked() -> bool:
                state = (await client.read_flow_run(run.id)).state
                return state is not None and state.type != StateType.PENDING

            await tick_until("the lost run marked Crashed", 240, settings, marked, seen=seen)

            async def finished() -> Any:
                record = await store.workflows.get(workflow_record_key(item.workflow_id))
                return record if record is not None and record.state == "done" else None

            # The rerun's own start is seconds of imports, more on a busy machine: past
            # the lost run, the grace is production's (a starting rerun is not lost).
            record = await tick_until(
                "the workflow to complete",
                240,
                settings,
                finished,
                options=FAST.model_copy(update={"pending_grace_s": 120.0}),
                seen=seen,
            )
            crashed = await client.read_flow_run(run.id)
            rerun = await client.read_flow_run(uuid.UUID(str(record.flow_run_id)))
    finally:
        await store.aclose()
        for w in workers:
            await stop_worker(w)
        await undeploy(deployed)
    logs = "\n".join(w.log.read_text(errors="replace")[-2000:] for w in workers)
    actions = [(r.action, r.why) for r in seen]
    assert crashed.state is not None and crashed.state.type == StateType.CRASHED, actions
    assert "reconcile-workflows" in (crashed.state.message or "") and "Pending" in (
        crashed.state.message or ""
    )
    assert rerun.id != run.id and "coder-reconciled" in rerun.tags, logs
    assert rerun.state is not None and rerun.state.type == StateType.COMPLETED, logs
    assert rerun.parameters == run.parameters  # all of them
    # A tick between the rerun's Completed state and its own write of the record may
    # mark the record done itself (the same verdict, idempotent).
    acted = [a for a, _ in actions]
    assert record.attempts == 1 and acted in (
        ["mark-crashed", "recover"],
        ["mark-crashed", "recover", "done"],
    ), actions
    counts = one_message_per_step(emu, item, STEPS)
    assert counts == {step_marker(item.workflow_id, s): 1 for s in STEPS}, counts
    assert all(c["archived"] for c in emu.chats())
