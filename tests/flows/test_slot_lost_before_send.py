"""A turn whose process stalled after it claimed its turn slot does not send once
the slot was taken over (``turn_slot.confirm_turn_slot``, the agent's ``before_send``).

The window (docs/fleet.md): a holder stalled past its ttl between claiming and
sending had no chat running, so a waiter saw its chats at rest and took the
lapsed slot; the holder then woke and sent — one turn over the cap. Here the
stall is real: the turn's event loop is blocked (a crash-point hook waits on a
thread event) while a waiter in another thread, with its own event loop and its
own store connection, takes the slot once it lapsed. Order facts come from the
emulator's rows and the store.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Iterator

import pytest
from flow_helpers import say

from coder_chat.crash_safe import add_crash_hook
from coder_chat.emulator import Emulator
from prefect_coder.blocks import CoderCredentials, StateStore
from prefect_coder.flows.parts.labels import LABEL_WORKFLOW
from prefect_coder.flows.parts.params import Step, WorkflowSettings
from prefect_coder.flows.parts.resources import TurnResources
from prefect_coder.flows.parts.retry import is_retryable_failure
from prefect_coder.flows.parts.turn_slot import (
    TurnSlotLostError,
    confirm_turn_slot,
    slot_key,
    turn_slot,
)
from prefect_coder.flows.turn.durable_turn import execute_turn

TTL = 0.5


class _Waiter:
    """Another worker: claims the cap's one slot from its own thread and loop, holds
    it until told to let go."""

    def __init__(self, store_url: str, tenant: str) -> None:
        self.took = threading.Event()
        self.release = threading.Event()
        self.error: BaseException | None = None
        # The test's context: Prefect's settings (the test server's API URL) are
        # context variables, which a new thread does not inherit.
        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=context.run, args=(self._run, store_url, tenant), daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        self.release.set()
        if self._thread.is_alive():
            self._thread.join(30)

    def _run(self, store_url: str, tenant: str) -> None:
        async def main() -> None:
            store = StateStore(store_url, tenant=tenant)
            try:
                async with turn_slot(store, 1, wait=30, ttl=TTL, workflow_id="waiter"):
                    self.took.set()
                    await asyncio.to_thread(self.release.wait, 30)
            finally:
                await store.aclose()

        try:
            asyncio.run(main())
        except BaseException as exc:  # reported to the test
            self.error = exc
            self.took.set()


@pytest.fixture
def waiter(store: StateStore) -> Iterator[_Waiter]:
    w = _Waiter(store.url, store.tenant)
    try:
        yield w
    finally:
        w.join()


async def test_a_turn_that_lost_its_slot_while_stalled_sends_nothing(
    emu: Emulator,
    coder_block: str,
    settings: WorkflowSettings,
    store: StateStore,
    workflow_id: str,
    waiter: _Waiter,
) -> None:
    creds = await CoderCredentials.aload(coder_block)
    capped = creds.model_copy(
        update={"max_concurrent_turns": 1, "turn_slot_ttl": TTL, "turn_slot_wait": 30.0}
    )
    resources = TurnResources(credentials=capped, store=store)
    step = Step(name="s", prompt="go" + say("done"))

    def stall(name: str) -> None:
        # Right after the turn claimed its slot, its whole event loop stalls (no
        # renewal runs) until the waiter — its own thread and loop — has taken the
        # lapsed slot.
        if name == "turn.slot_held" and not waiter.took.is_set():
            waiter.start()
            waiter.took.wait(30)

    remove = add_crash_hook(stall)
    try:
        with pytest.raises(TurnSlotLostError) as err:
            await execute_turn(workflow_id, step, settings, resources)
    finally:
        remove()
    assert waiter.error is None, waiter.error
    assert is_retryable_failure(err.value)  # Prefect's retry waits for a slot again
    # Nothing of this workflow reached the server while the waiter held the slot.
    assert [c for c in emu.chats() if c["labels"].get(LABEL_WORKFLOW) == workflow_id] == []
    assert await store.checkpoints.get(workflow_id) is None
    row = await store.leases.get(slot_key(0))
    assert row is not None and row[0].holder.endswith("waiter")

    # The retry (here: the same call again) gets the freed slot and runs the turn.
    waiter.join()
    result = await execute_turn(workflow_id, step, settings, resources)
    assert result.text == "done"


async def test_confirm_is_free_while_renewed_and_renews_after_a_stall(
    store: StateStore,
) -> None:
    assert await confirm_turn_slot() is None  # no slot held: nothing to prove
    async with turn_slot(store, 1, wait=5, ttl=TTL, workflow_id="solo") as index:
        before = await store.leases.get(slot_key(index))
        await confirm_turn_slot()  # just claimed: no store trip
        same = await store.leases.get(slot_key(index))
        assert before is not None and same is not None and same[0] == before[0]
        # A stall past half the ttl with no taker: the check renews and goes on.
        threading.Event().wait(TTL * 0.6)  # blocks the loop: no background renewal
        await confirm_turn_slot()
        after = await store.leases.get(slot_key(index))
        assert after is not None
        assert after[0].holder == before[0].holder
        assert after[0].expires_at > before[0].expires_at
