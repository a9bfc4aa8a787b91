"""``agent-fanout`` one run per workflow through the real path: a Prefect server, a
``prefect worker start`` process worker, deployment runs. The fan-out starts every
workflow as its own ``agent-workflow`` flow run (keyed ``fanout-<workflow_id>``), no
``agent-fanout-shard`` run. The Prefect server and the ``ChatStateStore`` both run on
the session's PostgreSQL cluster.

The fan-out itself runs in the test process (``workflow_deployment``, as the shard
test's in test_fanout_rerun.py does): nothing here kills it, and a flow-run process of
its own (≈ 5 CPU-s before the warm launch, issue 12) proved nothing the workflow runs
do not. A deployment run of ``agent-fanout`` at ``shard_size`` 1 choosing this mode
itself, killed and re-run, is test_fanout_rerun.py's.

One of the workflow runs is SIGKILLed (its own flow-run process, the worker lives on)
while its first turn runs on the emulator, once its chat is checkpointed. The worker reports the run Crashed; from
there everything is the product: the ``prefect.yaml`` Crashed trigger of
``agent-workflow`` starts ``recover-turn`` for the workflow, and the fan-out starts the
workflow again under the key naming the crashed run; the workflow lease serialises the
two, the in-flight turn is recovered from the chat, the rest runs once.

Measured: the fan-out's one ``agent-fanout`` table artifact lists each workflow with
its own flow run (the killed one with the run that finished it), every workflow
finished, one user message per step (the emulator's event log: the killed turn was
not sent again), no chat left unarchived, the turn cap never exceeded.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import uuid
from pathlib import Path
from typing import Any

from fanout_env import (
    ENGINE_COMMAND,
    ROOT,
    WORKER_QUERY_S,
    child_env,
    deploy,
    deployment_id,
    fanout_items,
    fanout_settings,
    parent_of,
    runs_of,
    start_worker,
    stop_worker,
    undeploy,
    until,
    user_messages_per_step,
)
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import DeploymentUpdate, WorkPoolCreate
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    ArtifactFilterKey,
)
from prefect.client.schemas.objects import StateType

from coder_chat.emulator import Emulator
from prefect_coder.blocks import StateStore
from prefect_coder.flows.common.labels import LABEL_WORKFLOW
from prefect_coder.flows.common.params import Step, step_marker
from prefect_coder.flows.deployments.agent_fanout import WORKFLOW_DEPLOYMENT, agent_fanout

#: Two workflows on one turn slot: the fewest that show each workflow as its own run
#: (the killed one and one that is not) and a cap the workflows contend for — the
#: killed run dies holding the only slot. (Three on two slots proved the same with
#: one more flow-run process, ≈ 6 CPU-s.)
CAP = 1
WORKFLOWS = 2
STEPS = ("plan", "do")
#: The killed workflow's first turn: long enough that the kill lands while it runs
#: server-side (checked from the emulator's log, not assumed).
VICTIM_TURN_S = 6.0


async def test_shard_size_one_runs_each_workflow_as_its_own_run_and_recovers_a_killed_one(
    prefect_harness: Any, emu: Emulator, pg_store: tuple[str, str], tmp_path: Path
) -> None:
    store_url, tenant = pg_store
    pool = f"fanout1-{uuid.uuid4().hex[:6]}"
    # The pool first and the worker started at once: its start-up (until it polls)
    # overlaps the blocks and the deploy below.
    async with get_client() as client:
        await client.create_work_pool(WorkPoolCreate(name=pool, type="process"), overwrite=True)
    env = child_env(prefect_harness.api_url, prefect_harness.results_dir, query_s=WORKER_QUERY_S)
    # --limit 4: the two workflow runs, the killed one's restart and the recover-turn
    # run the trigger starts.
    worker = await start_worker(pool, f"{pool}-w", env, tmp_path / "w.log", limit=4)
    try:
        settings = await fanout_settings(emu, store_url, CAP, tenant=tenant)
        # The launch path prefect.yaml gives users (no `command` job variable) for the
        # agent-workflow runs, one of which is killed: the one fan-out test that kills
        # a flow-run process started Prefect's default way. The recover-turn run and,
        # once the kill is done, the killed run's restart (not killed) start as
        # fanout_env.ENGINE_COMMAND: forked from the session's warm process, ≈ 5 CPU-s
        # less each than the default launch's supervisor and engine.
        deployed = await deploy(pool, default_launch=["agent-workflow"])
    except BaseException:
        await stop_worker(worker)
        raise
    items = fanout_items(uuid.uuid4().hex[:6], WORKFLOWS, STEPS, 0.3)
    victim = items[0].workflow_id
    plan = items[0].steps[0]
    items[0].steps[0] = Step(
        name=plan.name,
        prompt=plan.prompt.replace('"sleep": 0.3', f'"sleep": {VICTIM_TURN_S}'),
    )
    workflow_dep = deployment_id(deployed, "agent-workflow")
    store = StateStore(store_url, tenant=tenant)

    async def run_fanout() -> Any:
        return await agent_fanout(
            items,
            settings,
            max_parallel=WORKFLOWS,
            fail_on_error=True,
            workflow_deployment=WORKFLOW_DEPLOYMENT,
            return_state=True,
        )

    fanout: asyncio.Task[Any] | None = None
    try:
        async with get_client() as client:
            fanout = asyncio.create_task(run_fanout())

            # The victim's first turn runs on the emulator, and its flow run's process
            # (a child of the worker) is known: kill that process alone.
            def victim_turn_running() -> bool:
                chats = {c["id"] for c in emu.chats() if c["labels"].get(LABEL_WORKFLOW) == victim}
                log = [
                    e for e in emu.event_log(["turn_start", "turn_end"]) if e["chat_id"] in chats
                ]
                ends = sum(e["kind"] == "turn_end" for e in log)
                return len(log) - ends > 0 and ends == 0

            # … whether or not its chat is checkpointed yet: a kill between the create
            # response and the eager checkpoint leaves a chat no checkpoint names, which
            # the restart adopts (flows/recovery/orphans.py) — one user message per
            # step either way. (Before adoption, a loaded run that killed there sent the
            # step twice; the test then waited for the checkpoint.)
            async def victim_process() -> tuple[Any, int] | None:
                if fanout.done():  # it ended (failed) before the kill: say how
                    raise AssertionError(("the fan-out ended first", fanout.result()))
                # The emulator first (local): no server read before the turn runs.
                if not victim_turn_running():
                    return None
                for run in await runs_of(client, workflow_dep, [StateType.RUNNING], pool=pool):
                    pid = str(run.infrastructure_pid or "").split(":")[-1]
                    if run.name == victim and pid and parent_of(int(pid)) == worker.pid:
                        # Looked at last (a local read), so the kill follows at once.
                        return (run, int(pid)) if victim_turn_running() else None
                return None

            crashed_run, pid = await until("the victim's first turn", 240, victim_process)
            os.kill(pid, signal.SIGKILL)
            # An order fact from the emulator: the kill landed while the turn ran.
            assert victim_turn_running(), emu.event_log(["turn_start", "turn_end"])
            # Both agent-workflow runs started Prefect's default way and the kill is
            # done: the restart the fan-out makes once it sees the run Crashed starts
            # as the engine command (the worker reads a deployment's job variables
            # when it starts a run).
            await client.update_deployment(
                workflow_dep,
                DeploymentUpdate(
                    job_variables={"working_dir": str(ROOT), "command": ENGINE_COMMAND}
                ),
            )

            # The fan-out's own end, here in this process: no server reads to wait.
            state = await asyncio.wait_for(fanout, 240)
            final = await client.read_flow_run(state.state_details.flow_run_id)
            recover_dep = deployment_id(deployed, "recover-turn")

            # The trigger's recover-turn run has ended too (it may finish after the fan-out).
            async def recoveries() -> list[Any] | None:
                runs = await runs_of(client, recover_dep, pool=pool)
                return runs if runs and all(r.state and r.state.is_final() for r in runs) else None

            recover_runs = await until("the recover-turn run", 180, recoveries)
            workflow_runs = await runs_of(client, workflow_dep, pool=pool)
            shard_runs = await runs_of(
                client, deployment_id(deployed, "agent-fanout-shard"), pool=pool
            )
            artifacts = await client.read_artifacts(
                artifact_filter=ArtifactFilter(
                    key=ArtifactFilterKey(any_=["agent-fanout"]),
                    flow_run_id=ArtifactFilterFlowRunId(any_=[final.id]),
                )
            )
            outcomes = await state.aresult() if state.is_completed() else None
    finally:
        if fanout is not None and not fanout.done():
            fanout.cancel()
            await asyncio.gather(fanout, return_exceptions=True)
        await stop_worker(worker)
        await undeploy(deployed)
        await store.aclose()
        log = worker.log.read_text(errors="replace")[-4000:]

    assert state.is_completed(), (state, log)
    # Each workflow its own agent-workflow run; no shard runs at size 1. The killed
    # run ended Crashed (reported by the worker) and its workflow ran again once.
    assert shard_runs == []
    states = sorted((r.name, r.state_type) for r in workflow_runs)
    assert states == sorted(
        [(i.workflow_id, StateType.COMPLETED) for i in items] + [(victim, StateType.CRASHED)]
    ), states
    assert next(r for r in workflow_runs if r.id == crashed_run.id).state_type == StateType.CRASHED
    # The Crashed trigger started recover-turn for the killed workflow, and it completed.
    assert [(r.parameters["workflow_id"], r.state_type) for r in recover_runs] == [
        (victim, StateType.COMPLETED)
    ], [(r.name, r.state_name, r.state and r.state.message) for r in recover_runs]
    run_of = {r.name: str(r.id) for r in workflow_runs if r.state_type == StateType.COMPLETED}
    runs_per = {i.workflow_id: 2 if i.workflow_id == victim else 1 for i in items}
    # Per-workflow outcomes, in the fan-out's order, each naming the run that finished it …
    assert outcomes is not None
    got = [o if isinstance(o, dict) else o.model_dump(mode="json") for o in outcomes]
    assert [(o["workflow_id"], o["ok"], o["state"], o["runs"]) for o in got] == [
        (i.workflow_id, True, "COMPLETED", runs_per[i.workflow_id]) for i in items
    ], got
    assert [o["flow_run_id"] for o in got] == [run_of[i.workflow_id] for i in items]
    assert [[r["text"] for r in o["results"]] for o in got] == [
        [f"done {s}" for s in STEPS] for _ in items
    ]
    # … and in the one table artifact of the fan-out run.
    assert len(artifacts) == 1, artifacts
    data = artifacts[0].data
    assert isinstance(data, str), data  # a table artifact's rows, as JSON
    rows: list[dict[str, Any]] = json.loads(data)
    assert [
        (r["workflow_id"], r["ok"], r["state"], r["runs"], r["flow_run_id"], r["error"])
        for r in rows
    ] == [
        (i.workflow_id, True, "COMPLETED", runs_per[i.workflow_id], run_of[i.workflow_id], "")
        for i in items
    ], rows
    # One user message per step, counted from the emulator's event log: the killed
    # turn was recovered from its chat, not sent again.
    counts = user_messages_per_step(emu, items, STEPS)
    chats = emu.chats()
    assert counts == {step_marker(i.workflow_id, s): 1 for i in items for s in STEPS}, (
        counts,
        [(c["id"], c["labels"].get(LABEL_WORKFLOW), c["status"]) for c in chats],
        emu.event_log(["turn_start", "turn_end"]),
    )
    assert len(chats) == WORKFLOWS, chats
    assert all(c["archived"] for c in chats), [c for c in chats if not c["archived"]]
    assert emu.max_concurrent_turns() <= CAP, (
        [(c["id"], c["labels"].get(LABEL_WORKFLOW)) for c in chats],
        emu.event_log(["turn_start", "turn_end", "message", "archived", "chat_created"]),
        log,
    )
