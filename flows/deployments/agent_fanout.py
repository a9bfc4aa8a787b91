"""The ``agent-fanout`` deployment: many independent workflows in parallel.

Three modes, one contract (each workflow keeps its own workflow id, chat,
checkpoint, lease and stored step results; running turns stay within the
turn-slot cap of :mod:`prefect_coder.flows.fleet.slots`):

* **shards** (a deployment run with ``shard_size`` > 1, the default): the
  workflows are split into shards of ``shard_size``, each an
  ``agent-fanout-shard`` flow run (``run_deployment``) that runs its workflows
  in process. The pool's workers share the shards, and one process runs many
  turns instead of paying a process start per workflow (a flow run on a
  process worker is a new Python process: seconds of CPU). Each step is a task
  of its shard's run, persisted the moment it ends.
* **one run per workflow** (a deployment run with ``shard_size`` 1, or with
  ``workflow_deployment`` given): every workflow is its own ``agent-workflow``
  flow run; a crashed one is recovered by the ``recover-turn`` Crashed trigger and
  restarted by the fan-out, the workflow lease serialising the two (one extra
  process start per crash, kept on purpose: docs/fleet.md).
* **in process** (``agent_fanout`` called directly, no deployment): every step is
  a task of this flow run itself, never a task nested in a task — Prefect writes
  a nested task's result only when the outer task commits, so a crash lost the
  finished steps of every workflow in flight.

Runs started by a fan-out carry idempotency keys derived from the workflow ids
(``fanout-<workflow_id>``, ``fanout-shard-<digest of the shard's ids>``): a re-run
of the fan-out (its own Crashed trigger, or by hand) re-attaches to the runs that
exist instead of starting duplicates, and starts a crashed one again. Before it
starts anything it looks those keys up (:func:`live_runs`) and attaches first to
the runs that are still live, so they count against ``max_parallel`` from the
start instead of when the walk reaches them.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

from prefect import flow
from prefect.artifacts import acreate_table_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterDeploymentId,
    FlowRunFilterIdempotencyKey,
)
from prefect.client.schemas.objects import FlowRun
from prefect.deployments.flow_runs import arun_deployment
from prefect.logging import get_run_logger
from prefect.runtime import deployment as current_deployment
from pydantic import BaseModel

from prefect_coder.flows.common.errors import WorkflowParameterError
from prefect_coder.flows.common.params import WorkflowSettings
from prefect_coder.flows.deployments.fanout_shard import (
    FanoutItem,
    FanoutOutcome,
    run_in_process,
    run_many_in_process,
    track_batch,
)
from prefect_coder.flows.liveness.track import batch_key

__all__ = [
    "FanoutItem",
    "FanoutOutcome",
    "agent_fanout",
    "cut_shards",
    "fanout_idempotency_key",
    "live_first",
    "live_runs",
    "run_in_process",
    "shard_idempotency_key",
]

#: The deployment a fan-out run starts its workflows on (``shard_size`` 1).
WORKFLOW_DEPLOYMENT = "agent-workflow/agent-workflow"
#: The deployment a fan-out run starts its shards on (``shard_size`` > 1).
SHARD_DEPLOYMENT = "agent-fanout-shard/agent-fanout-shard"
#: Workflows per shard by default: enough turns per process to amortise its start
#: (≈ 2-4 s of CPU on a loaded machine) and still several shards to spread.
DEFAULT_SHARD_SIZE = 20
#: How often a re-attached run that ended Crashed is started again (the re-run
#: returns finished steps from storage; the lease serialises it with a
#: recover-turn run the Crashed trigger started).
CRASHED_RESTARTS = 2
#: Idempotency keys per flow-run read of :func:`live_runs` (one run per key).
_KEYS_PER_READ = 200

#: A unit's key: ``after_run`` None for its first run, else the crashed run it restarts.
UnitKey = Callable[[str | None], str]


def fanout_idempotency_key(workflow_id: str, after_run: str | None = None) -> str:
    """The idempotency key of a workflow's flow run: stable per workflow id, so a
    re-run of the fan-out finds the run instead of creating a second one; a
    restart after a Crashed run is keyed by that run (stable as well)."""
    return (
        f"fanout-{workflow_id}" if after_run is None else f"fanout-{workflow_id}-after-{after_run}"
    )


def shard_idempotency_key(workflow_ids: list[str], after_run: str | None = None) -> str:
    """The idempotency key of a shard's flow run: a digest of its workflow ids, so a
    re-run of the fan-out with the same parameters finds each shard's run."""
    digest = hashlib.sha256("\n".join(workflow_ids).encode()).hexdigest()[:24]
    base = f"fanout-shard-{digest}"
    return base if after_run is None else f"{base}-after-{after_run}"


def cut_shards(
    workflows: list[FanoutItem], shard_size: int, max_parallel: int
) -> tuple[list[list[FanoutItem]], int, int]:
    """The shards (in order, so a re-run with the same parameters cuts the same ones and
    finds them by key), the workflows each runs at once and the shards run at once:
    ``max_parallel`` is split over the shards that run at the same time."""
    shards = [workflows[i : i + shard_size] for i in range(0, len(workflows), shard_size)]
    per_shard = min(shard_size, max_parallel)
    return shards, per_shard, max(1, max_parallel // per_shard)


async def live_runs(deployment: str, keys: Sequence[UnitKey]) -> dict[int, FlowRun]:
    """The units (by index into ``keys``) whose flow run on ``deployment`` exists and
    is not final yet — Scheduled, Pending, Running, Paused — left by an earlier run of
    this fan-out (or of one with the same workflows). A unit whose run ended Crashed
    is followed to its restart (``key(<crashed run id>)``), as
    :func:`_run_once_or_again` would, up to ``CRASHED_RESTARTS`` times.

    One read per ``_KEYS_PER_READ`` keys and restart round; a fresh fan-out finds
    nothing."""
    async with get_client() as client:
        dep = await client.read_deployment_by_name(deployment)
        wanted = {i: key(None) for i, key in enumerate(keys)}
        live: dict[int, FlowRun] = {}
        for _ in range(1 + CRASHED_RESTARTS):
            if not wanted:
                break
            found: dict[str, FlowRun] = {}
            batch = list(wanted.values())
            for at in range(0, len(batch), _KEYS_PER_READ):
                chunk = batch[at : at + _KEYS_PER_READ]
                for run in await client.read_flow_runs(
                    flow_run_filter=FlowRunFilter(
                        idempotency_key=FlowRunFilterIdempotencyKey(any_=chunk),
                        deployment_id=FlowRunFilterDeploymentId(any_=[dep.id]),
                    ),
                    limit=len(chunk),
                ):
                    if run.idempotency_key is not None:
                        found[run.idempotency_key] = run
            after: dict[int, str] = {}
            for i, key in wanted.items():
                hit = found.get(key)
                if hit is None:
                    continue  # never started: nothing to attach to
                if hit.state is None or not hit.state.is_final():
                    live[i] = hit
                elif hit.state.is_crashed():
                    after[i] = keys[i](str(hit.id))
            wanted = after
        return live


def live_first(count: int, live: set[int]) -> list[int]:
    """The order a re-run walks its ``count`` units in: the live ones first (in their
    own order), then the rest. Each walk enters the ``max_parallel`` gate in this
    order (asyncio's semaphore is FIFO), so a new run starts only once every live one
    holds the gate or has ended: never more than ``max_parallel`` runs at once, even
    when the live runs are not the first in the list (a re-run by hand that lists the
    workflows in another order — their keys do not depend on it in per-workflow mode —
    or a workflow whose first start failed while later ones started)."""
    return sorted(range(count), key=lambda i: i not in live)


async def _live_or_none(
    deployment: str, keys: Sequence[UnitKey], logger: Any, what: str
) -> set[int]:
    """:func:`live_runs`, logged; a failed lookup is logged and walks in list order
    (the bound may then be exceeded briefly, as before the lookup existed)."""
    try:
        live = await live_runs(deployment, keys)
    except Exception as exc:
        logger.warning(
            "could not look up live %s runs of an earlier run of this fan-out (%s: %s); "
            "attaching in list order",
            what, type(exc).__name__, exc,
        )  # fmt: skip
        return set()
    if live:
        names = ", ".join(sorted(r.name for r in live.values())[:10])
        logger.info(
            "%d %s run(s) of an earlier run of this fan-out are still live (%s%s): attaching "
            "to them first, they count against max_parallel",
            len(live), what, names, " …" if len(live) > 10 else "",
        )  # fmt: skip
    return set(live)


async def _run_once_or_again(
    deployment: str,
    parameters: dict[str, Any],
    key: UnitKey,
    name: str,
    poll_interval_s: float,
) -> tuple[FlowRun, int]:
    """``run_deployment`` under an idempotency key (re-attaching to a run that exists);
    a run that ends Crashed is started again under a key naming it, at most
    ``CRASHED_RESTARTS`` times. Returns the last run and how many runs it took."""
    after: str | None = None
    run: FlowRun | None = None
    attempt = 0
    for attempt in range(1 + CRASHED_RESTARTS):
        run = await arun_deployment(
            deployment,
            parameters=parameters,
            idempotency_key=key(after),
            flow_run_name=name,
            timeout=None,
            poll_interval=poll_interval_s,
            as_subflow=True,
        )
        state = run.state
        if state is None or not state.is_crashed() or attempt == CRASHED_RESTARTS:
            break
        after = str(run.id)
    assert run is not None
    return run, attempt + 1


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
    run, runs = await _run_once_or_again(
        deployment,
        params,
        _workflow_key(item.workflow_id),
        item.workflow_id,
        poll_interval_s,
    )
    state = run.state
    outcome = FanoutOutcome(
        workflow_id=item.workflow_id,
        ok=bool(state and state.is_completed()),
        flow_run_id=str(run.id),
        state=state.type.value if state else None,
        runs=runs,
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


async def _run_shard(
    shard: list[FanoutItem],
    settings: WorkflowSettings,
    deployment: str,
    max_parallel: int,
    poll_interval_s: float,
) -> list[FanoutOutcome]:
    ids = [w.workflow_id for w in shard]
    name = ids[0] if len(ids) == 1 else f"{ids[0]}+{len(ids) - 1}"
    params = {
        "workflows": [w.model_dump(mode="json") for w in shard],
        "settings": settings.model_dump(mode="json"),
        "max_parallel": max_parallel,
        "shard_name": name,
    }
    run, runs = await _run_once_or_again(
        deployment,
        params,
        _shard_key(ids),
        f"shard-{name}",
        poll_interval_s,
    )
    state = run.state
    label = state.type.value if state else None
    values: list[Any] | None = None
    error: str | None = None
    if state is not None and state.is_completed():
        try:
            values = list(await state.aresult())
        except Exception as exc:  # result storage not shared with this worker
            error = f"shard result not readable here: {type(exc).__name__}"
    elif state is not None:
        error = f"shard {state.type.value}: {state.message or ''}".strip()
    else:
        error = "shard run has no state"
    if values is None or len(values) != len(shard):
        return [
            FanoutOutcome(
                workflow_id=w,
                ok=False,
                error=error,
                flow_run_id=str(run.id),
                state=label,
                runs=runs,
            )
            for w in ids
        ]
    outcomes = []
    for value in values:
        outcome = FanoutOutcome.model_validate(
            value.model_dump() if isinstance(value, BaseModel) else value
        )
        outcome.flow_run_id, outcome.runs = str(run.id), runs
        outcome.state = "COMPLETED" if outcome.ok else "FAILED"
        outcomes.append(outcome)
    return outcomes


def _workflow_key(workflow_id: str) -> UnitKey:
    return lambda after: fanout_idempotency_key(workflow_id, after)


def _shard_key(workflow_ids: list[str]) -> UnitKey:
    return lambda after: shard_idempotency_key(workflow_ids, after)


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
    shard_size: int = DEFAULT_SHARD_SIZE,
    shard_deployment: str | None = None,
) -> list[FanoutOutcome]:
    """Run independent workflows in parallel; every turn stays within the turn-slot cap.

    Concurrency of *turns* is bounded deployment-wide by
    ``CoderCredentials.max_concurrent_turns``; ``max_parallel`` bounds how many
    workflows this fan-out drives at once. Per-workflow outcomes are returned
    and, with ``settings.artifacts``, published as one table artifact.

    Args:
        workflows: the workflows; ids must be unique. Approval steps are not
            allowed here; run those workflows as their own ``agent-workflow`` runs.
        settings: shared by every workflow.
        max_parallel: workflows driven at once (in shards: summed over the shards
            running at once).
        fail_on_error: fail the fan-out run (after all finished) if any workflow failed.
        workflow_deployment: run every workflow as its own run of this deployment
            (no shards).
        poll_interval_s: how often a started flow run's state is polled.
        shard_size: workflows per ``agent-fanout-shard`` run when this run is a
            deployment run (or ``shard_deployment`` is given); 1: one
            ``agent-workflow`` run per workflow instead.
        shard_deployment: the deployment shards run on. Empty: when this run is
            itself a deployment run, ``agent-fanout-shard/agent-fanout-shard``;
            otherwise the workflows run in this process.
    """
    settings = settings or WorkflowSettings()
    _validate(workflows, max_parallel)
    if shard_size < 1:
        raise WorkflowParameterError("shard_size", "must be at least 1", "pass e.g. 20")
    logger = get_run_logger()
    # For reconcile-workflows: a fan-out has no lease of its own (its heartbeats and
    # Prefect's state are the evidence); its shards and workflows record themselves.
    tracked = await track_batch(
        settings, batch_key("fanout", [w.workflow_id for w in workflows]), []
    )
    deployed = bool(current_deployment.id)
    per_workflow = workflow_deployment or (
        WORKFLOW_DEPLOYMENT if deployed and shard_size == 1 else None
    )
    shards_on = (
        None if per_workflow else shard_deployment or (SHARD_DEPLOYMENT if deployed else None)
    )

    if per_workflow is not None:
        gate = asyncio.Semaphore(max_parallel)

        async def one(item: FanoutItem) -> FanoutOutcome:
            async with gate:
                try:
                    return await _run_as_deployment(item, settings, per_workflow, poll_interval_s)
                except Exception as exc:
                    return FanoutOutcome(
                        workflow_id=item.workflow_id,
                        ok=False,
                        error=f"{type(exc).__name__}: {exc}",
                    )

        live = await _live_or_none(
            per_workflow,
            [_workflow_key(w.workflow_id) for w in workflows],
            logger,
            "workflow",
        )
        order = live_first(len(workflows), live)
        done = await asyncio.gather(*(one(workflows[i]) for i in order))
        outcomes = [o for _, o in sorted(zip(order, done, strict=True), key=lambda p: p[0])]
        mode = f"one {per_workflow} run per workflow"
    elif shards_on is not None:
        shards, per_shard, at_once = cut_shards(workflows, shard_size, max_parallel)
        gate = asyncio.Semaphore(at_once)

        async def shard_of(shard: list[FanoutItem]) -> list[FanoutOutcome]:
            async with gate:
                try:
                    return await _run_shard(shard, settings, shards_on, per_shard, poll_interval_s)
                except Exception as exc:
                    error = f"{type(exc).__name__}: {exc}"
                    return [
                        FanoutOutcome(workflow_id=w.workflow_id, ok=False, error=error)
                        for w in shard
                    ]

        live = await _live_or_none(
            shards_on, [_shard_key([w.workflow_id for w in s]) for s in shards], logger, "shard"
        )
        order = live_first(len(shards), live)
        parts = await asyncio.gather(*(shard_of(shards[i]) for i in order))
        in_order = [p for _, p in sorted(zip(order, parts, strict=True), key=lambda p: p[0])]
        outcomes = [o for part in in_order for o in part]
        mode = f"{len(shards)} {shards_on} runs of ≤ {shard_size}"
    else:
        outcomes = await run_many_in_process(workflows, settings, max_parallel)
        mode = "in process"
    failed = [o.workflow_id for o in outcomes if not o.ok]
    logger.info(
        "fan-out finished (%s): %d ok, %d failed",
        mode,
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
    if tracked is not None:
        await tracked()
    if failed and fail_on_error:
        raise RuntimeError(
            f"{len(failed)} of {len(outcomes)} workflows failed: {', '.join(failed[:20])}"
            + (" …" if len(failed) > 20 else "")
        )
    return outcomes
