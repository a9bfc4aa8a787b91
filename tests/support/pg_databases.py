"""A throwaway database in the session's PostgreSQL cluster, for tests that need one
that does not exist yet or is empty (schema creation, migrations)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator

import asyncpg  # type: ignore[import-untyped]


@contextlib.asynccontextmanager
async def fresh_database(postgres_url: str, prefix: str) -> AsyncIterator[str]:
    """Create an empty database named ``<prefix>_<random>`` next to ``postgres_url``'s
    and yield its URL (same dialect); drop it (forcibly) on exit."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(postgres_url.replace("+asyncpg", ""))
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        yield postgres_url.rsplit("/", 1)[0] + "/" + name
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
