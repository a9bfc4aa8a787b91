"""The workflow's body: validate at the edge, then strictly sequential steps on one chat.

Parameters are validated at the edge (:func:`prepare`) — workflow id, tool and
output-model names, blocks, URL — before any chat exists. Each step is one
``run_turn`` task (or a model step, or an approval); a re-run (flow retry, new
flow run, another worker) returns finished steps from storage and sends nothing
for them. The chat is archived after the final step unless
``settings.keep_chat``; the deployments apply the failure handler
(:mod:`prefect_coder.flows.workflow.end_of_life`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence
from typing import Any, cast

from prefect.exceptions import Pause
from prefect.utilities.annotations import quote

from prefect_coder.flows.common import registry
from prefect_coder.flows.common.errors import WorkflowParameterError
from prefect_coder.flows.common.params import (
    AnyStep,
    ApprovalStep,
    ModelStep,
    WorkflowSettings,
    agent_steps,
    step_marker,
    validate_steps,
    validate_toolset,
    validate_workflow_id,
)
from prefect_coder.flows.common.resources import (
    TurnResources,
    hold_workflow_lease,
    load_resources,
    shared_client,
)
from prefect_coder.flows.common.results import TurnResult
from prefect_coder.flows.common.toolset import Toolset
from prefect_coder.flows.observe import background
from prefect_coder.flows.observe.summary import SummaryRow, publish_workflow_summary
from prefect_coder.flows.recovery.retire import retire_workflow_chat
from prefect_coder.flows.turn.approval_step import ApprovalResult, await_approval
from prefect_coder.flows.turn.durable_turn import run_turn
from prefect_coder.flows.turn.model_step import ModelStepResult, model_step
from prefect_coder.flows.workflow.end_of_life import archive_chat

__all__ = ["StepResult", "prepare", "run_steps"]

#: What one step returns: an agent turn, a model-only call or an approval decision.
StepResult = TurnResult | ModelStepResult | ApprovalResult


async def prepare(
    workflow_id: str,
    steps: Sequence[AnyStep],
    settings: WorkflowSettings,
    extra_tools: Toolset | None = None,
) -> TurnResources:
    """Validate every parameter and load the blocks; raises
    :class:`~prefect_coder.flows.common.errors.WorkflowParameterError` before any chat is created."""
    validate_workflow_id(workflow_id)
    registry.load_tool_modules(settings.tool_modules)
    tool_names, model_names = registry.tool_names(), registry.output_model_names()
    validate_steps(steps, tool_names=tool_names, output_model_names=model_names)
    if extra_tools is not None:
        validate_toolset(extra_tools, tool_names=tool_names, output_model_names=model_names)
    return await load_resources(settings, warn_other_stores=True)


@functools.lru_cache(maxsize=32)
def _step_tasks(retries: int, retry_delay_s: float) -> tuple[Any, Any]:
    """``run_turn`` and ``model_step`` with the workflow's retry settings, built once
    per setting: ``Task.with_options`` copies the task, and once per workflow it was
    ≈ 3 % of a fan-out shard's loop (the tasks are stateless, so sharing is safe)."""
    return (
        run_turn.with_options(retries=retries, retry_delay_seconds=retry_delay_s),
        model_step.with_options(retries=retries, retry_delay_seconds=retry_delay_s),
    )


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
    steps: Sequence[AnyStep],
    settings: WorkflowSettings,
    resources: TurnResources,
    *,
    allow_approval: bool = True,
    archive_as_task: bool = True,
    summary: bool = True,
) -> list[StepResult]:
    """The body of :func:`agent_workflow`: every step in order, then the archive.

    ``archive_as_task=False`` (a fan-out's workflows): the archive runs inline in the
    flow run instead of as an ``archive-chat`` task run. It is not cached either way
    (it runs again on every re-run), so the task run only showed it in the UI — at
    the price of a second Prefect task run per one-turn workflow, i.e. three more
    state events for the server to record and the task engine's start and finish
    in the worker. Its log line and ``coder.chat.archived`` event stay.

    ``summary`` (with ``settings.artifacts``): publish the workflow's summary card
    (:mod:`prefect_coder.flows.observe.summary`) when it ends, however it ends — a
    fan-out, whose own table lists its workflows, passes False."""
    turn, model = _step_tasks(settings.retries, settings.retry_delay_s)
    # Client tools are declared once, when the first step creates the chat.
    toolset = Toolset.of_steps(agent_steps(steps))
    results: list[StepResult] = []
    edited: dict[str, AnyStep] = {}
    failure: BaseException | None = None
    waiting = False
    # This workflow's artifacts and events only: in a fan-out shard its neighbours'
    # share the loop, and its end must not wait on theirs.
    with background.scope() as own_background:
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
                    # the store and the client as task inputs on every turn — and the
                    # step, the settings and the tool set: pydantic models it visits
                    # field by field twice per task run (inputs, then resolution; ≈ 2 %
                    # of a fan-out worker's loop, docs/performance.md round 8). The
                    # task gets them unquoted, its run name and cache key too.
                    if isinstance(step, ModelStep):
                        results.append(
                            await model(
                                workflow_id,
                                step,
                                settings,
                                cast(Any, quote(shared)),
                                _previous_answer(results),
                            )
                        )
                    elif isinstance(step, ApprovalStep):
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
                        # The step order lets the turn's recovery prove cheaply that this
                        # step never sent (the journal names an earlier one) — and look
                        # in history when the journal names a later one (a lost result).
                        earlier = frozenset(step_marker(workflow_id, s.name) for s in steps[:i])
                        results.append(
                            await turn(
                                workflow_id,
                                cast(Any, quote(step)),
                                cast(Any, quote(settings)),
                                cast(
                                    Any, quote(dataclasses.replace(shared, earlier_steps=earlier))
                                ),
                                cast(Any, quote(toolset)),
                            )
                        )
                if not settings.keep_chat and archive_as_task:
                    await archive_chat(workflow_id, settings, cast(Any, quote(shared)))
                elif not settings.keep_chat:
                    # Every step returned: the last turn settled on the chat, which is
                    # archived with one PATCH unless the server says a run is active.
                    await retire_workflow_chat(
                        workflow_id,
                        shared,
                        lease_wait_s=settings.lease_wait_s,
                        lease_ttl_s=settings.lease_ttl_s,
                        settled=True,
                    )
        except Pause:
            # An approval step suspended the run (the process exits and resumes): the
            # card says so and is published again when the workflow ends.
            failure = None
            waiting = True
            raise
        except BaseException as exc:
            failure = exc
            raise
        finally:
            if settings.artifacts and summary:
                rows, outcome = summary_rows(steps, results, failure, waiting=waiting)
                publish_workflow_summary(workflow_id, rows, outcome=outcome)
            await background.drain(only=own_background)
    return results


def summary_rows(
    steps: Sequence[AnyStep],
    results: list[StepResult],
    failure: BaseException | None,
    *,
    waiting: bool = False,
) -> tuple[list[SummaryRow], str]:
    """The summary card's rows (every step, run or not) and the workflow's outcome
    (``waiting``: suspended at an approval step, waiting on a person)."""
    rows: list[SummaryRow] = []
    for i, step in enumerate(steps):
        if i < len(results):
            rows.append(_row(step, results[i]))
        elif i == len(results) and waiting:
            rows.append(SummaryRow(step.name, step.kind, "waiting on a person"))
        elif i == len(results) and failure is not None:
            rows.append(SummaryRow(step.name, step.kind, f"failed: {type(failure).__name__}"))
        else:
            rows.append(SummaryRow(step.name, step.kind, "not run"))
    if waiting and len(results) < len(steps):
        return rows, f"waiting for approval at `{steps[len(results)].name}`"
    if failure is not None:
        failed_at = steps[len(results)].name if len(results) < len(steps) else "the end"
        return rows, f"failed at `{failed_at}` ({type(failure).__name__})"
    last = results[-1] if results else None
    if isinstance(last, ApprovalResult) and last.decision == "reject":
        return rows, f"stopped: `{last.step}` rejected"
    return rows, "completed"


def _row(step: AnyStep, result: StepResult) -> SummaryRow:
    if isinstance(result, ApprovalResult):
        decided = result.decision + (f" ({result.comment})" if result.comment else "")
        if result.decision == "edit":
            decided += ": the next prompt was edited"
        state = "rejected" if result.decision == "reject" else "decided"
        return SummaryRow(step.name, step.kind, state, "", None, decided)
    if isinstance(result, ModelStepResult):
        again = "re-asked once" if result.attempts > 1 else ""
        return SummaryRow(step.name, step.kind, "completed", result.text, result.attempts, again)
    again = f"recovered or resubmitted (attempt {result.attempt})" if result.attempt > 1 else ""
    return SummaryRow(step.name, step.kind, "completed", result.text, result.attempt, again)
