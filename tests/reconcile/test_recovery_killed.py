"""Issue 29, case 5, through deployments: a crashed ``recover-turn`` is restarted.

An ``agent-workflow`` run's process is SIGKILLed in its first turn; the worker reports
it Crashed and the ``prefect.yaml`` trigger starts ``recover-turn``. That run is
SIGKILLed too, once it has taken the workflow's lease (its record names it), and so
is the run that replaces it: two crashes of the recovery in a row. Nothing triggers
on a crashed ``recover-turn``; the reconciler reruns it (its own deployment, all its
parameters, ``finish_workflow`` included) and the workflow completes by itself — one
user message per step (the emulator's event log), every chat archived.
"""

from __future__ import annotations

import asyncio
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
)
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from reconcile_env import (
    FAST,
    TICK_S,
    kill_run_process,
    one_message_per_step,
    reconciler_settings,
    start_workflow,
)
from warm_python import WarmPython

from coder_chat.emulator import Emulator
from prefect_coder.blocks import StateStore
from prefect_coder.flows.common.params import step_marker
from prefect_coder.flows.deployments.reconcile_workflows import (
    ReconcileRow,
    reconcile_workflows,
)
from prefect_coder.flows.liveness.track import workflow_record_key

STEPS = ("plan", "do")
#: Crashes of the recovery in a row.
RECOVERY_KILLS = 2
#: The first turn's scripted sleep: longer than the test, ended by the test.
HELD_S = 900


async def test_a_recovery_killed_twice_in_a_row_is_restarted_until_the_workflow_completes(
    prefect_harness: Any, warm_python: WarmPython, emu: Emulator, tmp_path: Path
) -> None:
    store_url = f"sqlite+aiosqlite:///{tmp_path / 'state.db'}"
    pool = f"reconcile-rt-{uuid.uuid4().hex[:6]}"
    env = child_env(prefect_harness.api_url, prefect_harness.results_dir, query_s=WORKER_QUERY_S)
    settings = await fanout_settings(emu, store_url, None)
    deployed = await deploy(pool, untriggered=("agent-fanout",))
    [item] = fanout_items(uuid.uuid4().hex[:6], 1, STEPS, 0.5)
    # The first step's turn sleeps until the test ends it (emu.end_sleeps): every
    # recovery run follows that live turn, so each is caught running however slow the
    # machine, instead of racing a short turn (a fast recovery once finished first).
    plan = item.steps[0]
    item.steps[0] = plan.model_copy(
        update={"prompt": plan.prompt.replace('"sleep": 0.5', f'"sleep": {HELD_S}')}
    )
    key = workflow_record_key(item.workflow_id)
    worker = await start_worker(pool, f"{pool}-w", env, tmp_path / "w.log", limit=2)
    store = StateStore(store_url)
    seen: list[ReconcileRow] = []
    killed: list[str] = []
    ended = 0
    try:
        async with get_client() as client:
            run = await start_workflow(
                client, deployment_id(deployed, "agent-workflow"), item, settings
            )

            async def first_turn_running() -> bool:
                log = emu.event_log(["turn_start", "turn_end"])
                if not log or any(e["kind"] == "turn_end" for e in log):
                    return False
                current = await client.read_flow_run(run.id)
                return kill_run_process(current, worker.pid)

            await until("the first turn", 240, first_turn_running, every_s=0.2)
            killed.append(str(run.id))
            recover_dep = deployment_id(deployed, "recover-turn")

            # The reconciler ticks; each recover-turn run that has taken the lease (the
            # record names it) and runs is killed, RECOVERY_KILLS times in a row.
            deadline = time.monotonic() + 300
            record = None
            while time.monotonic() < deadline:
                if len(killed) <= RECOVERY_KILLS:
                    record = await store.workflows.get(key)
                    for r in await runs_of(client, recover_dep, [StateType.RUNNING], pool=pool):
                        if (
                            record is not None
                            and record.flow_run_id == str(r.id)
                            and str(r.id) not in killed
                            and kill_run_process(r, worker.pid)
                        ):
                            killed.append(str(r.id))
                    if len(killed) > RECOVERY_KILLS:
                        # The last recovery is dead: let the held turn finish.
                        ended = emu.end_sleeps()
                rows = await reconcile_workflows(reconciler_settings(settings), FAST)
                seen.extend(r for r in rows if r.action != "leave")
                record = await store.workflows.get(key)
                if record is not None and record.state == "done":
                    break
                await asyncio.sleep(TICK_S)
            recoveries = await runs_of(client, recover_dep, pool=pool)
            crashed = await client.read_flow_run(run.id)
    finally:
        await store.aclose()
        await stop_worker(worker)
        await undeploy(deployed)
    logs = worker.log.read_text(errors="replace")[-3000:]
    actions = [(r.action, r.why) for r in seen]
    assert record is not None and record.state == "done", (record, actions, logs)
    assert len(killed) == 1 + RECOVERY_KILLS, (killed, actions)
    assert ended == 1, "the first turn was not held in its sleep to the last kill"
    assert crashed.state is not None and crashed.state.type == StateType.CRASHED
    by_id = {str(r.id): r for r in recoveries}
    # Both killed recoveries ended Crashed; the last recover-turn run, a rerun by the
    # reconciler with all the parameters of the one it replaced, completed.
    assert [by_id[k].state_type for k in killed[1:]] == [StateType.CRASHED] * RECOVERY_KILLS
    last = by_id[str(record.flow_run_id)]
    assert last.state_type == StateType.COMPLETED and "coder-reconciled" in last.tags, logs
    assert last.parameters == by_id[killed[1]].parameters
    assert last.parameters["finish_workflow"] is True
    assert record.attempts == RECOVERY_KILLS, actions
    counts = one_message_per_step(emu, item, STEPS)
    assert counts == {step_marker(item.workflow_id, s): 1 for s in STEPS}, counts
    assert all(c["archived"] for c in emu.chats()), emu.chats()
