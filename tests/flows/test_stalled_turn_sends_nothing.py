"""A turn whose process stalled after it took its turn slot and its workflow's lease
does not send once either was taken over (the agent's ``before_send``:
``turn_slot.confirm_turn_slot`` and ``HeldLease.confirm``).

The windows (docs/fleet.md): a holder stalled past its ttl between claiming and
sending had no chat running, so a waiter saw its chats at rest and took the
lapsed slot; the holder then woke and sent — one turn over the cap. Likewise a
run stalled past its workflow lease's ttl: another run took the workflow over,
and the woken run's send would drive the chat next to it. Here the stall is
real: the turn's event loop is blocked (a crash-point hook waits on a thread
event) while another "worker" in another thread, with its own event loop and its
own store connection, takes the lapsed slot or lease. Order facts come from the
emulator's rows and the store.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable, Iterator

import pytest
from flow_helpers import say, user_messages

from coder_chat.crash_safe import add_crash_hook
from coder_chat.emulator import Emulator
from prefect_coder.blocks import CoderCredentials, StateStore
from prefect_coder.blocks.state import LeaseLostError, workflow_key
from prefect_coder.flows.common.labels import LABEL_WORKFLOW
from prefect_coder.flows.common.params import Step, WorkflowSettings
from prefect_coder.flows.common.resources import TurnResources
from prefect_coder.flows.common.retry import is_retryable_failure
from prefect_coder.flows.deployments.agent_workflow import agent_workflow
from prefect_coder.flows.fleet.slots import (
    TurnSlotLostError,
    confirm_turn_slot,
    slot_key,
    turn_slot,
)
from prefect_coder.flows.turn.durable_turn import execute_turn

TTL = 0.5


class _Waiter:
    """Another worker: claims the cap's one slot (or, with ``lease``, takes that lease
    once it lapsed) from its own thread and loop, holds it until told to let go."""

    def __init__(
        self, store_url: str, tenant: str, lease: str | None = None, hold_s: float = 30
    ) -> None:
        self.lease = lease
        self.hold_s = hold_s
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
                if self.lease is None:
                    async with turn_slot(store, 1, wait=30, ttl=TTL, workflow_id="waiter"):
                        self.took.set()
                        await asyncio.to_thread(self.release.wait, 30)
                else:
                    async with store.lease(self.lease, holder="waiter", ttl=30, wait=30):
                        self.took.set()
                        await asyncio.to_thread(self.release.wait, self.hold_s)
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


def _stall_until_taken(waiter: _Waiter) -> Callable[[str], None]:
    def stall(name: str) -> None:
        # Right after the turn claimed its slot (and took its workflow's lease), its
        # whole event loop stalls — no renewal runs — until the other worker, with
        # its own thread and loop, has taken what lapsed.
        if name == "turn.slot_held" and not waiter.took.is_set():
            waiter.start()
            waiter.took.wait(30)

    return stall


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
    remove = add_crash_hook(_stall_until_taken(waiter))
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


async def test_confirm_is_free_while_renewed_and_keeps_a_lapsed_untaken_slot(
    store: StateStore,
) -> None:
    assert await confirm_turn_slot() is None  # no slot held: nothing to prove
    # A long ttl: neither the background renewal nor the check touches the row.
    async with turn_slot(store, 1, wait=5, ttl=30, workflow_id="solo") as index:
        before = await store.leases.get(slot_key(index))
        await confirm_turn_slot()  # claimed less than half a ttl ago: no store trip
        same = await store.leases.get(slot_key(index))
        assert before is not None and same is not None and same[0] == before[0]
    # A stall past the whole ttl that nobody used: the slot lapsed but is still
    # this turn's to renew, so the check renews it and the turn goes on.
    async with turn_slot(store, 1, wait=5, ttl=TTL, workflow_id="solo") as index:
        threading.Event().wait(TTL * 1.2)  # blocks the loop: no background renewal
        await confirm_turn_slot()
        after = await store.leases.get(slot_key(index))
        assert after is not None and after[0].holder.endswith("solo")


async def test_a_turn_whose_workflow_was_taken_over_while_stalled_sends_nothing(
    emu: Emulator,
    coder_block: str,
    settings: WorkflowSettings,
    store: StateStore,
    workflow_id: str,
) -> None:
    creds = await CoderCredentials.aload(coder_block)
    resources = TurnResources(credentials=creds, store=store)
    step = Step(name="s", prompt="go" + say("done"))
    other = _Waiter(store.url, store.tenant, lease=workflow_key(workflow_id))
    remove = add_crash_hook(_stall_until_taken(other))
    try:
        with pytest.raises(LeaseLostError):
            await execute_turn(
                workflow_id, step, settings.model_copy(update={"lease_ttl_s": TTL}), resources
            )
    finally:
        remove()
        other.join()
    assert other.error is None, other.error
    # Nothing of this workflow reached the server: the run that took it over drives
    # its chat now (and the failure handler leaves that chat alone).
    assert [c for c in emu.chats() if c["labels"].get(LABEL_WORKFLOW) == workflow_id] == []
    assert await store.checkpoints.get(workflow_id) is None


async def test_a_run_that_lost_its_workflow_leaves_the_chat_to_the_new_holder(
    emu: Emulator, settings: WorkflowSettings, store: StateStore, workflow_id: str
) -> None:
    """The whole run: its second step stalls, another run takes the workflow over, and
    the stalled run fails — without sending the step and without its failure handler
    archiving the chat the other run now drives."""
    steps = [Step(name="one", prompt="1" + say("a")), Step(name="two", prompt="2" + say("b"))]
    # The other run is quick: it has finished (released the lease) by the time the
    # stalled run's failure handler would get the lease and archive the chat.
    other = _Waiter(store.url, store.tenant, lease=workflow_key(workflow_id), hold_s=0.3)
    turns = 0

    def stall_second(name: str) -> None:
        nonlocal turns
        if name == "turn.slot_held":
            turns += 1
            if turns == 2:
                _stall_until_taken(other)(name)

    remove = add_crash_hook(stall_second)
    try:
        with pytest.raises(LeaseLostError):
            await agent_workflow(
                # 2 s, not TTL: step one must keep its lease through a loaded
                # machine's pauses; only the stall below may lose it.
                workflow_id,
                steps,
                settings.model_copy(update={"lease_ttl_s": 2.0}),
            )
    finally:
        remove()
        other.join()
    assert other.error is None, other.error
    chats = [c for c in emu.chats() if c["labels"].get(LABEL_WORKFLOW) == workflow_id]
    assert len(chats) == 1 and not chats[0]["archived"], chats
    assert not any("[" + workflow_id + "/two]" in t for t in user_messages(emu, chats[0]["id"]))
