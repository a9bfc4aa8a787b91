"""SQLite connections on daemon worker threads, shared by every event loop of a process.

Why not aiosqlite under SQLAlchemy's async engine (the earlier design): it starts
a thread and opens the file for every connection, and then hops between the loop
and that thread 8-10 times per call (connect, PRAGMAs, BEGIN, cursor, execute,
fetch, close, COMMIT, reset). On a loaded 2-core machine every hop waits for the
scheduler: the profile in docs/performance.md had the store's four calls per turn
at ≈ 50 ms there. Here a read is ONE hop (BEGIN + SELECT; COMMIT and the
check-in are queued behind it on the same thread) and a write is two (BEGIN
IMMEDIATE + statement, then COMMIT, awaited: a caller only ever hears of a
durable write).

Why per process and not per loop: a worker's ``sqlite3`` connection belongs to
its thread, not to an event loop; any loop can hand it a job and gets the result
back through its own ``call_soon_threadsafe``. Prefect's worker-thread loops
therefore share one set of connections, and a closed loop leaves nothing behind.

Why daemon threads: an idle worker must not hold up interpreter exit (aiosqlite's
threads are not daemons). A worker killed at exit mid-transaction is a crash,
which SQLite's journal rolls back; nothing acknowledged is lost, because a write
is acknowledged only after its COMMIT returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import queue
import sqlite3
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import sqlalchemy as sa

from .faults import TransientRetry

T = TypeVar("T")
Job = Callable[[sa.Connection], Any]

_log = logging.getLogger(__name__)
_Item = tuple[
    Job,
    asyncio.AbstractEventLoop | None,
    asyncio.Future[Any] | None,
    Callable[[], None] | None,
]
_names = itertools.count(1)


def _settle(fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if fut.cancelled():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def _expire(fut: asyncio.Future[Any], timeout: float) -> None:
    if not fut.done():
        fut.set_exception(
            TimeoutError(
                f"no SQLite connection became free within {timeout:.0f}s (connect_timeout)"
            )
        )


class _Worker:
    """One daemon thread owning one SQLAlchemy (sync) connection; runs jobs in order."""

    def __init__(self, engine: sa.Engine) -> None:
        self._engine = engine
        self._jobs: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._conn: sa.Connection | None = None
        #: Holds its pool's writer lock (set and cleared on this worker's thread).
        self.writing = False
        thread = threading.Thread(
            target=self._run, name=f"prefect-coder-sqlite-{next(_names)}", daemon=True
        )
        thread.start()

    def call(self, job: Job, *, then: Callable[[], None] | None = None) -> asyncio.Future[Any]:
        """Queue ``job(conn)``; the future (on the running loop) gets its result.

        ``then()`` runs on the worker right after the job, whatever the job did (even
        when the connection could not be opened): the check-in goes there.
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._jobs.put((job, loop, fut, then))
        return fut

    def post(self, job: Job, *, then: Callable[[], None] | None = None) -> None:
        """Queue ``job(conn)`` without waiting for it (it runs after every earlier job)."""
        self._jobs.put((job, None, None, then))

    def stop(self) -> None:
        """Close the connection and end the thread once the queued jobs are done."""
        self._jobs.put(None)

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                break
            job, loop, fut, then = item
            result: Any = None
            error: BaseException | None = None
            try:
                if self._conn is None:
                    self._conn = self._engine.connect()
                result = job(self._conn)
            except BaseException as exc:
                error = exc
            if then is not None:
                try:
                    then()
                except BaseException:  # pragma: no cover - check-in does not raise
                    _log.exception("SQLite worker follow-up failed")
            if loop is not None and fut is not None:
                # The caller's loop may have closed meanwhile: nobody is left to tell.
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(_settle, fut, result, error)
            elif error is not None:
                _log.debug("background SQLite job failed", exc_info=error)
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()


class SqlitePool:
    """Up to ``size`` workers (connections) for one database file, shared by all loops.

    A transaction holds one worker exclusively from check-out to check-in. Workers
    start on demand; a caller that finds all of them busy waits (at most
    ``checkout_timeout`` seconds) for the next check-in, whichever loop it runs on.
    """

    def __init__(self, engine: sa.Engine, *, size: int, checkout_timeout: float) -> None:
        self.engine = engine
        self._size = max(1, size)
        self._timeout = checkout_timeout
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._started = 0
        self._waiters: deque[tuple[asyncio.AbstractEventLoop, asyncio.Future[_Worker]]] = deque()
        self._closed = False
        # One writer of this process at a time (module docstring: why not SQLite's
        # busy handler alone).
        self._writer = threading.Lock()

    def take_writer(self, worker: _Worker) -> None:
        """Take this process's writer lock for ``worker`` (on its thread), unless it holds
        it already; released at the worker's check-in (after its COMMIT or ROLLBACK)."""
        if worker.writing:
            return
        if not self._writer.acquire(timeout=self._timeout):
            # What SQLAlchemy raises when SQLite's own busy_timeout runs out.
            raise sa.exc.OperationalError(
                "BEGIN IMMEDIATE",
                None,
                sqlite3.OperationalError(
                    f"database is locked (another writer of this process held it "
                    f"for {self._timeout:g}s)"
                ),
            )
        worker.writing = True

    def writer_begin(
        self, worker: _Worker, begin: Callable[[sa.Connection], None]
    ) -> Callable[[sa.Connection], None]:
        """``begin`` preceded, on the worker, by taking this process's writer lock;
        released at the worker's check-in (after its COMMIT or ROLLBACK)."""

        def locked_begin(conn: sa.Connection) -> None:
            self.take_writer(worker)
            try:
                begin(conn)
            except BaseException:
                self._release_writer(worker)
                raise

        return locked_begin

    def _release_writer(self, worker: _Worker) -> None:
        if worker.writing:
            worker.writing = False
            self._writer.release()

    async def checkout(self) -> _Worker:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._idle:
                return self._idle.pop()
            if self._started < self._size:
                self._started += 1
                fut = None
            else:
                fut = loop.create_future()
                self._waiters.append((loop, fut))
        if fut is None:
            return _Worker(self.engine)
        # Not asyncio.wait_for: on Python 3.11 it returns the result instead of raising
        # when a cancellation and the worker arrive together, swallowing the
        # cancellation (a lease renewer cancelled that way never stopped; measured
        # with bench/fanout.py at cap 50).
        timer = loop.call_later(self._timeout, _expire, fut, self._timeout)
        try:
            return await fut
        except BaseException:
            # Cancelled just as a worker arrived: pass it on, never leak it.
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.checkin(fut.result())
            raise
        finally:
            timer.cancel()

    def checkin(self, worker: _Worker) -> None:
        """Hand the worker to the oldest live waiter, else keep it idle (any thread).

        Releases the writer lock the worker's transaction held: a check-in runs on the
        worker right after its COMMIT or ROLLBACK."""
        self._release_writer(worker)
        with self._lock:
            while self._waiters:
                loop, fut = self._waiters.popleft()
                if fut.done():
                    continue
                try:
                    loop.call_soon_threadsafe(self._deliver, fut, worker)
                    return
                except RuntimeError:  # that waiter's loop is closed
                    continue
            if self._closed:
                self._started -= 1
                worker.stop()
            else:
                self._idle.append(worker)

    def _deliver(self, fut: asyncio.Future[_Worker], worker: _Worker) -> None:
        if fut.done():  # it gave up meanwhile: the next waiter gets the worker
            self.checkin(worker)
        else:
            fut.set_result(worker)

    def close(self) -> None:
        """Stop idle workers now and busy ones at check-in (in-flight calls finish)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._started -= len(idle)
        for worker in idle:
            worker.stop()


class ThreadConnection:
    """What the repositories use of ``AsyncConnection``, run on one checked-out worker.

    The transaction's BEGIN travels with its first statement (one hop, not two).
    """

    def __init__(
        self,
        worker: _Worker,
        dialect: sa.Dialect,
        begin: Callable[[sa.Connection], None],
        retry: TransientRetry | None = None,
    ):
        self._worker = worker
        self._begin: Callable[[sa.Connection], None] | None = begin
        self._retry = retry
        self.dialect = dialect

    def _job(self, body: Callable[[sa.Connection], T]) -> asyncio.Future[T]:
        begin, self._begin = self._begin, None
        retry = self._retry

        def job(conn: sa.Connection) -> T:
            if begin is not None:
                _begin_retrying(begin, conn, retry)
            return body(conn)

        return self._worker.call(job)

    async def execute(self, statement: sa.Executable) -> sa.Result[Any]:
        """Execute on the worker; rows come back buffered (the cursor stays there)."""
        return await self._job(functools.partial(_execute_buffered, statement))

    async def run_sync(self, fn: Callable[[sa.Connection], T]) -> T:
        """Run ``fn(sync_connection)`` on the worker, inside this transaction."""
        return await self._job(fn)


def _begin_retrying(
    begin: Callable[[sa.Connection], None], conn: sa.Connection, retry: TransientRetry | None
) -> None:
    """``begin(conn)``, again while it fails transiently (another process holds the write
    lock past ``busy_timeout``; this process's writer lock is busy) within ``retry``'s
    bound. Safe without asking the caller: nothing of the transaction has run yet, so
    its body runs once, after a BEGIN that succeeded (issue 30, item 3)."""
    while True:
        try:
            begin(conn)
            return
        except Exception as exc:
            if conn.in_transaction():
                conn.rollback()
            if retry is None or not retry.again_blocking(exc):
                raise


def _execute_buffered(statement: sa.Executable, conn: sa.Connection) -> sa.Result[Any]:
    result = conn.execute(statement)
    if result.returns_rows:
        return result.freeze()()
    return result


def _finish(commit: bool, conn: sa.Connection) -> None:
    if commit and conn.in_transaction():
        try:
            conn.commit()
        except BaseException:
            conn.rollback()
            raise
    else:
        conn.rollback()


#: ``run_direct``'s body: ``body(sqlite3_connection, take_writer)``.
DirectBody = Callable[[sqlite3.Connection, Callable[[], None]], T]


def driver_rows(conn: sqlite3.Connection, sql: str, params: tuple[Any, ...]) -> list[Any]:
    """Every row of ONE statement on a worker's ``sqlite3`` connection, read to its end.

    Read to its end, the statement is reset: outside BEGIN … COMMIT, i.e. in SQLite's
    autocommit mode, that is when it commits (under ``synchronous=FULL`` durably), so
    a write statement returns only once committed, and a failed one changed nothing
    (statement-level atomicity). Errors come out as SQLAlchemy's, as through
    ``exec_driver_sql``."""
    try:
        return conn.execute(sql, params).fetchall()
    except sqlite3.Error as exc:
        raise sa.exc.DBAPIError.instance(sql, params, exc, sqlite3.Error) from exc


def driver_execute(conn: sqlite3.Connection, sql: str) -> None:
    """``BEGIN IMMEDIATE`` / ``COMMIT`` on the ``sqlite3`` connection; errors as SQLAlchemy's."""
    try:
        conn.execute(sql)
    except sqlite3.Error as exc:
        raise sa.exc.DBAPIError.instance(sql, (), exc, sqlite3.Error) from exc


async def run_direct(pool: SqlitePool, body: DirectBody[T]) -> T:
    """``body(conn, take_writer)`` on a worker's ``sqlite3`` connection in ONE hop, outside
    any SQLAlchemy transaction.

    A statement the body runs by itself (``driver_rows``) is a transaction of its own
    (SQLite's autocommit: one call where ``BEGIN``, statement, ``COMMIT`` were three,
    and none of SQLAlchemy's transaction bookkeeping); several that must commit
    together go between ``BEGIN IMMEDIATE`` and ``COMMIT`` (``driver_execute``). A
    body that writes calls ``take_writer()`` first: this process's writer lock, as
    every write transaction takes it, released at the check-in. Any error rolls back a
    transaction the body left open. A caller cancelled meanwhile does not stop the job:
    it finishes on the worker, then the worker is checked in."""
    worker = await pool.checkout()
    take_writer = functools.partial(pool.take_writer, worker)

    def job(conn: sa.Connection) -> T:
        driver: sqlite3.Connection = conn.connection.driver_connection  # type: ignore[assignment]
        try:
            return body(driver, take_writer)
        except BaseException:
            if driver.in_transaction:
                driver.rollback()
            raise

    return await worker.call(job, then=functools.partial(pool.checkin, worker))


@asynccontextmanager
async def transaction(
    pool: SqlitePool,
    begin: Callable[[sa.Connection], None],
    *,
    write: bool,
    retry: TransientRetry | None = None,
) -> AsyncIterator[ThreadConnection]:
    """One worker, one transaction: committed on success, rolled back on any error.

    A write's COMMIT is awaited; a read's COMMIT and the check-in are queued behind
    it on the worker (nothing to lose), so a one-statement read costs one hop.
    Rollback and check-in also run on the worker, after whatever it is still doing
    for a cancelled caller, so a worker is never handed on mid-transaction. ``retry``:
    a BEGIN that fails transiently is tried again on the worker within its bound.
    """
    worker = await pool.checkout()
    if write:
        begin = pool.writer_begin(worker, begin)
    conn = ThreadConnection(worker, pool.engine.dialect, begin, retry)
    checkin = functools.partial(pool.checkin, worker)
    try:
        yield conn
    except BaseException:
        worker.post(functools.partial(_finish, False), then=checkin)
        raise
    if write:
        await worker.call(functools.partial(_finish, True), then=checkin)
    else:
        worker.post(functools.partial(_finish, True), then=checkin)
