"""Write the reconciler's durable record of a workflow run where the run starts and ends.

Every deployment run the product starts on a workflow's behalf — ``agent-workflow``,
``agent-turn`` and ``recover-turn`` (when they take the workflow's lease), each
``agent-fanout-shard`` and the ``agent-fanout`` itself (at their entry) — records
its deployment id, ALL its parameters (Prefect's own copy of them: block names, never
a token), its flow-run id and the leases that show it alive (``store.workflows``).
That is what lets ``reconcile-workflows`` rerun it without any list of cases.

Only deployment runs are recorded (a direct Python call or an in-process subflow has
nothing to rerun), and only by the run the parameters belong to: a shard's workflows
run under the shard's record, not one each. Recording is bookkeeping: a failed
write is logged, never fails the workflow (``reconcile-workflows`` also adopts a
product run it finds Pending or Running without a record).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prefect.context import FlowRunContext

from prefect_coder.blocks.state.store import StateStore

__all__ = [
    "RESUMABLE_EVENT",
    "RunIdentity",
    "batch_key",
    "record_done",
    "record_start",
    "this_run",
    "workflow_record_key",
]

logger = logging.getLogger("prefect_coder.flows.liveness")

#: The event a failed run's failure handler emits when it keeps the chat live for a
#: rerun; related to the run (``prefect.flow-run.<id>``), so the reconciler can read it
#: when the store could not take the resumable mark.
RESUMABLE_EVENT = "coder.workflow.resumable"

#: The flows whose runs drive ONE workflow id (parameter ``workflow_id``) under its lease.
WORKFLOW_FLOWS = frozenset({"agent-workflow", "agent-turn", "recover-turn"})


def workflow_record_key(workflow_id: str) -> str:
    """The record of a workflow's runs (agent-workflow, agent-turn, recover-turn)."""
    return f"workflow:{workflow_id}"


def batch_key(kind: str, workflow_ids: Sequence[str]) -> str:
    """The record of a batch run (``shard``, ``fanout``): a digest of its workflow ids,
    in order (the same cut gives the same key on a rerun)."""
    digest = hashlib.sha256("\n".join(workflow_ids).encode()).hexdigest()[:24]
    return f"{kind}:{digest}"


@dataclass(frozen=True, slots=True)
class RunIdentity:
    """The current flow run, when it is a deployment run."""

    flow_run_id: str
    deployment_id: str
    flow_name: str
    parameters: dict[str, Any]


def this_run() -> RunIdentity | None:
    """The current deployment flow run (its parameters as Prefect stores them), or None
    outside a flow run, or for a run with no deployment (a subflow, a direct call)."""
    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None or ctx.flow_run.deployment_id is None:
        return None
    flow_name = ctx.flow.name if ctx.flow is not None else ""
    return RunIdentity(
        flow_run_id=str(ctx.flow_run.id),
        deployment_id=str(ctx.flow_run.deployment_id),
        flow_name=flow_name,
        parameters=dict(ctx.flow_run.parameters or {}),
    )


async def record_start(
    store: StateStore,
    key: str,
    run: RunIdentity,
    *,
    workflow_id: str | None = None,
    lease_keys: Sequence[str] = (),
) -> bool:
    """Record that ``run`` drives ``key`` (idempotent); False if the write failed."""
    try:
        await store.workflows.started(
            key,
            deployment=run.deployment_id,
            parameters=run.parameters,
            flow_run_id=run.flow_run_id,
            workflow_id=workflow_id,
            lease_keys=lease_keys,
        )
    except Exception as exc:
        logger.warning(
            "could not record %s for the reconciler (%s); it adopts the run from Prefect "
            "if it is lost",
            key,
            type(exc).__name__,
        )
        return False
    return True


async def record_done(store: StateStore, key: str, run: RunIdentity) -> bool:
    """Mark ``key`` done, if ``run`` is still its current run; False otherwise or on error."""
    try:
        return await store.workflows.finished(key, flow_run_id=run.flow_run_id)
    except Exception as exc:
        logger.warning(
            "could not mark %s done (%s); the reconciler marks it when it sees the run Completed",
            key,
            type(exc).__name__,
        )
        return False
