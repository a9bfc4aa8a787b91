"""Fixtures of the sweep tests.

The Prefect test server, the session emulator and the credentials block are the
ones of ``tests/flows/conftest.py`` (loaded from there, not copied). Every test
gets its own store tenant: the labels carry the tenant and the sweeps list by it,
so a test's sweep sees only that test's chats even though the emulator is shared.
"""

from __future__ import annotations

import importlib.util
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from coder_chat.rest import ChatClient
from prefect_coder.blocks import ChatStateStore, StateStore
from prefect_coder.flows.common.params import WorkflowSettings
from prefect_coder.flows.sweeps.options import SweepOptions

_FLOWS_TESTS = Path(__file__).resolve().parents[1] / "flows"
if str(_FLOWS_TESTS) not in sys.path:
    sys.path.insert(0, str(_FLOWS_TESTS))  # its conftest imports flow_helpers


def _load_flows_conftest() -> object:
    spec = importlib.util.spec_from_file_location(
        "_sweeps_flows_conftest", _FLOWS_TESTS / "conftest.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


_flows = _load_flows_conftest()
prefect_env = _flows.prefect_env  # type: ignore[attr-defined]
emu = _flows.emu  # type: ignore[attr-defined]
coder_block = _flows.coder_block  # type: ignore[attr-defined]
workflow_id = _flows.workflow_id  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def state_db(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('sweep-state') / 'state.db'}"


@pytest.fixture
def tenant() -> str:
    return f"sweep-{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def store_block(prefect_env: object, state_db: str, tenant: str) -> str:
    name = f"sweeps-{tenant}"
    await ChatStateStore(url=state_db, tenant=tenant).save(name, overwrite=True)
    return name


@pytest.fixture
async def store(state_db: str, tenant: str) -> AsyncIterator[StateStore]:
    s = StateStore(state_db, tenant=tenant)
    yield s


@pytest.fixture
def settings(coder_block: str, store_block: str) -> WorkflowSettings:
    """Fast settings: no retries, short waits, fast redials."""
    return WorkflowSettings(
        credentials_block=coder_block,
        store_block=store_block,
        retries=0,
        retry_delay_s=0,
        lease_wait_s=20,
        lease_ttl_s=10,
        settle_wait_s=5,
        redial_backoff_ms=20,
        artifacts=False,
    )


@pytest.fixture
def options() -> SweepOptions:
    """Short bounds: archive retries 50 ms apart, brief lease waits."""
    return SweepOptions(
        concurrency=4,
        page_size=7,
        page_overlap=2,
        lease_wait_s=0.2,
        lease_ttl_s=10,
        interrupt_bound_s=5,
        archive_settle_s=5,
        archive_retry_s=0.05,
        request_timeout_s=10,
    )


@pytest.fixture
async def client(emu: object) -> AsyncIterator[ChatClient]:
    from flow_helpers import TOKEN

    async with ChatClient(
        emu.base_url,  # type: ignore[attr-defined]
        TOKEN,
        organization_id=emu.organization_id,  # type: ignore[attr-defined]
    ) as c:
        yield c
