"""Fixtures of the fan-out tests: the session's Prefect test server, a fresh emulator per
test (its event log and messages are the measurement) and a SQLite store file per test."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from fanout_env import TOKEN  # noqa: E402

from coder_chat.emulator import Emulator  # noqa: E402


@pytest.fixture
def emu() -> Iterator[Emulator]:
    with Emulator.running_in_thread(tokens=[TOKEN], delta_delay=0.0) as e:
        yield e


@pytest.fixture
def store_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'state.db'}"
