"""A SQLite store loads none of the PostgreSQL-only code: not the PostgreSQL dialect,
not ``sqlalchemy.ext.asyncio`` (which imports the whole ORM). Every flow run is a fresh
process; they cost it ≈ 0.2 CPU-s (docs/performance.md, rounds 10c and 10d). The
PostgreSQL path loads them on first use and works as before (the store tests run on
both backends)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import sqlalchemy.ext.asyncio as sa_asyncio

from prefect_coder.blocks.state import engines

_PG_ONLY = ("sqlalchemy.dialects.postgresql", "sqlalchemy.ext.asyncio", "sqlalchemy.orm")

#: In a fresh interpreter: import the store, open a SQLite file and use every
#: repository that writes with an upsert, a lease and a grouped transaction.
_CHILD = r"""
import asyncio, json, sys
from prefect_coder.blocks.state import StateStore

PG_ONLY = json.loads(sys.argv[2])

def loaded():
    return sorted(m for m in sys.modules if any(m == p or m.startswith(p + ".") for p in PG_ONLY))

after_import = loaded()

async def main():
    store = StateStore("sqlite+aiosqlite:///" + sys.argv[1], tenant="t")
    try:
        await store.checkpoints.set("wf-1", "chat-1", last_seen_message_id=3)
        await store.stranded.record("wf-1", "chat-1", "test")
        async with store.lease("chat:chat-1", ttl=5, wait=1):
            pass
        async with store.transaction() as tx:
            await tx.stranded.remove("chat-1")
        cp = await store.checkpoints.get("wf-1")
        return cp.last_seen_message_id
    finally:
        await store.aclose()

cursor = asyncio.run(main())
print(json.dumps({"after_import": after_import, "after_use": loaded(), "cursor": cursor}))
"""


def test_sqlite_store_loads_no_postgresql_only_module(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path / "state.db"), json.dumps(_PG_ONLY)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["cursor"] == 3  # the store really ran
    # Before round 10d: the dialect, the asyncio extension and the ORM, at import.
    assert seen["after_import"] == []
    assert seen["after_use"] == []


def test_async_names_still_resolve_on_the_module() -> None:
    # store.py annotates with ``engines.AsyncEngine``; resolving it at run time
    # (typing.get_type_hints) gives SQLAlchemy's own classes.
    assert engines.AsyncEngine is sa_asyncio.AsyncEngine
    assert engines.AsyncConnection is sa_asyncio.AsyncConnection
