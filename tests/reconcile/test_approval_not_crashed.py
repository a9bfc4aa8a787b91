"""Issue 29, case 1, through deployments: an approval is never crashed.

The shipped set-up: a process worker whose flow runs send heartbeats every 30 s, the
zombie automation on (``apply_zombie_automation``, here with ``within`` 35 s: longer
than a heartbeat interval, as a live run needs, shorter than the 90 s default), the
``recover-turn`` Crashed triggers deployed, and the reconciler ticking. An
``agent-workflow`` run suspends at its approval step (its process exits: no more
heartbeats) and is left well past the zombie window: it is still Suspended, and no
reconciler tick acted on it. Approved through the API, the next step runs once (one
user message per step, from the emulator's event log) and the chat is archived.

Before the fix, the automation's ``expect`` held only final states: ``within`` after
the last heartbeat it marked the Suspended run Crashed, ``recover-turn`` failed
("Cannot suspend subflows") and the chat was archived.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fanout_env import (
    WORKER_QUERY_S,
    child_env,
    deploy,
    deployment_id,
    fanout_settings,
    runs_of,
    start_worker,
    stop_worker,
    undeploy,
    until,
)
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter
from prefect.flow_runs import aresume_flow_run
from reconcile_env import one_message_per_step, start_workflow, tick_until
from warm_python import WarmPython

from coder_chat.emulator import Emulator
from prefect_coder.blocks import StateStore
from prefect_coder.flows.common.params import ApprovalStep, Step, step_marker
from prefect_coder.flows.deployments.expire_approvals import expire_approvals
from prefect_coder.flows.deployments.fanout_shard import FanoutItem
from prefect_coder.flows.deployments.reconcile_workflows import ReconcileRow
from prefect_coder.flows.deployments.zombies import apply_zombie_automation
from prefect_coder.flows.liveness.track import workflow_record_key

#: The zombie window: > one heartbeat interval (30 s, Prefect's minimum), so the live
#: run is never crashed between two beats, and well under the shipped 90 s.
WITHIN_S = float(os.environ.get("PREFECT_CODER_APPROVAL_WITHIN_S") or 35.0)
#: How long past the window the suspended run is watched (issue 29's variant: 600 s,
#: ``PREFECT_CODER_APPROVAL_PAST_S=600 PREFECT_CODER_RECONCILE_TICK_S=10``).
PAST_S = float(os.environ.get("PREFECT_CODER_APPROVAL_PAST_S") or 10.0)


async def test_a_suspended_approval_outlives_the_zombie_window_and_runs_its_next_step_once(
    prefect_harness: Any, warm_python: WarmPython, emu: Emulator, tmp_path: Path
) -> None:
    wf = f"appr-z-{uuid.uuid4().hex[:6]}"
    item = FanoutItem(
        workflow_id=wf,
        steps=[
            Step(name="draft", prompt=f'{step_marker(wf, "draft")} #emu {{"text": "drafted"}}'),
            # Its deadline well after the watch (the approval's only clock).
            ApprovalStep(
                name="review",
                prompt="Ship it?",
                timeout_s=max(600, int(WITHIN_S + PAST_S + 300)),
            ),
            Step(name="apply", prompt=f'{step_marker(wf, "apply")} #emu {{"text": "applied"}}'),
        ],
    )
    store_url = f"sqlite+aiosqlite:///{tmp_path / 'state.db'}"
    settings = await fanout_settings(emu, store_url, None)
    pool = f"reconcile-appr-{uuid.uuid4().hex[:6]}"
    name = f"test-zombie-{uuid.uuid4().hex[:6]}"
    applied = await apply_zombie_automation(
        heartbeat_s=30, within_s=WITHIN_S, flows=["agent-workflow"], name=name
    )
    deployed = await deploy(pool, untriggered=("agent-fanout",))
    env = child_env(prefect_harness.api_url, prefect_harness.results_dir, query_s=WORKER_QUERY_S)
    env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] = "30"
    worker = await start_worker(pool, f"{pool}-w", env, tmp_path / "w.log", limit=2)
    store = StateStore(store_url)
    seen: list[ReconcileRow] = []
    try:
        async with get_client() as client:
            run = await start_workflow(
                client, deployment_id(deployed, "agent-workflow"), item, settings
            )

            async def suspended() -> bool:
                state = (await client.read_flow_run(run.id)).state
                if state is not None and state.is_final():
                    log = worker.log.read_text(errors="replace")[-3000:]
                    raise AssertionError(f"the run ended {state.name} before its approval: {log}")
                return state is not None and state.type == StateType.PAUSED

            await until("the run to suspend at its approval", 240, suspended)

            async def heartbeats() -> list[Any]:
                page = await client.read_events(
                    EventFilter(
                        event=EventNameFilter(name=["prefect.flow-run.heartbeat"]),
                        resource=EventResourceFilter(id=[f"prefect.flow-run.{run.id}"]),
                    ),
                    limit=50,
                )
                return list(page.events)

            # Events reach the server's store within seconds; none at all means the
            # run beat no heartbeat and the test would prove nothing.
            beats = await until("the run's heartbeat event", 60, heartbeats)
            last_beat = max(b.occurred for b in beats)

            async def past_the_window() -> bool:
                return (datetime.now(UTC) - last_beat).total_seconds() > WITHIN_S + PAST_S

            await tick_until(
                "the zombie window to pass", 180 + PAST_S, settings, past_the_window, seen=seen
            )
            waited = await client.read_flow_run(run.id)
            record = await store.workflows.get(workflow_record_key(wf))

            await aresume_flow_run(run.id, run_input={"decision": "approve"})

            async def completed() -> bool:
                state = (await client.read_flow_run(run.id)).state
                return state is not None and state.is_final()

            started = time.monotonic()
            await until("the approved run to finish", 240, completed)
            resumed_s = time.monotonic() - started
            final = await client.read_flow_run(run.id)
            await tick_until("the record to be done", 60, settings, _done(store, wf))
    finally:
        await store.aclose()
        await stop_worker(worker)
        await undeploy(deployed)
        async with get_client() as client:
            assert applied.automation.id is not None
            await client.delete_automation(applied.automation.id)
    assert waited.state is not None
    assert (waited.state.type, waited.state.name) == (StateType.PAUSED, "Suspended")
    assert seen == [], seen  # no tick acted on the waiting run
    assert record is not None and record.state == "running" and record.attempts == 0
    logs = worker.log.read_text(errors="replace")[-3000:]
    assert final.state is not None and final.state.type == StateType.COMPLETED, (final.state, logs)
    counts = one_message_per_step(emu, item, ("draft", "apply"))
    assert counts == {step_marker(wf, "draft"): 1, step_marker(wf, "apply"): 1}, counts
    assert [c["archived"] for c in emu.chats()] == [True]
    print(
        f"\napproval: suspended past the {WITHIN_S:.0f}s zombie window; resumed in {resumed_s:.1f}s"
    )


def _done(store: StateStore, wf: str) -> Any:
    async def check() -> bool:
        record = await store.workflows.get(workflow_record_key(wf))
        return record is not None and record.state == "done"

    return check


async def test_an_expired_approval_is_recorded_done_never_rerun(
    prefect_harness: Any, warm_python: WarmPython, emu: Emulator, tmp_path: Path
) -> None:
    """The approval's own deadline (``timeout_s``, here 2 s) is its only clock: past it
    the reconciler still leaves the Suspended run alone; once ``expire-approvals`` has
    failed it (Prefect's message, the chat archived), the record is ``done`` (its
    failure handler records the final verdict) — the workflow is not rerun and the
    next step is never sent."""
    wf = f"appr-x-{uuid.uuid4().hex[:6]}"
    item = FanoutItem(
        workflow_id=wf,
        steps=[
            Step(name="draft", prompt=f'{step_marker(wf, "draft")} #emu {{"text": "drafted"}}'),
            ApprovalStep(name="review", prompt="Ship it?", timeout_s=2),
            Step(name="apply", prompt=f'{step_marker(wf, "apply")} #emu {{"text": "applied"}}'),
        ],
    )
    store_url = f"sqlite+aiosqlite:///{tmp_path / 'state.db'}"
    settings = await fanout_settings(emu, store_url, None)
    pool = f"reconcile-expiry-{uuid.uuid4().hex[:6]}"
    deployed = await deploy(pool, untriggered=("agent-fanout",))
    env = child_env(prefect_harness.api_url, prefect_harness.results_dir, query_s=WORKER_QUERY_S)
    worker = await start_worker(pool, f"{pool}-w", env, tmp_path / "w.log", limit=1)
    store = StateStore(store_url)
    seen: list[ReconcileRow] = []
    try:
        async with get_client() as client:
            run = await start_workflow(
                client, deployment_id(deployed, "agent-workflow"), item, settings
            )

            async def suspended() -> bool:
                state = (await client.read_flow_run(run.id)).state
                return state is not None and state.type == StateType.PAUSED

            await until("the run to suspend at its approval", 240, suspended)
            paused_at = time.monotonic()

            async def past_deadline() -> bool:
                return time.monotonic() - paused_at > 4

            await tick_until("the deadline to pass", 60, settings, past_deadline, seen=seen)
            assert seen == [], seen  # past its deadline, still left to Prefect
            handled = await expire_approvals()
            assert str(run.id) in handled
            await tick_until("the record to be done", 60, settings, _done(store, wf), seen=seen)
            record = await store.workflows.get(workflow_record_key(wf))
            runs = await runs_of(client, deployment_id(deployed, "agent-workflow"), pool=pool)
    finally:
        await store.aclose()
        await stop_worker(worker)
        await undeploy(deployed)
    # Done by the failure handler that expire-approvals applied (a final verdict), or by
    # a tick that saw the expiry's message first: either way never rerun.
    assert record is not None and record.state == "done" and record.attempts == 0
    assert [r.id for r in runs] == [run.id]  # never rerun
    assert {r.action for r in seen} <= {"done"}, seen
    counts = one_message_per_step(emu, item, ("draft", "apply"))
    assert counts == {step_marker(wf, "draft"): 1}, counts  # apply never sent
    assert [c["archived"] for c in emu.chats()] == [True]
