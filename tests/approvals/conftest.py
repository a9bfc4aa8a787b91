"""Fixtures of the approval tests: a fresh emulator per test, a real Prefect test
server whose flow runs are executed by `python -m prefect.engine` subprocesses
(what a process worker runs), like in production."""

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

TOKEN = f"tok-approval-{uuid.uuid4().hex}-SECRET"


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    results = tmp_path_factory.mktemp("approval-results")
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
    with Emulator.running_in_thread(
        tokens=[TOKEN],
        delta_delay=0.0,
        aibridge_providers={
            "openai": "openai",
            "anthropic": "anthropic",
            "corp-claude": "anthropic",
        },
    ) as e:
        yield e
