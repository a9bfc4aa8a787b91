"""The ``ChatStateStore`` Prefect block: saved configuration + factory for ``StateStore``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Self

from prefect.blocks.core import Block
from pydantic import ConfigDict, Field, SecretStr, field_validator, model_validator

from .bounds import HOUR

if TYPE_CHECKING:
    from .state.store import StateStore

#: ``state.urls.SQLITE_SCHEME``, spelled out: this module is imported with the
#: ``prefect.collections`` entry point in every Prefect process, and ``.state``
#: (SQLAlchemy, ≈ 0.6-0.9 CPU-s) only where a store is opened or a URL checked.
#: ``tests/blocks/test_lazy_state_import.py`` keeps the two equal.
_SQLITE_SCHEME = "sqlite+aiosqlite"


class ChatStateStore(Block):
    """Where durable chat workflows keep checkpoints, the send journal, the client-tool
    ledger, leases and stranded chats: an embedded SQLite file by default (one machine,
    zero set-up) or PostgreSQL (workers on several machines). It never stores the Coder
    token.

    Example:
        Load a saved store and checkpoint a workflow's chat:
        ```python
        from prefect_coder.blocks import ChatStateStore

        state_block = ChatStateStore.load("BLOCK_NAME")
        store = state_block.get_store()
        await store.checkpoints.set("wf-1042", chat_id, last_seen_message_id=17)
        ```

        Point workers on several machines at PostgreSQL:
        ```python
        from prefect_coder.blocks import ChatStateStore

        ChatStateStore(
            url="postgresql+asyncpg://coder@db.internal:5432/coder_state",
            password="...",
        ).save("shared-state")
        ```
    """

    # A rejected URL may carry a password: never echo inputs in validation errors.
    model_config = ConfigDict(hide_input_in_errors=True)

    _block_type_name = "Chat State Store"
    _block_type_slug = "chat-state-store"
    _logo_url = "https://github.com/coder.png?size=200"  # type: ignore[assignment]
    _documentation_url = "https://docs.sqlalchemy.org/en/20/core/engines.html#database-urls"  # type: ignore[assignment]
    _description = (
        "Durable store for Coder chat workflow checkpoints, send journal, tool ledger, "
        "leases and stranded chats (SQLite by default, PostgreSQL for several machines)."
    )

    url: str | None = Field(
        default=None,
        title="Database URL",
        description=(
            "sqlite+aiosqlite:////absolute/path/state.db or "
            "postgresql+asyncpg://USER@HOST:5432/DBNAME, without a password; empty means "
            f"{_SQLITE_SCHEME}:///$PREFECT_HOME/prefect-coder/state.db on the machine that runs "
            "the code."
        ),
    )
    password: SecretStr | None = Field(
        default=None,
        description="PostgreSQL password, kept out of the URL; leave empty for SQLite.",
    )
    tenant: str = Field(
        default="default",
        min_length=1,
        max_length=128,
        description="Scope for every key, so several tenants can share one database.",
    )
    connect_timeout: float = Field(
        default=10.0,
        gt=0,
        le=HOUR,
        description="Seconds to connect, and on SQLite to wait for the write lock.",
    )
    transient_retry_s: float = Field(
        default=20.0,
        ge=0,
        le=HOUR,
        description=(
            "Seconds one store call keeps trying while the database is unreachable or "
            "busy (a restart, a failover, another process holding the write lock) "
            "before the step fails retryably with its chat left live; 0 tries once."
        ),
    )

    @field_validator("url")
    @classmethod
    def _validate_url(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        from .state.urls import parse_store_url

        url, _backend = parse_store_url(value)
        return url.render_as_string(hide_password=True)

    @model_validator(mode="after")
    def _password_needs_postgres(self) -> Self:
        # Fail at construction, naming the field, rather than at first use on a worker.
        if self.password is not None and (self.url is None or self.url.startswith("sqlite")):
            raise ValueError(
                "password: SQLite files take no password; clear the `password` field or set "
                "`url` to a postgresql+asyncpg:// URL"
            )
        return self

    def get_store(self) -> StateStore:
        """A ``StateStore`` for this configuration (cheap: connections are pooled per process)."""
        from .state.store import StateStore

        return StateStore(
            self.url,
            password=self.password,
            tenant=self.tenant,
            connect_timeout=self.connect_timeout,
            transient_retry_s=self.transient_retry_s,
        )
