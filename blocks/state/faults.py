"""The store's one fault model: which database errors are transient, and whether a
failed write may still have committed.

*Transient* — the same call, made again a little later, may succeed; nothing is
wrong with the configuration or the data:

* the connection is gone or cannot be made yet: a pooled connection the server
  closed (restart, failover, ``pg_terminate_backend``), a connection refused or
  reset while the server restarts, PostgreSQL's SQLSTATE class 08 (connection
  exception), 57P01/57P02/57P03 (admin shutdown, crash shutdown, "cannot connect
  now" while it starts), 53300 (too many connections), 57014 (statement cancelled);
* the database is busy: SQLite's ``database is locked`` / ``busy`` (another
  process holds the write lock past ``busy_timeout``), this process's own
  connection pool exhausted for ``connect_timeout``, PostgreSQL's 40001
  (serialization failure) and 40P01 (deadlock detected).

*Permanent* — everything else: schema (42xxx, a missing table or column), auth and
configuration (28xxx, 3D000, a bad URL), constraint violations (23xxx: a bug, never
retried), data errors (22xxx). These fail at once, whatever the retry bound.

*Outcome unknown* — a transient failure that may have hit AFTER the server applied
a write: the connection dropped in the middle of an operation (asyncpg's
``connection was closed in the middle of operation``, SQLSTATE 08003/08006, a reset
or broken pipe while a statement was in flight). A connection refused, a connection
found closed before anything was sent, or an error the server answered the
statement with (40001, 40P01, 57P01, SQLite busy) mean nothing was applied: the
server rolls back an unfinished transaction of a dead connection, and SQLite writes
nothing on a failed ``BEGIN IMMEDIATE`` or statement.

Only this module decides; the store (``store.py``: retries), the flows'
``retry.py`` (task retries) and the failure handler read it through
:func:`is_transient` and :class:`~prefect_coder.blocks.state.errors.StoreUnavailableError`.
The PostgreSQL driver is never imported here (a SQLite process must not load it):
its errors are recognised by module and ``sqlstate``.
"""

from __future__ import annotations

import asyncio
import errno
import sqlite3
import time
from collections.abc import Iterator

import sqlalchemy as sa

from .errors import StateStoreError, StoreUnavailableError

__all__ = ["TransientRetry", "describe", "is_store_error", "is_transient", "outcome_unknown"]

# SQLSTATEs that say "try again": connection exception (class 08), operator
# intervention while the server stops or starts, too many connections, cancelled
# statement, serialization failure, deadlock.
_TRANSIENT_SQLSTATES = frozenset({"57P01", "57P02", "57P03", "53300", "57014", "40001", "40P01"})
# Of those, the ones raised when the connection died under a statement in flight.
_UNKNOWN_SQLSTATES = frozenset({"08003", "08006", "08007"})
_SQLITE_BUSY = ("database is locked", "database table is locked", "database is busy")
_CLOSED = ("connection is closed", "connection was closed", "connection has been released")
_MID_OPERATION = "in the middle of operation"
_TRANSIENT_ERRNOS = frozenset(
    {
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.EPIPE,
        errno.ETIMEDOUT,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ENOENT,  # a unix socket whose server is down has no socket file
    }
)
_POOL_EXHAUSTED = "no SQLite connection became free"


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, the driver error SQLAlchemy wraps (``.orig``), and their causes."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo and len(seen) < 16:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        orig = getattr(e, "orig", None)
        if isinstance(orig, BaseException):
            todo.append(orig)
        if e.__cause__ is not None:
            todo.append(e.__cause__)
        elif e.__context__ is not None and not e.__suppress_context__:
            todo.append(e.__context__)


def _from_driver(e: BaseException) -> bool:
    mod = type(e).__module__
    return mod.startswith(("asyncpg", "sqlalchemy", "sqlite3")) or isinstance(e, sqlite3.Error)


def is_store_error(exc: BaseException) -> bool:
    """Whether ``exc`` is (or wraps) an error of the database layer (SQLAlchemy,
    sqlite3, asyncpg) or the store's own :class:`StoreUnavailableError`."""
    return any(isinstance(e, StoreUnavailableError) or _from_driver(e) for e in _chain(exc))


def _verdict(e: BaseException, *, raw_network: bool) -> bool | None:
    """True: transient; False: permanent; None: this link says nothing."""
    if isinstance(e, StoreUnavailableError):
        return True
    if isinstance(e, StateStoreError):
        return False  # config, schema version, leases: the store's own verdicts
    sqlstate = getattr(e, "sqlstate", None) or getattr(e, "pgcode", None)
    if isinstance(sqlstate, str) and len(sqlstate) == 5:
        return sqlstate.startswith("08") or sqlstate in _TRANSIENT_SQLSTATES
    text = str(e).lower()
    if isinstance(e, sqlite3.Error) or type(e).__module__.startswith("sqlite3"):
        return any(s in text for s in _SQLITE_BUSY)
    if isinstance(e, sa.exc.DBAPIError) and e.connection_invalidated:
        return True
    if isinstance(e, sa.exc.DisconnectionError | sa.exc.TimeoutError):
        return True  # a dead pooled connection; SQLAlchemy's pool exhausted
    if type(e).__module__.startswith("asyncpg") and any(s in text for s in _CLOSED):
        return True  # InterfaceError: connection is closed
    if _MID_OPERATION in text:
        return True
    if isinstance(e, TimeoutError) and _POOL_EXHAUSTED in str(e):
        return True
    if raw_network and isinstance(e, ConnectionError | TimeoutError):
        return True
    if raw_network and isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
        return True
    return None


def is_transient(exc: BaseException, *, raw_network: bool = False) -> bool:
    """Whether the store error ``exc`` is transient (see the module docstring).

    ``raw_network``: also count a bare ``ConnectionError`` / ``TimeoutError`` / socket
    ``OSError`` (asyncpg's connect raises them unwrapped). Only the store's own code
    passes it, where such an error can only come from the database connection; outside
    the store a bare ``TimeoutError`` is e.g. a turn's deadline, which is final.
    """
    for e in _chain(exc):
        verdict = _verdict(e, raw_network=raw_network)
        if verdict is not None:
            return verdict
    return False


def outcome_unknown(exc: BaseException) -> bool:
    """Whether a write that failed with ``exc`` may nevertheless have committed: the
    connection died while a statement (or its COMMIT) was in flight. False for a
    connection refused or found closed before the send, and for an error the server
    answered with (nothing applied)."""
    for e in _chain(exc):
        sqlstate = getattr(e, "sqlstate", None) or getattr(e, "pgcode", None)
        if isinstance(sqlstate, str) and sqlstate in _UNKNOWN_SQLSTATES:
            return True
        if _MID_OPERATION in str(e).lower():
            return True
        if isinstance(e, ConnectionResetError | BrokenPipeError):
            return True
    return False


def describe(exc: BaseException) -> str:
    """A short, secret-free name for the fault: the innermost driver error's class and
    first line (never the statement's SQL or parameters)."""
    inner = exc
    for e in _chain(exc):
        # The deepest link: the driver's own error (asyncpg's class, not the adapter's).
        if not isinstance(e, sa.exc.StatementError):
            inner = e
    line = str(inner).strip().splitlines()[0] if str(inner).strip() else ""
    line = line.split("[SQL:")[0].strip()
    return f"{type(inner).__name__}: {line[:200]}" if line else type(inner).__name__


#: First pause between two attempts; doubled each time up to :data:`BACKOFF_MAX_S`.
BACKOFF_FIRST_S = 0.05
BACKOFF_MAX_S = 1.0


class TransientRetry:
    """One store call's retry budget: attempts go on while a transient fault lasts,
    until ``bound_s`` seconds have passed since the call began (pauses of 50 ms
    doubling to 1 s in between; an attempt itself may take longer, e.g. SQLite's
    wait for the write lock). Then :class:`StoreUnavailableError` (retryable).

    ``again(exc)`` after a failed attempt: False — a permanent fault, re-raise it
    as it is; True — the pause is over, try again; or it raises
    :class:`StoreUnavailableError` (out of time, or — ``idempotent=False`` — a write
    whose outcome is unknown, which only the step's own recovery may repeat).
    """

    __slots__ = ("_backend", "_bound", "_pause", "_start", "_store", "attempts")

    def __init__(self, store: str, backend: str, bound_s: float) -> None:
        self._store = store
        self._backend = backend
        self._bound = bound_s
        self._start = time.monotonic()
        self._pause = BACKOFF_FIRST_S
        self.attempts = 0

    def waited(self) -> float:
        return time.monotonic() - self._start

    def unavailable(self, exc: BaseException, *, unknown: bool = False) -> Exception:
        """The error a caller sees for ``exc`` once the store gave up on it."""
        return StoreUnavailableError(
            self._store,
            describe(exc),
            backend=self._backend,
            waited=self.waited(),
            attempts=max(1, self.attempts),
            outcome_unknown=unknown,
        )

    def _step(self, exc: BaseException, idempotent: bool) -> float | None:
        """The pause before the next attempt, None: a permanent fault (raises when out)."""
        self.attempts += 1
        if not is_transient(exc, raw_network=True):
            return None
        unknown = outcome_unknown(exc)
        if unknown and not idempotent:
            raise self.unavailable(exc, unknown=True) from exc
        left = self._bound - self.waited()
        if left <= 0:
            raise self.unavailable(exc, unknown=unknown) from exc
        pause = min(self._pause, left)
        self._pause = min(self._pause * 2, BACKOFF_MAX_S)
        return pause

    async def again(self, exc: BaseException, *, idempotent: bool = False) -> bool:
        """After a failed attempt (see the class docstring); pauses asynchronously."""
        pause = self._step(exc, idempotent)
        if pause is None:
            return False
        await asyncio.sleep(pause)
        return True

    def again_blocking(self, exc: BaseException, *, idempotent: bool = False) -> bool:
        """:meth:`again` for a worker thread of its own (SQLite's ``BEGIN``)."""
        pause = self._step(exc, idempotent)
        if pause is None:
            return False
        time.sleep(pause)
        return True
