"""The narrow interface the table repositories run on.

A repository (checkpoints, journal, ...) only needs: the backend, the tenant,
the database clock, and a way to get a connection inside a read or a write
transaction. The store gives each call its own transaction; a
``store.transaction()`` block gives all calls the same one.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import sqlalchemy as sa

from .urls import Backend

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection

T = TypeVar("T")


class StoreConnection(Protocol):
    """The part of a connection the repositories use, inside an open transaction.

    PostgreSQL hands them SQLAlchemy's ``AsyncConnection``; SQLite a connection run
    on a worker thread (``sqlite_pool.ThreadConnection``). Results come back buffered.
    """

    @property
    def dialect(self) -> sa.Dialect: ...

    async def execute(self, statement: sa.Executable) -> sa.Result[Any]: ...

    async def run_sync(self, fn: Callable[[sa.Connection], T]) -> T: ...


class Ops(Protocol):
    """What a repository needs from the store."""

    @property
    def backend(self) -> Backend: ...

    @property
    def tenant(self) -> str: ...

    def now(self) -> sa.ColumnElement[float]: ...

    def clock(self) -> float: ...  # this process's wall clock (time.time), journal.py

    def read(self) -> AbstractAsyncContextManager[StoreConnection]: ...

    def write(self) -> AbstractAsyncContextManager[StoreConnection]: ...


class DirectOps(Ops, Protocol):
    """The store itself (not a ``store.transaction()``): statements that are atomic by
    themselves run outside any SQLAlchemy transaction, in one hop or round trip."""

    async def run_direct(
        self, body: Callable[[sqlite3.Connection, Callable[[], None]], T]
    ) -> T: ...  # SQLite: ``body(conn, take_writer)`` on a worker, in one hop

    def autocommit(
        self,
    ) -> AbstractAsyncContextManager[AsyncConnection]: ...  # PostgreSQL, autocommit
