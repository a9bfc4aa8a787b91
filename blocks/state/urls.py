"""Validate and normalise state-store URLs at the edge.

Only two backends exist: ``sqlite+aiosqlite`` (default, one machine) and
``postgresql+asyncpg`` (workers on several machines). The password is never
part of the URL: it travels separately as a SecretStr so that a saved block,
a log line or an error can never show it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

Backend = Literal["sqlite", "postgresql"]

SQLITE_SCHEME = "sqlite+aiosqlite"
POSTGRES_SCHEME = "postgresql+asyncpg"

_ALIASES = {
    "sqlite": SQLITE_SCHEME,
    SQLITE_SCHEME: SQLITE_SCHEME,
    "postgresql": POSTGRES_SCHEME,
    "postgres": POSTGRES_SCHEME,
    POSTGRES_SCHEME: POSTGRES_SCHEME,
}

_EXAMPLES = (
    "use sqlite+aiosqlite:////absolute/path/state.db (one machine) or "
    "postgresql+asyncpg://USER@HOST:5432/DBNAME (several machines; put the password "
    "in the `password` field)"
)


def default_sqlite_path() -> Path:
    """``$PREFECT_HOME/prefect-coder/state.db`` on the machine that runs the code."""
    from prefect.settings import get_current_settings

    return Path(get_current_settings().home).expanduser() / "prefect-coder" / "state.db"


def default_url() -> str:
    """The default store URL: an embedded SQLite file under PREFECT_HOME."""
    return f"{SQLITE_SCHEME}:///{default_sqlite_path()}"


def _err(msg: str) -> ValueError:
    from .errors import StateStoreConfigError

    return StateStoreConfigError(msg)


def parse_store_url(raw: str | None) -> tuple[URL, Backend]:
    """Parse, validate and normalise a store URL; ``None`` means the default file.

    Raises StateStoreConfigError naming the ``url`` field and the fix.
    """
    text = default_url() if raw is None or not raw.strip() else raw.strip()
    try:
        url = make_url(text)
    except ArgumentError:
        raise _err(f"url: not a database URL; {_EXAMPLES}") from None
    scheme = _ALIASES.get(url.drivername)
    if scheme is None:
        raise _err(f"url: unsupported scheme {url.drivername!r}; {_EXAMPLES}")
    if url.password is not None:
        raise _err(
            "url: contains a password; remove it from the URL and set the separate "
            "`password` field (a SecretStr) so it is never stored or logged in clear"
        )
    url = url.set(drivername=scheme)
    if scheme == SQLITE_SCHEME:
        db = url.database
        if not db or db == ":memory:" or db.startswith("file:"):
            raise _err(
                "url: the SQLite store needs a file path (an in-memory database is not "
                f"durable and not shared between connections); {_EXAMPLES}"
            )
        if url.query:
            raise _err("url: query options are not supported for SQLite; give only the path")
        return url.set(database=str(Path(db).expanduser().resolve())), "sqlite"
    if not url.host and "host" not in url.query:
        raise _err(f"url: a PostgreSQL URL needs a host; {_EXAMPLES}")
    if not url.database:
        raise _err(f"url: a PostgreSQL URL needs a database name; {_EXAMPLES}")
    return url, "postgresql"
