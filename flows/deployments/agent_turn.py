"""The ``agent-turn`` deployment: one durable turn of a workflow per flow run (no archive)."""

from __future__ import annotations

from prefect import flow

from prefect_coder.flows.common.params import Step, WorkflowSettings
from prefect_coder.flows.common.results import TurnResult
from prefect_coder.flows.common.toolset import Toolset
from prefect_coder.flows.liveness.track import record_done, this_run, workflow_record_key
from prefect_coder.flows.observe.background import drain as drain_background
from prefect_coder.flows.turn.durable_turn import run_turn
from prefect_coder.flows.workflow.steps import prepare

__all__ = ["agent_turn"]


@flow(
    name="agent-turn",
    flow_run_name="{workflow_id}/{step.name}",
    persist_result=True,
    result_serializer="json",
)
async def agent_turn(
    workflow_id: str,
    step: Step,
    settings: WorkflowSettings | None = None,
    workflow_tools: Toolset | None = None,
) -> TurnResult:
    """Run one durable turn of a workflow (no archive: use ``archive-workflow-chat``).

    For engines that drive the steps themselves, one deployment run per step.

    Args:
        workflow_tools: every client tool and output model the workflow's chat will
            ever need. chatd learns client tools only when the chat is created, so
            the first step must declare them all; pass the same value to every step.
            Default: this step's own tools.
    """
    settings = settings or WorkflowSettings()
    resources = await prepare(workflow_id, [step], settings, workflow_tools)
    turn = run_turn.with_options(
        retries=settings.retries, retry_delay_seconds=settings.retry_delay_s
    )
    try:
        result = await turn(workflow_id, step, settings, resources, workflow_tools)
    finally:
        await drain_background()
    run = this_run()
    if run is not None:
        await record_done(resources.store, workflow_record_key(workflow_id), run)
    return result
