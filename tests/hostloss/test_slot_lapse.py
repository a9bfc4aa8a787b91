"""A turn slot whose lease lapsed is not free while its holder's turn still runs
server-side; a slot a dead holder held for the waiter's own workflow is taken at once.

The cap counts turns running on the server. A holder stops renewing its slot when
its process stalls (a starved event loop on a loaded machine, SIGSTOP here) or dies,
and either way the turn it started goes on in chatd. Taking the lapsed slot on the
ttl alone let another workflow's turn start next to it: CI saw 3 running turns at
cap 2 with a 3 s test ttl. The second test is the other side of the rule: the
recovery of the dead holder's own workflow holds that workflow's lease, so the turn
still running is the very turn it follows — it takes the slot at once instead of
waiting for a turn only it can see through (a paused one would never end).

Real parts: the holder is a separate process forked from the warm process, stopped
with SIGSTOP or killed with SIGKILL; the emulator's event log gives the order facts;
the slot rows are read from the store (database clock).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import uuid
from typing import Any

import pytest
from prefect.client.orchestration import get_client
from prefect.states import Crashed
from slot_env import chat_of, slot_row, start_fanout_child, until
from support.prefect_blocks import save_settings
from warm_python import WarmPython

from coder_chat.emulator import Emulator
from prefect_coder.blocks import CoderCredentials, StateStore
from prefect_coder.flows.common.holders import holder_run_id, holder_workflow_id
from prefect_coder.flows.common.params import Step, WorkflowSettings
from prefect_coder.flows.deployments.agent_fanout import FanoutItem, agent_fanout


async def _settings(
    creds: CoderCredentials, store_url: str, tenant: str, ttl: float
) -> WorkflowSettings:
    capped = creds.model_copy(
        update={"max_concurrent_turns": 1, "turn_slot_wait": 120.0, "turn_slot_ttl": ttl}
    )
    # The workflow lease lapses as fast as the slot: the waiter of the second test
    # must not wait for it either (it is taken over once the run is Crashed anyway).
    return await save_settings("lapse", capped, store_url, tenant=tenant, lease_ttl_s=ttl)


async def test_a_stalled_holders_lapsed_slot_waits_for_its_turn_to_end_server_side(
    warm_python: WarmPython,
    postgres_url: str,
    emu: Emulator,
    creds: CoderCredentials,
    caplog: pytest.LogCaptureFixture,
) -> None:
    tenant = f"lapse-{uuid.uuid4().hex[:8]}"
    settings = await _settings(creds, postgres_url, tenant, ttl=1.0)
    run = uuid.uuid4().hex[:6]
    stalled_wf = f"stalled-{run}"
    long_turn = Step(name="s", prompt='work #emu {"sleep": 600, "text": "late"}')
    holder = await asyncio.to_thread(
        start_fanout_child,
        warm_python,
        [FanoutItem(workflow_id=stalled_wf, steps=[long_turn])],
        settings,
    )
    store = StateStore(postgres_url, tenant=tenant)
    waiter: asyncio.Task[Any] | None = None
    try:
        await until(
            "the holder's turn to run server-side",
            180,
            lambda: len(emu.event_log(["turn_start"])) == 1,
        )
        os.kill(holder.pid, signal.SIGSTOP)  # stalled: alive, but renews nothing
        stalled_chat = chat_of(emu, stalled_wf)
        held = await slot_row(store)
        assert held is not None and holder_workflow_id(held.holder) == stalled_wf

        async def lapsed() -> bool:
            row = await slot_row(store)
            return row is not None and row.left < 0 and row.holder == held.holder

        await until("the stalled holder's slot to lapse", 60, lapsed)
        assert emu.chat(stalled_chat)["status"] == "running"

        with caplog.at_level(logging.INFO, logger="prefect.task_runs"):
            quick = Step(name="s", prompt='work #emu {"text": "next"}')
            waiter = asyncio.create_task(
                agent_fanout([FanoutItem(workflow_id=f"next-{run}", steps=[quick])], settings)
            )

            def kept() -> bool:
                said = " ".join(r.getMessage() for r in caplog.records)
                return waiter.done() or f"chat {stalled_chat} is still running" in said

            await until("the waiter to judge the lapsed slot", 120, kept)
            # Lapsed, and still not taken: the stalled holder's turn runs.
            assert not waiter.done()
            assert len(emu.event_log(["turn_start"])) == 1
            row = await slot_row(store)
            assert row is not None and row.holder == held.holder

            # The stalled turn ends server-side (a sweep would interrupt it too): now
            # the waiter takes the slot and runs.
            async with creds.get_client() as coder:
                await coder.interrupt_chat(stalled_chat)
            outcomes = await asyncio.wait_for(waiter, 120)
        assert [o.ok for o in outcomes] == [True]
        said = f"turn slot 0 taken over from {held.holder}: its lease lapsed"
        assert any(said in r.getMessage() for r in caplog.records), [
            r.getMessage() for r in caplog.records if "turn slot" in r.getMessage()
        ]
        # The stalled holder wakes up: its renewal finds the slot taken (it does not
        # take it back), and it is stopped for good.
        os.kill(holder.pid, signal.SIGCONT)
        taken = await slot_row(store)
        assert taken is not None and taken.fence > held.fence
    finally:
        if waiter is not None and not waiter.done():
            waiter.cancel()
        if holder.returncode is None:
            holder.kill()  # SIGKILL ends a stopped process too
            await holder.communicate(30)
        await store.aclose()

    # Order facts from the emulator: the waiter's turn began after the stalled turn
    # ended, and one turn ran at a time.
    log = emu.event_log(["turn_start", "turn_end"])
    end = next(e for e in log if e["kind"] == "turn_end" and e["chat_id"] == stalled_chat)
    starts = [e for e in log if e["kind"] == "turn_start" and e["chat_id"] != stalled_chat]
    assert len(starts) == 1 and starts[0]["mono"] > end["mono"]
    assert emu.max_concurrent_turns() == 1


async def test_the_dead_holders_own_workflow_takes_its_slot_while_the_turn_runs(
    warm_python: WarmPython,
    postgres_url: str,
    emu: Emulator,
    creds: CoderCredentials,
    caplog: pytest.LogCaptureFixture,
) -> None:
    tenant = f"lapse-{uuid.uuid4().hex[:8]}"
    settings = await _settings(creds, postgres_url, tenant, ttl=60.0)
    workflow_id = f"own-{uuid.uuid4().hex[:6]}"
    # Long enough that the recovery below is holding the slot before it ends.
    step = Step(name="s", prompt='work #emu {"sleep": 15, "text": "late"}')
    holder = await asyncio.to_thread(
        start_fanout_child,
        warm_python,
        [FanoutItem(workflow_id=workflow_id, steps=[step])],
        settings,
    )
    store = StateStore(postgres_url, tenant=tenant)
    recovery: asyncio.Task[Any] | None = None
    try:

        async def running_and_checkpointed() -> bool:
            return len(emu.event_log(["turn_start"])) == 1 and (
                await store.checkpoints.get(workflow_id) is not None
            )

        await until("the holder's turn to run, checkpointed", 180, running_and_checkpointed)
        holder.kill()  # SIGKILL: no release, no renewals
        assert (await holder.communicate(30)).returncode == -signal.SIGKILL
        chat = chat_of(emu, workflow_id)
        dead = await slot_row(store)
        assert dead is not None and dead.left > 0  # live for up to a minute more
        run_id = holder_run_id(dead.holder)
        assert run_id is not None
        async with get_client() as client:  # what the zombie automation does
            await client.set_flow_run_state(run_id, Crashed(), force=True)

        with caplog.at_level(logging.INFO, logger="prefect.task_runs"):
            # The workflow run again (a recovery): it follows the turn still running.
            recovery = asyncio.create_task(
                agent_fanout([FanoutItem(workflow_id=workflow_id, steps=[step])], settings)
            )

            async def slot_taken_while_running() -> bool:
                row = await slot_row(store)
                return (
                    row is not None
                    and row.holder != dead.holder
                    and emu.chat(chat)["status"] == "running"
                )

            # Taken while the dead holder's turn still runs on the server: without the
            # same-workflow rule the recovery waited for that turn's end.
            await until("the recovery to take the slot", 60, slot_taken_while_running)
            assert len(emu.event_log(["turn_start"])) == 1
            outcomes = await asyncio.wait_for(recovery, 120)
        assert [(o.ok, [r.text for r in o.results]) for o in outcomes] == [(True, ["late"])]
        said = f"turn slot 0 taken over from {dead.holder}, which ran this workflow's turn"
        assert any(said in r.getMessage() for r in caplog.records)
    finally:
        if recovery is not None and not recovery.done():
            recovery.cancel()
        if holder.returncode is None:
            holder.kill()
            await holder.communicate(30)
        await store.aclose()
    # Followed, not sent again: one user message, one turn.
    users = [
        e
        for e in emu.event_log(["message"])
        if e["chat_id"] == chat and e["details"]["role"] == "user"
    ]
    assert len(users) == 1, users
    assert len(emu.event_log(["turn_start"])) == 1
