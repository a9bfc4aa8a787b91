"""The ``archive-workflow-chat`` deployment: retire a workflow's chat on demand."""

from __future__ import annotations

from prefect import flow

from prefect_coder.flows.common.params import WorkflowSettings, validate_workflow_id
from prefect_coder.flows.common.resources import load_resources
from prefect_coder.flows.recovery.retire import ArchiveOutcome
from prefect_coder.flows.workflow.end_of_life import archive_chat

__all__ = ["archive_workflow_chat"]


@flow(name="archive-workflow-chat", flow_run_name="archive {workflow_id}")
async def archive_workflow_chat(
    workflow_id: str, settings: WorkflowSettings | None = None
) -> ArchiveOutcome:
    """Interrupt (15 s bound, a 409 is fine) and archive a workflow's chat, plus any
    chats it stranded. Use it for workflows that ran with ``keep_chat`` or died
    without their failure handler."""
    settings = settings or WorkflowSettings()
    validate_workflow_id(workflow_id)
    resources = await load_resources(settings)
    return await archive_chat(workflow_id, settings, resources)
