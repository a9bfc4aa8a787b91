"""Leases: single-flight per chat / per workflow across processes and machines.

The durable design requires steps to run strictly sequentially per chat:
sessions are single-flight system-wide. A lease is a row with a holder and an
expiry on the *database* clock. Acquiring is ONE atomic statement (insert, or
take over a row whose lease has expired, or re-enter our own), so exactly one
caller wins on SQLite and PostgreSQL alike. A holder that crashes stops
renewing and its lease lapses after ``ttl`` seconds — or sooner: a caller that
knows the holder is gone (the flows layer asks Prefect whether the holder's run
ended) takes the row over with :meth:`Leases.take_over`, a compare-and-set on
the holder, without waiting for the expiry.

A held lease is a :class:`HeldLease`: renewed in the background (each renewal
checks holder *and* fence), confirmed before an effect (``confirm``), released or
abandoned at the end. ``store.lease(...)`` waits for one key; ``claim_any`` wins
any free one of a set of keys in one store call (the fleet's turn slots).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import random
import socket
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import sqlalchemy as sa

from . import fencing, sqlite_pool
from ._ops import DirectOps, Ops
from .engines import db_now_sql, upsert
from .errors import LeaseLostError, LeaseUnavailableError, SchemaChangedError
from .records import Lease, from_epoch
from .schema import leases as t
from .urls import Backend

logger = logging.getLogger("prefect_coder.blocks.state.leases")

#: ``hold(..., holder_gone=...)``: given the live lease that blocks us, True when its
#: holder is known to be gone for good (then it is taken over at once).
HolderGone = Callable[[Lease], Awaitable[bool]]


#: The expiry a released row gets (the epoch): a lapsed row keeps its last expiry.
RELEASED = 0.0


def default_holder() -> str:
    """A holder id unique to this process and call: host, pid and a random suffix."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def chat_key(chat_id: str) -> str:
    """The lease key for single-flight per chat."""
    return f"chat:{chat_id}"


def workflow_key(workflow_id: str) -> str:
    """The lease key for single-flight per workflow."""
    return f"workflow:{workflow_id}"


def _check_ttl(ttl: float) -> None:
    if not ttl > 0:
        raise ValueError("ttl: must be > 0 seconds (how long a crashed holder blocks others)")


def _row(row: Any) -> Lease:
    acquired = from_epoch(row.acquired_at)
    expires = from_epoch(row.expires_at)
    assert acquired is not None and expires is not None
    return Lease(
        key=row.key, holder=row.holder, fence=row.fence, acquired_at=acquired, expires_at=expires
    )


# The lease statements are built once per backend, with bind parameters, and run
# with each call's values: building the upsert anew per call (its ``excluded``
# alias above all) cost ≈ 1.4 ms of CPU per acquire, ≈ 10 % of a fan-out
# worker's event loop at cap 50, where every turn takes two leases (the
# workflow's and a turn slot) and releases both (docs/performance.md, round 6).
_P = sa.bindparam


def _build(name: str, backend: Backend, now: sa.ColumnElement[float]) -> Any:
    ours = sa.and_(t.c.tenant == _P("p_tenant"), t.c.key == _P("p_key"))
    ttl = _P("p_ttl", type_=sa.Double)
    if name in ("acquire", "acquire_released"):
        # INSERT … ON CONFLICT DO UPDATE … WHERE expired OR same holder, RETURNING.
        stmt = upsert(backend, t).values(
            tenant=_P("p_tenant"),
            key=_P("p_key"),
            holder=_P("p_holder"),
            fence=1,
            acquired_at=now,
            expires_at=now + ttl,
        )
        same = t.c.holder == stmt.excluded.holder
        return stmt.on_conflict_do_update(
            index_elements=[t.c.tenant, t.c.key],
            set_={
                "holder": stmt.excluded.holder,
                # Re-entry by the same holder keeps the fence; a takeover bumps it.
                "fence": sa.case((same, t.c.fence), else_=t.c.fence + 1),
                "acquired_at": sa.case((same, t.c.acquired_at), else_=stmt.excluded.acquired_at),
                "expires_at": stmt.excluded.expires_at,
            },
            where=sa.or_(
                same,
                t.c.expires_at <= now if name == "acquire" else t.c.expires_at == RELEASED,
            ),
        ).returning(*t.c)
    if name == "renew":
        return (
            sa.update(t)
            .where(ours, t.c.holder == _P("p_holder"))
            .values(expires_at=now + ttl)
            .returning(*t.c)
        )
    if name in ("release", "abandon"):
        return (
            sa.update(t)
            .where(ours, t.c.holder == _P("p_holder"), t.c.expires_at > now)
            .values(expires_at=RELEASED if name == "release" else now)
            .returning(t.c.key)
        )
    raise ValueError(name)  # pragma: no cover


# Keyed by backend: ``Ops.now()`` is the backend's clock expression (engines.db_now).
_STATEMENTS: dict[tuple[str, Backend], Any] = {}


def _statement(ops: Ops, name: str) -> Any:
    key = (name, ops.backend)
    stmt = _STATEMENTS.get(key)
    if stmt is None:
        stmt = _STATEMENTS[key] = _build(name, ops.backend, ops.now())
    return stmt


# The same three statements as fixed text, for a call made on the store itself (not
# inside a ``store.transaction()``): on SQLite the whole write transaction then runs as
# ONE job on the worker thread (BEGIN IMMEDIATE, statement, COMMIT: one hop instead of
# two), on PostgreSQL as ONE statement in autocommit (one round trip instead of
# BEGIN, statement, COMMIT) — a single statement is atomic, and durable once it
# returns. No SQLAlchemy compilation or cache-key walk per call either. Every turn
# of a fan-out takes two leases and releases both (docs/performance.md, round 7).
_COLUMNS = "tenant, key, holder, fence, acquired_at, expires_at"
# Each carries the schema fence (``fencing.VERSION_OK_SQL``): a worker whose code
# predates the database's schema takes, renews and gives up no lease (no row back; the
# version is read to say why: ``_driver_one``, ``_refused_pg``).
_ACQUIRE = (
    f"INSERT INTO {t.name} ({_COLUMNS}) SELECT {{p1}}, {{p2}}, {{p3}}, 1, {{now}}, "
    f"{{now}} + {{p4}} WHERE {fencing.VERSION_OK_SQL} "
    "ON CONFLICT (tenant, key) DO UPDATE SET holder = excluded.holder, "
    f"fence = CASE WHEN {t.name}.holder = excluded.holder THEN {t.name}.fence "
    f"ELSE {t.name}.fence + 1 END, "
    f"acquired_at = CASE WHEN {t.name}.holder = excluded.holder THEN {t.name}.acquired_at "
    "ELSE excluded.acquired_at END, "
    "expires_at = excluded.expires_at "
    f"WHERE {t.name}.holder = excluded.holder OR {t.name}.expires_at "
)
_TEXT = {
    "acquire": _ACQUIRE + f"<= {{now}} RETURNING {_COLUMNS}",
    "acquire_released": _ACQUIRE + f"= {RELEASED!r} RETURNING {_COLUMNS}",
    "renew": (
        f"UPDATE {t.name} SET expires_at = {{now}} + {{p4}} "
        "WHERE tenant = {p1} AND key = {p2} AND holder = {p3} "
        f"AND {fencing.VERSION_OK_SQL} RETURNING {_COLUMNS}"
    ),
    "release": (
        f"UPDATE {t.name} SET expires_at = {RELEASED!r} "
        "WHERE tenant = {p1} AND key = {p2} AND holder = {p3} AND expires_at > {now} "
        f"AND {fencing.VERSION_OK_SQL} RETURNING key"
    ),
    "abandon": (
        "UPDATE " + t.name + " SET expires_at = {now} "
        "WHERE tenant = {p1} AND key = {p2} AND holder = {p3} AND expires_at > {now} "
        f"AND {fencing.VERSION_OK_SQL} RETURNING key"
    ),
}
_VERSION = f"SELECT {fencing.VERSION_SQL}"
_SQLITE_TEXT = {
    name: sql.format(now=db_now_sql("sqlite"), p1="?1", p2="?2", p3="?3", p4="?4")
    for name, sql in _TEXT.items()
}
_PG_TEXT = {
    name: sql.format(
        now=db_now_sql("postgresql"),
        p1="$1::text",
        p2="$2::text",
        p3="$3::text",
        p4="$4::double precision",
    )
    for name, sql in _TEXT.items()
}

# The rows of a set of keys not released by their holder (live, or lapsed: seconds left
# ≤ 0), for ``claim_any`` and ``holders``: ONE key range on the primary key, from the
# set's least key to its greatest, filtered to the set in Python (``_holdings``).
# Fixed text: building an ``IN (50 keys)`` select per claim was ≈ 1 % of a fan-out
# worker's loop (docs/performance.md, round 7), and an ``IN`` of 50 bound keys cost
# SQLite twice the range's time (45 vs 21 µs). A set's keys should share a prefix
# (``turn-slot:0`` … ``turn-slot:49``): rows of other keys inside the range are read
# and dropped.
_HOLDERS = (
    "SELECT key, holder, expires_at - {now} FROM " + t.name + " "
    "WHERE tenant = {p1} AND key BETWEEN {p2} AND {p3} AND expires_at <> " + repr(RELEASED)
)
_SQLITE_HOLDERS = _HOLDERS.format(now=db_now_sql("sqlite"), p1="?1", p2="?2", p3="?3")
_PG_HOLDERS = _HOLDERS.format(
    now=db_now_sql("postgresql"), p1="$1::text", p2="$2::text", p3="$3::text"
)


_FENCE = "SELECT holder, fence FROM " + t.name + " WHERE tenant = {p1} AND key = {p2}"
_SQLITE_FENCE = _FENCE.format(p1="?1", p2="?2")
_PG_FENCE = _FENCE.format(p1="$1::text", p2="$2::text")


def _driver_one(
    sql: str, params: tuple[Any, ...], conn: sqlite3.Connection, take_writer: Callable[[], None]
) -> Any:
    # ONE statement in SQLite's autocommit mode, on the worker's sqlite3 connection:
    # atomic by itself and committed once read to its end — what BEGIN IMMEDIATE,
    # the statement and COMMIT through SQLAlchemy did in three driver calls and a
    # cursor result (4 of a one-turn workflow's store transactions are these;
    # docs/performance.md, round 10a). Every lease statement writes (or may), so it
    # queues on the process's writer lock first, like every write transaction.
    take_writer()
    rows = sqlite_pool.driver_rows(conn, sql, params)
    if not rows:
        # No row: held by another (or not ours) — or refused by the schema fence.
        fencing.check_version(sqlite_pool.driver_rows(conn, _VERSION, ())[0][0])
        return None
    return _DriverRow(*rows[0]) if len(rows[0]) == len(_DriverRow._fields) else rows[0]


class Holding(NamedTuple):
    """A key's holder as ``Leases.holders`` and ``claim_any`` read it: its holder id and
    the seconds left to its expiry on the database clock (≤ 0: lapsed, not released)."""

    holder: str
    left: float


def _holders_params(tenant: str, keys: Sequence[str]) -> tuple[str, str, str]:
    return tenant, min(keys), max(keys)


def _holdings(rows: Sequence[Any], keys: Sequence[str]) -> dict[str, Holding]:
    """The rows of ``keys`` among ``rows`` (a key range: it may hold others)."""
    wanted = frozenset(keys)
    return {
        str(key): Holding(str(holder), float(left)) for key, holder, left in rows if key in wanted
    }


# Private: the global ``random`` is shared with (and reseeded by) other code.
_rng = random.Random()


def _claim_direct(
    tenant: str,
    keys: Sequence[str],
    holder: str,
    ttl: float,
    first: str | None,
    conn: sqlite3.Connection,
    take_writer: Callable[[], None],
) -> tuple[Any, list[Any]]:
    """SQLite: ``claim_any``'s statements in ONE hop to a worker, each a transaction of
    its own: ``first``'s acquire, else the read of the keys' rows and an acquire per
    free one until one is won. Done hop by hop, a claim that read and then acquired
    took two hops (three after a failed ``first``), each a thread hand-off on a busy
    loop (docs/performance.md, round 10a). Returns the row won (or None) and the rows
    read (none when ``first`` won: nothing was read)."""
    # Released (or never held) rows only, ``first`` too: a key taken since this process
    # released it, or since the read, may have lapsed meanwhile — with its work going on.
    sql = _SQLITE_TEXT["acquire_released"]
    if first is not None:
        got = _driver_one(sql, (tenant, first, holder, ttl), conn, take_writer)
        if got is not None:
            return got, []
    rows = sqlite_pool.driver_rows(conn, _SQLITE_HOLDERS, _holders_params(tenant, keys))
    for key in _free(keys, rows):
        got = _driver_one(sql, (tenant, key, holder, ttl), conn, take_writer)
        if got is not None:
            return got, rows
    return None, rows


def _free(keys: Sequence[str], rows: Sequence[Any]) -> list[str]:
    """The keys no row was read for (never held, or released), in random order: waiters
    that read the same free keys then mostly try different ones."""
    taken = {str(row[0]) for row in rows}
    free = [key for key in keys if key not in taken]
    _rng.shuffle(free)
    return free


class _DriverRow(NamedTuple):
    """A lease row as ``sqlite3`` returns it (``_COLUMNS``), read by name like
    SQLAlchemy's rows."""

    tenant: str
    key: str
    holder: str
    fence: int
    acquired_at: float
    expires_at: float


async def _run(ops: Ops, name: str, params: dict[str, Any]) -> Any:
    """Run a lease statement with ``params`` in a write transaction of its own (or the
    caller's ``store.transaction()``); its row or None (every lease statement touches at
    most the one row of its key)."""
    if hasattr(ops, "run_direct"):  # the store itself, not a transaction: one trip
        values: tuple[Any, ...] = (params["p_tenant"], params["p_key"], params["p_holder"])
        if name not in ("release", "abandon"):
            values += (params["p_ttl"],)
        if ops.backend == "sqlite":
            return await ops.run_direct(functools.partial(_driver_one, _SQLITE_TEXT[name], values))
        async with ops.autocommit() as conn:  # type: ignore[attr-defined]
            row = (await conn.exec_driver_sql(_PG_TEXT[name], values)).one_or_none()
            if row is None:
                await _refused_pg(conn)
            return row
    stmt = _statement(ops, name)
    async with ops.write() as conn:
        return await conn.run_sync(functools.partial(_one_or_none, stmt, params))


async def _refused_pg(conn: Any) -> None:
    """PostgreSQL: after a lease statement wrote nothing, raise ``SchemaChangedError`` if
    the schema fence refused it (one more round trip, only when nothing was won)."""
    fencing.check_version((await conn.exec_driver_sql(_VERSION)).scalar_one())


def _one_or_none(stmt: Any, params: dict[str, Any], conn: sa.Connection) -> Any:
    return conn.execute(stmt, params).one_or_none()


Log = logging.Logger | logging.LoggerAdapter[Any]


class HeldLease:
    """A lease this process holds: renewed in the background, confirmed before effects.

    ``store.lease(...)`` yields one (and releases it on exit); ``Leases.claim_any`` and
    ``Leases.keep`` return one, which the caller ends with :meth:`release` or
    :meth:`abandon`. Every renewal checks the row still carries this holder *and* this
    fence: a renewal that finds the lease gone or re-fenced (it lapsed and was taken
    over), or no renewal succeeding for a whole ttl, sets :attr:`lost`.
    """

    def __init__(
        self, lease: Lease, *, ttl: float, leases: Leases, logger: Log | None = None
    ) -> None:
        self.lease = lease
        self.lost = False
        self._ttl = ttl
        self._leases = leases
        self._log: Log = logger or logging.getLogger(__name__)
        self._renewer: asyncio.Task[None] | None = None
        #: ``time.monotonic()`` after the acquisition or the last renewal that kept it.
        self.last_ok = time.monotonic()

    @property
    def key(self) -> str:
        return self.lease.key

    @property
    def holder(self) -> str:
        return self.lease.holder

    @property
    def fence(self) -> int:
        return self.lease.fence

    @property
    def ttl(self) -> float:
        return self._ttl

    def raise_if_lost(self) -> None:
        """Raise LeaseLostError if a renewal found the lease gone (check before effects)."""
        if self.lost:
            raise LeaseLostError(self.key, self.holder)

    async def confirm(self) -> None:
        """Prove the lease is still held, right before an effect another holder must
        not duplicate (a turn's send); LeaseLostError if the row is gone or carries
        another holder or fence.

        :meth:`raise_if_lost` knows only what the background renewal found. After a
        stall (a starved event loop, a paused VM) that renewal has not run yet while
        the lease may have lapsed and been taken over: when the last renewal is older
        than half a ttl this renews now. A lease renewed since may still have been
        taken over WITHOUT a lapse — ``take_over`` by a waiter that judged this holder
        gone (its Prefect run marked Crashed while this process was merely cut off
        from the API) — so otherwise it reads the row's holder and fence: one indexed
        read (SQLite: one hop, no write lock; PostgreSQL: one round trip)."""
        self.raise_if_lost()
        if time.monotonic() - self.last_ok < self._ttl / 2:
            if await self._leases.fence_of(self.key) == (self.holder, self.fence):
                return
            self.lost = True
            raise LeaseLostError(self.key, self.holder, fence=self.fence)
        if not self._kept(await self._leases.renew(self.key, self.holder, self._ttl)):
            raise LeaseLostError(self.key, self.holder)

    def _kept(self, renewed: Lease | None) -> bool:
        """Take a renewal's answer: False (and :attr:`lost`) unless the row is still this
        holder's under this fence (the same holder id under a new fence held it again
        after another holder: what it guarded may have been redone meanwhile)."""
        if renewed is None or renewed.fence != self.fence:
            self.lost = True
            return False
        self.lease = renewed
        self.last_ok = time.monotonic()
        return True

    def _renew_every(self, every: float | None = None) -> None:
        """Renew in the background every ``every`` seconds (default ttl/3) until
        :meth:`release` or :meth:`abandon`."""
        if self._renewer is None:
            self._renewer = asyncio.create_task(
                self._renew_loop(every or self._ttl / 3), name=f"lease-renew:{self.key}"
            )

    async def _renew_loop(self, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            try:
                renewed = await self._leases.renew(self.key, self.holder, self._ttl)
            except SchemaChangedError as exc:
                # Newer code migrated the store: this worker may not write any more, and
                # its lease lapses (``fencing``). Stop at once: no renewal will succeed.
                self.lost = True
                self._log.error("lease %r: %s", self.key, exc)
                return
            except Exception as exc:
                # A transient database error: keep trying until a whole ttl has gone by.
                if time.monotonic() - self.last_ok < self._ttl:
                    self._log.warning(
                        "lease %r renewal failed (%s); retrying", self.key, type(exc).__name__
                    )
                    continue
                renewed = None
            if not self._kept(renewed):
                self._log.warning(
                    "lease %r held by %r was lost; another holder may be running",
                    self.key,
                    self.holder,
                )
                return

    async def _stop_renewing(self) -> None:
        renewer, self._renewer = self._renewer, None
        if renewer is not None:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer

    async def release(self) -> bool:
        """Stop renewing and give the lease up (``Leases.release``); True if it was still
        ours. A lost lease is left alone (another holder may have it). Database errors
        propagate: the lease then lapses after its ttl."""
        await self._stop_renewing()
        if self.lost:
            return False
        return await self._leases.release(self.key, self.holder)

    async def abandon(self) -> bool:
        """Stop renewing and let the lease lapse now (``Leases.abandon``): for a holder
        whose work may go on without it. True if it was still ours."""
        await self._stop_renewing()
        if self.lost:
            return False
        return await self._leases.abandon(self.key, self.holder)


@dataclass(frozen=True, slots=True)
class AnyClaim:
    """What ``Leases.claim_any`` found: the lease it won, and the rows it read."""

    #: The key won, held and renewed in the background; None when every key was taken.
    lease: HeldLease | None
    #: The keys' rows not released by their holder as the claim read them, by key
    #: (live, or lapsed: ``left`` ≤ 0). Empty when ``first`` was won: nothing was read.
    holders: Mapping[str, Holding]


class Leases:
    """``store.leases``: acquire / renew / release / get, and ``hold()`` (waits, renews)."""

    def __init__(self, ops: Ops) -> None:
        self._ops = ops

    def keep(
        self,
        lease: Lease,
        ttl: float,
        *,
        renew_interval: float | None = None,
        logger: Log | None = None,
    ) -> HeldLease:
        """Hold ``lease`` (won by ``acquire`` or ``take_over`` with this ``ttl``): renewed
        in the background every ``renew_interval`` (default ttl/3) from now until the
        handle's ``release()`` or ``abandon()``. ``logger`` gets the renewal warnings."""
        _check_ttl(ttl)
        handle = HeldLease(lease, ttl=ttl, leases=self, logger=logger)
        handle._renew_every(renew_interval)
        return handle

    async def claim_any(
        self,
        keys: Sequence[str],
        holder: str,
        ttl: float,
        *,
        first: str | None = None,
        logger: Log | None = None,
    ) -> AnyClaim:
        """Win any one of ``keys`` that is free — never held, or released by its holder —
        and hold it (``keep``: renewed until released or abandoned).

        A key whose lease *lapsed* (its holder stopped renewing without releasing) is
        never taken here: what it guarded may still be going on, so the caller judges
        it from ``AnyClaim.holders`` and takes it with ``take_over`` (turn slots:
        ``flows/fleet``). ``first``: tried first, with one acquire and no read — a key
        most likely free (a process hands on what it just released); when it wins,
        nothing is read. Otherwise ONE read of the keys' rows, then an acquire per
        free-looking key in random order until one wins (contenders that read the same
        free keys mostly try different ones); each acquire is atomic by itself, so two
        claims never win the same key. SQLite: all of it in ONE hop to a worker thread;
        PostgreSQL: one round trip per statement, on one connection. The read is a key
        range (``holders``): give it keys that share a prefix.
        """
        _check_ttl(ttl)
        if not keys or not holder:
            raise ValueError("keys and holder: both required and non-empty")
        ops = cast(DirectOps, self._ops)
        tenant = ops.tenant
        rows: list[Any]
        if ops.backend == "sqlite":
            row, rows = await ops.run_direct(
                functools.partial(_claim_direct, tenant, keys, holder, float(ttl), first)
            )
        else:
            row, rows = await self._claim_pg(ops, keys, holder, float(ttl), first)
        won = None if row is None else self.keep(_row(row), ttl, logger=logger)
        return AnyClaim(won, _holdings(rows, keys))

    @staticmethod
    async def _claim_pg(
        ops: DirectOps, keys: Sequence[str], holder: str, ttl: float, first: str | None
    ) -> tuple[Any, list[Any]]:
        sql = _PG_TEXT["acquire_released"]
        tenant = ops.tenant
        async with ops.autocommit() as conn:
            if first is not None:
                got = (await conn.exec_driver_sql(sql, (tenant, first, holder, ttl))).one_or_none()
                if got is not None:
                    return got, []
            params = _holders_params(tenant, keys)
            rows = list((await conn.exec_driver_sql(_PG_HOLDERS, params)).all())
            tried = first is not None
            for key in _free(keys, rows):
                tried = True
                got = (await conn.exec_driver_sql(sql, (tenant, key, holder, ttl))).one_or_none()
                if got is not None:
                    return got, rows
            if tried:
                await _refused_pg(conn)
        return None, rows

    async def fence_of(self, key: str) -> tuple[str, int] | None:
        """The holder and fence on ``key``'s row (live, lapsed or released), or None: one
        indexed read, for ``HeldLease.confirm`` right before a send."""
        ops = cast(DirectOps, self._ops)
        params = (ops.tenant, key)
        row: Any
        if ops.backend == "sqlite":

            def body(conn: sqlite3.Connection, _take_writer: Callable[[], None]) -> Any:
                rows = sqlite_pool.driver_rows(conn, _SQLITE_FENCE, params)
                return rows[0] if rows else None

            row = await ops.run_direct(body)
        else:
            async with ops.autocommit() as conn:
                row = (await conn.exec_driver_sql(_PG_FENCE, params)).one_or_none()
        return None if row is None else (str(row[0]), int(row[1]))

    async def holders(self, keys: Sequence[str]) -> dict[str, Holding]:
        """The rows of ``keys`` not released by their holder, by key: who holds each
        and its seconds left (≤ 0: lapsed). One statement (SQLite: one hop) reading the
        key range from the least of ``keys`` to the greatest: give it keys that share a
        prefix."""
        if not keys:
            return {}
        ops = cast(DirectOps, self._ops)
        rows: list[Any]
        params = _holders_params(ops.tenant, keys)
        if ops.backend == "sqlite":

            def body(conn: sqlite3.Connection, _take_writer: Callable[[], None]) -> list[Any]:
                # A read: one statement, its own snapshot, no writer lock.
                return sqlite_pool.driver_rows(conn, _SQLITE_HOLDERS, params)

            rows = await ops.run_direct(body)
        else:
            async with ops.autocommit() as conn:
                rows = list((await conn.exec_driver_sql(_PG_HOLDERS, params)).all())
        return _holdings(rows, keys)

    async def acquire(
        self, key: str, holder: str, ttl: float, *, released_only: bool = False
    ) -> Lease | None:
        """Take the lease if free, expired, or already ours (then extended). None if held.

        One statement: INSERT … ON CONFLICT DO UPDATE … WHERE expired OR same holder,
        RETURNING the row; no row back means someone else holds it.
        ``released_only``: not a lease that *lapsed* — only one its holder released
        (or that never existed): what a lapsed lease guarded may still be going on,
        and the caller judges that itself (turn slots: ``flows/fleet/slots.py``).
        """
        _check_ttl(ttl)
        if not key or not holder:
            raise ValueError("key and holder: both required and non-empty")
        row = await _run(
            self._ops,
            "acquire_released" if released_only else "acquire",
            {"p_tenant": self._ops.tenant, "p_key": key, "p_holder": holder, "p_ttl": float(ttl)},
        )
        return None if row is None else _row(row)

    async def take_over(
        self,
        key: str,
        expected_holder: str,
        new_holder: str,
        ttl: float,
        *,
        lapsed_only: bool = False,
    ) -> Lease | None:
        """Take the lease from ``expected_holder`` now, live or not; None if it moved on.

        A compare-and-set on the holder: the row changes only if ``expected_holder``
        still holds it, so two waiters that both judged the same dead holder never
        both win (the loser sees None), and a holder that re-entered meanwhile under
        another id is not robbed. The fence grows, like any takeover. Call it only
        when the holder is known to be gone (e.g. its Prefect run is Crashed): a live
        holder loses the lease at its next renewal. ``lapsed_only``: only while the
        lease is lapsed (not released, not renewed since): a holder judged by its lapse
        that renewed in between keeps it.
        """
        _check_ttl(ttl)
        if not key or not expected_holder or not new_holder:
            raise ValueError("key, expected_holder and new_holder: all required and non-empty")
        now = self._ops.now()
        where = [t.c.tenant == self._ops.tenant, t.c.key == key, t.c.holder == expected_holder]
        if lapsed_only:
            where += [t.c.expires_at <= now, t.c.expires_at != RELEASED]
        stmt = (
            sa.update(t)
            .where(*where)
            .values(holder=new_holder, fence=t.c.fence + 1, acquired_at=now, expires_at=now + ttl)
            .returning(*t.c)
        )
        async with self._ops.write() as conn:
            row = (await conn.execute(stmt)).one_or_none()
        return None if row is None else _row(row)

    async def renew(self, key: str, holder: str, ttl: float) -> Lease | None:
        """Push the expiry to now + ttl if ``holder`` still holds the key; None if lost.

        A lapsed lease that nobody took over is still ours and renews.
        """
        _check_ttl(ttl)
        row = await _run(
            self._ops,
            "renew",
            {"p_tenant": self._ops.tenant, "p_key": key, "p_holder": holder, "p_ttl": float(ttl)},
        )
        return None if row is None else _row(row)

    async def release(self, key: str, holder: str) -> bool:
        """Give the lease up now (only its holder can); True if ``holder`` held it.

        The row stays so the fence keeps growing across holders, with its expiry set
        to :data:`RELEASED`: a waiter can tell a lease its holder gave up from one that
        *lapsed* (its holder stopped renewing — dead, or stalled — while what it
        guarded may still be going on; see ``flows/fleet/takeover.py``).
        """
        row = await _run(
            self._ops, "release", {"p_tenant": self._ops.tenant, "p_key": key, "p_holder": holder}
        )
        return row is not None

    async def abandon(self, key: str, holder: str) -> bool:
        """Stop holding the lease now *without* releasing it: it lapses at once (only its
        holder can); True if ``holder`` held it.

        For a holder whose work may go on without it — a turn that failed while its
        run may still be running server-side: a waiter judges a lapsed lease (is that
        work over?) where it takes a released one as free.
        """
        row = await _run(
            self._ops, "abandon", {"p_tenant": self._ops.tenant, "p_key": key, "p_holder": holder}
        )
        return row is not None

    async def get(self, key: str) -> tuple[Lease, float] | None:
        """The live lease on ``key`` and its seconds left (database clock), or None if free."""
        now = self._ops.now()
        async with self._ops.read() as conn:
            row = (
                await conn.execute(
                    sa.select(t, (t.c.expires_at - now).label("remaining")).where(
                        t.c.tenant == self._ops.tenant, t.c.key == key, t.c.expires_at > now
                    )
                )
            ).one_or_none()
        return None if row is None else (_row(row), float(row.remaining))

    @contextlib.asynccontextmanager
    async def hold(
        self,
        key: str,
        *,
        holder: str | None = None,
        ttl: float = 30.0,
        wait: float = 60.0,
        poll_interval: float = 0.1,
        renew_interval: float | None = None,
        holder_gone: HolderGone | None = None,
    ) -> AsyncIterator[HeldLease]:
        """Acquire ``key`` (polling up to ``wait`` s), renew it in the background, release on exit.

        ``holder_gone``, when given, is asked about the live holder that blocks us;
        if it answers True the lease is taken over at once (``take_over``) instead
        of waiting out the dead holder's ttl. Its errors count as "don't know".

        Raises LeaseUnavailableError naming the current holder if ``wait`` runs out.
        Renewal runs every ``renew_interval`` (default ttl/3). If a renewal finds the
        lease gone, or none succeeds for a whole ttl, ``handle.lost`` becomes True and a
        warning is logged; call ``handle.raise_if_lost()`` before irreversible effects.
        """
        _check_ttl(ttl)
        if poll_interval <= 0:
            raise ValueError("poll_interval: must be > 0 seconds")
        holder = holder or default_holder()
        deadline = time.monotonic() + max(0.0, wait)
        while True:
            got = await self.acquire(key, holder, ttl)
            if got is None and holder_gone is not None:
                got = await self._take_if_gone(key, holder, ttl, holder_gone)
            if got is not None:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                current = await self.get(key)
                raise LeaseUnavailableError(
                    key,
                    holder=current[0].holder if current else None,
                    expires_in=current[1] if current else None,
                    waited=max(0.0, wait),
                )
            await asyncio.sleep(min(poll_interval, left))
        handle = self.keep(got, ttl, renew_interval=renew_interval)
        db = getattr(self._ops, "fence_db", None)
        try:
            if db is None:
                yield handle
            else:
                # Every write this block makes to this store checks the lease's fence in
                # its own transaction (``fencing``): after a takeover — one that did not
                # wait for a lapse too — it is refused and writes nothing.
                with fencing.fencing(
                    fencing.Fence(db, self._ops.tenant, got.key, got.holder, got.fence)
                ):
                    yield handle
        finally:
            try:
                await handle.release()
            except Exception:  # the lease then lapses after ttl on its own
                logger.warning("could not release lease %r; it lapses after its ttl", key)

    async def _take_if_gone(
        self, key: str, holder: str, ttl: float, holder_gone: HolderGone
    ) -> Lease | None:
        current = await self.get(key)
        if current is None:
            return None  # lapsed meanwhile: the next acquire gets it
        blocking = current[0]
        try:
            gone = await holder_gone(blocking)
        except Exception:
            logger.debug("holder_gone(%r) failed; waiting instead", blocking.holder, exc_info=True)
            return None
        if not gone:
            return None
        got = await self.take_over(key, blocking.holder, holder, ttl)
        if got is not None:
            logger.warning(
                "lease %r taken over from %r, whose run is over (%.1fs before its expiry)",
                key,
                blocking.holder,
                current[1],
            )
        return got
