"""Fixtures of the Prefect-layer tests: a real Prefect test server, a real emulator,
real SQLite and PostgreSQL stores, saved blocks.

* The session's one Prefect test server (``prefect_harness`` in tests/conftest.py):
  heartbeats off, result storage in a fresh temp dir.
* One emulator per session, in its own thread, so flows, worker threads and
  subprocesses all reach it. Tests isolate themselves with unique workflow ids
  and count messages per chat.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from flow_helpers import ROOT, TOKEN

from coder_chat.emulator import Emulator
from prefect_coder.blocks import ChatStateStore, CoderCredentials, StateStore
from prefect_coder.flows.common.params import WorkflowSettings


@dataclass(frozen=True)
class PrefectEnv:
    """The session's Prefect test server and its isolated result storage."""

    api_url: str
    results_dir: Path

    def subprocess_env(self, **extra: str) -> dict[str, str]:
        """Environment for a child process that must use the same server and storage."""
        env = dict(os.environ)
        env.update(
            PREFECT_API_URL=self.api_url,
            PREFECT_RESULTS_LOCAL_STORAGE_PATH=str(self.results_dir),
            PREFECT_LOGGING_LEVEL="WARNING",
            PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        )
        env.update(extra)
        return env


@pytest.fixture(scope="session")
def prefect_env(prefect_harness: Any) -> PrefectEnv:
    return PrefectEnv(prefect_harness.api_url, prefect_harness.results_dir)


@pytest.fixture(scope="session")
def emu() -> Iterator[Emulator]:
    with Emulator.running_in_thread(tokens=[TOKEN], delta_delay=0.0) as e:
        yield e


@pytest.fixture(scope="session")
async def coder_block(prefect_env: PrefectEnv, emu: Emulator) -> str:
    """Name of a saved CoderCredentials block pointing at this ``emu``.

    A name of its own per emulator: tests/sweeps/conftest.py loads these fixtures
    again (a second session ``emu`` with its own ``coder_block``) on the same
    Prefect server, and with one fixed name whichever saved last won. In one
    process that was sweeps (after flows, alphabetically); when a process ran a
    sweeps file before a flows file (pytest-xdist), the flows tests talked to the
    sweeps' emulator and found none of their chats in their own.
    """
    name = f"flows-test-coder-{uuid.uuid4().hex[:8]}"
    await CoderCredentials(
        base_url=emu.base_url,
        organization_id=emu.organization_id,
        token=TOKEN,
        request_timeout=15.0,
        turn_timeout=30.0,
    ).save(name, overwrite=True)
    return name


@pytest.fixture(scope="session")
async def sqlite_block(prefect_env: PrefectEnv, tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("state") / "state.db"
    await ChatStateStore(url=f"sqlite+aiosqlite:///{path}").save(
        "flows-test-sqlite", overwrite=True
    )
    return "flows-test-sqlite"


@pytest.fixture(scope="session")
async def pg_block(prefect_env: PrefectEnv, postgres_url: str) -> str:
    await ChatStateStore(url=postgres_url, tenant="flows-tests").save(
        "flows-test-pg", overwrite=True
    )
    return "flows-test-pg"


@pytest.fixture
def workflow_id(request: pytest.FixtureRequest) -> str:
    """Unique per test: result keys are global within the session's storage."""
    return f"t-{request.node.name[:40].strip('_-[]')}-{uuid.uuid4().hex[:8]}".replace("[", "-")


@pytest.fixture
def settings(coder_block: str, sqlite_block: str) -> WorkflowSettings:
    """Fast settings for tests: no retry delay, short waits, fast redials."""
    return WorkflowSettings(
        credentials_block=coder_block,
        store_block=sqlite_block,
        retries=0,
        retry_delay_s=0,
        lease_wait_s=20,
        lease_ttl_s=10,
        settle_wait_s=5,
        redial_backoff_ms=20,
    )


@pytest.fixture
async def store(sqlite_block: str) -> AsyncIterator[StateStore]:
    s = (await ChatStateStore.aload(sqlite_block)).get_store()
    yield s
    await s.aclose()
