"""A released lease is told apart from one that lapsed: ``acquire(released_only=True)``
takes the first and never the second (turn slots judge a lapsed one themselves: its
holder's turn may still run server-side)."""

from __future__ import annotations

import asyncio

import sqlalchemy as sa

from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state.leases import RELEASED
from prefect_coder.blocks.state.schema import leases


async def test_released_only_takes_a_released_or_new_lease_not_a_lapsed_one(
    store: StateStore,
) -> None:
    # Never held: taken.
    new = await store.leases.acquire("slot:0", "A", ttl=5, released_only=True)
    assert new is not None and new.fence == 1
    # Released by its holder: taken, and the fence grows.
    assert await store.leases.release("slot:0", "A") is True
    again = await store.leases.acquire("slot:0", "B", ttl=1.0, released_only=True)
    assert again is not None and (again.holder, again.fence) == ("B", 2)
    # Live: not taken, either way.
    assert await store.leases.acquire("slot:0", "C", ttl=5, released_only=True) is None
    # Lapsed (B stopped renewing, never released): not taken by released_only …
    await asyncio.sleep(1.05)
    assert await store.leases.get("slot:0") is None
    assert await store.leases.acquire("slot:0", "C", ttl=5, released_only=True) is None
    # … a plain acquire takes a lapsed lease, as before.
    assert await store.leases.release("slot:0", "B") is False  # lapsed: nothing to give up
    taken = await store.leases.acquire("slot:0", "C", ttl=5)
    assert taken is not None and (taken.holder, taken.fence) == ("C", 3)


async def test_release_marks_the_row(store: StateStore) -> None:
    assert await store.leases.acquire("slot:1", "A", ttl=5) is not None
    assert await store.leases.release("slot:1", "A") is True
    # The row stays (the fence goes on growing) with the released mark as its expiry.
    async with store.read() as conn:
        expiry = (
            await conn.execute(
                sa.select(leases.c.expires_at).where(
                    leases.c.tenant == store.tenant, leases.c.key == "slot:1"
                )
            )
        ).scalar_one()
    assert expiry == RELEASED


async def test_abandon_lets_the_lease_lapse_now_without_releasing_it(store: StateStore) -> None:
    assert await store.leases.acquire("slot:2", "A", ttl=30) is not None
    assert await store.leases.abandon("slot:2", "B") is False  # only the holder
    assert await store.leases.abandon("slot:2", "A") is True
    # Lapsed at once: no longer live, but not released either.
    assert await store.leases.get("slot:2") is None
    assert await store.leases.acquire("slot:2", "C", ttl=5, released_only=True) is None
    taken = await store.leases.acquire("slot:2", "C", ttl=5)
    assert taken is not None and taken.fence == 2


async def test_take_over_lapsed_only_needs_the_judged_holders_lapsed_row(
    store: StateStore,
) -> None:
    assert await store.leases.acquire("slot:3", "A", ttl=30) is not None
    # Live: not taken with lapsed_only (A renewed, or never lapsed).
    assert await store.leases.take_over("slot:3", "A", "W", ttl=5, lapsed_only=True) is None
    assert await store.leases.abandon("slot:3", "A") is True
    # Another holder's row is not taken by a CAS on A …
    assert await store.leases.take_over("slot:3", "B", "W", ttl=5, lapsed_only=True) is None
    # … A's lapsed row is.
    got = await store.leases.take_over("slot:3", "A", "W", ttl=5, lapsed_only=True)
    assert got is not None and (got.holder, got.fence) == ("W", 2)
    # Released rows are free, not lapsed: a plain acquire takes them, this does not.
    assert await store.leases.release("slot:3", "W") is True
    assert await store.leases.take_over("slot:3", "W", "X", ttl=5, lapsed_only=True) is None
