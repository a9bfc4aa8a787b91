"""Fixtures of the reconciler tests: the session's Prefect test server (tests/conftest.py),
a fresh emulator per test (its event log is the measurement), and the fan-out tests'
process fleet helpers (``tests/fanout/fanout_env.py``: deploy, workers, kills) and the
fault tests' private PostgreSQL (``tests/faults/faults_pg.py``), which these tests
reuse rather than copy."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
for extra in (HERE, HERE.parent / "fanout", HERE.parent / "faults"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from fanout_env import TOKEN  # noqa: E402

from coder_chat.emulator import Emulator  # noqa: E402


@pytest.fixture
def emu() -> Iterator[Emulator]:
    with Emulator.running_in_thread(tokens=[TOKEN], delta_delay=0.0) as e:
        yield e
