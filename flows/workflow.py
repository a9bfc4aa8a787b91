"""The workflow flow: strictly sequential steps on one chat, archived at the end.

Parameters are validated at the edge (:func:`prepare`) — workflow id, tool and
output-model names, blocks, URL — before any chat exists. Each step is one
``run_turn`` task; a re-run (flow retry, new flow run, another worker) returns
finished steps from storage and sends nothing for them. The chat is archived
after the final step and by the failure handler (only once the run is finally
failed, not while Prefect will retry it), unless ``settings.keep_chat``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any, cast

from prefect import Flow, flow
from prefect.client.schemas.objects import FlowRun
from prefect.logging import get_run_logger
from prefect.states import State
from prefect.utilities.annotations import quote
from prefect_coder.flows import registry
from prefect_coder.flows.approval import ApprovalResult, await_approval
from prefect_coder.flows.archive import archive_chat, retire_workflow_chat
from prefect_coder.flows.background import drain as drain_background
from prefect_coder.flows.errors import WorkflowBusyError, WorkflowParameterError
from prefect_coder.flows.model_step import ModelStepResult, model_step
from prefect_coder.flows.params import (
    Step,
    WorkflowSettings,
    validate_steps,
    validate_toolset,
    validate_workflow_id,
)
from prefect_coder.flows.resources import (
    TurnResources,
    hold_workflow_lease,
    load_resources,
    shared_client,
)
from prefect_coder.flows.results import TurnResult
from prefect_coder.flows.toolset import Toolset
from prefect_coder.flows.turn import run_turn

__all__ = ["StepResult", "agent_turn", "agent_workflow", "prepare", "run_steps"]


async def prepare(
    workflow_id: str,
    steps: list[Step],
    settings: WorkflowSettings,
    extra_tools: Toolset | None = None,
) -> TurnResources:
    """Validate every parameter and load the blocks; raises
    :class:`~prefect_coder.flows.errors.WorkflowParameterError` before any chat is created."""
    validate_workflow_id(workflow_id)
    registry.load_tool_modules(settings.tool_modules)
    tool_names, model_names = registry.tool_names(), registry.output_model_names()
    validate_steps(steps, tool_names=tool_names, output_model_names=model_names)
    if extra_tools is not None:
        validate_toolset(extra_tools, tool_names=tool_names, output_model_names=model_names)
    return await load_resources(settings)


async def _archive_on_failure(_flow: Flow[..., Any], flow_run: FlowRun, state: State[Any]) -> None:
    """Failure handler: the workflow owns its chat's end of life, so a finally
    failed run retires its chat (abandoned runs must not accumulate live chats).

    Not when the run never drove the chat: bad parameters or a busy workflow
    must not archive a chat that an earlier or a concurrent run still uses.
    """
    logger: logging.Logger | logging.LoggerAdapter[Any]
    try:
        logger = get_run_logger()
    except Exception:
        logger = logging.getLogger("prefect_coder.flows.workflow")
    try:
        failure = await state.aresult(raise_on_failure=False)
    except Exception:
        failure = None
    if isinstance(failure, WorkflowParameterError | WorkflowBusyError):
        logger.info("the run failed before driving the chat (%s): not archiving", failure)
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


@flow(
    name="agent-workflow",
    flow_run_name="{workflow_id}",
    on_failure=[_archive_on_failure],  # type: ignore[list-item]  # async hook, Prefect types it loosely
    persist_result=True,
    result_serializer="json",
)
async def agent_workflow(
    workflow_id: str,
    steps: list[Step],
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
    return await run_steps(workflow_id, steps, settings, resources)


#: What one step returns: an agent turn, a model-only call or an approval decision.
StepResult = TurnResult | ModelStepResult | ApprovalResult

#: The failure handler, for flows that apply it to runs that ended without it
#: (flows/approval.py: expired approvals).
archive_on_failure = _archive_on_failure


def _previous_answer(results: list[StepResult]) -> str | None:
    for result in reversed(results):
        if isinstance(result, ApprovalResult):
            continue
        if result.structured is not None:
            return json.dumps(result.structured)
        return result.text
    return None


async def run_steps(
    workflow_id: str,
    steps: list[Step],
    settings: WorkflowSettings,
    resources: TurnResources,
    *,
    allow_approval: bool = True,
) -> list[StepResult]:
    """The body of :func:`agent_workflow`: every step in order, then the archive."""
    turn = run_turn.with_options(
        retries=settings.retries, retry_delay_seconds=settings.retry_delay_s
    )
    model = model_step.with_options(
        retries=settings.retries, retry_delay_seconds=settings.retry_delay_s
    )
    # Client tools are declared once, when the first step creates the chat.
    toolset = Toolset.of_steps([s for s in steps if s.kind == "agent"])
    results: list[StepResult] = []
    edited: dict[str, Step] = {}
    try:
        # One lease for the whole run (not one per turn): another run of this
        # workflow waits up to lease_wait_s, then finds the finished steps stored.
        async with (
            hold_workflow_lease(workflow_id, resources.store, settings) as held,
            shared_client(resources) as shared,
        ):
            shared = dataclasses.replace(shared, lease=held)
            for i, step in enumerate(steps):
                step = edited.get(step.name, step)
                # quote(): Prefect would otherwise walk (and rebuild) the blocks,
                # the store and the client as task inputs on every turn.
                if step.kind == "model":
                    results.append(
                        await model(
                            workflow_id,
                            step,
                            settings,
                            cast(Any, quote(shared)),
                            _previous_answer(results),
                        )
                    )
                elif step.kind == "approval":
                    if not allow_approval:
                        raise WorkflowParameterError(
                            f"steps[{i}].kind",
                            "approval steps need a flow run of their own (a subflow or a "
                            "fan-out member cannot suspend)",
                            "run this workflow as its own agent-workflow deployment run",
                        )
                    following = steps[i + 1] if i + 1 < len(steps) else None
                    decision = await await_approval(
                        workflow_id,
                        step,
                        last_text=_previous_answer(results),
                        next_step=following,
                    )
                    results.append(decision)
                    if decision.decision == "reject":
                        break
                    if decision.decision == "edit" and following is not None:
                        edited[following.name] = following.model_copy(
                            update={"prompt": decision.next_prompt}
                        )
                else:
                    results.append(
                        await turn(workflow_id, step, settings, cast(Any, quote(shared)), toolset)
                    )
            if not settings.keep_chat:
                await archive_chat(workflow_id, settings, cast(Any, quote(shared)))
    finally:
        await drain_background()
    return results


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
    if step.kind != "agent":
        raise WorkflowParameterError(
            "step.kind",
            f"agent-turn runs agent turns only, not a {step.kind!r} step",
            "run model and approval steps in agent-workflow",
        )
    resources = await prepare(workflow_id, [step], settings, workflow_tools)
    turn = run_turn.with_options(
        retries=settings.retries, retry_delay_seconds=settings.retry_delay_s
    )
    try:
        return await turn(workflow_id, step, settings, resources, workflow_tools)
    finally:
        await drain_background()
