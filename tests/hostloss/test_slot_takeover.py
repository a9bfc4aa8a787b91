"""A worker killed mid-turn gives up each turn slot when that slot's turn has ended
server-side: not before (the cap counts turns running on the server), and not only
after the slot's ttl (the fleet would stall).

Real parts: a child process runs two workflows (``agent_fanout``, cap 2, slot ttl 60 s)
and holds both slots; it is SIGKILLed while both turns still run on the emulator, and its
flow run is marked Crashed through the API (the zombie automation's action). Two
workflows in this process then wait: Prefect says the holder is over, but the emulator
says both chats still run, so both slots are kept. When one dead turn ends server-side
(interrupted here, as a sweep or the turn's own end would), its slot is taken over at
once and both waiting workflows run through it, one after the other, while the other
dead turn keeps its slot. Order facts from the emulator's event log and the slot rows
(database clock), not wall-clock bounds.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import uuid
from typing import Any

import pytest
from prefect.client.orchestration import get_client
from prefect.states import Crashed
from slot_env import slot_rows, start_fanout_child, until
from support.prefect_blocks import save_settings
from warm_python import WarmPython

from coder_chat.emulator import Emulator
from prefect_coder.blocks import CoderCredentials, StateStore
from prefect_coder.flows.common.holders import holder_run_id, holder_workflow_id
from prefect_coder.flows.common.labels import LABEL_WORKFLOW
from prefect_coder.flows.common.params import Step, WorkflowSettings
from prefect_coder.flows.deployments.agent_fanout import FanoutItem, agent_fanout
from prefect_coder.flows.fleet.slots import SLOT_PREFIX

CAP = 2
TTL = 60.0  # the dead slots' ttl: the test is over long before it could lapse


async def _settings(creds: CoderCredentials, store_url: str, tenant: str) -> WorkflowSettings:
    capped = creds.model_copy(
        update={"max_concurrent_turns": CAP, "turn_slot_wait": 120.0, "turn_slot_ttl": TTL}
    )
    return await save_settings("hl", capped, store_url, tenant=tenant)


async def test_dead_workers_slots_are_taken_over_as_their_turns_end_server_side(
    warm_python: WarmPython,
    postgres_url: str,
    emu: Emulator,
    creds: CoderCredentials,
    caplog: pytest.LogCaptureFixture,
) -> None:
    tenant = f"hostloss-{uuid.uuid4().hex[:8]}"
    settings = await _settings(creds, postgres_url, tenant)
    run = uuid.uuid4().hex[:6]
    # The dead worker's turns would run for 10 minutes server-side.
    long_turn = Step(name="s", prompt='work #emu {"sleep": 600, "text": "late"}')
    dead_items = [FanoutItem(workflow_id=f"dead-{run}-{i}", steps=[long_turn]) for i in range(2)]
    # The worker: a separate process forked from the session's warm process (its
    # environment: the session's Prefect server and result storage), so it does not
    # import Prefect again; it runs its flows in-process, so one SIGKILL kills it all.
    worker = await asyncio.to_thread(start_fanout_child, warm_python, dead_items, settings)
    store = StateStore(postgres_url, tenant=tenant)
    waiter: asyncio.Task[Any] | None = None
    quick = Step(name="s", prompt='work #emu {"text": "next"}')
    try:
        started = await until(
            "both of the worker's turns to run server-side",
            180,
            lambda: len(emu.event_log(["turn_start"])) == CAP,
        )
        assert started
        worker.kill()  # SIGKILL, a real crash: no release, no renewals
        assert (await worker.communicate(30)).returncode == -signal.SIGKILL
        workflow_of = {c["id"]: c["labels"][LABEL_WORKFLOW] for c in emu.chats()}
        chat_of = {wf: chat for chat, wf in workflow_of.items()}
        dead = {str(k): r for k, r in (await slot_rows(store, CAP)).items()}
        assert len(dead) == CAP
        slot_of = {holder_workflow_id(r.holder): key for key, r in dead.items()}
        assert set(slot_of) == {i.workflow_id for i in dead_items}
        run_ids = {holder_run_id(r.holder) for r in dead.values()}
        assert len(run_ids) == 1  # both slots: the dead worker's one flow run
        run_id = run_ids.pop()
        assert run_id is not None
        # The process is gone; its turns are not: chatd runs the agent loop.
        assert {emu.chat(c)["status"] for c in workflow_of} == {"running"}
        async with get_client() as client:  # what the zombie automation does
            await client.set_flow_run_state(run_id, Crashed(), force=True)

        with caplog.at_level(logging.INFO, logger="prefect.task_runs"):
            waiter = asyncio.create_task(
                agent_fanout(
                    [FanoutItem(workflow_id=f"next-{run}-{i}", steps=[quick]) for i in range(2)],
                    settings,
                )
            )

            def kept_for_running_chats() -> bool:
                said = " ".join(r.getMessage() for r in caplog.records)
                return waiter.done() or all(
                    f"chat {chat} is still running" in said for chat in workflow_of
                )

            # The waiters know the holder's run is over, and still keep off both slots:
            # the dead worker's turns run server-side.
            await until("the waiters to judge the dead slots", 180, kept_for_running_chats)
            assert not waiter.done()
            assert len(emu.event_log(["turn_start"])) == CAP
            assert {r.holder for r in (await slot_rows(store, CAP)).values()} == {
                r.holder for r in dead.values()
            }

            # One dead turn ends server-side: its slot is taken over, and both waiting
            # workflows run through it while the other dead turn keeps its slot.
            ended, running = dead_items[0].workflow_id, dead_items[1].workflow_id
            async with creds.get_client() as coder:
                await coder.interrupt_chat(chat_of[ended])
            outcomes = await asyncio.wait_for(waiter, 120)
            assert [o.ok for o in outcomes] == [True, True]
            assert emu.chat(chat_of[running])["status"] == "running"
        index = slot_of[ended].removeprefix(SLOT_PREFIX)
        said = f"turn slot {index} taken over from {dead[slot_of[ended]].holder}"
        assert any(said in r.getMessage() for r in caplog.records)
        rows = await slot_rows(store, CAP)
    finally:
        if waiter is not None and not waiter.done():
            waiter.cancel()
        if worker.returncode is None:
            worker.kill()
            await worker.communicate(30)
        await store.aclose()

    # (1) The cap on running turns held server-side: the waiting workflows' turns
    # started only after the dead turn had ended, and never more than CAP ran at once.
    log = emu.event_log(["turn_start", "turn_end"])
    end = next(e for e in log if e["kind"] == "turn_end" and e["chat_id"] == chat_of[ended])
    starts = [e for e in log if e["kind"] == "turn_start" and e["chat_id"] not in workflow_of]
    assert len(starts) == 2
    assert all(e["mono"] > end["mono"] for e in starts)
    assert emu.max_concurrent_turns() == CAP
    # (2) The ended turn's slot went to the waiting workflows before the dead row's
    # expiry (database clock): only a takeover moves a live row, the ttl was not waited
    # out. The still-running turn's slot stayed with its dead holder.
    taken, kept = rows[slot_of[ended]], rows[slot_of[running]]
    assert (holder_workflow_id(taken.holder) or "").startswith(f"next-{run}-")
    assert taken.fence > dead[slot_of[ended]].fence
    assert taken.acquired_at < dead[slot_of[ended]].expires_at
    assert kept.holder == dead[slot_of[running]].holder
