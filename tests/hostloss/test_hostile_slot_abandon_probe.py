"""An abandoned turn slot is not taken at once when the probe of its workflow's chats
fails: the "could not tell" rule passes a lapsed slot on only once it has lapsed a
whole ttl.

A turn that fails while its run may go on server-side (a lost response to a landed
send) abandons its slot: it lapses at once, unreleased, and a waiter judges it — taken
once the workflow's chats are at rest. When the waiter cannot tell (its ``GET /chats``
probe fails or times out), ``slot_takeover`` used to take a lapsed slot anyway,
reasoning that a whole ttl had gone by without a renewal. An abandoned slot had no ttl
go by, and the probe fails most likely for the same reason the turn did (the Coder
server slow or unreachable): the waiter's turn started next to the left run (2 at cap
1). Now such a slot passes on a ttl after it lapsed.

Real parts: the emulator's fault API loses the response of the step's
``POST …/messages`` and holds every ``GET`` under ``/api/v2/chats`` longer than the
probe's bound (``PROBE_TIMEOUT_S``; the turns' own requests have 15 s); two in-process
fan-outs on one store (SQLite) and the session's Prefect test server; the count of
running turns is the emulator's event log.
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
from prefect_coder.flows.parts.slot_takeover import PROBE_TIMEOUT_S
from prefect_coder.flows.parts.turn_slot import slot_key

TEST_HOLDER = "test-holds-the-only-slot"
#: The slot ttl: a slot nobody can judge passes on once it has lapsed this long.
TTL = 20.0
#: How long the left run goes on server-side: past the probe's bound, within the ttl.
B_RUNS_S = PROBE_TIMEOUT_S + 10.0


async def _until(what: str, limit_s: float, check: Any) -> Any:
    for _ in range(int(limit_s / 0.05)):
        value = await check() if asyncio.iscoroutinefunction(check) else check()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def test_an_abandoned_slot_is_not_taken_when_its_chats_cannot_be_probed(
    prefect_server: Path,
    emu: Emulator,
    creds: CoderCredentials,
    tmp_path: Path,
) -> None:
    store_url = f"sqlite+aiosqlite:///{tmp_path / 'state.db'}"
    tenant = f"abandon-{uuid.uuid4().hex[:8]}"
    capped = creds.model_copy(
        update={"max_concurrent_turns": 1, "turn_slot_wait": 60.0, "turn_slot_ttl": TTL}
    )
    # keep_chat: the second run of `left` sends its step on the first run's chat
    # (POST …/messages, the request whose response the emulator loses).
    settings = await save_settings("abandon", capped, store_url, tenant=tenant, keep_chat=True)
    run = uuid.uuid4().hex[:6]
    left, other = f"left-{run}", f"other-{run}"
    first = Step(name="a", prompt='first #emu {"text": "one"}')
    # The step whose answer is lost: it runs server-side longer than a probe takes to
    # fail, shorter than the ttl (when a dead holder's unjudgeable slot would pass on).
    long = Step(name="b", prompt=f'second #emu {{"sleep": {B_RUNS_S}, "text": "two"}}')
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
        # b's message lands; its response is lost. Every GET under /api/v2/chats is
        # held past the probe's bound (the turns' own GETs just wait: they have 15 s).
        emu.faults.drop_response(1, method="POST", path="/messages")
        emu.faults.delay_commit(
            PROBE_TIMEOUT_S + 1.0, count=1000, method="GET", path="/api/v2/chats"
        )
        assert await store.leases.release(slot_key(0), TEST_HOLDER)

        await _until(
            "b's message to land",
            60,
            lambda: any(e["chat_id"] == chat for e in emu.event_log(["turn_start"])[1:]),
        )
        left_out, other_out = await asyncio.wait_for(asyncio.gather(*runs), 120)
    finally:
        emu.faults.clear()
        for task in runs:
            if not task.done():
                task.cancel()
        await store.aclose()

    # The case under test happened: b's answer was lost and its turn failed
    # transiently (retries 0), leaving its run live for recovery to follow.
    assert [o.ok for o in left_out] == [False], left_out
    assert [o.ok for o in other_out] == [True], other_out
    # The cap counts turns running on the server: `other`'s turn must not start while
    # b's run goes on there, whether or not the waiter could ask the server about it.
    log = emu.event_log(["turn_start", "turn_end"])
    assert emu.max_concurrent_turns() == 1, [
        (e["kind"], e["chat_id"], round(e["mono"], 2)) for e in log
    ]
