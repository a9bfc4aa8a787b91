"""Store fixtures: every store test runs on a real SQLite file AND the real PostgreSQL.

Isolation on the shared PostgreSQL database comes from a fresh tenant per test
(which also exercises tenant scoping); SQLite tests get a fresh file.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from prefect_coder.blocks import StateStore

BACKENDS = ["sqlite", "postgresql"]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store_url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """A store URL for this test's backend (SQLite: a fresh file under tmp_path)."""
    if backend == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path}/state/state.db"
    return str(request.getfixturevalue("postgres_url"))


@pytest.fixture
def tenant() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def store(store_url: str, tenant: str) -> AsyncIterator[StateStore]:
    """A StateStore on this test's backend with a tenant of its own."""
    s = StateStore(store_url, tenant=tenant, connect_timeout=10.0)
    yield s
    await s.aclose()
