"""Fixtures of the host-loss tests: the session's Prefect test server (tests/conftest.py),
and a store on SQLite and on the session's PostgreSQL, each in a tenant of its own."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'state.db'}"
    return str(request.getfixturevalue("postgres_url"))


@pytest.fixture
def tenant() -> str:
    return f"hostloss-{uuid.uuid4().hex[:8]}"
