"""The ``agent-fanout-shard`` deployment: a batch of a fan-out's workflows in one flow run.

``agent-fanout`` splits its workflows into shards and starts each shard as its
own flow run, so the pool's workers share the fan-out while one process runs
many turns (a flow run on a process worker is a process start: seconds of CPU,
more than a one-turn workflow itself costs). Inside a shard every workflow runs
in process: each step is a task of the shard's flow run, written to result
storage the moment the step ends — never a task nested in a task (Prefect writes
a nested task's result only when the outer task commits, so a crash lost the
finished steps of every workflow in flight).

A crashed shard is started again by its fan-out (or by the fan-out's re-run);
the new run takes over the workflows' leases of the crashed run at once, returns
their finished steps from storage and recovers a turn that was in flight from
its chat before sending anything.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import httpx
from prefect import flow
from prefect.exceptions import PrefectHTTPStatusError
from prefect.logging import get_run_logger
from pydantic import BaseModel, ConfigDict, Field

from prefect_coder.blocks.state import workflow_key
from prefect_coder.flows.common import registry
from prefect_coder.flows.common.errors import WorkflowParameterError
from prefect_coder.flows.common.params import (
    AnyStep,
    WorkflowSettings,
    validate_steps,
    validate_workflow_id,
)
from prefect_coder.flows.common.resources import (
    TurnResources,
    load_resources,
    load_store,
    shared_client,
)
from prefect_coder.flows.liveness.track import batch_key, record_done, record_start, this_run
from prefect_coder.flows.workflow.end_of_life import end_failed_workflow
from prefect_coder.flows.workflow.steps import run_steps

__all__ = [
    "FanoutItem",
    "FanoutOutcome",
    "agent_fanout_shard",
    "run_in_process",
    "run_many_in_process",
    "track_batch",
]

#: Attempts and first back-off of loading the blocks in a shard (1, 2, 4, 8 s).
LOAD_ATTEMPTS = 5
LOAD_BACKOFF_S = 1.0


class FanoutItem(BaseModel):
    """One independent workflow of a fan-out (its own workflow id, chat and results)."""

    model_config = ConfigDict(extra="forbid")

    workflow_id: str = Field(description="Stable id of this workflow (unique in the fan-out).")
    steps: list[AnyStep] = Field(description="The workflow's steps, run in order.")


class FanoutOutcome(BaseModel):
    """How one workflow of a fan-out ended."""

    workflow_id: str
    ok: bool
    error: str | None = None
    results: list[Any] = Field(default_factory=list)
    #: The flow run that ran it (an agent-workflow or agent-fanout-shard run), the
    #: last one if restarted; empty in process.
    flow_run_id: str | None = None
    state: str | None = None
    #: How many flow runs this fan-out attached to or started for it.
    runs: int = 0


def _validate(workflow_id: str, steps: Sequence[AnyStep]) -> None:
    validate_workflow_id(workflow_id)
    validate_steps(
        steps,
        tool_names=registry.tool_names(),
        output_model_names=registry.output_model_names(),
    )


async def run_in_process(
    workflow_id: str,
    steps: Sequence[AnyStep],
    settings: WorkflowSettings,
    resources: TurnResources | None = None,
) -> list[Any]:
    """One workflow inside the calling flow run: each step is a task of that flow
    run (its result is persisted when the step ends). On failure it applies the
    workflow's failure handler itself: the chat is archived only on a failure known
    to be final (``end_failed_workflow``); a transient one leaves it live.

    ``resources`` (credentials and store) may be shared by every workflow of a
    shard: they are the same blocks, and loading them is two API calls."""
    if resources is None:
        registry.load_tool_modules(settings.tool_modules)
        _validate(workflow_id, steps)
        resources = await load_resources(settings, warn_other_stores=True)
    try:
        # The archive inline, not as a task run of its own: one Prefect task run per
        # one-turn workflow instead of two (docs/performance.md, round 5).
        return await run_steps(
            workflow_id,
            steps,
            settings,
            resources,
            allow_approval=False,
            archive_as_task=False,
            # The fan-out's own table lists its workflows: no card per workflow.
            summary=False,
        )
    except Exception as exc:
        # The same verdict as a workflow's own failure hook: a store outage or any
        # transient fault must not cost a shard's workflows their chats (issue 30).
        await end_failed_workflow(workflow_id, settings, exc, resources)
        raise


def _transient(exc: Exception) -> bool:
    if isinstance(exc, PrefectHTTPStatusError):
        return exc.response.status_code >= 500 or exc.response.status_code == 429
    return isinstance(exc, httpx.TransportError)


async def _load_resources_patiently(settings: WorkflowSettings) -> TurnResources:
    """``load_resources``, retried on a transient Prefect API failure: a shard loads the
    blocks once for all its workflows, so one 500 from a loaded server (measured: its
    database pool timed out) would otherwise fail them all."""
    for attempt in range(LOAD_ATTEMPTS):
        try:
            return await load_resources(settings, warn_other_stores=True)
        except Exception as exc:
            if not _transient(exc) or attempt == LOAD_ATTEMPTS - 1:
                raise
            get_run_logger().warning("loading the blocks failed (%s), retrying", type(exc).__name__)
            await asyncio.sleep(LOAD_BACKOFF_S * 2**attempt)
    raise AssertionError("unreachable")


async def run_many_in_process(
    workflows: list[FanoutItem], settings: WorkflowSettings, max_parallel: int
) -> list[FanoutOutcome]:
    """Every workflow in the calling flow run, at most ``max_parallel`` at once; one
    outcome per workflow, in order (a workflow's failure is its outcome, not an
    exception). Blocks are loaded once for all of them."""
    registry.load_tool_modules(settings.tool_modules)
    invalid: dict[str, str] = {}
    for item in workflows:
        try:
            _validate(item.workflow_id, item.steps)
        except WorkflowParameterError as exc:
            invalid[item.workflow_id] = f"{type(exc).__name__}: {exc}"
    resources: TurnResources | None = None
    if len(invalid) < len(workflows):
        try:
            resources = await _load_resources_patiently(settings)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            return [
                FanoutOutcome(workflow_id=w.workflow_id, ok=False, error=error) for w in workflows
            ]
    gate = asyncio.Semaphore(max_parallel)

    async def one(item: FanoutItem, shared: TurnResources | None) -> FanoutOutcome:
        if item.workflow_id in invalid:
            return FanoutOutcome(
                workflow_id=item.workflow_id, ok=False, error=invalid[item.workflow_id]
            )
        async with gate:
            try:
                results = await run_in_process(item.workflow_id, item.steps, settings, shared)
            except Exception as exc:
                return FanoutOutcome(
                    workflow_id=item.workflow_id, ok=False, error=f"{type(exc).__name__}: {exc}"
                )
        return FanoutOutcome(workflow_id=item.workflow_id, ok=True, results=list(results))

    if resources is None:
        return list(await asyncio.gather(*(one(w, None) for w in workflows)))
    # One ChatClient (one connection pool) for every workflow of the shard, opened
    # and closed on this event loop, which runs all of them; each turn's transport
    # events still reach only its own hook (parts/resources.ContextRouter).
    async with shared_client(resources) as shared:
        return list(await asyncio.gather(*(one(w, shared) for w in workflows)))


@flow(
    name="agent-fanout-shard",
    flow_run_name="shard-{shard_name}",
    persist_result=True,
    result_serializer="json",
)
async def agent_fanout_shard(
    workflows: list[FanoutItem],
    settings: WorkflowSettings | None = None,
    max_parallel: int = 64,
    shard_name: str = "",
) -> list[FanoutOutcome]:
    """Run a batch of a fan-out's workflows in this flow run (started by ``agent-fanout``).

    Returns one outcome per workflow; a workflow's failure does not fail the shard
    (the fan-out decides). Every turn stays within the turn-slot cap.

    Args:
        workflows: the shard's workflows (no approval steps).
        settings: shared by every workflow.
        max_parallel: workflows run at once in this process.
        shard_name: names the flow run (``agent-fanout`` passes the first workflow id
            and the shard's size).
    """
    settings = settings or WorkflowSettings()
    ids = [w.workflow_id for w in workflows]
    tracked = await track_batch(settings, batch_key("shard", ids), [workflow_key(w) for w in ids])
    outcomes = await run_many_in_process(workflows, settings, max_parallel)
    failed = sum(not o.ok for o in outcomes)
    get_run_logger().info("shard finished: %d ok, %d failed", len(outcomes) - failed, failed)
    if tracked is not None:
        await tracked()
    return outcomes


async def track_batch(
    settings: WorkflowSettings, key: str, lease_keys: list[str]
) -> Callable[[], Awaitable[object]] | None:
    """Record this deployment run for ``reconcile-workflows`` (its workflows' leases show
    it alive: a shard on a lost host stops renewing them); returns what marks it done,
    or None (not a deployment run, or the store could not be loaded: logged)."""
    run = this_run()
    if run is None:
        return None
    try:
        store = await load_store(settings)
    except Exception as exc:
        get_run_logger().warning("not recorded for the reconciler: %s", type(exc).__name__)
        return None
    if not await record_start(store, key, run, lease_keys=lease_keys):
        return None
    return lambda: record_done(store, key, run)
