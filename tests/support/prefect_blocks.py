"""Saved blocks and workflow settings for tests that run workflows against the emulator.

A test that runs workflows through Prefect (in process, in a child process or on a
worker) passes them ``WorkflowSettings`` naming a ``CoderCredentials`` block and a
``ChatStateStore`` block. Each test saves blocks of its own, under fresh names: the
session's Prefect server is shared by every test, and a block saved under a fixed
name would point another test's workflows at this test's emulator or store.

Importable as ``support.prefect_blocks``: ``tests/`` is on ``sys.path`` under pytest
(``tests/conftest.py`` has no package), and ``tests/fanout/fanout_env.py`` puts it
there for ``bench/fanout.py``, which imports that module outside pytest.
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import SecretStr

from coder_chat.emulator import Emulator
from prefect_coder.blocks import ChatStateStore, CoderCredentials
from prefect_coder.flows.common.params import WorkflowSettings

__all__ = ["QUICK_SETTINGS", "emulator_credentials", "save_settings"]

#: Short, test-sized defaults of ``WorkflowSettings`` (production: retries with a 5 s
#: delay, a 60 s lease, a longer settle wait): a failure shows at once, and a crashed
#: holder's lease lapses within the test. Keyword arguments of ``save_settings``
#: override them.
QUICK_SETTINGS: dict[str, Any] = {
    "retries": 0,
    "retry_delay_s": 0,
    "lease_ttl_s": 5,
    "settle_wait_s": 2,
    "redial_backoff_ms": 20,
    "artifacts": False,
}


def emulator_credentials(emu: Emulator, token: str, **fields: Any) -> CoderCredentials:
    """Credentials for ``emu`` with ``token`` (one of the tokens it was started with):
    15 s requests and 30 s turns unless ``fields`` say otherwise (e.g. a turn cap:
    ``max_concurrent_turns``, ``turn_slot_wait``, ``turn_slot_ttl``)."""
    values: dict[str, Any] = {"request_timeout": 15.0, "turn_timeout": 30.0, **fields}
    return CoderCredentials(
        base_url=emu.base_url,
        organization_id=uuid.UUID(str(emu.organization_id)),
        token=SecretStr(token),
        **values,
    )


async def save_settings(
    prefix: str,
    credentials: CoderCredentials,
    store_url: str,
    *,
    tenant: str | None = None,
    **settings: Any,
) -> WorkflowSettings:
    """Save ``credentials`` and a ``ChatStateStore`` for ``store_url`` (and ``tenant``)
    as blocks named ``<prefix>-coder-<random>`` and ``<prefix>-store-<random>``, and
    return the settings that name them: :data:`QUICK_SETTINGS` updated with
    ``settings``."""
    name = uuid.uuid4().hex[:10]
    credentials_block, store_block = f"{prefix}-coder-{name}", f"{prefix}-store-{name}"
    await credentials.save(credentials_block, overwrite=True)
    # The block's own default tenant unless one is named (a PostgreSQL cluster is
    # shared by the session: a tenant of its own keeps the test's rows apart).
    store = (
        ChatStateStore(url=store_url)
        if tenant is None
        else ChatStateStore(url=store_url, tenant=tenant)
    )
    await store.save(store_block, overwrite=True)
    return WorkflowSettings(
        credentials_block=credentials_block,
        store_block=store_block,
        **{**QUICK_SETTINGS, **settings},
    )
