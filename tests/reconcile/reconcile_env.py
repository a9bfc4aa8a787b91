"""Shared pieces of the reconciler's deployed tests: the short clocks, a tick loop that
runs the ``reconcile-workflows`` flow (a real flow run on the session's server) until a
condition holds, and the counts the tests assert on."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fanout_env import parent_of, user_messages_per_step
from prefect.client.orchestration import PrefectClient
from prefect.client.schemas.objects import FlowRun
from warm_launch import behind

from coder_chat.emulator import Emulator
from prefect_coder.flows.common.params import WorkflowSettings
from prefect_coder.flows.deployments.fanout_shard import FanoutItem
from prefect_coder.flows.deployments.reconcile_workflows import (
    ReconcileOptions,
    ReconcileRow,
    reconcile_workflows,
)
from prefect_coder.flows.deployments.sweep_settings import SweepSettings

#: Test-sized clocks (production: docs/reconciler.md). Seconds, not minutes.
FAST = ReconcileOptions(
    pending_grace_s=4,
    lost_grace_s=1,
    heartbeat_grace_s=90,
    # The workers' flow runs here beat too: a beat this recent vetoes the lease's
    # evidence (production: 45 s, 1.5 beats of 30 s).
    heartbeat_fresh_s=5,
    crashed_grace_s=3,
    max_attempts=3,
    backoff_s=2,
    max_backoff_s=10,
)
#: Seconds between two ticks in the tests (production: 10 s); a long variant (e.g. an
#: approval left for 10 minutes) may tick less often.
TICK_S = float(os.environ.get("PREFECT_CODER_RECONCILE_TICK_S") or 1.0)


def reconciler_settings(settings: WorkflowSettings) -> SweepSettings:
    """The reconciler's settings for the test's store (the workflows' own block)."""
    return SweepSettings(
        store_block=settings.store_block, credentials_block=settings.credentials_block
    )


async def tick_until(
    what: str,
    limit_s: float,
    settings: WorkflowSettings,
    done: Callable[[], Awaitable[Any]],
    options: ReconcileOptions = FAST,
    seen: list[ReconcileRow] | None = None,
) -> Any:
    """Run one reconciler tick every :data:`TICK_S` until ``done()`` is truthy (returned);
    every row acted on is appended to ``seen``."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        rows = await reconcile_workflows(reconciler_settings(settings), options)
        if seen is not None:
            seen.extend(r for r in rows if r.action != "leave")
        value = await done()
        if value:
            return value
        await asyncio.sleep(TICK_S)
    raise AssertionError(f"timed out waiting for {what}; acted: {seen}")


async def start_workflow(
    client: PrefectClient, deployment: Any, item: FanoutItem, settings: WorkflowSettings
) -> FlowRun:
    """Start ``item`` as an ``agent-workflow`` deployment run (what a user's "Run")."""
    return await client.create_flow_run_from_deployment(
        deployment,
        parameters={
            "workflow_id": item.workflow_id,
            "steps": [s.model_dump(mode="json") for s in item.steps],
            "settings": settings.model_dump(mode="json"),
        },
    )


async def state_of(client: PrefectClient, run_id: Any) -> FlowRun:
    return await client.read_flow_run(run_id)


def one_message_per_step(emu: Emulator, item: FanoutItem, steps: tuple[str, ...]) -> dict[str, int]:
    """User messages per step marker, from the emulator's event log."""
    return user_messages_per_step(emu, [item], steps)


def kill_run_process(run: FlowRun, worker_pid: int) -> bool:
    """SIGKILL a run's process (the worker's child, and the engine forked behind it)."""
    pid = str(run.infrastructure_pid or "").split(":")[-1]
    if not pid or parent_of(int(pid)) != worker_pid:
        return False
    for target in {behind(int(pid)), int(pid)}:
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return True
