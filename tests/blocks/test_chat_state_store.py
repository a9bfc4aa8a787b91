"""ChatStateStore block: thin config + factory over StateStore, validated at the edge."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError

from prefect_coder.blocks import ChatStateStore, StateStore
from prefect_coder.blocks.state import default_sqlite_path


def test_default_is_sqlite_under_prefect_home() -> None:
    block = ChatStateStore()
    assert block.url is None and block.tenant == "default"
    store = block.get_store()
    assert isinstance(store, StateStore) and store.backend == "sqlite"
    assert store.url == f"sqlite+aiosqlite:///{default_sqlite_path()}"


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"url": "mysql://u@h/db"}, "url: unsupported scheme"),
        ({"url": "postgresql://u:pw-SECRET@h/db"}, "url: contains a password"),
        ({"password": "pw-SECRET"}, "password: SQLite files take no password"),
        ({"url": "sqlite:///tmp/x.db", "password": "pw-SECRET"}, "password: SQLite"),
        ({"tenant": ""}, "tenant"),
        ({"connect_timeout": 0}, "connect_timeout"),
    ],
)
def test_bad_config_names_field_and_fix(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ValidationError) as info:
        ChatStateStore(**kwargs)  # type: ignore[arg-type]
    text = str(info.value)
    assert needle in text
    assert "pw-SECRET" not in text


def test_url_is_normalised_and_password_masked() -> None:
    block = ChatStateStore(url="postgres://coder@db:5432/state", password=SecretStr("pw-SECRET"))
    assert block.url == "postgresql+asyncpg://coder@db:5432/state"
    for text in (repr(block), str(block.model_dump()), block.model_dump_json()):
        assert "pw-SECRET" not in text
    store = block.get_store()
    assert store.backend == "postgresql" and "pw-SECRET" not in repr(store)


async def test_get_store_works_on_sqlite(tmp_path: Path) -> None:
    block = ChatStateStore(url=f"sqlite:///{tmp_path}/s/state.db", tenant="acme")
    store = block.get_store()
    assert store.tenant == "acme"
    await store.checkpoints.set("wf", "chat", 3)
    # A second factory call (e.g. another task) sees the same data.
    got = await block.get_store().checkpoints.get("wf")
    assert got is not None and got.last_seen_message_id == 3
    await store.aclose()


async def test_get_store_works_on_postgres_with_password(postgres_url: str) -> None:
    import asyncpg

    admin = await asyncpg.connect(postgres_url.replace("+asyncpg", ""))
    await admin.execute("CREATE ROLE block_probe LOGIN SUPERUSER PASSWORD 'pw-SECRET-1'")
    try:
        block = ChatStateStore(
            url=postgres_url.replace("postgres@", "block_probe@"),
            password=SecretStr("pw-SECRET-1"),
            tenant="block-test",
        )
        store = block.get_store()
        await store.checkpoints.set("wf", "chat", 9)
        got = await store.checkpoints.get("wf")
        assert got is not None and got.last_seen_message_id == 9
        await store.aclose()
    finally:
        await admin.execute("REASSIGN OWNED BY block_probe TO postgres")
        await admin.execute("DROP ROLE block_probe")
        await admin.close()
