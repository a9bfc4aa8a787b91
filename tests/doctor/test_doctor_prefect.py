"""The doctor with the Prefect side real: a saved CoderCredentials block, a ChatStateStore
block on PostgreSQL (its own role, with a password), the session's Prefect test server,
and the zombie-run automation before and after ``apply``."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import pytest
from pydantic import SecretStr
from sqlalchemy.engine import make_url

from coder_chat.emulator import Emulator
from prefect_coder.blocks import ChatStateStore, CoderCredentials
from prefect_coder.doctor.local_verdicts import ZOMBIE_AUTOMATION as SPELLED_OUT
from prefect_coder.flows.deployments.zombies import ZOMBIE_AUTOMATION, apply_zombie_automation

from .helpers import TOKEN, assert_no_secret

pytestmark = pytest.mark.usefixtures("prefect_server")

PASSWORD = "pw-Vb7Kq2Xr9Tn4Lm8Zs3"


async def _role_and_database(postgres_url: str) -> tuple[str, str]:
    """A login role with a password and an empty database it owns; returns (url, name)."""
    name = f"doctor_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(postgres_url.replace("+asyncpg", ""))
    try:
        await admin.execute(f"CREATE ROLE {name} LOGIN PASSWORD '{PASSWORD}'")
        await admin.execute(f'CREATE DATABASE "{name}" OWNER {name}')
    finally:
        await admin.close()
    url = make_url(postgres_url).set(username=name, database=name)
    return url.render_as_string(hide_password=False), name


async def _drop(postgres_url: str, name: str) -> None:
    admin = await asyncpg.connect(postgres_url.replace("+asyncpg", ""))
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.execute(f"DROP ROLE IF EXISTS {name}")
    finally:
        await admin.close()


def test_the_verdicts_name_the_same_automation() -> None:
    assert SPELLED_OUT == ZOMBIE_AUTOMATION


@pytest.mark.chatd_emulator(tokens=[TOKEN])
def test_blocks_store_and_automation(
    chatd_emulator: Emulator, postgres_url: str, doctor: Any
) -> None:
    suffix = uuid.uuid4().hex[:8]
    coder_block, store_block, bad_store = (
        f"doctor-{k}-{suffix}" for k in ("coder", "store", "bad")
    )
    automation = f"doctor-zombie-{suffix}"
    url, db = asyncio.run(_role_and_database(postgres_url))

    async def save() -> None:
        creds = CoderCredentials(
            base_url=chatd_emulator.base_url,
            organization_id=uuid.UUID(chatd_emulator.organization_id),
            token=SecretStr(TOKEN),
            max_concurrent_turns=3,
        )
        await creds.asave(coder_block, overwrite=True)
        await ChatStateStore(url=url, password=SecretStr(PASSWORD)).asave(store_block)
        await ChatStateStore(url=url, password=SecretStr("wrong-" + PASSWORD)).asave(bad_store)

    asyncio.run(save())
    args = ("--credentials-block", coder_block, "--automation-name", automation)
    try:
        run = doctor(*args, "--store-block", store_block, env={})
        assert run.exit_code == 0, run.output
        assert f"CoderCredentials block {coder_block!r}" in run.line("credentials")
        # The block's fleet cap is within chatd's default capacity.
        assert run.line("limits").startswith("OK    limits  ")
        assert "fleet cap 3 turn(s)" in run.line("limits")
        store_line = run.line("store")
        assert store_line.startswith("OK    store")
        assert f"PostgreSQL postgresql+asyncpg://{db}@" in store_line
        assert "no tables yet" in store_line  # read without writing: nothing created
        assert run.line("prefect-api").startswith("OK    prefect-api")
        auto = run.line("automations")
        assert auto.startswith("WARN  automations") and "is not applied" in auto
        assert f"prefect-coder automations apply --name '{automation}'" in auto

        # A store a worker opened: its schema version. And the automation applied.
        async def open_and_apply() -> None:
            block = await ChatStateStore.aload(store_block)
            async with block.get_store() as store:
                await store.ensure_schema()
            await apply_zombie_automation(within_s=3600.0, name=automation)

        asyncio.run(open_and_apply())
        run = doctor(*args, "--store-block", store_block, env={})
        assert run.exit_code == 0, run.output
        from prefect_coder.blocks.state import SCHEMA_VERSION

        assert f"schema version {SCHEMA_VERSION}" in run.line("store")
        assert run.line("automations").startswith("OK    automations")

        # An automation applied for fewer flows (an older prefect-coder) is a warning.
        asyncio.run(
            apply_zombie_automation(within_s=3600.0, flows=["agent-workflow"], name=automation)
        )
        run = doctor(*args, "--store-block", store_block, env={})
        assert "does not cover agent-turn" in run.line("automations")

        # A wrong password: the store line fails, and shows no piece of either password.
        run = doctor(*args, "--store-block", bad_store, env={})
        assert run.exit_code == 1
        bad = run.line("store")
        assert bad.startswith("FAIL  store") and "cannot be read" in bad
        assert "password" in bad  # the fix names the field
        for secret in (PASSWORD, TOKEN):
            assert_no_secret(run.output + run.logs, secret)

        # Blocks that do not exist are named, with how to create them.
        run = doctor("--credentials-block", "no-such-block-" + suffix, env={})
        assert run.exit_code == 1
        assert "no CoderCredentials block named" in run.line("credentials")
        run = doctor(*args, "--store-block", "no-such-store-" + suffix, env={})
        assert run.line("store").startswith("FAIL  store")
    finally:

        async def cleanup() -> None:
            from prefect.automations import Automation

            try:
                found = await Automation.aread(name=automation)
            except ValueError:
                pass
            else:
                await found.adelete()

        asyncio.run(cleanup())
        asyncio.run(_drop(postgres_url, db))
