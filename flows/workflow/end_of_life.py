"""The workflow owns its chat's end of life: the final archive step and the failure handler.

An archived chat cannot be resumed, so archiving belongs to the workflow, never
to a step: :func:`archive_chat` is its last step, :func:`archive_on_failure`
retires the chat of a run that finally failed.
"""

from __future__ import annotations

from typing import Any

from prefect import Flow, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import FlowRun
from prefect.events import emit_event
from prefect.states import State

from prefect_coder.blocks.state import LeaseLostError
from prefect_coder.flows.common.errors import WorkflowBusyError, WorkflowParameterError
from prefect_coder.flows.common.params import WorkflowSettings, validate_workflow_id
from prefect_coder.flows.common.resources import TurnResources, load_resources
from prefect_coder.flows.common.retry import is_transient_failure
from prefect_coder.flows.observe.run_log import run_logger
from prefect_coder.flows.recovery.retire import ArchiveOutcome, retire_workflow_chat

__all__ = ["archive_chat", "archive_on_failure"]


# NO_CACHE: archiving must really run every time (it is idempotent), and its
# inputs hold a live client that cannot be hashed.
@task(name="archive-chat", task_run_name="archive {workflow_id}", cache_policy=NO_CACHE)
async def archive_chat(
    workflow_id: str, settings: WorkflowSettings, resources: TurnResources | None = None
) -> ArchiveOutcome:
    """The final step of a workflow: retire its chat."""
    resources = resources or await load_resources(settings)
    return await retire_workflow_chat(
        workflow_id,
        resources,
        lease_wait_s=settings.lease_wait_s,
        lease_ttl_s=settings.lease_ttl_s,
    )


async def archive_on_failure(_flow: Flow[..., Any], flow_run: FlowRun, state: State[Any]) -> None:
    """Failure handler: the workflow owns its chat's end of life, so a finally
    failed run retires its chat (abandoned runs must not accumulate live chats).

    Not when the run never drove the chat: bad parameters or a busy workflow
    must not archive a chat that an earlier or a concurrent run still uses. Nor
    when it lost the workflow's lease (it stalled past the ttl and another run
    took the workflow over): that run drives the chat now.
    Not when the failure was transient (a reset connection, an httpx timeout, a
    5xx — only the retries ran out): the checkpointed chat is continued by a
    rerun of the same ``workflow_id`` or by ``recover-turn``, which an archive
    would make impossible. The run emits ``coder.workflow.resumable`` instead;
    ``archive-workflow-chat`` (or a later run's final archive) retires the chat.
    """
    logger = run_logger(__name__)
    try:
        failure = await state.aresult(raise_on_failure=False)
    except Exception:
        failure = None
    if isinstance(failure, WorkflowParameterError | WorkflowBusyError):
        logger.info("the run failed before driving the chat (%s): not archiving", failure)
        return
    if isinstance(failure, LeaseLostError):
        logger.warning("another run took the workflow over (%s): not archiving", failure)
        return
    params = flow_run.parameters or {}
    try:
        settings = WorkflowSettings.model_validate(params.get("settings") or {})
        workflow_id = str(params["workflow_id"])
        validate_workflow_id(workflow_id)
    except Exception:
        return  # failed at the edge: no chat can exist
    if settings.keep_chat:
        logger.info("keep_chat is set: leaving the chat of %s live", workflow_id)
        return
    if isinstance(failure, BaseException) and is_transient_failure(failure):
        logger.warning(
            "the run of %s failed transiently (%s): leaving its chat live for a rerun or "
            "recover-turn; archive-workflow-chat retires it",
            workflow_id,
            type(failure).__name__,
        )
        try:
            emit_event(
                event="coder.workflow.resumable",
                resource={"prefect.resource.id": f"coder.workflow.{workflow_id}"},
                payload={"error": type(failure).__name__, "message": str(failure)[:500]},
            )
        except Exception:
            logger.debug("could not emit coder.workflow.resumable", exc_info=True)
        return
    try:
        resources = await load_resources(settings)
        outcome = await retire_workflow_chat(
            workflow_id,
            resources,
            lease_wait_s=settings.lease_wait_s,
            lease_ttl_s=settings.lease_ttl_s,
        )
        logger.info("failure handler archived %s", outcome.archived_chat_ids or "nothing")
    except Exception:
        logger.error("failure handler could not archive the chat of %s", workflow_id, exc_info=True)
