"""A turn slot is a store ``HeldLease``: its renewal checks the fence, like the
workflow lease's. A slot row that another holder took and that came back under the
same holder id (a new fence) is lost to the turn: ``confirm_turn_slot`` raises
``TurnSlotLostError`` before anything is sent (the slot's own renewal loop checked
only the holder, and kept such a row)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import AsyncIterator

import pytest

from prefect_coder.blocks import StateStore
from prefect_coder.flows.fleet.slots import (
    TurnSlotLostError,
    busy_slots,
    confirm_turn_slot,
    slot_key,
    turn_slot,
)

TTL = 1.0


@pytest.fixture(params=["sqlite", "postgresql"])
async def store(request: pytest.FixtureRequest, store_url: str) -> AsyncIterator[StateStore]:
    url = store_url if request.param == "sqlite" else request.getfixturevalue("postgres_url")
    s = StateStore(url, tenant=f"fence-{uuid.uuid4().hex[:8]}")
    yield s
    await s.aclose()


async def test_a_refenced_slot_fails_the_turn_before_it_sends(store: StateStore) -> None:
    async with turn_slot(store, 2, wait=5, ttl=TTL, workflow_id="wf") as index:
        assert index is not None
        key = slot_key(index)
        row = await store.leases.get(key)
        assert row is not None
        mine = row[0].holder
        await confirm_turn_slot()  # claimed just now: free, and still ours
        # Another worker took the slot, and the row came back under this holder id.
        assert await store.leases.take_over(key, mine, "other", ttl=30) is not None
        back = await store.leases.take_over(key, "other", mine, ttl=30)
        assert back is not None and back.fence == row[0].fence + 2
        threading.Event().wait(TTL * 0.6)  # a stall: confirm must look in the store
        with pytest.raises(TurnSlotLostError) as err:
            await confirm_turn_slot()
        assert err.value.index == index and err.value.retryable
    # A lost slot is not released by the turn: the row stays with its new fence.
    assert await busy_slots(store, 2) == {index}
    after = await store.leases.get(key)
    assert after is not None and after[0].fence == back.fence
