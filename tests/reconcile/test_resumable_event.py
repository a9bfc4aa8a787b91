"""A run failed by a store outage is rerun by the reconciler although its failure
handler could not write the resumable mark: the mark's second source is the run's
``coder.workflow.resumable`` event in Prefect.

Through deployments: an ``agent-workflow`` run on a process worker, its store a
private PostgreSQL. Step ``two``'s turn sleeps (emulator) until the test stops
PostgreSQL and ends the sleep: the end-of-turn checkpoint fails past
``transient_retry_s``, the run fails retryably (task retries off), and its failure
handler keeps the chat live and emits the event but cannot mark the record (the store
is down). PostgreSQL comes back; the reconciler ticks. Before the event was read, it
took the unmarked Failed run for an end (``done``) and the workflow never finished.
Now it reruns it: step ``two`` is recovered from the chat's history, ``three`` sent,
one user message per step (the emulator's event log), the chat archived at the end.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fanout_env import (
    WORKER_QUERY_S,
    child_env,
    deploy,
    deployment_id,
    fanout_items,
    fanout_settings,
    start_worker,
    stop_worker,
    undeploy,
    until,
)
from faults_pg import PrivateCluster, running_cluster
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from prefect.events.filters import EventFilter, EventNameFilter, EventRelatedFilter
from reconcile_env import FAST, TICK_S, one_message_per_step, reconciler_settings, start_workflow

from coder_chat.emulator import Emulator
from prefect_coder.blocks import ChatStateStore, StateStore
from prefect_coder.blocks.state.workflows import RESUMABLE_PREFIX
from prefect_coder.flows.common.params import step_marker
from prefect_coder.flows.deployments.reconcile_workflows import ReconcileRow, reconcile_workflows
from prefect_coder.flows.liveness.track import RESUMABLE_EVENT, workflow_record_key

STEPS = ("one", "two", "three")


@pytest.fixture
def private_pg() -> Iterator[PrivateCluster]:
    with running_cluster() as cluster:
        yield cluster


async def test_a_run_failed_by_a_store_outage_is_rerun_on_its_event_when_the_mark_is_lost(
    prefect_harness: Any, emu: Emulator, private_pg: PrivateCluster, tmp_path: Path
) -> None:
    pool = f"reconcile-ev-{uuid.uuid4().hex[:6]}"
    env = child_env(prefect_harness.api_url, prefect_harness.results_dir, query_s=WORKER_QUERY_S)
    tenant = f"ev-{uuid.uuid4().hex[:6]}"
    settings = await fanout_settings(emu, private_pg.url, None, tenant=tenant)
    assert settings.store_block is not None
    # The store rides out a short blip only: the outage (it lasts until the failure
    # handler is done) fails the step within seconds.
    await ChatStateStore(
        url=private_pg.url, tenant=tenant, connect_timeout=5.0, transient_retry_s=2.0
    ).save(settings.store_block, overwrite=True)
    # No task retries (the outage outlasts them anyway); a lease no renewal miss loses.
    settings = settings.model_copy(update={"retries": 0, "lease_ttl_s": 30})
    [item] = fanout_items(uuid.uuid4().hex[:6], 1, STEPS, 0.2)
    held = item.steps[1]
    item.steps[1] = held.model_copy(
        update={"prompt": held.prompt.replace('"sleep": 0.2', '"sleep": 900')}
    )
    key = workflow_record_key(item.workflow_id)
    deployed = await deploy(pool, untriggered=("agent-fanout",))
    worker = await start_worker(pool, f"{pool}-w", env, tmp_path / "w.log", limit=2)
    seen: list[ReconcileRow] = []
    try:
        async with get_client() as client:
            run = await start_workflow(
                client, deployment_id(deployed, "agent-workflow"), item, settings
            )
            two = step_marker(item.workflow_id, "two")

            async def two_sleeping() -> bool:
                current = await client.read_flow_run(run.id)
                assert current.state is not None and not current.state.is_final(), (
                    current.state,
                    worker.log.read_text(errors="replace")[-3000:],
                )
                return any(
                    c["sleeping"]
                    for c in emu.chats()
                    if any(
                        two in json.dumps(m["content"])
                        for m in emu.messages(c["id"], include_system=False)
                        if m["role"] == "user"
                    )
                )

            await until("step two's turn sleeping", 240, two_sleeping, every_s=0.2)
            private_pg.stop()
            assert emu.end_sleeps() == 1

            async def failed() -> bool:
                current = await client.read_flow_run(run.id)
                return current.state_type in (StateType.FAILED, StateType.COMPLETED)

            await until("the run to fail on the outage", 120, failed, every_s=0.2)
            failed_run = await client.read_flow_run(run.id)

            # The handler runs after the Failed state is set; it emits the event after
            # its attempt to mark the record: only then may the store come back.
            async def handler_done() -> bool:
                page = await client.read_events(
                    EventFilter(
                        event=EventNameFilter(name=[RESUMABLE_EVENT]),
                        related=EventRelatedFilter(id=[f"prefect.flow-run.{run.id}"]),
                    ),
                    limit=5,
                )
                return bool(page.events)

            await until("the failure handler's event", 120, handler_done, every_s=0.2)
            private_pg.start()

            store = StateStore(private_pg.url, tenant=tenant)
            try:
                record = await store.workflows.get(key)
                before = record
                deadline = time.monotonic() + 240
                while time.monotonic() < deadline:
                    rows = await reconcile_workflows(reconciler_settings(settings), FAST)
                    seen.extend(r for r in rows if r.action != "leave")
                    record = await store.workflows.get(key)
                    if record is not None and record.state == "done":
                        break
                    await asyncio.sleep(TICK_S)
            finally:
                await store.aclose()
            last = None
            if record is not None and record.state == "done":
                # The run records its end before Prefect has its final state.
                rerun_id = uuid.UUID(str(record.flow_run_id))

                async def rerun_ended() -> bool:
                    current = await client.read_flow_run(rerun_id)
                    return current.state is not None and current.state.is_final()

                await until("the rerun's final state", 120, rerun_ended, every_s=0.2)
                last = await client.read_flow_run(rerun_id)
    finally:
        await stop_worker(worker)
        await undeploy(deployed)
    logs = worker.log.read_text(errors="replace")[-3000:]
    actions = [(r.action, r.why) for r in seen]
    assert failed_run.state_type == StateType.FAILED, (failed_run.state, logs)
    # The handler could not mark it (the store was down): the event alone made it rerun.
    assert before is not None and before.flow_run_id == str(run.id), before
    assert not (before.reason or "").startswith(RESUMABLE_PREFIX), before
    assert actions and actions[0][0] == "recover", actions
    assert record is not None and record.state == "done", (record, actions, logs)
    assert last is not None and last.id != run.id
    assert last.state_type == StateType.COMPLETED, (last.state, logs)
    counts = one_message_per_step(emu, item, STEPS)
    assert counts == {step_marker(item.workflow_id, s): 1 for s in STEPS}, counts
    assert all(c["archived"] for c in emu.chats()), emu.chats()
