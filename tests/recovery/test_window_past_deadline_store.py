"""The tool ledger's match of a resubmitted attempt's calls (schema version 3), on real
SQLite and PostgreSQL: which calls are answered from an earlier attempt's applied call,
count-based; that calls within one attempt never match; that racing identical calls
take distinct matches; and the in-place 2 → 3 migration of an existing database."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine
from support.pg_databases import fresh_database

from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state import SCHEMA_VERSION, JournalEntry

MARKER = "[wf/pay]"


async def _journal(
    store: StateStore, chat: str, state: str, attempt: int, marker: str = MARKER
) -> None:
    await store.journal.set(chat, JournalEntry(state=state, marker=marker, attempt=attempt))  # type: ignore[arg-type]


async def _call(
    store: StateStore, chat: str, call_id: str, cents: int, **extra: int
) -> tuple[str, str | None, int | None]:
    """One crash-safe call as the tool runs it: begin (matching), and — when it is
    not answered from the ledger — the effect's ``done``. Returns (state at begin,
    replay_of, attempt)."""
    args = {"amount_cents": cents, **extra}
    entry, created = await store.ledger.begin(
        chat, call_id, tool_name="charge_card", args=args, match_earlier_attempts=True
    )
    assert created
    if entry.state == "committing":
        await store.ledger.complete(chat, call_id, {"receipt": call_id})
    return entry.state, entry.replay_of, entry.attempt


async def test_a_resubmitted_attempt_matches_applied_calls_count_based(
    store: StateStore,
) -> None:
    store, chat = store, "chat-1"
    await _journal(store, chat, "submitting", 0)
    # Attempt 0 applies the same call twice (both run: one attempt never matches itself)
    # and another one once.
    assert await _call(store, chat, "a0-1", 250) == ("committing", None, 0)
    assert await _call(store, chat, "a0-2", 250) == ("committing", None, 0)
    assert await _call(store, chat, "a0-3", 30) == ("committing", None, 0)
    # Cut short; the resubmission's write-ahead names attempt 1.
    await _journal(store, chat, "cut-short", 1)
    await _journal(store, chat, "submitting", 1)
    # Same tool, same arguments (key order does not matter): the k-th such call is
    # answered from the k-th applied one; a third one runs.
    assert await _call(store, chat, "a1-1", 250) == ("done", "a0-1", 1)
    assert await _call(store, chat, "a1-2", 250) == ("done", "a0-2", 1)
    assert await _call(store, chat, "a1-3", 250) == ("committing", None, 1)
    # Other arguments run; the matched one keeps the earlier call's recorded output.
    assert await _call(store, chat, "a1-4", 31) == ("committing", None, 1)
    replayed = await store.ledger.get(chat, "a1-1")
    assert replayed is not None and replayed.output == {"receipt": "a0-1"}
    # A revived run of attempt 1 (journal "resumed" with the count 2) is still attempt 1.
    await _journal(store, chat, "resumed", 2)
    assert await _call(store, chat, "a1-5", 30) == ("done", "a0-3", 1)
    # Attempt 2 matches every call APPLIED before it (answered ones are not applied
    # effects): a0-1, a0-2, a1-3 for 250.
    await _journal(store, chat, "submitting", 2)
    got = [await _call(store, chat, f"a2-{i}", 250) for i in range(4)]
    assert got == [
        ("done", "a0-1", 2),
        ("done", "a0-2", 2),
        ("done", "a1-3", 2),
        ("committing", None, 2),
    ]
    # A re-driven call keeps its entry (not created, not matched).
    entry, created = await store.ledger.begin(
        chat,
        "a2-3",
        tool_name="charge_card",
        args={"amount_cents": 250},
        match_earlier_attempts=True,
    )
    assert not created and entry.replay_of is None


async def test_other_steps_chats_and_unscoped_calls_never_match(store: StateStore) -> None:
    store = store
    await _journal(store, "chat-a", "submitting", 0)
    await _call(store, "chat-a", "x", 250)
    # Another step on the same chat, resubmitted: the first step's call is not its own.
    await _journal(store, "chat-a", "submitting", 1, marker="[wf/other]")
    assert await _call(store, "chat-a", "y", 250) == ("committing", None, 1)
    # Another chat never sees this chat's calls.
    await _journal(store, "chat-b", "submitting", 1)
    assert await _call(store, "chat-b", "z", 250) == ("committing", None, 1)
    # No journal entry: nothing is scoped, nothing matched.
    assert await _call(store, "chat-c", "w", 250) == ("committing", None, None)
    # Without asking, begin behaves as before.
    entry, _ = await store.ledger.begin(
        "chat-a", "v", tool_name="charge_card", args={"amount_cents": 250}
    )
    assert (entry.state, entry.attempt, entry.replay_of) == ("committing", None, None)


async def test_racing_identical_calls_take_distinct_matches(store: StateStore) -> None:
    store, chat = store, "chat-race"
    await _journal(store, chat, "submitting", 0)
    for i in range(3):
        await _call(store, chat, f"old-{i}", 250)
    await _journal(store, chat, "submitting", 1)

    async def begin(i: int) -> tuple[str, str | None]:
        entry, _ = await store.ledger.begin(
            chat,
            f"new-{i}",
            tool_name="charge_card",
            args={"amount_cents": 250},
            match_earlier_attempts=True,
        )
        return entry.state, entry.replay_of

    got = await asyncio.gather(*(begin(i) for i in range(8)))
    replays = sorted(r for s, r in got if s == "done")
    assert replays == ["old-0", "old-1", "old-2"], got  # each applied call matched once
    assert sum(s == "committing" for s, _ in got) == 5, got


#: A version-2 database: the version row and a ledger table without the v3 columns.
_V2 = (
    "CREATE TABLE coder_state_schema_version (component TEXT PRIMARY KEY, "
    "version INTEGER NOT NULL, updated_at DOUBLE PRECISION NOT NULL)",
    "CREATE TABLE coder_state_tool_ledger (tenant TEXT NOT NULL, chat_id TEXT NOT NULL, "
    "tool_call_id TEXT NOT NULL, state TEXT NOT NULL, tool_name TEXT, args_json TEXT, "
    "output_json TEXT, created_at DOUBLE PRECISION NOT NULL, "
    "updated_at DOUBLE PRECISION NOT NULL, PRIMARY KEY (tenant, chat_id, tool_call_id))",
    "INSERT INTO coder_state_schema_version VALUES ('prefect-coder-state', 2, 1.0)",
    "INSERT INTO coder_state_tool_ledger VALUES ('t', 'c', 'old', 'done', 'charge_card', "
    '\'{"amount_cents":250}\', \'{"receipt":"old"}\', 50.0, 51.0)',
)


@pytest.fixture(params=["sqlite", "postgresql"])
async def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """A database that does not exist yet (SQLite) or is empty (PostgreSQL)."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path}/v2/state.db"
        return
    async with fresh_database(str(request.getfixturevalue("postgres_url")), "v2") as url:
        yield url


async def test_a_version_2_database_gains_the_ledger_columns_and_keeps_its_rows(
    empty_url: str,
) -> None:
    from prefect_coder.blocks.state import store as store_mod

    if empty_url.startswith("sqlite"):
        Path(empty_url.split("///", 1)[1]).parent.mkdir(parents=True)
    engine = create_async_engine(empty_url)
    async with engine.begin() as conn:
        for statement in _V2:
            await conn.exec_driver_sql(statement)
    await engine.dispose()
    store_mod._schema_ready.clear()
    store = StateStore(empty_url, tenant="t")
    try:
        old = await store.ledger.get("c", "old")  # first use: migrates
        assert old is not None and (old.state, old.output) == ("done", {"receipt": "old"})
        assert (old.marker, old.attempt, old.replay_of) == (None, None, None)
        # A row from before the columns has no attempt: the same call (tool, arguments)
        # of a resubmission is answered from it, never a fresh effect (issue 30 item 4).
        await _journal(store, "c", "submitting", 1)
        assert await _call(store, "c", "new", 250) == ("done", "old", 1)
    finally:
        await store.aclose()
    engine = create_async_engine(empty_url)
    try:
        async with engine.connect() as conn:
            rows = await conn.execute(sa.text("SELECT version FROM coder_state_schema_version"))
            assert [r[0] for r in rows] == [SCHEMA_VERSION]  # migrated through v3 to the latest
    finally:
        await engine.dispose()
