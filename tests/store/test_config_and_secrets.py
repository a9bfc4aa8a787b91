"""URL validation at the edge, secret hygiene (password never in a row, repr or error)."""

from __future__ import annotations

import json
from pathlib import Path

import asyncpg
import pytest
import sqlalchemy as sa
from pydantic import SecretStr
from sqlalchemy.ext.asyncio import create_async_engine

from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state import JournalEntry, StateStoreConfigError, default_sqlite_path
from prefect_coder.blocks.state.schema import ALL_TABLES


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("mysql://u@h/db", "unsupported scheme 'mysql'"),
        ("postgresql+psycopg2://u@h/db", "unsupported scheme"),
        ("postgresql+asyncpg://u:hunter2@h/db", "`password` field"),
        ("sqlite+aiosqlite://", "needs a file path"),
        ("sqlite+aiosqlite:///:memory:", "needs a file path"),
        ("postgresql+asyncpg:///db", "needs a host"),
        ("postgresql+asyncpg://u@h", "needs a database name"),
        ("not a url", "not a database URL"),
    ],
)
def test_bad_urls_name_the_field_and_fix(url: str, needle: str) -> None:
    with pytest.raises(StateStoreConfigError) as info:
        StateStore(url)
    msg = str(info.value)
    assert msg.startswith("url:") and needle in msg
    assert "hunter2" not in msg


def test_url_normalisation_and_defaults(tmp_path: Path) -> None:
    assert StateStore("postgres://u@h:5433/db").url == "postgresql+asyncpg://u@h:5433/db"
    assert StateStore("postgresql://u@h/db").backend == "postgresql"
    s = StateStore(f"sqlite:///{tmp_path}/x.db")
    assert s.url == f"sqlite+aiosqlite:///{tmp_path}/x.db" and s.backend == "sqlite"
    default = StateStore()
    assert default.url == f"sqlite+aiosqlite:///{default_sqlite_path()}"
    assert default_sqlite_path().parts[-2:] == ("prefect-coder", "state.db")
    with pytest.raises(StateStoreConfigError, match=r"^password: SQLite"):
        StateStore(f"sqlite:///{tmp_path}/x.db", password="pw")
    with pytest.raises(StateStoreConfigError, match=r"^tenant:"):
        StateStore(f"sqlite:///{tmp_path}/x.db", tenant="")


def test_password_never_in_repr_or_url() -> None:
    s = StateStore("postgresql+asyncpg://coder@db:5432/state", password=SecretStr("hunter2"))
    assert "hunter2" not in repr(s) and "hunter2" not in s.url and "**" in repr(s)


async def test_password_is_used_and_never_leaks(postgres_url: str) -> None:
    # The test cluster checks passwords (SCRAM) for every role but the admin over TCP.
    admin = await asyncpg.connect(postgres_url.replace("+asyncpg", ""))
    await admin.execute("CREATE ROLE leak_probe LOGIN SUPERUSER PASSWORD 'right-pw-123'")
    try:
        url = postgres_url.replace("postgres@", "leak_probe@")
        bad = StateStore(url, password="wrong-pw-456", connect_timeout=5)
        with pytest.raises(Exception, match="password authentication failed") as info:
            await bad.checkpoints.get("wf")
        text = f"{info.value!r} {info.value} {info.value.__cause__!r} {info.value.__context__!r}"
        assert "wrong-pw-456" not in text
        await bad.aclose()
        good = StateStore(url, password=SecretStr("right-pw-123"), tenant="leak-probe")
        await good.checkpoints.set("wf", "chat")
        assert (await good.checkpoints.get("wf")) is not None
        await good.aclose()
    finally:
        await admin.execute("REASSIGN OWNED BY leak_probe TO postgres")
        await admin.execute("DROP ROLE leak_probe")
        await admin.close()


async def test_secret_scan_every_row(store: StateStore, store_url: str, backend: str) -> None:
    """Write through every API, then dump every table: no password, no token anywhere."""
    token = "coder-session-token-SECRET-abc123"
    password = "pg-password-SECRET-xyz789"
    if backend == "postgresql":
        admin = await asyncpg.connect(store_url.replace("+asyncpg", ""))
        role = f"scan_{store.tenant.replace('-', '_')}"
        await admin.execute(f"CREATE ROLE {role} LOGIN SUPERUSER PASSWORD '{password}'")
        await admin.close()
        s = StateStore(
            store_url.replace("postgres@", f"{role}@"), password=password, tenant=store.tenant
        )
    else:
        s = store
    await s.checkpoints.set("wf-1", "chat-1", 42)
    await s.journal.set("chat-1", JournalEntry(state="submitting", marker="[wf-1/s1]", attempt=0))
    await s.ledger.begin("chat-1", "call-1", tool_name="charge_card", args={"amount": 5})
    await s.ledger.complete("chat-1", "call-1", {"receipt": "r-1"})
    await s.stranded.record("wf-1", "chat-2", "CoderStreamError")
    await s.workflows.started("workflow:wf-1", deployment="d", parameters={"x": 1}, flow_run_id="r")
    assert await s.identity()  # the store's identity row
    async with s.lease("chat:chat-1", ttl=5):
        dump: list[str] = []
        engine = create_async_engine(store_url)
        async with engine.connect() as conn:
            for table in ALL_TABLES:
                rows = (await conn.execute(sa.select(table))).all()
                assert rows, f"{table.name} is empty: the scan would prove nothing"
                dump.extend(json.dumps([str(v) for v in row]) for row in rows)
        await engine.dispose()
    text = "\n".join(dump)
    assert "chat-1" in text and "charge_card" in text  # the dump does see our data
    assert token not in text and password not in text
    assert "SECRET" not in text
    if s is not store:
        await s.aclose()
        admin = await asyncpg.connect(store_url.replace("+asyncpg", ""))
        await admin.execute(f"REASSIGN OWNED BY {role} TO postgres")
        await admin.execute(f"DROP ROLE {role}")
        await admin.close()
