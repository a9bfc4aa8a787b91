"""The reconciler gives up loudly, once: a workflow whose run was SIGKILLed mid-turn
(no Crashed trigger deployed, recoveries exhausted — ``max_attempts`` 0 here) is
marked ``gave-up`` in the store, a ``coder.workflow.gave-up`` event names it and its
chat, a markdown artifact says why, and the chat is left live (not archived) for a
person. A second tick reports nothing again."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from fanout_env import (
    TOKEN,
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
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
from prefect.client.schemas.objects import StateType
from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter
from reconcile_env import FAST, kill_run_process, start_workflow, tick_until
from warm_python import WarmPython

from coder_chat.emulator import Emulator
from prefect_coder.blocks import StateStore
from prefect_coder.flows.deployments.reconcile_workflows import GAVE_UP_EVENT, ReconcileRow
from prefect_coder.flows.liveness.track import workflow_record_key

NO_RETRIES = FAST.model_copy(update={"max_attempts": 0})


async def test_exhausted_recoveries_give_up_with_an_event_and_an_artifact_and_a_live_chat(
    prefect_harness: Any, warm_python: WarmPython, emu: Emulator, tmp_path: Path
) -> None:
    store_url = f"sqlite+aiosqlite:///{tmp_path / 'state.db'}"
    pool = f"reconcile-gaveup-{uuid.uuid4().hex[:6]}"
    env = child_env(prefect_harness.api_url, prefect_harness.results_dir, query_s=WORKER_QUERY_S)
    settings = await fanout_settings(emu, store_url, None)
    deployed = await deploy(pool, untriggered=("recover-turn", "agent-fanout"))
    [item] = fanout_items(uuid.uuid4().hex[:6], 1, ("plan",), 30.0)
    key = workflow_record_key(item.workflow_id)
    worker = await start_worker(pool, f"{pool}-w", env, tmp_path / "w.log", limit=1)
    store = StateStore(store_url)
    seen: list[ReconcileRow] = []
    try:
        async with get_client() as client:
            run = await start_workflow(
                client, deployment_id(deployed, "agent-workflow"), item, settings
            )

            async def turn_running_and_killed() -> bool:
                if (
                    not emu.event_log(["turn_start"])
                    or await store.checkpoints.get(item.workflow_id) is None
                ):
                    return False
                return kill_run_process(await client.read_flow_run(run.id), worker.pid)

            await until("the turn", 240, turn_running_and_killed, every_s=0.2)

            async def gave_up() -> Any:
                record = await store.workflows.get(key)
                return record if record is not None and record.state == "gave-up" else None

            record = await tick_until("the give-up", 120, settings, gave_up, NO_RETRIES, seen)
            again = await tick_until("one more tick", 5, settings, _true, NO_RETRIES, seen)

            async def events() -> list[Any]:
                page = await client.read_events(
                    EventFilter(
                        event=EventNameFilter(name=[GAVE_UP_EVENT]),
                        resource=EventResourceFilter(id=[f"coder.workflow.{item.workflow_id}"]),
                    ),
                    limit=50,
                )
                return list(page.events)

            [event] = await until("the gave-up event", 60, events)
            artifacts = await client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(like_="coder-gave-up-"))
            )
            crashed = await client.read_flow_run(run.id)
    finally:
        await store.aclose()
        await stop_worker(worker)
        await undeploy(deployed)
    assert again is True
    assert crashed.state is not None and crashed.state.type == StateType.CRASHED
    assert [r.action for r in seen] == ["give-up"], seen  # once, not on the next tick
    [chat] = emu.chats()
    assert record.chat_id == chat["id"] and not chat["archived"]  # left live for a person
    assert event.payload["chat_id"] == chat["id"] and event.payload["key"] == key
    assert "recoveries already started" in event.payload["why"]
    mine = [a for a in artifacts if chat["id"] in str(a.data)]
    assert len(mine) == 1 and "left live, not archived" in str(mine[0].data)
    assert TOKEN not in str(mine[0].data) + str(event.payload) + record.model_dump_json()


async def _true() -> bool:
    return True
