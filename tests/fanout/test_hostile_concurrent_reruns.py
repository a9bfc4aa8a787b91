"""Two re-runs of one fan-out at once — the Crashed trigger's and one started by hand
with the same workflows — never start a workflow twice, restart a Crashed run once,
and together stay within ``max_parallel``.

Why it holds: both walk the same units in the same order (the live ones first, then
list order) and ask for the same idempotency keys, so the second re-run attaches to
the runs the first one started instead of starting its own, and a Crashed run's
restart key (``…-after-<run id>``) is the same in both. (With the workflows listed in
another order, each re-run's own gate holds only its own runs: up to twice
``max_parallel`` between them — ``max_parallel`` is per fan-out run, docs/fleet.md;
neither the turn cap nor single-flight depends on it.)

Cheap: no worker and no turns. The workflows' runs are created on a deployment of this
test's own (the session's Prefect server is shared) in a pool nobody polls, and this
test plays the worker through the API: it ends each run it finds some time after it
appeared (Failed: a Completed state with no stored result costs the fan-out seconds of
result-reading retries, and the outcome is not what is measured here). Concurrency is read from the runs' state histories, as order facts.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

from fanout_env import most_at_once, until
from prefect.client.orchestration import PrefectClient, get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterDeploymentId
from prefect.client.schemas.objects import FlowRun
from prefect.deployments.runner import EntrypointType
from prefect.states import Completed, Crashed, Failed

from prefect_coder.flows.common.params import Step
from prefect_coder.flows.deployments.agent_fanout import (
    FanoutItem,
    agent_fanout,
    fanout_idempotency_key,
)
from prefect_coder.flows.deployments.agent_workflow import agent_workflow

MAX_PARALLEL = 2
#: How long the playing worker lets a run live before it ends it.
RUN_S = 0.6
DONE = "ended by the test"


async def _runs(client: PrefectClient, dep_id: Any) -> list[FlowRun]:
    return await client.read_flow_runs(
        flow_run_filter=FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[dep_id])),
        limit=200,
    )


async def _span(client: PrefectClient, run: FlowRun) -> tuple[Any, Any]:
    states = sorted(await client.read_flow_run_states(run.id), key=lambda s: s.timestamp)
    final = [s for s in states if s.is_final()]
    assert states and final, (run.name, [(s.type, s.timestamp) for s in states])
    return states[0].timestamp, final[-1].timestamp


async def test_two_reruns_at_once_share_runs_and_max_parallel(prefect_server: Path) -> None:
    tag = uuid.uuid4().hex[:6]
    pool, name = f"hostile-{tag}", f"hostile-{tag}"
    items = [
        FanoutItem(workflow_id=f"cr-{tag}-{n}", steps=[Step(name="s", prompt="x")])
        for n in range(5)
    ]
    async with get_client() as client:
        await client.create_work_pool(WorkPoolCreate(name=pool, type="process"), overwrite=True)
        dep = await agent_workflow.ato_deployment(
            name=name,
            work_pool_name=pool,
            entrypoint_type=EntrypointType.MODULE_PATH,
            triggers=[],
        )
        dep_id = await dep.aapply()
        try:
            # What the crashed fan-out left: items[0]'s run Crashed (both re-runs must
            # restart it under one key), items[1]'s run still live.
            def params(item: FanoutItem) -> dict[str, Any]:
                return {
                    "workflow_id": item.workflow_id,
                    "steps": [s.model_dump(mode="json") for s in item.steps],
                }

            crashed = await client.create_flow_run_from_deployment(
                dep_id,
                parameters=params(items[0]),
                idempotency_key=fanout_idempotency_key(items[0].workflow_id),
            )
            await client.set_flow_run_state(crashed.id, Crashed(), force=True)
            live = await client.create_flow_run_from_deployment(
                dep_id,
                parameters=params(items[1]),
                idempotency_key=fanout_idempotency_key(items[1].workflow_id),
            )

            def rerun() -> Any:
                return agent_fanout(
                    items,
                    max_parallel=MAX_PARALLEL,
                    fail_on_error=False,
                    workflow_deployment=f"agent-workflow/{name}",
                    # Each look at a workflow run's state is a read of the server
                    # (up to 2 runs per re-run, 2 re-runs): every 0.1 s cost ≈ 40
                    # reads/s. Lag before a re-run's next start changes no key or
                    # order fact below (issue 12).
                    poll_interval_s=0.5,
                )

            reruns = [asyncio.create_task(rerun()), asyncio.create_task(rerun())]
            seen: dict[Any, float] = {}

            before = {crashed.id, live.id}

            async def play_the_worker() -> bool:
                now = asyncio.get_running_loop().time()
                current = await _runs(client, dep_id)
                if not {r.id for r in current} - before:
                    # Nothing ends before a re-run has walked: the live run must be
                    # live when they look it up.
                    return False
                for run in current:
                    if run.state is None or run.state.is_final():
                        continue
                    first = seen.setdefault(run.id, now)
                    if now - first >= RUN_S:
                        # Failed, not Completed: a Completed state without a stored
                        # result costs the fan-out seconds of result-reading retries.
                        await client.set_flow_run_state(run.id, Failed(message=DONE), force=True)
                return all(t.done() for t in reruns)

            # Every 0.3 s, not until()'s default: this loop is the worker, its pace is
            # each run's RUN_S.
            await until("both re-runs to end", 120, play_the_worker, every_s=0.3)
            outcomes = [t.result() for t in reruns]
            runs = await _runs(client, dep_id)
            spans = [await _span(client, r) for r in runs]
        finally:
            for current in await _runs(client, dep_id):
                if current.state is not None and not current.state.is_final():
                    await client.set_flow_run_state(current.id, Completed(), force=True)
            await client.delete_deployment(dep_id)

    keys = sorted(r.idempotency_key or "" for r in runs)
    # One run per workflow, plus the one restart of the crashed run: no run twice.
    assert keys == sorted(
        [fanout_idempotency_key(i.workflow_id) for i in items]
        + [fanout_idempotency_key(items[0].workflow_id, str(crashed.id))]
    ), keys
    # Both re-runs report the same run for every workflow (the restart for items[0]).
    ran = [{o.workflow_id: (o.flow_run_id, o.state) for o in out} for out in outcomes]
    assert ran[0] == ran[1], ran
    assert all(state == "FAILED" for _, state in ran[0].values()), ran[0]
    assert all(o.error == f"FAILED: {DONE}" for out in outcomes for o in out), outcomes
    # Together never more than max_parallel workflow runs between created and final
    # (the crashed one ended before either re-run started).
    live_spans = [s for r, s in zip(runs, spans, strict=True) if r.id != crashed.id]
    assert most_at_once(live_spans) <= MAX_PARALLEL, sorted(live_spans)
