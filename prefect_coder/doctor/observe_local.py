"""Thin I/O on this side: the state store (read only) and the Prefect API.

The store is read without writing: a SQLite file is opened read-only (a missing file
stays missing), PostgreSQL through the store's own engine settings with a read in
autocommit. Opening the store the usual way would create its tables or upgrade an older
schema — on a shared database, under workers that still run the old version.
"""

from __future__ import annotations

import asyncio
import re
import sqlite3
from dataclasses import replace
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import make_url

from .observed import PrefectObserved, StoreObserved

__all__ = ["observe_prefect", "observe_store"]

#: Bound of every Prefect API call the doctor makes.
PREFECT_TIMEOUT = 15.0


def _one_line(exc: BaseException) -> str:
    """``Class: message`` on one line, without SQLAlchemy's wrapper noise."""
    text = re.sub(r"\(sqlalchemy[^)]*\)\s*", "", str(exc)).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _read_sqlite(path: str, timeout: float) -> tuple[bool, bool, int | None]:
    """(the file exists, has the version table, the version) of a SQLite store, opened
    read-only: a missing file stays missing."""
    from prefect_coder.blocks.state.schema import COMPONENT, schema_version

    if not Path(path).exists():
        return False, False, None
    con = sqlite3.connect(f"{Path(path).as_uri()}?mode=ro", uri=True, timeout=timeout)
    try:
        row = con.execute(
            f"SELECT version FROM {schema_version.name} WHERE component = ?", (COMPONENT,)
        ).fetchone()
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            return True, False, None
        raise
    finally:
        con.close()
    return True, True, None if row is None else int(row[0])


async def _read_postgres(
    url: str, password: str | None, connect_timeout: float
) -> tuple[bool, int | None]:
    from prefect_coder.blocks.state import engines
    from prefect_coder.blocks.state.schema import COMPONENT, schema_version

    parsed = make_url(url)
    engine = engines.get_engine(parsed, password, connect_timeout=connect_timeout, pool_size=1)
    try:
        async with engines.transaction(engine, write=False) as conn:
            has = await conn.run_sync(lambda c: sa.inspect(c).has_table(schema_version.name))
            if not has:
                return False, None
            row = (
                await conn.execute(
                    sa.select(schema_version.c.version).where(
                        schema_version.c.component == COMPONENT
                    )
                )
            ).first()
            return True, None if row is None else int(row[0])
    finally:
        popped = engines.pop_engine(parsed, password)
        if popped is not None:
            await popped.dispose()


async def observe_store(block_name: str | None) -> tuple[StoreObserved, list[str]]:
    """The store a ``ChatStateStore`` block names (or the default one), read only.
    Returns the observation and the secrets it handled (for the report's redaction)."""
    from prefect_coder.blocks import ChatStateStore
    from prefect_coder.blocks.state import SCHEMA_VERSION, StateStoreError

    source = f"ChatStateStore block {block_name!r}" if block_name else "the default store"
    base = StoreObserved(source=source, expected_version=SCHEMA_VERSION)
    try:
        block = ChatStateStore()
        if block_name:
            async with asyncio.timeout(PREFECT_TIMEOUT):
                block = await ChatStateStore.aload(block_name)
        store = block.get_store()
    except (ValueError, RuntimeError, StateStoreError) as exc:
        return replace(base, config_error=str(exc)), []
    except Exception as exc:  # the Prefect API itself (the prefect-api line says more)
        text = str(exc) or f"no answer within {PREFECT_TIMEOUT:.0f} s"
        return replace(base, config_error=f"could not load: {type(exc).__name__}: {text}"), []
    secret = block.password.get_secret_value() if block.password is not None else None
    obs = replace(base, backend=store.backend, url=store.url, tenant=store.tenant)
    try:
        if store.backend == "sqlite":
            path = make_url(store.url).database or ""
            exists, has, version = await asyncio.to_thread(
                _read_sqlite, path, block.connect_timeout
            )
            if not exists:
                return replace(obs, exists=False), []
        else:
            has, version = await asyncio.wait_for(
                _read_postgres(store.url, secret, block.connect_timeout),
                block.connect_timeout + 5,
            )
    except Exception as exc:  # any driver error (asyncpg's are not OSErrors) is the finding
        return replace(obs, connect_error=_one_line(exc)), [s for s in (secret,) if s]
    return replace(obs, has_tables=has, version=version), [s for s in (secret,) if s]


async def observe_prefect(automation_name: str | None = None) -> PrefectObserved:
    """Whether the Prefect API answers, and the state of the zombie-run automation
    (``automation_name``: the name it was applied under; default, its own)."""
    from prefect.settings import get_current_settings

    from prefect_coder.flows.deployments.zombies import PRODUCT_FLOWS, ZOMBIE_AUTOMATION

    name = automation_name or ZOMBIE_AUTOMATION
    url = get_current_settings().api.url
    if not url:
        return PrefectObserved(api_url=None, automation_name=name)
    from prefect.automations import Automation
    from prefect.client.orchestration import get_client

    obs = PrefectObserved(api_url=str(url), automation_name=name)
    try:
        async with asyncio.timeout(PREFECT_TIMEOUT), get_client() as client:
            failed = await client.api_healthcheck()
            if failed is not None:
                return replace(obs, error=f"{type(failed).__name__}: {failed}")
            version = await client.api_version()
    except Exception as exc:  # any client failure is the finding itself
        return replace(obs, error=f"{type(exc).__name__}: {exc}")
    obs = replace(obs, server_version=str(version))
    try:
        async with asyncio.timeout(PREFECT_TIMEOUT):
            found = await Automation.aread(name=name)
    except ValueError:  # "Automation not found"
        return replace(obs, automation_found=False)
    except Exception as exc:
        return replace(obs, automation_error=f"{type(exc).__name__}: {exc}")
    related = found.trigger.model_dump(mode="json").get("match_related") or {}
    specs = related if isinstance(related, list) else [related]
    names: set[str] = set()
    for spec in specs:
        value = spec.get("prefect.resource.name") if isinstance(spec, dict) else None
        names.update([value] if isinstance(value, str) else value or [])
    return replace(
        obs,
        automation_found=True,
        automation_enabled=bool(found.enabled),
        flows_not_covered=tuple(f for f in PRODUCT_FLOWS if f not in names),
    )
