"""The dead holder's own workflow takes its slot at once — even when another
workflow's waiter of the same process is at the head of the claim queue.

A turn paused on a client tool (``requires_action``) is not at rest until someone
answers it, and only its workflow's recovery answers it (from the tool ledger, or by
running a pure tool again). ``slot_takeover`` lets that recovery take the dead
holder's slot at once for this reason. But every claim of a process goes through one
FIFO queue (``turn_slot._Gate``), and its head keeps the queue for its whole wait: a
waiter of *another* workflow at the head waited for the paused chat to come to rest
while the recovery that would bring it to rest was queued behind it, until chatd
ended the pause itself (5 minutes: the tool's answer then lost to a synthetic
timeout) or the head's ``turn_slot_wait`` ran out. Now the head, keeping a gone
holder's slot, calls a queued claim of that holder's workflow out of the queue.

Real parts: the holder is a separate process forked from the warm process; the
emulator holds its tool-results ``POST`` (fault API), the process is SIGKILLed while
the chat waits in ``requires_action``, and its flow run is marked Crashed through the
API (the zombie automation's action); the store is the session's PostgreSQL.
"""

from __future__ import annotations

import asyncio
import json
import logging
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
from prefect_coder.flows.common.params import Step
from prefect_coder.flows.deployments.agent_fanout import FanoutItem, agent_fanout

# The model calls the (pure) demo tool, then answers.
_PAUSING = json.dumps(
    {
        "steps": [
            {"tool_calls": [{"name": "lookup_build", "args": {"build_id": "nightly-7"}}]},
            {"text": "done"},
        ]
    }
)


async def test_the_recovery_of_a_paused_dead_turn_is_not_queued_behind_another_waiter(
    warm_python: WarmPython,
    postgres_url: str,
    emu: Emulator,
    creds: CoderCredentials,
    caplog: pytest.LogCaptureFixture,
) -> None:
    tenant = f"gate-{uuid.uuid4().hex[:8]}"
    capped = creds.model_copy(
        update={"max_concurrent_turns": 1, "turn_slot_wait": 120.0, "turn_slot_ttl": 60.0}
    )
    settings = await save_settings("gate", capped, postgres_url, tenant=tenant)
    run = uuid.uuid4().hex[:6]
    paused_wf, other_wf = f"paused-{run}", f"other-{run}"
    step = Step(name="s", prompt=f"look it up #emu {_PAUSING}", tools=["lookup_build"])
    # The holder's answer to the tool call never commits while the test runs: the chat
    # stays in requires_action after the holder dies.
    emu.faults.hold_commit(
        until_path="/never", method="POST", path="/tool-results", max_seconds=600
    )
    holder = await asyncio.to_thread(
        start_fanout_child, warm_python, [FanoutItem(workflow_id=paused_wf, steps=[step])], settings
    )
    store = StateStore(postgres_url, tenant=tenant)
    runs: list[asyncio.Task[Any]] = []
    try:

        def answer_sent() -> bool:
            return any(e["details"].get("fault") == "hold_commit" for e in emu.event_log(["fault"]))

        await until("the holder's tool answer to be held", 180, answer_sent)
        holder.kill()  # SIGKILL: no release, no renewals, no answer
        assert (await holder.communicate(30)).returncode == -signal.SIGKILL
        chat = chat_of(emu, paused_wf)
        assert emu.chat(chat)["status"] == "requires_action"
        dead_row = await slot_row(store)
        dead = None if dead_row is None else str(dead_row.holder)
        assert dead is not None and holder_workflow_id(dead) == paused_wf
        run_id = holder_run_id(dead)
        assert run_id is not None
        async with get_client() as client:  # what the zombie automation does
            await client.set_flow_run_state(run_id, Crashed(), force=True)

        with caplog.at_level(logging.INFO, logger="prefect.task_runs"):
            quick = Step(name="v", prompt='other #emu {"text": "next"}')
            runs.append(
                asyncio.create_task(
                    agent_fanout([FanoutItem(workflow_id=other_wf, steps=[quick])], settings)
                )
            )

            def judged() -> bool:
                said = " ".join(r.getMessage() for r in caplog.records)
                return runs[0].done() or f"chat {chat} is still requires_action" in said

            # The other workflow's turn heads this process's claim queue and keeps off
            # the dead slot: its chat is paused.
            await until("the other workflow to judge the dead slot", 120, judged)
            assert not runs[0].done()
            # The paused workflow's recovery, in the same process: it holds the workflow
            # lease (the dead run is Crashed) and should take its own slot at once.
            runs.append(
                asyncio.create_task(
                    agent_fanout([FanoutItem(workflow_id=paused_wf, steps=[step])], settings)
                )
            )

            other_out, paused_out = await asyncio.wait_for(asyncio.gather(*runs), 60)
            # Order facts from the log (one process, one loop), not a poll of the slot
            # row: the recovery may take the slot, finish and release it between two
            # polls (seen in CI: all of it within 50 ms).
            said = [f"{getattr(r, 'task_run_name', '')}: {r.getMessage()}" for r in caplog.records]
            took = next(
                (
                    i
                    for i, m in enumerate(said)
                    if m.startswith(f"{paused_wf}/s: turn slot 0 taken over from ")
                    and dead in m
                    and "which ran this workflow's turn" in m
                ),
                None,
            )
            other_got = next(
                (i for i, m in enumerate(said) if m.startswith(f"{other_wf}/v: got turn slot 0/1")),
                None,
            )
    finally:
        for task in runs:
            if not task.done():
                task.cancel()
        await asyncio.gather(*runs, return_exceptions=True)
        if holder.returncode is None:
            holder.kill()
            await holder.communicate(30)
        await store.aclose()

    # The recovery took its own workflow's slot from the dead holder, before the other
    # workflow's waiter (the head of the queue) got it: not queued behind it.
    assert took is not None, said
    assert other_got is not None and took < other_got, said
    assert [o.ok for o in other_out] == [True], other_out
    assert [(o.ok, [r.text for r in o.results]) for o in paused_out] == [(True, ["done"])]
    users = [
        e
        for e in emu.event_log(["message"])
        if e["chat_id"] == chat and e["details"]["role"] == "user"
    ]
    assert len(users) == 1, users
    assert emu.max_concurrent_turns() == 1
