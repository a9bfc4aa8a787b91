"""The ``agent-fanout`` deployment: many independent workflows in parallel.

Two modes, one contract (each workflow keeps its own workflow id, chat,
checkpoint, lease and stored step results; running turns stay within the
turn-slot cap of :mod:`prefect_coder.flows.parts.turn_slot`):

* **as a deployment run** (or with ``workflow_deployment`` given): every
  workflow is its own ``agent-workflow`` flow run (``run_deployment``), so the
  pool's workers share the fan-out, each step result is persisted by the
  process that ran the step, and a crashed workflow run is recovered by the
  ``recover-turn`` Crashed trigger like any other. The runs carry the
  idempotency key ``fanout-<workflow_id>``: a re-run of the fan-out (its own
  Crashed trigger, or by hand) re-attaches to the runs that exist instead of
  starting duplicates.
* **in process** (``agent_fanout`` called directly, no deployment): every step is
  a task of this flow run itself, never a task nested in a task — Prefect writes
  a nested task's result only when the outer task commits, so a crash lost the
  finished steps of every workflow in flight.
"""

from __future__ import annotations

import asyncio
from typing import Any

from prefect import flow
from prefect.artifacts import acreate_table_artifact
from prefect.client.schemas.objects import FlowRun
from prefect.deployments.flow_runs import arun_deployment
from prefect.logging import get_run_logger
from prefect.runtime import deployment as current_deployment
from pydantic import BaseModel, ConfigDict, Field

from prefect_coder.flows.parts.errors import WorkflowParameterError
from prefect_coder.flows.parts.params import Step, WorkflowSettings
from prefect_coder.flows.parts.retire import retire_workflow_chat
from prefect_coder.flows.workflow.steps import prepare, run_steps

__all__ = [
    "FanoutItem",
    "FanoutOutcome",
    "agent_fanout",
    "fanout_idempotency_key",
    "run_in_process",
]

#: The deployment a fan-out run starts its workflows on by default.
WORKFLOW_DEPLOYMENT = "agent-workflow/agent-workflow"
#: How often a re-attached workflow that ended Crashed is started again (the
#: re-run returns finished steps from storage; the lease serialises it with the
#: recover-turn run the Crashed trigger started).
CRASHED_RESTARTS = 2


class FanoutItem(BaseModel):
    """One independent workflow of a fan-out (its own workflow id, chat and results)."""

    model_config = ConfigDict(extra="forbid")

    workflow_id: str = Field(description="Stable id of this workflow (unique in the fan-out).")
    steps: list[Step] = Field(description="The workflow's steps, run in order.")


class FanoutOutcome(BaseModel):
    """How one workflow of a fan-out ended."""

    workflow_id: str
    ok: bool
    error: str | None = None
    results: list[Any] = Field(default_factory=list)
    #: The agent-workflow flow run (deployment mode), the last one if restarted.
    flow_run_id: str | None = None
    state: str | None = None
    #: How many agent-workflow runs this fan-out attached to or started for it.
    runs: int = 0


def fanout_idempotency_key(workflow_id: str, after_run: str | None = None) -> str:
    """The idempotency key of a workflow's flow run: stable per workflow id, so a
    re-run of the fan-out finds the run instead of creating a second one; a
    restart after a Crashed run is keyed by that run (stable as well)."""
    return (
        f"fanout-{workflow_id}" if after_run is None else f"fanout-{workflow_id}-after-{after_run}"
    )


async def run_in_process(
    workflow_id: str, steps: list[Step], settings: WorkflowSettings
) -> list[Any]:
    """One workflow inside the calling flow run: each step is a task of that flow
    run (its result is persisted when the step ends). On failure it applies the
    workflow's failure handler itself (archives the chat unless ``keep_chat``)."""
    resources = await prepare(workflow_id, steps, settings)
    try:
        return await run_steps(workflow_id, steps, settings, resources, allow_approval=False)
    except Exception:
        if not settings.keep_chat:
            try:
                await retire_workflow_chat(
                    workflow_id,
                    resources,
                    lease_wait_s=settings.lease_wait_s,
                    lease_ttl_s=settings.lease_ttl_s,
                )
            except Exception:
                get_run_logger().error(
                    "could not archive the chat of %s", workflow_id, exc_info=True
                )
        raise


async def _run_as_deployment(
    item: FanoutItem,
    settings: WorkflowSettings,
    deployment: str,
    poll_interval_s: float,
) -> FanoutOutcome:
    params = {
        "workflow_id": item.workflow_id,
        "steps": [s.model_dump(mode="json") for s in item.steps],
        "settings": settings.model_dump(mode="json"),
    }
    after: str | None = None
    run: FlowRun | None = None
    for attempt in range(1 + CRASHED_RESTARTS):
        run = await arun_deployment(
            deployment,
            parameters=params,
            idempotency_key=fanout_idempotency_key(item.workflow_id, after),
            flow_run_name=item.workflow_id,
            timeout=None,
            poll_interval=poll_interval_s,
            as_subflow=True,
        )
        state = run.state
        if state is None or not state.is_crashed() or attempt == CRASHED_RESTARTS:
            break
        after = str(run.id)
    assert run is not None
    state = run.state
    outcome = FanoutOutcome(
        workflow_id=item.workflow_id,
        ok=bool(state and state.is_completed()),
        flow_run_id=str(run.id),
        state=state.type.value if state else None,
        runs=attempt + 1,
    )
    if state is None:
        return outcome
    if outcome.ok:
        try:
            value = await state.aresult()
            outcome.results = [
                r.model_dump(mode="json") if isinstance(r, BaseModel) else r for r in value
            ]
        except Exception as exc:  # result storage not shared with this worker
            outcome.error = f"result not readable here: {type(exc).__name__}"
    else:
        outcome.error = f"{state.type.value}: {state.message or ''}".strip()
    return outcome


def _validate(workflows: list[FanoutItem], max_parallel: int) -> None:
    seen: set[str] = set()
    for i, item in enumerate(workflows):
        if item.workflow_id in seen:
            raise WorkflowParameterError(
                f"workflows[{i}].workflow_id",
                f"{item.workflow_id!r} is used twice",
                "give every workflow of a fan-out its own id",
            )
        seen.add(item.workflow_id)
        for j, step in enumerate(item.steps):
            if step.kind == "approval":
                raise WorkflowParameterError(
                    f"workflows[{i}].steps[{j}].kind",
                    "approval steps cannot run inside a fan-out (only a flow run can suspend)",
                    "run workflows with approvals as their own agent-workflow deployment runs",
                )
    if max_parallel < 1:
        raise WorkflowParameterError("max_parallel", "must be at least 1", "pass e.g. 64")


@flow(name="agent-fanout", persist_result=True, result_serializer="json")
async def agent_fanout(
    workflows: list[FanoutItem],
    settings: WorkflowSettings | None = None,
    max_parallel: int = 64,
    fail_on_error: bool = True,
    workflow_deployment: str | None = None,
    poll_interval_s: float = 2.0,
) -> list[FanoutOutcome]:
    """Run independent workflows in parallel; every turn stays within the turn-slot cap.

    Concurrency of *turns* is bounded deployment-wide by
    ``CoderCredentials.max_concurrent_turns``; ``max_parallel`` bounds how many
    workflows this flow run drives at once. Per-workflow outcomes are returned
    and, with ``settings.artifacts``, published as one table artifact.

    Args:
        workflows: the workflows; ids must be unique. Approval steps are not
            allowed here; run those workflows as their own ``agent-workflow`` runs.
        settings: shared by every workflow.
        max_parallel: workflows driven (flow runs started and awaited) at once.
        fail_on_error: fail the fan-out run (after all finished) if any workflow failed.
        workflow_deployment: the deployment each workflow runs on. Empty: when
            this run is itself a deployment run, ``agent-workflow/agent-workflow``;
            otherwise in process.
        poll_interval_s: how often a workflow's flow run state is polled.
    """
    settings = settings or WorkflowSettings()
    _validate(workflows, max_parallel)
    logger = get_run_logger()
    target = workflow_deployment or (WORKFLOW_DEPLOYMENT if current_deployment.id else None)
    gate = asyncio.Semaphore(max_parallel)

    async def one(item: FanoutItem) -> FanoutOutcome:
        async with gate:
            try:
                if target is not None:
                    return await _run_as_deployment(item, settings, target, poll_interval_s)
                results = await run_in_process(item.workflow_id, item.steps, settings)
            except Exception as exc:
                return FanoutOutcome(
                    workflow_id=item.workflow_id, ok=False, error=f"{type(exc).__name__}: {exc}"
                )
            return FanoutOutcome(workflow_id=item.workflow_id, ok=True, results=list(results))

    outcomes = list(await asyncio.gather(*(one(w) for w in workflows)))
    failed = [o.workflow_id for o in outcomes if not o.ok]
    logger.info(
        "fan-out finished (%s): %d ok, %d failed",
        target or "in process",
        len(outcomes) - len(failed),
        len(failed),
    )
    if settings.artifacts:
        await acreate_table_artifact(
            key="agent-fanout",
            table=[
                {
                    "workflow_id": o.workflow_id,
                    "ok": o.ok,
                    "state": o.state or ("COMPLETED" if o.ok else "FAILED"),
                    "runs": o.runs,
                    "flow_run_id": o.flow_run_id or "",
                    "error": (o.error or "")[:200],
                }
                for o in outcomes
            ],
            description=f"agent-fanout: {len(outcomes) - len(failed)} ok, {len(failed)} failed",
        )
    if failed and fail_on_error:
        raise RuntimeError(
            f"{len(failed)} of {len(outcomes)} workflows failed: {', '.join(failed[:20])}"
            + (" …" if len(failed) > 20 else "")
        )
    return outcomes
