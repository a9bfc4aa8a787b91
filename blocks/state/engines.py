"""Connections per process (SQLite) or per (process, event loop) (PostgreSQL), and SQL bits.

PostgreSQL: asyncpg connections belong to the loop that opened them, and Prefect
runs tasks in worker threads with their own loops, so each loop gets its own
pooled async engine.

SQLite: one pool of daemon worker threads per process and file, each owning one
``sqlite3`` connection that any loop may use (``sqlite_pool.py`` says why that
beats aiosqlite here). One plain ``sqlite3`` connection per process and file stays
open as an *anchor*: it switches the file to WAL, and while it is open no other
connection closing is ever the file's last, so SQLite never checkpoints and
deletes the WAL on a close (≈ 3-5x slower writes when it did).

The PostgreSQL-only imports (``sqlalchemy.ext.asyncio``, which pulls in the whole
ORM, and the PostgreSQL dialect) load on the first PostgreSQL engine or upsert, not
at import: every flow run is a fresh process, and a SQLite one never needs them
(≈ 0.2 CPU-s per process; docs/performance.md, round 10d).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import select
import sqlite3
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import URL
from sqlalchemy.pool import NullPool

from .faults import TransientRetry
from .sqlite_pool import SqlitePool
from .urls import Backend

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

_ASYNC_NAMES = frozenset({"AsyncConnection", "AsyncEngine"})


def __getattr__(name: str) -> Any:
    # ``engines.AsyncEngine`` / ``engines.AsyncConnection`` (store.py's annotations)
    # still resolve at run time, e.g. for typing.get_type_hints, importing the
    # asyncio extension only then.
    if name in _ASYNC_NAMES:
        import sqlalchemy.ext.asyncio as sa_asyncio

        return getattr(sa_asyncio, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_WRITE_OPTION = "prefect_coder_write"

_lock = threading.Lock()
_anchors: dict[tuple[int, str], sqlite3.Connection] = {}
_sqlite_pools: dict[tuple[int, str], SqlitePool] = {}
_engines: dict[
    tuple[int, str], weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncEngine]
] = {}


def cache_key(url: URL, password: str | None) -> str:
    """Identify an engine configuration without keeping the password in the key."""
    digest = hashlib.sha256((password or "").encode()).hexdigest()[:16]
    return f"{url.render_as_string(hide_password=True)}#{digest}"


def _install_sqlite_hooks(engine: sa.Engine, busy_timeout_ms: int) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Let SQLAlchemy's "begin" hook (below) emit BEGIN itself, so writers can
        # take the write lock up front.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        # FULL: a committed checkpoint survives power loss, not only a process crash.
        cur.execute("PRAGMA synchronous = FULL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: sa.Connection) -> None:
        # BEGIN IMMEDIATE takes the write lock at the start: a read-then-write
        # transaction can then never fail on lock upgrade (SQLITE_BUSY without
        # waiting), and concurrent writers queue on busy_timeout instead.
        statement = "BEGIN IMMEDIATE" if conn.info.get(_WRITE_OPTION) else "BEGIN"
        # On the driver's connection itself: through exec_driver_sql every transaction
        # also built (and threw away) a cursor result, and reading the flag from the
        # execution options copied them — together about a quarter of a worker
        # thread's CPU per store call (docs/performance.md, round 9). Errors come out
        # as SQLAlchemy's, as they did.
        try:
            conn.connection.driver_connection.execute(statement)  # type: ignore[union-attr]
        except sqlite3.Error as exc:
            raise sa.exc.DBAPIError.instance(statement, (), exc, sqlite3.Error) from exc


def _begin_write(conn: sa.Connection) -> None:
    conn.info[_WRITE_OPTION] = True
    conn.begin()


def _begin_read(conn: sa.Connection) -> None:
    conn.info[_WRITE_OPTION] = False
    conn.begin()


def sqlite_begin(write: bool) -> Callable[[sa.Connection], None]:
    """Start a (write: ``BEGIN IMMEDIATE``) transaction on a worker's connection."""
    return _begin_write if write else _begin_read


def _open_anchor(path: str, timeout: float) -> None:
    """Keep the file (and its WAL) open in this process; also switches it to WAL."""
    key = (os.getpid(), path)
    if key in _anchors:
        return
    anchor = sqlite3.connect(path, timeout=timeout, check_same_thread=False)
    # WAL: readers never block the writer and vice versa (persistent in the file).
    mode = anchor.execute("PRAGMA journal_mode = WAL").fetchall()[0][0]
    if str(mode).lower() != "wal":
        anchor.close()
        from .errors import StateStoreConfigError

        raise StateStoreConfigError(
            f"url: SQLite could not switch {path!r} to WAL mode (got {mode!r}); "
            "use a local file system path"
        )
    # A read in WAL mode maps the shared-memory index: from now on closing the other
    # connections never finds itself the last one.
    # fetchall() runs the statement to completion, so the anchor holds no read
    # transaction that would stop checkpoints and let the WAL grow without bound.
    anchor.execute("SELECT count(*) FROM sqlite_master").fetchall()
    _anchors[key] = anchor


def get_sqlite_pool(path: str, *, connect_timeout: float, pool_size: int) -> SqlitePool:
    """This process's worker pool for the SQLite file (created, with the file, on demand)."""
    key = (os.getpid(), path)
    with _lock:
        pool = _sqlite_pools.get(key)
        if pool is None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            _open_anchor(path, connect_timeout)
            # Plain sqlite3 under SQLAlchemy's sync engine; the pool's threads own the
            # connections (NullPool: a connection lives exactly as long as its worker).
            engine = sa.create_engine(
                URL.create("sqlite", database=path),
                poolclass=NullPool,
                connect_args={"timeout": connect_timeout, "check_same_thread": False},
            )
            _install_sqlite_hooks(engine, int(connect_timeout * 1000))
            pool = SqlitePool(engine, size=pool_size, checkout_timeout=connect_timeout)
            _sqlite_pools[key] = pool
        return pool


def close_sqlite_pool(path: str) -> None:
    """Stop this process's workers for the file (busy ones when they finish) and its anchor."""
    key = (os.getpid(), path)
    with _lock:
        pool = _sqlite_pools.pop(key, None)
        anchor = _anchors.pop(key, None)
    if pool is not None:
        pool.close()
    if anchor is not None:
        anchor.close()


#: Test a pooled PostgreSQL connection with a round trip before handing it out
#: (SQLAlchemy's ``pool_pre_ping``). Off: the local check below finds the connections
#: a restart closed for nothing, and the store runs a statement whose connection was
#: found closed again on a fresh one (docs/performance.md, "Pre-ping or a local check").
PRE_PING = False


def _drop_closed(dbapi_conn: Any, _record: Any, _proxy: Any) -> None:
    """Pool check-out hook: a connection the server closed (a restart, a failover,
    ``pg_terminate_backend``) is replaced before anyone uses it, without a round trip.

    An idle connection has nothing to read; one the server closed has its goodbye (an
    ``ErrorResponse`` 57P01) or the socket's end waiting — also when the event loop has
    not run since (a loop that was blocked, a worker thread's loop between tasks), so
    asyncpg has not marked it closed yet. One ``poll(0)`` on the socket sees both (a
    system call, no round trip); SQLAlchemy then discards the connection and opens
    another (``DisconnectionError``, up to 3 times). A connection that dies after the
    check fails its statement — ``store.autocommit()`` runs it again when nothing was
    applied, and SQLAlchemy recycles the rest of the pool on that first failure.
    """
    raw = getattr(dbapi_conn, "_connection", None)
    if raw is None:
        return
    is_closed = getattr(raw, "is_closed", None)
    if is_closed is not None and is_closed():
        raise sa.exc.DisconnectionError("the server closed this pooled connection")
    transport = getattr(raw, "_transport", None)
    if transport is None or transport.get_extra_info("ssl_object") is not None:
        # TLS: records the loop has not read yet (e.g. session tickets) are not a
        # goodbye; such a connection relies on is_closed() and the statement retry.
        return
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN | select.POLLPRI)
    if poller.poll(0):
        raise sa.exc.DisconnectionError("the server ended this pooled connection")


def _create(url: URL, password: str | None, connect_timeout: float, pool_size: int) -> AsyncEngine:
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(
        url.set(password=password) if password is not None else url,
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_timeout=connect_timeout,
        pool_pre_ping=PRE_PING,
        connect_args={
            "timeout": connect_timeout,
            "server_settings": {"application_name": "prefect-coder-state"},
        },
    )
    event.listen(engine.sync_engine, "checkout", _drop_closed)
    return engine


def get_engine(
    url: URL,
    password: str | None,
    *,
    connect_timeout: float,
    pool_size: int,
) -> AsyncEngine:
    """The PostgreSQL engine for this URL in this process on the running loop (on demand)."""
    loop = asyncio.get_running_loop()
    key = (os.getpid(), cache_key(url, password))
    with _lock:
        _forget_closed_loops()
        per_loop = _engines.setdefault(key, weakref.WeakKeyDictionary())
        engine = per_loop.get(loop)
        if engine is None:
            engine = _create(url, password, connect_timeout, pool_size)
            per_loop[loop] = engine
        return engine


def _forget_closed_loops() -> None:
    """Drop engines whose event loop has closed without ``aclose()`` (caller holds _lock).

    A pooled asyncpg connection references its loop, so the weak key alone never lets go
    (``asyncio.run()`` per call in a worker thread would pile up engines and open
    PostgreSQL connections). The loop is gone, so the connections cannot be closed
    politely: dereference the pool and let garbage collection close the sockets.
    """
    for per_loop in _engines.values():
        for loop in [lp for lp in per_loop if lp.is_closed()]:
            engine = per_loop.pop(loop)
            engine.sync_engine.dispose(close=False)


def pop_engine(url: URL, password: str | None) -> AsyncEngine | None:
    """Forget (and return, for disposal) this loop's PostgreSQL engine for the URL."""
    loop = asyncio.get_running_loop()
    key = (os.getpid(), cache_key(url, password))
    with _lock:
        per_loop = _engines.get(key)
        return per_loop.pop(loop, None) if per_loop is not None else None


async def connect(engine: AsyncEngine, retry: TransientRetry | None = None) -> AsyncConnection:
    """A pooled PostgreSQL connection (pre-pinged: a connection the server closed is
    replaced), tried again while the server refuses or drops connections (a restart,
    a failover) within ``retry``'s bound. Nothing is sent before it returns, so
    retrying it is always safe."""
    while True:
        try:
            return await engine.connect()
        except Exception as exc:
            if retry is None or not await retry.again(exc):
                raise


@asynccontextmanager
async def transaction(
    engine: AsyncEngine, *, write: bool, retry: TransientRetry | None = None
) -> AsyncIterator[AsyncConnection]:
    """One pooled PostgreSQL connection; a write runs in one transaction (committed on
    success, rolled back on error).

    A read runs in autocommit: under PostgreSQL's READ COMMITTED every statement takes
    its own snapshot whether or not a transaction wraps it, so BEGIN and COMMIT would
    add two round trips per read and no guarantee (measured: they were most of a read's
    cost on a loaded machine).
    """
    conn = await connect(engine, retry)
    try:
        if not write:
            await conn.execution_options(isolation_level="AUTOCOMMIT")
            yield conn
            return
        await conn.execution_options(**{_WRITE_OPTION: True})
        async with conn.begin():
            yield conn
    finally:
        # As ``async with conn`` would: back to the pool even when cancelled.
        await asyncio.shield(conn.close())


# The database clock in Unix epoch seconds: the one place it is spelled. ``julianday``
# counts days from noon, 4714 BC (2440587.5 is the Unix epoch); ``clock_timestamp()``
# is the wall clock now, not the transaction's start (``now()``), so a lease's expiry
# is measured from when its statement runs.
_NOW_SQL: dict[Backend, str] = {
    "sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
    "postgresql": "CAST(EXTRACT(epoch FROM clock_timestamp()) AS DOUBLE PRECISION)",
}


def db_now_sql(backend: Backend) -> str:
    """The database clock in Unix epoch seconds as SQL text, for the store's fixed-text
    statements run through the driver (leases, ``store.turns``)."""
    return _NOW_SQL[backend]


def db_now(backend: Backend) -> sa.ColumnElement[float]:
    """The database clock in Unix epoch seconds, so machines with skewed clocks agree."""
    return sa.literal_column(db_now_sql(backend), sa.Double)


def upsert(backend: Backend, table: sa.Table) -> Any:
    """``INSERT`` with ON CONFLICT support; SQLite and PostgreSQL share the same API."""
    if backend == "sqlite":
        return sqlite_dialect.insert(table)
    from sqlalchemy.dialects import postgresql as pg_dialect

    return pg_dialect.insert(table)
