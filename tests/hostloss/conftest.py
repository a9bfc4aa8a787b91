"""Fixtures of the host-loss tests: the session's Prefect test server (tests/conftest.py),
a store on SQLite and on the session's PostgreSQL, each in a tenant of its own, and an
emulator (a waiter asks it whether a dead holder's turn still runs)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from coder_chat.emulator import Emulator
from prefect_coder.blocks import CoderCredentials

TOKEN = f"tok-hostloss-{uuid.uuid4().hex}-SECRET"


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'state.db'}"
    return str(request.getfixturevalue("postgres_url"))


@pytest.fixture
def tenant() -> str:
    return f"hostloss-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def emu() -> Iterator[Emulator]:
    # No emulator capacity limit: the cap under test is ours, measured by the server.
    with Emulator.running_in_thread(tokens=[TOKEN], delta_delay=0.0) as e:
        yield e


@pytest.fixture
def creds(emu: Emulator) -> CoderCredentials:
    return CoderCredentials(
        base_url=emu.base_url,
        organization_id=uuid.UUID(str(emu.organization_id)),
        token=SecretStr(TOKEN),
        request_timeout=15.0,
        turn_timeout=30.0,
    )
