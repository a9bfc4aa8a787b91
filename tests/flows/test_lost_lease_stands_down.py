"""The turn's lost-lease rule end to end (flows/turn/decide.py, "The workflow's lease is
lost ⇒ stand down"): a run whose workflow lease is known lost before it sends fails with
``LeaseLostError`` — it neither recovers, follows, returns nor sends.

Two runs of one workflow, each holding the workflow's lease as ``agent_workflow`` holds
it for its turns (``TurnResources.lease``), on the real emulator and a real SQLite store.
An earlier run finished the step and its result was lost (the turn ran outside Prefect:
nothing persisted), then the chat was archived (an operator's archive): the first run's
recovery reads the finished attempt back from the archived chat's history. That is the
one path no other guard covers — it writes nothing to the store (no write fence: a
recovery that settles a live chat journals, and is refused there) and sends nothing (no
``still_ours``). While that recovery reads the history (the emulator holds the read), a
second run takes the workflow over at once (``take_over``: the first run judged gone,
as when its Prefect run was marked Crashed while its process was merely cut off). The
first run's renewal finds the lease lost; then the read is let go. Without the rule the
first run returns the step's result as if it still held the workflow (checked by
removing the rule); with it the run fails. The emulator's event log shows the first run
sent nothing after the takeover, and the second run recovers the result, sending nothing.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from flow_helpers import TOKEN, say, user_messages

from coder_chat.emulator import Emulator
from coder_chat.models import UpdateChatRequest
from coder_chat.rest import ChatClient
from prefect_coder.blocks import CoderCredentials, StateStore
from prefect_coder.blocks.state import HeldLease, Lease, LeaseLostError, workflow_key
from prefect_coder.flows.common.params import Step, WorkflowSettings, step_marker
from prefect_coder.flows.common.resources import TurnResources
from prefect_coder.flows.turn.durable_turn import execute_turn

#: The first run's lease ttl: renewed every third of it, so its loss is found quickly.
TTL = 2.0


async def _until(check: Any, what: str, bound_s: float = 20.0) -> None:
    deadline = time.monotonic() + bound_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def _events(emu: Emulator, chat_id: str, kind: str, after: float, before: float) -> list[Any]:
    return [
        e for e in emu.event_log([kind]) if e["chat_id"] == chat_id and after <= e["mono"] <= before
    ]


async def test_a_run_whose_lease_was_taken_over_during_recovery_stands_down(
    emu: Emulator,
    coder_block: str,
    settings: WorkflowSettings,
    store: StateStore,
    workflow_id: str,
) -> None:
    creds = await CoderCredentials.aload(coder_block)
    step = Step(name="s", prompt="go" + say("done"))
    key = workflow_key(workflow_id)

    # An earlier run: the step's turn finished, its result never reached Prefect.
    earlier = await execute_turn(workflow_id, step, settings, TurnResources(creds, store))
    chat_id = earlier.chat_id
    entry = await store.journal.get(chat_id)
    assert entry is not None and entry.marker == step_marker(workflow_id, step.name)
    # The entry's times are read back on this process's clock: compared without them.
    times = {"at", "deadline"}
    before = (await store.checkpoints.get(workflow_id), entry.model_dump(exclude=times))
    async with ChatClient(emu.base_url, TOKEN, organization_id=emu.organization_id) as c:
        await c.update_chat(chat_id, UpdateChatRequest(archived=True))

    # The first run's recovery reads the chat's history: held until the test lets go.
    emu.faults.hold_commit(
        method="GET",
        path=f"/chats/{chat_id}/messages",
        until_method="GET",
        until_path=f"/chats/{chat_id}",
        max_seconds=30,
    )
    first: dict[str, HeldLease] = {}

    async def first_run() -> Any:
        async with store.lease(key, holder="run-a", ttl=TTL, wait=5) as held:
            first["lease"] = held
            return await execute_turn(
                workflow_id, step, settings, TurnResources(creds, store, lease=held)
            )

    async def judged_gone(lease: Lease) -> bool:
        # The second run's verdict on the holder in its way (Prefect's, in production).
        return lease.holder == "run-a"

    run_a = asyncio.create_task(first_run())
    try:
        await _until(
            lambda: any(
                e["details"].get("fault") == "hold_commit" and chat_id in e["details"]["path"]
                for e in emu.event_log(["fault"])
            ),
            "the first run's recovery read",
        )
        async with store.lease(
            key, holder="run-b", ttl=10, wait=5, holder_gone=judged_gone
        ) as second:
            took_over = time.monotonic()
            await _until(lambda: first["lease"].lost, "the first run's renewal to find it lost")
            async with ChatClient(emu.base_url, TOKEN, organization_id=emu.organization_id) as c:
                await c.get_chat(chat_id)  # lets the held read go
            with pytest.raises(LeaseLostError):
                await run_a
            first_ended = time.monotonic()

            # The event log: after the takeover the first run sent nothing — no message,
            # no interrupt, no tool result (only the reads of its recovery).
            requests = _events(emu, chat_id, "request", took_over, first_ended)
            assert requests, "the held read is logged when it completes"
            assert [r for r in requests if r["details"]["method"] != "GET"] == [], requests
            assert _events(emu, chat_id, "message", took_over, first_ended) == []
            # ...and wrote nothing: the checkpoint and the journal are the earlier run's.
            after = await store.journal.get(chat_id)
            assert after is not None
            assert (await store.checkpoints.get(workflow_id), after.model_dump(exclude=times)) == (
                before
            )

            # The second run, holding the workflow now, recovers the step's result.
            result = await execute_turn(
                workflow_id, step, settings, TurnResources(creds, store, lease=second)
            )
    finally:
        emu.faults.clear()
        if not run_a.done():
            run_a.cancel()
    assert (result.text, result.chat_id, result.user_message_id) == (
        earlier.text,
        chat_id,
        earlier.user_message_id,
    )
    # One send of the step in all: the earlier run's. Neither run sent it again.
    assert len(user_messages(emu, chat_id)) == 1
    assert len([e for e in emu.event_log(["turn_start"]) if e["chat_id"] == chat_id]) == 1
