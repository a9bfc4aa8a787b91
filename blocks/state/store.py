"""``StateStore``: the durable store for checkpoints, journal, tool ledger, leases, strays
and the workflow records of the reconciler.

A plain asyncio class, usable with or without Prefect::

    store = StateStore("sqlite+aiosqlite:////var/lib/coder/state.db", tenant="acme")
    await store.checkpoints.set("wf-1042", chat_id, last_seen_message_id=17)
    async with store.lease(chat_key(chat_id), ttl=30):
        ...
    await store.aclose()

Every call is one atomic transaction; ``async with store.transaction() as tx``
groups several writes into one. The schema is created on first use.
"""

from __future__ import annotations

import asyncio
import functools
import os
import sqlite3
import time
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from types import TracebackType
from typing import Any, Self, TypeVar, cast

import sqlalchemy as sa
from pydantic import SecretStr

from . import engines, faults, fencing, schema, sqlite_pool
from ._ops import StoreConnection
from .checkpoints import Checkpoints
from .engines import upsert
from .errors import StateStoreConfigError, StoreUnavailableError
from .journal import Journal
from .leases import HeldLease, HolderGone, Leases
from .ledger import ToolLedger
from .schema import ensure_schema
from .stranded import StrandedChats
from .turns import Turns
from .urls import Backend, parse_store_url
from .workflows import Workflows

T = TypeVar("T")

# (pid, engine cache key) pairs whose schema this process has already ensured.
_schema_ready: set[tuple[int, str]] = set()
#: Store identities by engine cache key: read once per process and database.
_IDENTITIES: dict[Any, str] = {}
# One schema check at a time per loop and store: the callers that arrive meanwhile wait
# for it and then find the schema ready (asyncio locks belong to one loop).
_schema_locks: weakref.WeakKeyDictionary[
    asyncio.AbstractEventLoop, dict[tuple[int, str], asyncio.Lock]
] = weakref.WeakKeyDictionary()


def _guarded_begin(
    begin: Callable[[sa.Connection], None],
    fences: tuple[fencing.Fence, ...],
    conn: sa.Connection,
) -> None:
    """SQLite: BEGIN IMMEDIATE, then the write guard (``fencing``), on the worker in the
    same hop as the transaction's first statement. A refusal raises from here: the
    transaction is rolled back before anything of it ran."""
    begin(conn)
    driver: sqlite3.Connection = conn.connection.driver_connection  # type: ignore[assignment]
    rows = sqlite_pool.driver_rows(
        driver, fencing.guard_sql("sqlite", len(fences)), fencing.guard_params(fences)
    )
    fencing.check(rows[0], fences)


class _TxOps:
    """Ops bound to one open write transaction (see ``StateStore.transaction``)."""

    def __init__(self, store: StateStore, conn: StoreConnection) -> None:
        self._store = store
        self._conn = conn

    @property
    def connection(self) -> StoreConnection:
        return self._conn

    @property
    def backend(self) -> Backend:
        return self._store.backend

    @property
    def tenant(self) -> str:
        return self._store.tenant

    def now(self) -> sa.ColumnElement[float]:
        return self._store.now()

    def clock(self) -> float:
        return self._store.clock()

    @asynccontextmanager
    async def _same(self) -> AsyncIterator[StoreConnection]:
        yield self._conn

    def read(self) -> AbstractAsyncContextManager[StoreConnection]:
        return self._same()

    def write(self) -> AbstractAsyncContextManager[StoreConnection]:
        return self._same()


class StoreTransaction:
    """Repositories sharing ONE write transaction: all their writes commit together."""

    def __init__(self, ops: _TxOps) -> None:
        #: The transaction's own connection, for SQL of the store's own modules.
        self.connection = ops.connection
        self.checkpoints = Checkpoints(ops)
        self.journal = Journal(ops)
        self.ledger = ToolLedger(ops)
        self.stranded = StrandedChats(ops)


class StateStore:
    """Durable chat state over SQLite (sqlite3 on worker threads) or PostgreSQL (asyncpg).

    Args:
        url: ``sqlite+aiosqlite:///PATH`` or ``postgresql+asyncpg://USER@HOST:PORT/DB``;
            None means ``$PREFECT_HOME/prefect-coder/state.db``. Never put the password here.
        password: PostgreSQL password, kept as a SecretStr and only handed to the driver.
        tenant: scopes every key; two tenants never see each other's rows.
        connect_timeout: seconds to connect (and, on SQLite, to wait for the write lock).
        pool_size: PostgreSQL connections per event loop; SQLite connections (worker
            threads) per process.
        transient_retry_s: how long one call keeps trying while the database is
            unreachable or busy (a restart, a failover, another process holding
            SQLite's write lock) before it raises ``StoreUnavailableError`` (retryable);
            0 tries once. On SQLite each attempt also waits up to ``connect_timeout``
            for the write lock. See docs/state-store.md, "Faults of the store".
        clock: this process's wall clock, ``time.time`` (a test of skewed clocks passes
            another): journal entries' ``at`` / ``deadline`` are on it when they are
            handed in and back, and on the database's clock in the store.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        password: SecretStr | str | None = None,
        tenant: str = "default",
        connect_timeout: float = 10.0,
        pool_size: int = 5,
        transient_retry_s: float = 20.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._url, self._backend = parse_store_url(url)
        self._clock = clock
        if not tenant or len(tenant) > 128:
            raise StateStoreConfigError("tenant: must be 1-128 characters (e.g. 'default')")
        if password is not None and not isinstance(password, SecretStr):
            password = SecretStr(password)
        if password is not None and self._backend == "sqlite":
            raise StateStoreConfigError(
                "password: SQLite files take no password; clear the `password` field "
                "or point `url` at PostgreSQL"
            )
        if connect_timeout <= 0:
            raise StateStoreConfigError("connect_timeout: must be > 0 seconds")
        if not 0 <= transient_retry_s <= 3600:  # also rejects NaN
            raise StateStoreConfigError(
                "transient_retry_s: must be 0-3600 seconds (e.g. 20: ride out a restart)"
            )
        self._transient_retry_s = float(transient_retry_s)
        self._password = password
        self._tenant = tenant
        self._connect_timeout = connect_timeout
        self._pool_size = pool_size
        self._cache_key = engines.cache_key(self._url, self._secret())
        self._identity: str | None = None
        self.checkpoints = Checkpoints(self)
        self.journal = Journal(self)
        self.ledger = ToolLedger(self)
        self.stranded = StrandedChats(self)
        self.leases = Leases(self)
        self.turns = Turns(self)
        #: Every workflow the product starts, for ``reconcile-workflows`` (issue 29).
        self.workflows = Workflows(self)

    # --- identity ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The normalised URL (never contains a password)."""
        return self._url.render_as_string(hide_password=True)

    @property
    def backend(self) -> Backend:
        """``"sqlite"`` or ``"postgresql"``."""
        return self._backend

    @property
    def tenant(self) -> str:
        """The tenant every key is scoped by."""
        return self._tenant

    def __repr__(self) -> str:
        pw = ", password=SecretStr('**********')" if self._password is not None else ""
        return f"StateStore(url={self.url!r}{pw}, tenant={self._tenant!r})"

    def _secret(self) -> str | None:
        return None if self._password is None else self._password.get_secret_value()

    # --- connections ------------------------------------------------------------------------

    def now(self) -> sa.ColumnElement[float]:
        """SQL for the database clock, epoch seconds."""
        return engines.db_now(self._backend)

    def clock(self) -> float:
        """This process's wall clock (``time.time()``; the ``clock`` argument): the clock
        journal entries' ``at`` / ``deadline`` are handed in and back on, stored on the
        database's (``journal.py``)."""
        return self._clock()

    def _engine(self) -> engines.AsyncEngine:
        return engines.get_engine(
            self._url,
            self._secret(),
            connect_timeout=self._connect_timeout,
            pool_size=self._pool_size,
        )

    def _sqlite_pool(self) -> sqlite_pool.SqlitePool:
        assert self._url.database
        return engines.get_sqlite_pool(
            self._url.database, connect_timeout=self._connect_timeout, pool_size=self._pool_size
        )

    @property
    def transient_retry_s(self) -> float:
        """How long one call keeps trying through a transient fault."""
        return self._transient_retry_s

    def _retry(self) -> faults.TransientRetry:
        return faults.TransientRetry(self.url, self._backend, self._transient_retry_s)

    def _transaction(
        self,
        write: bool,
        retry: faults.TransientRetry | None = None,
        guard: tuple[fencing.Fence, ...] | None = None,
    ) -> AbstractAsyncContextManager[StoreConnection]:
        if self._backend == "sqlite":
            begin = engines.sqlite_begin(write)
            if guard is not None:
                begin = functools.partial(_guarded_begin, begin, guard)
            return sqlite_pool.transaction(self._sqlite_pool(), begin, write=write, retry=retry)
        return engines.transaction(self._engine(), write=write, retry=retry)

    @property
    def fence_db(self) -> str:
        """Which database this store writes to (no password): a lease's fence applies to
        the writes to its own database only (``fencing``)."""
        return self._cache_key

    def write_fences(self) -> tuple[fencing.Fence, ...]:
        """The fences of the leases the calling context holds on this store
        (``async with store.lease(...)``): every write transaction checks them."""
        return fencing.active(self._cache_key)

    async def run_direct(self, body: sqlite_pool.DirectBody[T]) -> T:
        """SQLite only: ``body(sqlite3_connection, take_writer)`` on a worker in one hop,
        each statement it runs by itself a transaction of its own (see
        ``sqlite_pool.run_direct``): the leases, the turn slot's read, ``store.turns``.

        A body that fails transiently (another process holds the write lock past
        ``connect_timeout``) runs again within ``transient_retry_s``: on SQLite a
        failed statement or BEGIN IMMEDIATE wrote nothing, and the bodies run each
        write in one statement or one transaction, so running them again is safe."""
        assert self._backend == "sqlite"
        retry = self._retry()
        while True:
            try:
                await self.ensure_schema()
                return await sqlite_pool.run_direct(self._sqlite_pool(), body)
            except StoreUnavailableError:
                raise
            except Exception as exc:
                if not await retry.again(exc):
                    raise

    @asynccontextmanager
    async def autocommit(self) -> AsyncIterator[engines.AsyncConnection]:
        """PostgreSQL: a pooled connection in autocommit, for ONE statement that is
        atomic (and durable once it returns) by itself: one round trip, no BEGIN/COMMIT.

        A statement that fails transiently with nothing applied (a connection refused
        or found closed, a serialization failure) runs again, on a fresh connection,
        within ``transient_retry_s``; one whose connection died in flight (it may have
        committed) raises ``StoreUnavailableError`` at once."""
        await self.ensure_schema()
        retry = self._retry()
        conn = _Autocommit(self._engine(), retry)
        try:
            await conn.open()
            yield cast("engines.AsyncConnection", conn)
        except StoreUnavailableError:
            raise
        except Exception as exc:
            if faults.is_transient(exc, raw_network=True):
                raise retry.unavailable(exc, unknown=faults.outcome_unknown(exc)) from exc
            raise
        finally:
            await conn.close()

    async def ensure_schema(self) -> None:
        """Create tables / check the schema version (done automatically on first use)."""
        marker = (os.getpid(), self._cache_key)
        if marker in _schema_ready:
            return
        # Single-flight: a fan-out's workflows all make their first store call at once,
        # and each ran its own check (a write transaction: CREATE TABLE IF NOT EXISTS
        # for six tables, the version row) before the first marked the schema ready —
        # one serialised write transaction per workflow in a fresh worker process, e.g.
        # every agent-fanout-shard run (docs/performance.md, round 9).
        lock = _schema_locks.setdefault(asyncio.get_running_loop(), {}).setdefault(
            marker, asyncio.Lock()
        )
        async with lock:
            if marker in _schema_ready:
                return
            retry = self._retry()
            while True:
                try:
                    # Idempotent (CREATE … IF NOT EXISTS, versioned migrations): run it
                    # again after any transient fault, even one that hit its COMMIT.
                    async with self._transaction(write=True) as conn:
                        await ensure_schema(conn, self.now())
                    break
                except StoreUnavailableError:
                    raise
                except Exception as exc:
                    if not await retry.again(exc, idempotent=True):
                        raise
            _schema_ready.add(marker)

    @asynccontextmanager
    async def _tx(self, write: bool) -> AsyncIterator[StoreConnection]:
        await self.ensure_schema()
        # Connecting (PostgreSQL) and BEGIN (SQLite: the write lock) are tried again
        # within the bound: nothing of the body has run then. A transient fault inside
        # the body (the connection died mid-transaction: rolled back by the server)
        # fails the call as StoreUnavailableError, which the step retries.
        retry = self._retry()
        # A write checks, in its own transaction, the schema version and the fences of
        # the leases its caller holds (``fencing``): SQLite right after BEGIN IMMEDIATE
        # in the same hop, PostgreSQL with one statement before the body's.
        fences = self.write_fences() if write else None
        try:
            async with self._transaction(write, retry, fences) as conn:
                if fences is not None and self._backend == "postgresql":
                    sql = fencing.guard_sql("postgresql", len(fences))
                    params = fencing.guard_params(fences)
                    row = (await conn.exec_driver_sql(sql, params or None)).one()  # type: ignore[attr-defined]
                    fencing.check(row, fences)
                yield conn
        except StoreUnavailableError:
            raise
        except Exception as exc:
            if faults.is_transient(exc, raw_network=True):
                raise retry.unavailable(exc, unknown=faults.outcome_unknown(exc)) from exc
            raise

    def read(self) -> AbstractAsyncContextManager[StoreConnection]:
        """A connection in a read transaction (pooled; checked in after)."""
        return self._tx(False)

    def write(self) -> AbstractAsyncContextManager[StoreConnection]:
        """A connection in a write transaction (SQLite: BEGIN IMMEDIATE)."""
        return self._tx(True)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[StoreTransaction]:
        """Group several writes (checkpoint + journal + ledger ...) into ONE transaction."""
        async with self.write() as conn:
            yield StoreTransaction(_TxOps(self, conn))

    def lease(
        self,
        key: str,
        *,
        holder: str | None = None,
        ttl: float = 30.0,
        wait: float = 60.0,
        poll_interval: float = 0.1,
        renew_interval: float | None = None,
        holder_gone: HolderGone | None = None,
    ) -> AbstractAsyncContextManager[HeldLease]:
        """Hold a lease for a block of code; see ``Leases.hold``."""
        return self.leases.hold(
            key,
            holder=holder,
            ttl=ttl,
            wait=wait,
            poll_interval=poll_interval,
            renew_interval=renew_interval,
            holder_gone=holder_gone,
        )

    async def identity(self) -> str:
        """The store's identity: a random id written once into the database (shared by
        every tenant and every process that opens it), read once per store object.

        Two stores of the same URL on two machines (each worker's local SQLite file under
        the same PREFECT_HOME path) have different identities: that is the point. A
        chat's labels carry its store's identity, and a sweep acts only on chats of its
        own store (``flows/common/labels.py``)."""
        if self._identity is None:
            self._identity = _IDENTITIES.get(self._cache_key)
        if self._identity is None:
            import uuid

            read = sa.select(schema.meta.c.value).where(schema.meta.c.key == "store_id")
            async with self.read() as conn:
                found = (await conn.execute(read)).scalar_one_or_none()
            if found is None:
                # First use: whoever writes first wins, every later reader agrees.
                stmt = (
                    upsert(self._backend, schema.meta)
                    .values(key="store_id", value=str(uuid.uuid4()))
                    .on_conflict_do_nothing(index_elements=[schema.meta.c.key])
                )
                async with self.write() as conn:
                    await conn.execute(stmt)
                    found = (await conn.execute(read)).scalar_one()
            self._identity = _IDENTITIES[self._cache_key] = found
        return self._identity

    async def forget_chat(self, chat_id: str) -> None:
        """Drop a chat's journal, ledger and stranded record at once (after archiving it)."""
        async with self.transaction() as tx:
            await tx.journal.clear(chat_id)
            await tx.ledger.clear(chat_id)
            await tx.stranded.remove(chat_id)

    async def aclose(self) -> None:
        """Release connections (safe to call twice; the next call reconnects).

        PostgreSQL: disposes this event loop's engine. SQLite: stops this process's
        workers for the file (busy ones once their call is done) and its anchor.
        """
        if self._backend == "sqlite":
            assert self._url.database
            engines.close_sqlite_pool(self._url.database)
            return
        engine = engines.pop_engine(self._url, self._secret())
        if engine is not None:
            await engine.dispose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


class _Autocommit:
    """What ``store.autocommit()`` yields: ONE pooled PostgreSQL connection in autocommit
    whose statements are each tried again on a fresh connection after a transient fault
    that applied nothing (``faults``), within the call's bound."""

    def __init__(self, engine: engines.AsyncEngine, retry: faults.TransientRetry) -> None:
        self._engine = engine
        self._retry = retry
        self._conn: engines.AsyncConnection | None = None

    async def open(self) -> None:
        conn = await engines.connect(self._engine, self._retry)
        try:
            await conn.execution_options(isolation_level="AUTOCOMMIT")
        except BaseException:
            await conn.close()
            raise
        self._conn = conn

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()

    async def _again(self, exc: BaseException) -> bool:
        if not await self._retry.again(exc):
            return False
        # The old connection is dead (SQLAlchemy invalidated it): a fresh one.
        try:
            await self.close()
        except Exception:
            pass
        await self.open()
        return True

    async def exec_driver_sql(self, statement: str, parameters: Any = None) -> Any:
        while True:
            assert self._conn is not None
            try:
                return await self._conn.exec_driver_sql(statement, parameters)
            except StoreUnavailableError:
                raise
            except Exception as exc:
                if not await self._again(exc):
                    raise

    async def execute(self, statement: Any, parameters: Any = None) -> Any:
        while True:
            assert self._conn is not None
            try:
                return await self._conn.execute(statement, parameters)
            except StoreUnavailableError:
                raise
            except Exception as exc:
                if not await self._again(exc):
                    raise


__all__ = ["StateStore", "StoreTransaction"]
