"""``agent-fanout`` with ``shard_size`` 1 through the real path: a Prefect server, a
``prefect worker start`` process worker, ``run_deployment``. At size 1 a deployment
run of the fan-out starts every workflow as its own ``agent-workflow`` flow run
(keyed ``fanout-<workflow_id>``), no ``agent-fanout-shard`` run.

Measured: the fan-out's one ``agent-fanout`` table artifact lists each workflow with
its own flow run, every workflow finished, one user message per step (the emulator's
event log), no chat left unarchived, the turn cap never exceeded.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from fanout_env import (
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
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    ArtifactFilterKey,
)
from prefect.deployments import run_deployment

from coder_chat.emulator import Emulator
from prefect_coder.flows.parts.params import step_marker

CAP = 2
WORKFLOWS = 3
STEPS = ("plan", "do")


async def test_shard_size_one_runs_each_workflow_as_its_own_run(
    prefect_harness: Any, emu: Emulator, store_url: str, tmp_path: Path
) -> None:
    settings = await fanout_settings(emu, store_url, CAP)
    pool = f"fanout1-{uuid.uuid4().hex[:6]}"
    deployed = await deploy(pool)
    env = child_env(prefect_harness.api_url, prefect_harness.results_dir)
    # --limit 4: the fan-out and its three workflow runs at once.
    worker = await start_worker(pool, f"{pool}-w", env, tmp_path / "w.log", limit=4)
    items = fanout_items(uuid.uuid4().hex[:6], WORKFLOWS, STEPS, 0.3)
    parameters = {
        "workflows": [i.model_dump(mode="json") for i in items],
        "settings": settings.model_dump(mode="json"),
        "max_parallel": WORKFLOWS,
        "fail_on_error": True,
        "shard_size": 1,
    }
    try:
        async with get_client() as client:
            started = await run_deployment(  # type: ignore[misc]
                "agent-fanout/agent-fanout", parameters=parameters, timeout=0
            )

            async def fanout_final() -> Any:
                run = await client.read_flow_run(started.id)
                return run if run.state and run.state.is_final() else None

            final = await until("the agent-fanout run to end", 240, fanout_final)
            workflow_runs = await runs_of(client, deployment_id(deployed, "agent-workflow"))
            shard_runs = await runs_of(client, deployment_id(deployed, "agent-fanout-shard"))
            artifacts = await client.read_artifacts(
                artifact_filter=ArtifactFilter(
                    key=ArtifactFilterKey(any_=["agent-fanout"]),
                    flow_run_id=ArtifactFilterFlowRunId(any_=[final.id]),
                )
            )
            outcomes = await final.state.aresult() if final.state.is_completed() else None
    finally:
        await stop_worker(worker)
        await undeploy(deployed)
        log = worker.log.read_text(errors="replace")[-4000:]

    assert final.state.is_completed(), (final.state, log)
    # Each workflow its own agent-workflow run; no shard runs at size 1.
    assert shard_runs == []
    assert sorted(r.name for r in workflow_runs) == sorted(i.workflow_id for i in items)
    assert all(r.state and r.state.is_completed() for r in workflow_runs), [
        (r.name, r.state_name) for r in workflow_runs
    ]
    run_of = {r.name: str(r.id) for r in workflow_runs}
    # Per-workflow outcomes, in the fan-out's order, each naming its own run …
    assert outcomes is not None
    got = [o if isinstance(o, dict) else o.model_dump(mode="json") for o in outcomes]
    assert [(o["workflow_id"], o["ok"], o["state"]) for o in got] == [
        (i.workflow_id, True, "COMPLETED") for i in items
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
    ] == [(i.workflow_id, True, "COMPLETED", 1, run_of[i.workflow_id], "") for i in items], rows
    # One user message per step, counted from the emulator's event log.
    counts = user_messages_per_step(emu, items, STEPS)
    assert counts == {step_marker(i.workflow_id, s): 1 for i in items for s in STEPS}, counts
    chats = emu.chats()
    assert len(chats) == WORKFLOWS, chats
    assert all(c["archived"] for c in chats), [c for c in chats if not c["archived"]]
    assert emu.max_concurrent_turns() <= CAP
