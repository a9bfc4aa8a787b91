"""Fixtures of the fleet tests: a real Prefect test server (one per session, heartbeats
off, results in a fresh temp dir), a fresh emulator per test (its event log is the
measurement), a SQLite store file per test and saved blocks pointing at both."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fleet_env import TOKEN

from coder_chat.emulator import Emulator


@pytest.fixture
def emu() -> Iterator[Emulator]:
    # No emulator capacity limit: the cap under test must be ours, measured by the server.
    with Emulator.running_in_thread(tokens=[TOKEN], delta_delay=0.0) as e:
        yield e


@pytest.fixture
def store_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'state.db'}"
