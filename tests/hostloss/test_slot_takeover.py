"""A worker killed mid-turn gives up its turn slot when its turn has ended server-side,
not before and not only after the slot's ttl.

Real parts: a child process runs a workflow (``agent_fanout``, cap 1, slot ttl 60 s)
whose turn is still running on the emulator when the child is SIGKILLed; its flow run
is marked Crashed through the API (the zombie automation's action). A workflow in this
process then waits: Prefect says the holder is over, but the emulator says its chat still
runs, so the slot is kept (cap 1 holds). When that turn ends server-side (interrupted
here, as a sweep or the turn's own end would), the waiter takes the slot over at once,
well before its ttl. Order facts from the emulator's event log and the slot row (database
clock), not wall-clock bounds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from prefect.client.orchestration import get_client
from prefect.states import Crashed

from coder_chat.emulator import Emulator
from prefect_coder.blocks import ChatStateStore, CoderCredentials, StateStore
from prefect_coder.blocks.state.schema import leases as lease_table
from prefect_coder.flows.deployments.agent_fanout import FanoutItem, agent_fanout
from prefect_coder.flows.parts.holders import holder_run_id, holder_workflow_id
from prefect_coder.flows.parts.params import Step, WorkflowSettings
from prefect_coder.flows.parts.turn_slot import slot_key

ROOT = Path(__file__).resolve().parents[2]
TTL = 60.0  # the dead slot's ttl: the test is over long before it could lapse

_WORKER = """
import asyncio, json, sys
from prefect_coder.flows.deployments.agent_fanout import FanoutItem, agent_fanout
from prefect_coder.flows.parts.params import WorkflowSettings

args = json.loads(sys.argv[1])
items = [FanoutItem.model_validate(i) for i in args["items"]]
asyncio.run(agent_fanout(items, WorkflowSettings.model_validate(args["settings"])))
"""


async def _settings(creds: CoderCredentials, store_url: str, tenant: str) -> WorkflowSettings:
    name = uuid.uuid4().hex[:10]
    await creds.model_copy(
        update={"max_concurrent_turns": 1, "turn_slot_wait": 120.0, "turn_slot_ttl": TTL}
    ).save(f"hl-coder-{name}", overwrite=True)
    await ChatStateStore(url=store_url, tenant=tenant).save(f"hl-store-{name}", overwrite=True)
    return WorkflowSettings(
        credentials_block=f"hl-coder-{name}",
        store_block=f"hl-store-{name}",
        retries=0,
        retry_delay_s=0,
        lease_ttl_s=5,
        settle_wait_s=2,
        redial_backoff_ms=20,
        artifacts=False,
    )


async def _until(what: str, limit_s: float, check: Any) -> Any:
    for _ in range(int(limit_s / 0.05)):
        value = check()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def test_dead_workers_slot_is_taken_over_once_its_turn_ended_server_side(
    prefect_harness: Any,
    postgres_url: str,
    emu: Emulator,
    creds: CoderCredentials,
    caplog: pytest.LogCaptureFixture,
) -> None:
    tenant = f"hostloss-{uuid.uuid4().hex[:8]}"
    settings = await _settings(creds, postgres_url, tenant)
    run = uuid.uuid4().hex[:6]
    dead_wf, next_wf = f"dead-{run}", f"next-{run}"
    # The dead worker's turn would run for 10 minutes server-side.
    long_turn = Step(name="s", prompt='work #emu {"sleep": 600, "text": "late"}')
    payload = json.dumps(
        {
            "items": [FanoutItem(workflow_id=dead_wf, steps=[long_turn]).model_dump(mode="json")],
            "settings": settings.model_dump(mode="json"),
        }
    )
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        PREFECT_API_URL=str(prefect_harness.api_url),
        PREFECT_RESULTS_LOCAL_STORAGE_PATH=str(prefect_harness.results_dir),
        PREFECT_LOGGING_LEVEL="WARNING",
    )
    worker = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _WORKER, payload, cwd=ROOT, env=env, start_new_session=True,
    )  # fmt: skip
    store = StateStore(postgres_url, tenant=tenant)
    waiter: asyncio.Task[Any] | None = None
    try:
        started = await _until(
            "the worker's turn to start server-side", 180, lambda: emu.event_log(["turn_start"])
        )
        dead_chat = started[0]["chat_id"]
        os.killpg(worker.pid, signal.SIGKILL)  # a real crash: no release, no renewals
        await worker.wait()
        slot = await store.leases.get(slot_key(0))
        assert slot is not None
        dead = slot[0]
        assert holder_workflow_id(dead.holder) == dead_wf
        run_id = holder_run_id(dead.holder)
        assert run_id is not None
        # The process is gone; its turn is not: chatd runs the agent loop.
        assert emu.chat(dead_chat)["status"] == "running"
        async with get_client() as client:  # what the zombie automation does
            await client.set_flow_run_state(run_id, Crashed(), force=True)

        with caplog.at_level(logging.INFO, logger="prefect.task_runs"):
            waiter = asyncio.create_task(
                agent_fanout(
                    [
                        FanoutItem(
                            workflow_id=next_wf,
                            steps=[Step(name="s", prompt='work #emu {"text": "next"}')],
                        )
                    ],
                    settings,
                )
            )

            def kept_for_running_chat() -> bool:
                return waiter.done() or any(
                    f"chat {dead_chat} is still running" in r.getMessage() for r in caplog.records
                )

            # The waiter knows the holder's run is over, and still keeps off its slot:
            # the dead worker's turn runs server-side.
            await _until("the waiter to judge the dead slot", 180, kept_for_running_chat)
            assert not waiter.done()
            assert [e["chat_id"] for e in emu.event_log(["turn_start"])] == [dead_chat]
            held = await store.leases.get(slot_key(0))
            assert held is not None and held[0].holder == dead.holder

            # The dead worker's turn ends server-side; the waiter takes the slot then.
            async with creds.get_client() as coder:
                await coder.interrupt_chat(dead_chat)
            outcomes = await asyncio.wait_for(waiter, 120)
        assert [o.ok for o in outcomes] == [True]
        assert any("taken over from" in r.getMessage() for r in caplog.records)
    finally:
        if waiter is not None and not waiter.done():
            waiter.cancel()
        if worker.returncode is None:
            os.killpg(worker.pid, signal.SIGKILL)
            await worker.wait()
        async with store.read() as conn:
            row = (
                await conn.execute(
                    sa.select(lease_table).where(
                        lease_table.c.tenant == tenant, lease_table.c.key == slot_key(0)
                    )
                )
            ).one()
        await store.aclose()

    # (1) The cap on running turns held server-side: the next turn started only after
    # the dead worker's turn had ended, and never more than one ran at once.
    ends = [e for e in emu.event_log(["turn_end"]) if e["chat_id"] == dead_chat]
    starts = [e for e in emu.event_log(["turn_start"]) if e["chat_id"] != dead_chat]
    assert len(ends) == 1 and len(starts) == 1
    assert starts[0]["mono"] > ends[0]["mono"]
    assert emu.max_concurrent_turns() == 1
    # (2) It got the slot by taking it over from the dead holder (fence + 1), before the
    # dead row's expiry (database clock), not by waiting out the ttl.
    assert holder_workflow_id(row.holder) == next_wf
    assert row.fence == dead.fence + 1
    assert row.acquired_at < dead.expires_at.timestamp()
