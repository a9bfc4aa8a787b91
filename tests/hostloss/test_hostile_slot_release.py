"""A turn that fails after its send landed keeps its slot's place while that turn
still runs server-side: the next waiter does not start a turn next to it.

``CoderAgent(leave_landed_runs=True)`` — what every durable turn uses — does not
interrupt a run whose submission landed when only the answer was lost (a transport
error, a 5xx): the run is left live for the retry's recovery to follow. The turn then
fails. ``turn_slot``'s exit used to *release* the slot, and the next waiter took it at
once, next to the run going on in chatd (2 running turns at cap 1). Now a failed
turn *abandons* its slot (it lapses at once, unreleased), and a lapsed slot is taken
only once its workflow's chats are at rest (``slot_takeover``).

Real parts: the emulator's fault API loses the response of the step's
``POST …/messages`` (the message lands, the connection closes with no answer); two
in-process fan-outs on one store (SQLite) and the session's Prefect test server; the
count of running turns is the emulator's event log.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

from support.prefect_blocks import save_settings

from coder_chat.emulator import Emulator
from prefect_coder.blocks import CoderCredentials, StateStore
from prefect_coder.flows.deployments.agent_fanout import FanoutItem, agent_fanout
from prefect_coder.flows.parts.labels import LABEL_WORKFLOW
from prefect_coder.flows.parts.params import Step
from prefect_coder.flows.parts.turn_slot import slot_key

TEST_HOLDER = "test-holds-the-only-slot"


async def _until(what: str, limit_s: float, check: Any) -> Any:
    for _ in range(int(limit_s / 0.05)):
        value = await check() if asyncio.iscoroutinefunction(check) else check()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def test_a_turn_left_running_after_a_lost_response_keeps_its_slot(
    prefect_server: Path,
    emu: Emulator,
    creds: CoderCredentials,
    tmp_path: Path,
) -> None:
    store_url = f"sqlite+aiosqlite:///{tmp_path / 'state.db'}"
    tenant = f"release-{uuid.uuid4().hex[:8]}"
    capped = creds.model_copy(
        update={"max_concurrent_turns": 1, "turn_slot_wait": 60.0, "turn_slot_ttl": 2.0}
    )
    # keep_chat: the second run of `left` sends its step on the first run's chat
    # (POST …/messages, the request whose response the emulator loses).
    settings = await save_settings("release", capped, store_url, tenant=tenant, keep_chat=True)
    run = uuid.uuid4().hex[:6]
    left, other = f"left-{run}", f"other-{run}"
    first = Step(name="a", prompt='first #emu {"text": "one"}')
    # The step whose answer is lost: it runs server-side for 6 s.
    long = Step(name="b", prompt='second #emu {"sleep": 6, "text": "two"}')
    quick = Step(name="v", prompt='other #emu {"text": "three"}')

    # `left`'s first step, finished and stored: its chat is checkpointed and kept.
    done = await agent_fanout([FanoutItem(workflow_id=left, steps=[first])], settings)
    assert [o.ok for o in done] == [True]
    chat = next(c["id"] for c in emu.chats() if c["labels"].get(LABEL_WORKFLOW) == left)

    store = StateStore(store_url, tenant=tenant)
    held = await store.leases.acquire(slot_key(0), TEST_HOLDER, ttl=120)
    assert held is not None
    runs: list[asyncio.Task[Any]] = []
    try:
        # `left`'s step b and then `other` queue for the one slot (this process's claim
        # queue is FIFO): b gets it first, `other` waits on the cap behind it.
        runs.append(
            asyncio.create_task(
                agent_fanout(
                    [FanoutItem(workflow_id=left, steps=[first, long])],
                    settings,
                    fail_on_error=False,
                )
            )
        )
        await asyncio.sleep(1.0)  # b's claim is queued first
        runs.append(
            asyncio.create_task(
                agent_fanout([FanoutItem(workflow_id=other, steps=[quick])], settings)
            )
        )
        await asyncio.sleep(1.0)
        # b's message lands; its response is lost.
        emu.faults.drop_response(1, method="POST", path="/messages")
        assert await store.leases.release(slot_key(0), TEST_HOLDER)

        await _until(
            "b's message to land",
            60,
            lambda: any(e["chat_id"] == chat for e in emu.event_log(["turn_start"])[1:]),
        )
        left_out, other_out = await asyncio.wait_for(asyncio.gather(*runs), 120)
    finally:
        for task in runs:
            if not task.done():
                task.cancel()
        await store.aclose()

    # The case under test happened: b's answer was lost and its turn failed
    # transiently (retries 0), leaving its run live for recovery to follow.
    assert [o.ok for o in left_out] == [False], left_out
    assert [o.ok for o in other_out] == [True], other_out
    # The cap counts turns running on the server: `other`'s turn must not start while
    # b's run goes on there.
    log = emu.event_log(["turn_start", "turn_end"])
    assert emu.max_concurrent_turns() == 1, [
        (e["kind"], e["chat_id"], round(e["mono"], 2)) for e in log
    ]
