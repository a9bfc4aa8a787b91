"""``store.leases.claim_any``: any free one of N lease rows in one store call, held as a
``HeldLease`` whose renewals keep the store's fencing (the fleet's turn slots)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state import LeaseLostError

KEYS = ("k:0", "k:1", "k:2", "k:3")


async def test_claims_a_free_key_never_a_live_or_lapsed_one(store: StateStore) -> None:
    leases = store.leases
    assert await leases.acquire("k:0", "live", ttl=600) is not None
    assert await leases.acquire("k:1", "gone", ttl=600) is not None
    assert await leases.abandon("k:1", "gone")  # lapsed now: its work may go on
    assert await leases.acquire("k:2", "done", ttl=600) is not None
    assert await leases.release("k:2", "done")  # released: free
    # Inside the keys' range (k:0 … k:3) but not one of them: never reported.
    assert await leases.acquire("k:10", "outside", ttl=600) is not None
    claim = await leases.claim_any(KEYS, "w", ttl=30)
    held = claim.lease
    assert held is not None
    try:
        assert held.key in {"k:2", "k:3"} and held.holder == "w"
        # The rows read: the live one and the lapsed one, never the released one.
        assert set(claim.holders) == {"k:0", "k:1"}
        assert claim.holders["k:0"].holder == "live" and 590 < claim.holders["k:0"].left <= 600
        assert claim.holders["k:1"].holder == "gone" and claim.holders["k:1"].left <= 0
        live = await leases.get(held.key)
        assert live is not None and live[0].holder == "w"
        # holders(): the same read on its own.
        rows = await leases.holders(KEYS)
        assert set(rows) == {"k:0", "k:1", held.key} and rows[held.key].holder == "w"
    finally:
        assert await held.release()
    # Released: marked so (not lapsed), so the next claim may take it.
    assert held.key not in await leases.holders(KEYS)


async def test_first_is_tried_without_a_read(store: StateStore) -> None:
    leases = store.leases
    claim = await leases.claim_any(KEYS, "a", ttl=30, first="k:3")
    assert claim.lease is not None and claim.lease.key == "k:3"
    assert claim.holders == {}  # won by the first acquire: nothing was read
    # A taken ``first`` falls back to the read and another free key.
    other = await leases.claim_any(KEYS, "b", ttl=30, first="k:3")
    assert other.lease is not None and other.lease.key != "k:3"
    assert set(other.holders) == {"k:3"}
    # A lapsed ``first`` is not taken either: the caller judges it.
    assert await claim.lease.abandon()
    third = await leases.claim_any(("k:3",), "c", ttl=30, first="k:3")
    assert third.lease is None and third.holders["k:3"].holder == "a"
    assert await other.lease.release()


async def test_none_when_every_key_is_held(store: StateStore) -> None:
    for key in KEYS:
        assert await store.leases.acquire(key, f"h-{key}", ttl=600) is not None
    claim = await store.leases.claim_any(KEYS, "w", ttl=30)
    assert claim.lease is None and set(claim.holders) == set(KEYS)
    with pytest.raises(ValueError, match="keys"):
        await store.leases.claim_any((), "w", ttl=30)


async def test_concurrent_claims_never_share_a_key(store: StateStore) -> None:
    claims = await asyncio.gather(
        *(store.leases.claim_any(KEYS, f"w{i}", ttl=30) for i in range(10))
    )
    won = [c.lease for c in claims if c.lease is not None]
    try:
        assert sorted(h.key for h in won) == sorted(KEYS)
        rows = await store.leases.holders(KEYS)
        assert {k: r.holder for k, r in rows.items()} == {h.key: h.holder for h in won}
    finally:
        assert all(await asyncio.gather(*(h.release() for h in won)))


async def test_a_claimed_lease_is_renewed_and_confirmed(store: StateStore) -> None:
    claim = await store.leases.claim_any(KEYS[:1], "w", ttl=0.6)
    held = claim.lease
    assert held is not None
    first = held.lease.expires_at
    try:
        await asyncio.sleep(1.0)  # > ttl: only the background renewal keeps it
        assert not held.lost and held.lease.expires_at > first
        assert await store.leases.acquire(held.key, "other", ttl=5) is None
        await held.confirm()
    finally:
        assert await held.release()


async def test_a_renewal_of_a_refenced_row_loses_the_lease(store: StateStore) -> None:
    """The same holder id under a new fence held the row again after another holder:
    what it guarded may have been redone meanwhile, so the renewal that finds it — the
    background one or ``confirm`` after a stall — reports the lease lost."""
    claim = await store.leases.claim_any(KEYS[:1], "w", ttl=1.0)
    held = claim.lease
    assert held is not None and held.fence == 1
    # Another holder took it, and the row came back under the same holder id.
    assert await store.leases.take_over(held.key, "w", "x", ttl=5) is not None
    back = await store.leases.take_over(held.key, "x", "w", ttl=5)
    assert back is not None and back.holder == "w" and back.fence == 3
    # A stall past half a ttl: confirm must ask the store (or the renewal did meanwhile).
    threading.Event().wait(0.6)
    with pytest.raises(LeaseLostError, match="k:0"):
        await held.confirm()
    assert held.lost
    # A lost lease is not released: the row is left to whoever holds it now.
    assert await held.release() is False
    live = await store.leases.get(held.key)
    assert live is not None and live[0].fence == 3


async def test_the_background_renewal_finds_a_refenced_row(store: StateStore) -> None:
    claim = await store.leases.claim_any(KEYS[:1], "w", ttl=0.6)
    held = claim.lease
    assert held is not None
    assert await store.leases.take_over(held.key, "w", "x", ttl=5) is not None
    assert await store.leases.take_over(held.key, "x", "w", ttl=5) is not None
    deadline = time.monotonic() + 10
    while not held.lost:  # the renewal every ttl/3 finds the new fence
        assert time.monotonic() < deadline, "the renewal never noticed the new fence"
        await asyncio.sleep(0.05)
    with pytest.raises(LeaseLostError):
        held.raise_if_lost()
    await held.abandon()
