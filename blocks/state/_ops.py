"""The narrow interface the table repositories run on.

A repository (checkpoints, journal, ...) only needs: the backend, the tenant,
the database clock, and a way to get a connection inside a read or a write
transaction. The store gives each call its own transaction; a
``store.transaction()`` block gives all calls the same one.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Protocol

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from .urls import Backend


class Ops(Protocol):
    """What a repository needs from the store."""

    @property
    def backend(self) -> Backend: ...

    @property
    def tenant(self) -> str: ...

    def now(self) -> sa.ColumnElement[float]: ...

    def read(self) -> AbstractAsyncContextManager[AsyncConnection]: ...

    def write(self) -> AbstractAsyncContextManager[AsyncConnection]: ...
