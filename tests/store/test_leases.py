"""Leases inside one process: atomic acquire, renew, release, waiting, background renewal."""

from __future__ import annotations

import asyncio
import time

import pytest

from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state import Lease, LeaseUnavailableError, chat_key, workflow_key


async def test_acquire_renew_release(store: StateStore) -> None:
    a = await store.leases.acquire("chat:1", "A", ttl=5)
    assert a is not None and (a.holder, a.fence) == ("A", 1)
    assert await store.leases.acquire("chat:1", "B", ttl=5) is None
    # Re-entry by the holder extends, keeps the fence.
    again = await store.leases.acquire("chat:1", "A", ttl=10)
    assert again is not None and again.fence == 1 and again.expires_at > a.expires_at
    live = await store.leases.get("chat:1")
    assert live is not None and live[0].holder == "A" and 9 < live[1] <= 10
    renewed = await store.leases.renew("chat:1", "A", ttl=20)
    assert renewed is not None and renewed.expires_at > again.expires_at
    assert await store.leases.renew("chat:1", "B", ttl=20) is None
    assert await store.leases.release("chat:1", "B") is False  # only the holder releases
    assert await store.leases.release("chat:1", "A") is True
    assert await store.leases.release("chat:1", "A") is False
    assert await store.leases.get("chat:1") is None
    b = await store.leases.acquire("chat:1", "B", ttl=5)
    assert b is not None and b.fence == 2  # a takeover bumps the fence


async def test_expired_lease_is_taken_over(store: StateStore) -> None:
    # 1 s, not less: B's first try must come while A's lease is live, and on a 2-core
    # machine at load 10 the gap between these two statements passed 0.2 s.
    assert await store.leases.acquire("k", "A", ttl=1.0) is not None
    assert await store.leases.acquire("k", "B", ttl=5) is None
    await asyncio.sleep(1.05)
    assert await store.leases.get("k") is None
    b = await store.leases.acquire("k", "B", ttl=5)
    assert b is not None and b.holder == "B" and b.fence == 2
    # The old holder's renewal now fails: it has lost the lease.
    assert await store.leases.renew("k", "A", ttl=5) is None


async def test_leases_are_per_key_and_per_tenant(store: StateStore, store_url: str) -> None:
    assert chat_key("c1") == "chat:c1" and workflow_key("w") == "workflow:w"
    assert await store.leases.acquire(chat_key("c1"), "A", 5) is not None
    assert await store.leases.acquire(chat_key("c2"), "B", 5) is not None
    other = StateStore(store_url, tenant=store.tenant + "-o")
    assert await other.leases.acquire(chat_key("c1"), "B", 5) is not None


async def test_bad_ttl_rejected(store: StateStore) -> None:
    with pytest.raises(ValueError, match="ttl"):
        await store.leases.acquire("k", "A", ttl=0)


async def test_concurrent_acquire_from_tasks_exactly_one_wins(store: StateStore) -> None:
    results = await asyncio.gather(
        *(store.leases.acquire("hot", f"H{i}", ttl=10) for i in range(12))
    )
    winners = [r for r in results if r is not None]
    assert len(winners) == 1
    live = await store.leases.get("hot")
    assert live is not None and live[0].holder == winners[0].holder


async def test_context_manager_mutual_exclusion_across_tasks(store: StateStore) -> None:
    inside = 0
    max_inside = 0
    order: list[int] = []

    async def worker(i: int) -> None:
        nonlocal inside, max_inside
        async with store.lease("chat:x", ttl=5, wait=10, poll_interval=0.01) as held:
            inside += 1
            max_inside = max(max_inside, inside)
            order.append(i)
            assert held.fence >= 1 and not held.lost
            await asyncio.sleep(0.02)
            inside -= 1

    await asyncio.gather(*(worker(i) for i in range(6)))
    assert max_inside == 1 and sorted(order) == list(range(6))
    assert await store.leases.get("chat:x") is None  # released on exit


async def test_wait_times_out_naming_the_holder(store: StateStore) -> None:
    await store.leases.acquire("chat:busy", "worker-7", ttl=30)
    t0 = time.monotonic()
    with pytest.raises(LeaseUnavailableError) as info:
        async with store.lease("chat:busy", ttl=5, wait=0.3, poll_interval=0.05):
            pytest.fail("must not enter")
    waited = time.monotonic() - t0
    assert 0.3 <= waited < 2.0
    err = info.value
    assert err.holder == "worker-7" and err.key == "chat:busy"
    assert err.expires_in is not None and 25 < err.expires_in <= 30
    assert "worker-7" in str(err) and "chat:busy" in str(err)


async def test_waiter_gets_the_lease_when_holder_releases(store: StateStore) -> None:
    await store.leases.acquire("k", "first", ttl=30)

    async def release_soon() -> None:
        await asyncio.sleep(0.15)
        await store.leases.release("k", "first")

    task = asyncio.create_task(release_soon())
    t0 = time.monotonic()
    async with store.lease("k", holder="second", ttl=5, wait=5, poll_interval=0.02) as held:
        handoff = time.monotonic() - t0
        assert held.holder == "second" and held.fence == 2
    await task
    assert 0.1 < handoff < 1.0


async def test_background_renewal_keeps_lease_past_ttl(store: StateStore) -> None:
    async with store.lease("k", holder="A", ttl=0.2, renew_interval=0.05) as held:
        first_expiry = held.lease.expires_at
        await asyncio.sleep(0.5)  # > 2 ttl: without renewal B would take it
        assert await store.leases.acquire("k", "B", ttl=5) is None
        assert held.lease.expires_at > first_expiry and not held.lost
    assert await store.leases.acquire("k", "B", ttl=5) is not None


async def test_lost_lease_flag_set_by_renewal(store: StateStore) -> None:
    from prefect_coder.blocks.state import LeaseLostError

    async with store.lease("k2", holder="A", ttl=0.15, renew_interval=0.25) as held:
        await asyncio.sleep(0.17)  # renewal too slow: the lease lapses...
        assert await store.leases.acquire("k2", "B", ttl=5) is not None  # ...and is taken
        assert not held.lost
        await asyncio.sleep(0.15)  # the renewal at 0.25 s finds the lease gone
        assert held.lost
        with pytest.raises(LeaseLostError, match="k2"):
            held.raise_if_lost()
    live = await store.leases.get("k2")
    assert live is not None and live[0].holder == "B"


async def test_take_over_is_a_compare_and_set_on_the_holder(store: StateStore) -> None:
    a = await store.leases.acquire("k", "A", ttl=600)
    assert a is not None
    # Two waiters judged "A" gone: exactly one gets it, before A's expiry.
    won = await asyncio.gather(*(store.leases.take_over("k", "A", w, ttl=5) for w in "BC"))
    winners = [w for w in won if w is not None]
    assert len(winners) == 1
    got = winners[0]
    assert got.fence == a.fence + 1 and got.acquired_at < a.expires_at
    assert await store.leases.take_over("k", "A", "D", ttl=5) is None  # A no longer holds it
    assert await store.leases.renew("k", "A", ttl=5) is None  # A has lost it
    live = await store.leases.get("k")
    assert live is not None and live[0].holder == got.holder


async def test_hold_takes_over_from_a_holder_known_gone(store: StateStore) -> None:
    a = await store.leases.acquire("k", "dead", ttl=600)
    assert a is not None
    asked: list[str] = []

    async def gone(lease: Lease) -> bool:
        asked.append(lease.holder)
        return lease.holder == "dead"

    async with store.lease("k", holder="B", ttl=5, wait=5, holder_gone=gone) as held:
        assert held.lease.acquired_at < a.expires_at and held.fence == a.fence + 1
        assert asked == ["dead"]
        # A live holder that is not "gone" is waited for, not taken over.
        with pytest.raises(LeaseUnavailableError):
            async with store.lease("k", holder="C", ttl=5, wait=0.2, holder_gone=gone):
                pytest.fail("took a lease whose holder is alive")
    assert "B" in asked


async def test_confirm_is_free_while_renewed_and_renews_after_a_stall(store: StateStore) -> None:
    async with store.lease("k3", holder="A", ttl=30, renew_interval=60) as held:
        first = held.lease.expires_at
        await held.confirm()  # renewed (taken) less than half a ttl ago: no store trip
        assert held.lease.expires_at == first
    # A renewer that has not run for over half a ttl (a stalled process): renewed now.
    async with store.lease("k4", holder="A", ttl=0.4, renew_interval=60) as held:
        first = held.lease.expires_at
        await asyncio.sleep(0.25)
        await held.confirm()
        assert held.lease.expires_at > first and not held.lost


async def test_confirm_finds_a_lease_taken_over_while_stalled(store: StateStore) -> None:
    from prefect_coder.blocks.state import LeaseLostError

    async with store.lease("k5", holder="A", ttl=0.2, renew_interval=60) as held:
        await asyncio.sleep(0.25)  # lapsed, no renewal ran...
        assert await store.leases.acquire("k5", "B", ttl=5) is not None  # ...and taken
        assert not held.lost  # nothing has looked yet
        with pytest.raises(LeaseLostError, match="k5"):
            await held.confirm()
        assert held.lost
    live = await store.leases.get("k5")
    assert live is not None and live[0].holder == "B"
