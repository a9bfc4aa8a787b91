"""Fixtures of the fan-out tests: the session's Prefect test server, a fresh emulator per
test (its event log and messages are the measurement), a SQLite store file per test, and
for the tests whose workflows run on process workers the session's PostgreSQL cluster
as the store (a tenant of its own per test), as issue 15 asks of the real path."""

from __future__ import annotations

import sys
import uuid
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


@pytest.fixture
def pg_store(postgres_url: str) -> tuple[str, str]:
    """The session's PostgreSQL as the ``ChatStateStore`` and a tenant of this test's own:
    the cluster is shared by the session, and turn slots and leases are per tenant."""
    return postgres_url, f"fanout-{uuid.uuid4().hex[:8]}"
