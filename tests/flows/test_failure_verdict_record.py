"""The failure handler and the reconciler agree on what a failed run means: a failure
known to be final is recorded ``done`` for that run (the reconciler never reruns it);
a transient or unknown one keeps the chat live and marks the record resumable, so the
reconciler reruns the workflow (flows/liveness/decide.py) instead of forgetting it."""

from __future__ import annotations

import uuid

from prefect_coder.blocks.state.workflows import RESUMABLE_PREFIX
from prefect_coder.errors import StoreUnavailableError, StructuredAnswerError
from prefect_coder.flows.common.params import WorkflowSettings
from prefect_coder.flows.common.resources import load_resources
from prefect_coder.flows.liveness.track import workflow_record_key
from prefect_coder.flows.workflow.end_of_life import end_failed_workflow


async def _record(store: object, workflow_id: str, run_id: str) -> None:
    await store.workflows.started(  # type: ignore[attr-defined]
        workflow_record_key(workflow_id),
        deployment=f"agent-workflow/agent-workflow-{uuid.uuid4().hex[:6]}",
        parameters={"workflow_id": workflow_id},
        flow_run_id=run_id,
        workflow_id=workflow_id,
    )


async def test_a_final_failure_is_recorded_done_a_transient_one_stays_open(
    settings: WorkflowSettings, workflow_id: str
) -> None:
    resources = await load_resources(settings)
    store = resources.store
    final_id, other_id = f"{workflow_id}-final", f"{workflow_id}-transient"
    run = str(uuid.uuid4())
    await _record(store, final_id, run)
    verdict = await end_failed_workflow(
        final_id,
        settings,
        StructuredAnswerError("s", "plan", None, 2),
        resources,
        flow_run_id=run,
    )
    assert verdict.action == "archive"
    final = await store.workflows.get(workflow_record_key(final_id))
    assert final is not None and final.state == "done"

    run2 = str(uuid.uuid4())
    await _record(store, other_id, run2)
    failure = StoreUnavailableError("sqlite:///state.db", "database is locked", waited=20.0)
    verdict = await end_failed_workflow(other_id, settings, failure, resources, flow_run_id=run2)
    assert verdict.action == "keep-live"
    open_ = await store.workflows.get(workflow_record_key(other_id))
    assert open_ is not None and open_.state == "running"
    assert (open_.reason or "").startswith(RESUMABLE_PREFIX)

    # Another run's failure never ends the record of the run that drives it now.
    newer = str(uuid.uuid4())
    await _record(store, final_id + "-x", newer)
    await end_failed_workflow(
        final_id + "-x",
        settings,
        StructuredAnswerError("s", "plan", None, 2),
        resources,
        flow_run_id=str(uuid.uuid4()),
    )
    still = await store.workflows.get(workflow_record_key(final_id + "-x"))
    assert still is not None and still.state == "running"
