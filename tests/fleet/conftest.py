"""Fixtures of the fleet tests: a real Prefect test server (one per session, heartbeats
off, results in a fresh temp dir), a fresh emulator per test (its event log is the
measurement), a SQLite store file per test and saved blocks pointing at both."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect.settings import (
    PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
    PREFECT_LOGGING_LEVEL,
    PREFECT_RESULTS_LOCAL_STORAGE_PATH,
    temporary_settings,
)
from prefect.testing.utilities import prefect_test_harness

from coder_chat.emulator import Emulator

TOKEN = f"tok-fleet-{uuid.uuid4().hex}-SECRET"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    results = tmp_path_factory.mktemp("fleet-results")
    with temporary_settings(
        updates={
            PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None,
            PREFECT_RESULTS_LOCAL_STORAGE_PATH: results,
            PREFECT_LOGGING_LEVEL: "WARNING",
        }
    ):
        with prefect_test_harness(server_startup_timeout=60):
            yield results


@pytest.fixture
def emu() -> Iterator[Emulator]:
    # No emulator capacity limit: the cap under test must be ours, measured by the server.
    with Emulator.running_in_thread(tokens=[TOKEN], delta_delay=0.0) as e:
        yield e


@pytest.fixture
def store_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'state.db'}"
