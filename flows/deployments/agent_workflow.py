"""The ``agent-workflow`` deployment: run a list of steps as turns of one chat, then archive it."""

from __future__ import annotations

from collections.abc import Sequence

from prefect import flow

from prefect_coder.flows.common.params import AnyStep, WorkflowSettings
from prefect_coder.flows.liveness.track import record_done, this_run, workflow_record_key
from prefect_coder.flows.workflow.end_of_life import archive_on_failure
from prefect_coder.flows.workflow.steps import StepResult, prepare, run_steps

__all__ = ["agent_workflow"]


@flow(
    name="agent-workflow",
    flow_run_name="{workflow_id}",
    on_failure=[archive_on_failure],  # type: ignore[list-item]  # async hook, Prefect types it loosely
    persist_result=True,
    result_serializer="json",
)
async def agent_workflow(
    workflow_id: str,
    steps: Sequence[AnyStep],
    settings: WorkflowSettings | None = None,
) -> list[StepResult]:
    """Run ``steps`` in order as turns of one Coder chat, then archive it.

    Steps of kind ``"model"`` call the AI Gateway instead (no chat); steps of kind
    ``"approval"`` suspend the run until a person decides (docs/approvals.md).

    Args:
        workflow_id: stable id of this workflow; with a step name it keys the step's
            stored result, and it keys the checkpoint and the single-flight lease.
        steps: the turns, strictly sequential.
        settings: blocks, time bounds, retries, keep_chat.
    """
    settings = settings or WorkflowSettings()
    resources = await prepare(workflow_id, steps, settings)
    results = await run_steps(workflow_id, steps, settings, resources)
    # A clean end (a suspension never gets here: it leaves the record running, and
    # the reconciler leaves a Suspended run alone). Failures are seen by the reconciler.
    run = this_run()
    if run is not None:
        await record_done(resources.store, workflow_record_key(workflow_id), run)
    return results
