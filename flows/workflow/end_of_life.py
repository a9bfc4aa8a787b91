"""The workflow owns its chat's end of life: the final archive step and the failure handler.

An archived chat cannot be resumed, so archiving belongs to the workflow, never
to a step: :func:`archive_chat` is its last step, :func:`archive_on_failure`
retires the chat of a run that finally failed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from prefect import Flow, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import FlowRun
from prefect.events import emit_event
from prefect.exceptions import FailedRun
from prefect.states import State

from coder_chat.errors import CoderChatError
from prefect_coder.blocks.state import LeaseLostError
from prefect_coder.flows.common.errors import (
    StructuredAnswerError,
    WorkflowBusyError,
    WorkflowParameterError,
)
from prefect_coder.flows.common.params import WorkflowSettings, validate_workflow_id
from prefect_coder.flows.common.resources import TurnResources, load_resources
from prefect_coder.flows.common.retry import is_retryable_failure
from prefect_coder.flows.liveness.decide import APPROVAL_EXPIRED_MESSAGE
from prefect_coder.flows.liveness.track import RESUMABLE_EVENT, workflow_record_key
from prefect_coder.flows.observe.observer import chat_resource
from prefect_coder.flows.observe.run_log import run_logger
from prefect_coder.flows.recovery.retire import ArchiveOutcome, retire_workflow_chat

__all__ = [
    "APPROVAL_EXPIRED_MESSAGE",
    "ArchiveVerdict",
    "archive_chat",
    "archive_on_failure",
    "archive_verdict",
    "end_failed_workflow",
]


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


#: The message of the run Prefect failed when its approval's pause timed out (the
#: server's, and ``expire-approvals``' when it fails such a run itself): final.
# (its one home is flows/liveness/decide.py: the reconciler reads it too)

#: ``CoderChatError`` kinds the client makes up itself (a lost queued submission, a
#: failed ledger write, an archive that did not finish): not the server's verdict on
#: the chat's run, so never final.
_CLIENT_KINDS = frozenset(
    {"timeout", "stream_closed", "queued_submission_lost", "tool_bookkeeping", "archive_incomplete"}
)


@dataclass(frozen=True, slots=True)
class ArchiveVerdict:
    """What the failure handler does with the chat of a run that finally failed.

    ``archive``: the failure is final for the workflow — retire its chat.
    ``keep-live``: a rerun or ``recover-turn`` may continue it — leave it live and emit
    ``coder.workflow.resumable``. ``leave``: this run does not own the chat (it never
    drove one, or another run drives it now) — touch nothing, say nothing.
    """

    action: Literal["archive", "keep-live", "leave"]
    why: str


def _caused_by(failure: BaseException | None, kind: type[BaseException]) -> bool:
    """True when ``kind`` is in ``failure``'s chain of causes (``raise ... from``)."""
    seen: set[int] = set()
    cause = None if failure is None else failure.__cause__
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, kind):
            return True
        seen.add(id(cause))
        cause = cause.__cause__
    return False


def archive_verdict(failure: BaseException | None) -> ArchiveVerdict:
    """The failure handler's verdict on ``failure`` (pure; table-tested).

    An archive cannot be undone, so it needs a POSITIVE verdict: only failures known
    to be final for the workflow archive (an allow-list). A run that fails the same
    way every time it is run again: a structured answer that never validated (its
    re-ask included), an approval nobody decided before it expired, a chat run the
    server failed for good (a non-retryable
    ``CoderChatError``), the turn's own total deadline (a builtin ``TimeoutError``:
    the same prompt meets the same deadline). Everything else — a transient fault of
    the store, of the Prefect API, of the network, anything retryable, and anything
    unknown — keeps the chat live: wrongly keeping a chat costs a live chat that
    ``archive-workflow-chat`` or a later run's final archive retires; wrongly
    archiving it costs the workflow (issue 30: a store fault archived chats).
    """
    if isinstance(failure, WorkflowParameterError | WorkflowBusyError):
        return ArchiveVerdict("leave", "the run failed before driving the chat")
    if isinstance(failure, LeaseLostError) or _caused_by(failure, LeaseLostError):
        # Also when it surfaced wrapped (a crash-safe tool's ledger write refused by the
        # fence reaches the flow as ToolBookkeepingError): the chat is the new holder's.
        return ArchiveVerdict("leave", "another run took the workflow over and drives the chat")
    if failure is None:
        return ArchiveVerdict("keep-live", "the failure could not be read")
    if is_retryable_failure(failure):
        return ArchiveVerdict("keep-live", "transient: only the retries ran out")
    if isinstance(failure, FailedRun) and str(failure) == APPROVAL_EXPIRED_MESSAGE:
        return ArchiveVerdict("archive", "its approval expired: nobody decided in time")
    if isinstance(failure, StructuredAnswerError):
        return ArchiveVerdict("archive", "the step's structured answer never validated")
    if type(failure) is TimeoutError:
        return ArchiveVerdict("archive", "the turn's total deadline ran out")
    if (
        isinstance(failure, CoderChatError)
        and not failure.retryable
        and failure.kind not in _CLIENT_KINDS
    ):
        return ArchiveVerdict("archive", f"the chat's run failed for good ({failure.kind})")
    return ArchiveVerdict("keep-live", "not known to be final")


async def archive_on_failure(_flow: Flow[..., Any], flow_run: FlowRun, state: State[Any]) -> None:
    """Failure handler: the workflow owns its chat's end of life, so a run whose
    failure is final for the workflow retires its chat (abandoned runs must not
    accumulate live chats) — and only then (:func:`archive_verdict`).

    Not when the run never drove the chat (bad parameters, a busy workflow) nor when
    it lost the workflow's lease: another run drives the chat. Not when the failure
    is transient or unknown (the store, the Prefect API, the network; anything not
    known to be final): the checkpointed chat is continued by a rerun of the same
    ``workflow_id`` or by ``recover-turn``, which an archive would make impossible.
    The run emits ``coder.workflow.resumable`` (naming the workflow and its chat)
    instead; ``archive-workflow-chat`` (or a later run's final archive) retires it.
    """
    try:
        failure = await state.aresult(raise_on_failure=False)
    except Exception:
        failure = None
    params = flow_run.parameters or {}
    try:
        settings = WorkflowSettings.model_validate(params.get("settings") or {})
        workflow_id = str(params["workflow_id"])
        validate_workflow_id(workflow_id)
    except Exception:
        return  # failed at the edge: no chat can exist
    await end_failed_workflow(
        workflow_id,
        settings,
        failure if isinstance(failure, BaseException) else None,
        flow_run_id=str(flow_run.id),
    )


async def end_failed_workflow(
    workflow_id: str,
    settings: WorkflowSettings,
    failure: BaseException | None,
    resources: TurnResources | None = None,
    *,
    flow_run_id: str | None = None,
) -> ArchiveVerdict:
    """What the failure handler does for a workflow that finally failed with
    ``failure``, for callers that run workflows in process (the fan-out shard):
    archive on a final failure, else leave the chat live and emit
    ``coder.workflow.resumable`` (``leave``: touch nothing). Never raises for the
    archive or the event; returns the verdict."""
    logger = run_logger(__name__)
    verdict = archive_verdict(failure)
    if verdict.action != "leave" and flow_run_id is not None:
        # What the reconciler reads (flows/liveness/decide.py): a final failure is done;
        # a resumable one is marked so, and rerun. ("leave": this run never drove the
        # workflow, or another run drives it now — not its record to touch.)
        resources = await _record_verdict(
            workflow_id, settings, flow_run_id, verdict, resources, logger
        )
    if verdict.action == "leave":
        logger.info("not archiving: %s (%s)", verdict.why, failure)
        return verdict
    if verdict.action == "keep-live":
        # Before keep_chat: the event is also the reconciler's evidence that a rerun
        # can continue the workflow, whether or not the chat would have been archived.
        await _resumable(workflow_id, settings, failure, verdict, logger, resources, flow_run_id)
        return verdict
    if settings.keep_chat:
        logger.info("keep_chat is set: leaving the chat of %s live", workflow_id)
        return verdict
    try:
        resources = resources or await load_resources(settings)
        outcome = await retire_workflow_chat(
            workflow_id,
            resources,
            lease_wait_s=settings.lease_wait_s,
            lease_ttl_s=settings.lease_ttl_s,
        )
        logger.info(
            "failure handler archived %s (%s)", outcome.archived_chat_ids or "nothing", verdict.why
        )
    except Exception:
        logger.error("failure handler could not archive the chat of %s", workflow_id, exc_info=True)
    return verdict


async def _record_verdict(
    workflow_id: str,
    settings: WorkflowSettings,
    flow_run_id: str,
    verdict: ArchiveVerdict,
    resources: TurnResources | None,
    logger: Any,
) -> TurnResources | None:
    """Tell the workflow's record (if ``flow_run_id`` is still its run) what the failure
    means: ``done`` when final, resumable when the chat is kept live. Never raises;
    returns the resources it loaded."""
    key = workflow_record_key(workflow_id)
    try:
        resources = resources or await load_resources(settings)
        if verdict.action == "keep-live":
            await resources.store.workflows.resumable(key, flow_run_id=flow_run_id, why=verdict.why)
        else:
            await resources.store.workflows.finished(key, flow_run_id=flow_run_id)
    except Exception as exc:
        logger.warning(
            "could not record the failure verdict of %s (%s): %s",
            workflow_id,
            type(exc).__name__,
            "a rerun or recover-turn continues it (the reconciler takes it for ended)"
            if verdict.action == "keep-live"
            else "the reconciler takes the failed run for ended",
        )
    return resources


async def _resumable(
    workflow_id: str,
    settings: WorkflowSettings,
    failure: object,
    verdict: ArchiveVerdict,
    logger: Any,
    resources: TurnResources | None = None,
    flow_run_id: str | None = None,
) -> None:
    """Leave the chat live and say so: ``coder.workflow.resumable`` on the checkpointed
    chat (the workflow's resource when the store cannot tell which chat it is)."""
    chat_id = getattr(failure, "chat_id", None)
    try:
        if not isinstance(chat_id, str) or not chat_id:
            resources = resources or await load_resources(settings)
            checkpoint = await resources.store.checkpoints.get(workflow_id)
            chat_id = checkpoint.chat_id if checkpoint is not None else None
    except Exception:
        # The store may be what failed: the event still names the workflow.
        logger.debug("could not read the checkpoint of %s", workflow_id, exc_info=True)
    name = type(failure).__name__ if isinstance(failure, BaseException) else "unknown"
    logger.warning(
        "the run of %s failed (%s: %s): leaving chat %s live for a rerun or recover-turn; "
        "archive-workflow-chat retires it",
        workflow_id,
        name,
        verdict.why,
        chat_id or "(none checkpointed)",
    )
    try:
        emit_event(
            event=RESUMABLE_EVENT,
            resource=chat_resource(chat_id, workflow_id),
            related=[
                {
                    "prefect.resource.id": f"coder.workflow.{workflow_id}",
                    "prefect.resource.role": "workflow",
                },
                # Named explicitly (not only from the run context): the reconciler
                # finds the mark by this run when the store could not take it.
                *(
                    [
                        {
                            "prefect.resource.id": f"prefect.flow-run.{flow_run_id}",
                            "prefect.resource.role": "flow-run",
                        }
                    ]
                    if flow_run_id
                    else []
                ),
            ],
            payload={
                "workflow_id": workflow_id,
                "chat_id": chat_id,
                "error": name,
                "message": str(failure)[:500],
                "why": verdict.why,
            },
        )
    except Exception:
        logger.debug("could not emit coder.workflow.resumable", exc_info=True)
