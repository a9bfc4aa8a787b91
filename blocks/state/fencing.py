"""Write fencing: every write transaction checks, in that same transaction, that the
database still has this code's schema version and that the leases its caller holds
still carry its holder and fence.

Two failure windows close here (issue 30, items 4 and 7):

* **A rolling upgrade.** A worker started before newer code migrated the store checks
  the version once per process (``ensure_schema``); without a check per write it would
  go on writing rows the new schema's readers misread. Every write transaction reads
  the version row (one indexed read, in the same transaction) and refuses with
  :class:`~prefect_coder.blocks.state.errors.SchemaChangedError`, writing nothing.
  A migration takes ``ACCESS EXCLUSIVE`` on the version table (PostgreSQL; SQLite's
  writers are serial anyway), so it waits for the writes in flight that read the old
  version, and every write after it reads the new one.
* **A takeover without a lapse.** A holder judged gone (its Prefect run marked Crashed
  while the process is merely cut off) is taken over at once (``take_over``), well
  before its renewals find out. Writes made inside ``async with store.lease(...)``
  carry that lease's fence (a context variable, so the flows' calls stay as they are):
  the transaction reads the lease row — PostgreSQL: ``FOR SHARE``, so a takeover waits
  for the write to commit and the new holder reads it — and refuses with
  :class:`~prefect_coder.blocks.state.errors.LeaseLostError` when another holder or
  another fence is on it, writing nothing.

One statement answers both: the version and, per fence, whether the row still holds it.
SQLite: run right after ``BEGIN IMMEDIATE`` in the same worker hop (no extra hop).
PostgreSQL: one more round trip inside the write transaction, or a ``gate`` CTE in the
store's one-statement writes (``store.turns``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from .errors import LeaseLostError, SchemaChangedError
from .schema import COMPONENT, SCHEMA_VERSION
from .schema import leases as lt
from .schema import schema_version as vt
from .urls import Backend

__all__ = [
    "VERSION_OK_SQL",
    "VERSION_SQL",
    "Fence",
    "active",
    "check",
    "fencing",
    "gate_params",
    "gate_sql",
    "guard_condition",
    "guard_params",
    "guard_sql",
]


@dataclass(frozen=True, slots=True)
class Fence:
    """A lease the calling code holds, as a write checks it: on the database ``db`` (the
    store's engine cache key: only writes to the lease's own database are fenced)."""

    db: str
    tenant: str
    key: str
    holder: str
    fence: int


_FENCES: contextvars.ContextVar[tuple[Fence, ...]] = contextvars.ContextVar(
    "prefect_coder_write_fences", default=()
)


def active(db: str) -> tuple[Fence, ...]:
    """The fences of this context on the database ``db``."""
    fences = _FENCES.get()
    if not fences:
        return ()
    return tuple(f for f in fences if f.db == db)


@contextlib.contextmanager
def fencing(fence: Fence) -> Iterator[None]:
    """Fence this context's writes (and those of tasks it starts) with ``fence``."""
    token = _FENCES.set((*_FENCES.get(), fence))
    try:
        yield
    finally:
        _FENCES.reset(token)


def _fence_sub(backend: Backend, i: int) -> str:
    lock = " FOR SHARE" if backend == "postgresql" else ""
    if backend == "postgresql":
        p = [f"${i + n}" for n in range(4)]
        tenant, key, holder, fence = (
            f"{p[0]}::text",
            f"{p[1]}::text",
            f"{p[2]}::text",
            f"{p[3]}::bigint",
        )
    else:
        tenant = key = holder = fence = "?"
    return (
        f"(SELECT 1 FROM {lt.name} WHERE tenant = {tenant} AND key = {key} "
        f"AND holder = {holder} AND fence = {fence}{lock})"
    )


#: The database's schema version, as a scalar subquery.
VERSION_SQL = f"(SELECT version FROM {vt.name} WHERE component = '{COMPONENT}')"
#: A condition true only while the database has this code's version: the lease
#: statements (one statement each, no transaction around) carry it in their WHERE.
VERSION_OK_SQL = f"{VERSION_SQL} = {SCHEMA_VERSION}"


@cache
def guard_sql(backend: Backend, n: int, first: int = 1) -> str:
    """``SELECT version, fence_1_held, ...``: one row; ``first`` numbers PostgreSQL's
    parameters."""
    cols = [VERSION_SQL] + [_fence_sub(backend, first + 4 * i) for i in range(n)]
    return "SELECT " + ", ".join(cols)


@cache
def guard_condition(backend: Backend, n: int, first: int = 1) -> str:
    """The guard as ONE condition, for a one-statement write's ``WHERE``: true only while
    the database has this code's version and every fence is held (no row written:
    read the guard to say why)."""
    held = [f"{_fence_sub(backend, first + 4 * i)} IS NOT NULL" for i in range(n)]
    return " AND ".join([VERSION_OK_SQL, *held])


@cache
def gate_sql(n: int, first: int) -> str:
    """PostgreSQL: the guard as a CTE ``gate(v, f1, ..., ok)`` for a one-statement write,
    whose writes select ``FROM gate WHERE gate.ok``; return ``gate.*`` for :func:`check`
    (every column but ``ok``)."""
    cols = [f"{VERSION_SQL} AS v"] + [
        f"{_fence_sub('postgresql', first + 4 * i)} AS f{i}" for i in range(n)
    ]
    ok = " AND ".join([f"g0.v = {SCHEMA_VERSION}"] + [f"g0.f{i} IS NOT NULL" for i in range(n)])
    return f"gate AS (SELECT g0.*, ({ok}) AS ok FROM (SELECT {', '.join(cols)}) g0)"


def guard_params(fences: Sequence[Fence]) -> tuple[Any, ...]:
    """The guard's (and the gate's) parameters."""
    out: list[Any] = []
    for f in fences:
        out += [f.tenant, f.key, f.holder, f.fence]
    return tuple(out)


gate_params = guard_params


def check(row: Sequence[Any], fences: Sequence[Fence]) -> None:
    """Raise for a guard's row: :class:`SchemaChangedError` when the database's version
    is not this code's, :class:`LeaseLostError` for the first fence no longer held."""
    check_version(row[0])
    for fence, held in zip(fences, row[1:], strict=True):
        if held is None:
            raise LeaseLostError(fence.key, fence.holder, fence=fence.fence)


def check_version(found: Any) -> None:
    """Raise :class:`SchemaChangedError` unless ``found`` is this code's version."""
    if found != SCHEMA_VERSION:
        raise SchemaChangedError(None if found is None else int(found), SCHEMA_VERSION)
