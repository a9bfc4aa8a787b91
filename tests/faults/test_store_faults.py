"""Issue 30, items 2 and 3, at the store: the store rides out its own transient faults
(a PostgreSQL restart that is already over, PostgreSQL down for less than
``transient_retry_s``, another process holding SQLite's write lock past
``connect_timeout``) and reports what outlasts them as ``StoreUnavailableError`` —
retryable, naming the store (never its password) and what to check.

Real faults only: ``pg_ctl stop -m fast`` / start of a private cluster, a second
process that holds ``BEGIN IMMEDIATE`` and is SIGSTOPped.
"""

from __future__ import annotations

import asyncio
import pickle
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from faults_pg import PrivateCluster
from lock_holder import LockHolder
from pydantic import SecretStr

from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state.errors import StoreUnavailableError
from prefect_coder.flows.common.retry import is_retryable_failure

#: Short, so each case takes seconds: SQLite's wait for the write lock per attempt,
#: the store's retry bound, and how long the fault lasts.
BUSY_S = 0.4
BOUND_S = 2.0
SHORT_FAULT_S = 1.2  # > BUSY_S: fails without the retries; < BUSY_S + BOUND_S
LONG_BOUND_S = 0.5


async def _every_path(store: StateStore, tag: str) -> list[Any]:
    """One call through each of the store's paths, at once (several pooled connections):
    autocommit statements (turns, leases), transactions (checkpoints, ledger), a read."""
    return list(
        await asyncio.gather(
            store.turns.record(f"wf-{tag}", "chat", 1),
            store.checkpoints.set(f"wf2-{tag}", "chat", 2),
            store.ledger.begin("chat", f"call-{tag}", tool_name="t", args={}),
            store.leases.acquire(f"k-{tag}", "h", 30),
            store.journal.get("chat"),
            return_exceptions=True,
        )
    )


def _errors(results: list[Any]) -> list[str]:
    return [f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)]


async def test_a_postgresql_restart_that_is_over_costs_no_call(private_pg: PrivateCluster) -> None:
    # Before: every pooled connection failed once after the restart ("connection was
    # closed in the middle of operation"), a step's checkpoint among them.
    store = StateStore(private_pg.url, tenant=f"t-{uuid.uuid4().hex[:8]}", transient_retry_s=0)
    try:
        assert _errors(await _every_path(store, "a")) == []
        private_pg.stop()
        private_pg.start()
        assert _errors(await _every_path(store, "b")) == []  # no retry bound needed
    finally:
        await store.aclose()


async def test_postgresql_down_shorter_than_the_bound_is_ridden_out(
    private_pg: PrivateCluster,
) -> None:
    store = StateStore(
        private_pg.url, tenant=f"t-{uuid.uuid4().hex[:8]}", transient_retry_s=BOUND_S + 8
    )
    try:
        assert _errors(await _every_path(store, "a")) == []
        private_pg.stop()
        back = threading.Timer(SHORT_FAULT_S, private_pg.start)
        back.start()
        t0 = time.monotonic()
        try:
            results = await _every_path(store, "b")
        finally:
            back.join()
        assert _errors(results) == []
        assert time.monotonic() - t0 >= SHORT_FAULT_S * 0.8  # they waited the restart out
    finally:
        await store.aclose()


async def test_postgresql_down_longer_than_the_bound_is_store_unavailable(
    private_pg: PrivateCluster,
) -> None:
    password = "s3cret-" + uuid.uuid4().hex  # trust auth: any password connects
    store = StateStore(
        private_pg.url,
        password=SecretStr(password),
        tenant=f"t-{uuid.uuid4().hex[:8]}",
        transient_retry_s=LONG_BOUND_S,
    )
    try:
        await store.turns.record("wf", "chat", 1)
        private_pg.stop()
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailableError) as got:
            await store.turns.record("wf", "chat", 2)
        waited = time.monotonic() - t0
        with pytest.raises(StoreUnavailableError):
            await store.checkpoints.set("wf", "chat", 2)
    finally:
        if not private_pg.running:
            private_pg.start()
        await store.aclose()
    err = got.value
    assert LONG_BOUND_S <= waited < LONG_BOUND_S + 5
    assert err.retryable and is_retryable_failure(err)
    assert err.attempts > 1 and not err.outcome_unknown
    text = str(err) + repr(err) + str(pickle.loads(pickle.dumps(err)))
    assert f"127.0.0.1:{private_pg.port}" in text and "PostgreSQL is up" in text
    assert password not in text
    again = pickle.loads(pickle.dumps(err))
    assert (type(again), again.store, again.attempts) == (type(err), err.store, err.attempts)


@pytest.fixture
def sqlite_store(tmp_path: Path) -> tuple[Path, StateStore]:
    path = tmp_path / "state.db"
    return path, StateStore(
        f"sqlite+aiosqlite:///{path}", connect_timeout=BUSY_S, transient_retry_s=BOUND_S
    )


async def test_sqlite_write_lock_held_by_a_stopped_process_is_waited_out(
    sqlite_store: tuple[Path, StateStore],
) -> None:
    # Before: each write failed "database is locked" after connect_timeout, and the
    # step's checkpoint with it (not retried, the chat archived).
    path, store = sqlite_store
    try:
        await store.turns.record("wf", "chat", 1)  # creates the file and the schema
        holder = LockHolder(path)
        try:
            holder.release_after(SHORT_FAULT_S)
            results = await _every_path(store, "b")
        finally:
            holder.close()
        assert _errors(results) == []
        assert holder.releasing_at is not None  # the writes waited for the lock
        cp = await store.checkpoints.get("wf-b")
        assert cp is not None and cp.chat_id == "chat"
    finally:
        await store.aclose()


async def test_sqlite_write_lock_held_past_the_bound_is_store_unavailable(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = StateStore(
        f"sqlite+aiosqlite:///{path}", connect_timeout=BUSY_S, transient_retry_s=LONG_BOUND_S
    )
    try:
        await store.turns.record("wf", "chat", 1)
        holder = LockHolder(path)
        try:
            with pytest.raises(StoreUnavailableError, match="database is locked") as got:
                await store.turns.record("wf", "chat", 2)
            with pytest.raises(StoreUnavailableError, match="database is locked"):
                await store.checkpoints.set("wf", "chat", 2)
        finally:
            holder.close()
        assert got.value.retryable and "write lock" in str(got.value)
        await store.turns.record("wf", "chat", 3)  # the lock gone: writes go through
    finally:
        await store.aclose()
