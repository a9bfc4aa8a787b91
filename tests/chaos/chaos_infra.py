"""Faults of our own dependencies in a chaos schedule (issue 30): the state store,
the Prefect API and result storage — real parts faulted for real, no patching.

* ``store-restart`` — the store's PostgreSQL cluster stopped with ``pg_ctl stop -m
  fast`` (every pooled connection of every process goes dead), down for a while,
  started again on the same port: a restart or a failover;
* ``store-drop-conns`` — ``pg_terminate_backend`` of every client connection to the
  store's database (a proxy or a pooler cutting connections, an admin's kill);
* ``store-lock`` — another process takes the SQLite store's write lock (``BEGIN
  IMMEDIATE``) and is SIGSTOPped while it holds it, for a while: a stopped or stuck
  worker of the same machine;
* ``prefect-restart`` — the Prefect API server SIGKILLed, down for a while, started
  again on the same port and database (an operator's restart, a crashed pod);
* ``results-unwritable`` — the rig's result storage refuses new files for a while
  (``chattr +i`` as root, ``chmod 0555`` otherwise).

The store and Prefect faults are global: every rig of a bench uses the one cluster
and the one server — as every worker of a deployment uses them — so a fault one
schedule draws also lands on the schedules of the other rigs. :class:`Infra` keeps
a log of them; a schedule's outcome names those of other rigs that overlapped it.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_FAULTS = Path(__file__).resolve().parents[1] / "faults"
if str(_FAULTS) not in sys.path:
    sys.path.insert(0, str(_FAULTS))

from faults_pg import PrivateCluster  # noqa: E402
from lock_holder import LockHolder  # noqa: E402
from prefect_server_proc import PrivatePrefectServer  # noqa: E402
from unwritable import make_unwritable, make_writable  # noqa: E402

__all__ = ["INFRA_ACTIONS", "Infra", "InfraEvent", "results_dir"]

#: The timed actions of a schedule this module carries out.
INFRA_ACTIONS = (
    "store-restart",
    "store-drop-conns",
    "store-lock",
    "prefect-restart",
    "results-unwritable",
)


def results_dir(workdir: Path) -> Path:
    """The result storage of the rig working in ``workdir`` (its children's and its
    in-process runs'; ``results-unwritable`` faults it)."""
    return workdir / "results"


def _sqlite_file(workdir: Path) -> Path:
    """The SQLite store of the rig working in ``workdir`` (``store-lock`` locks it)."""
    return workdir / "chaos.db"


@dataclass(frozen=True)
class InfraEvent:
    """One fault as it ran: when (this process's monotonic clock), what, for whom."""

    began: float
    ended: float
    rig: str
    what: str


@dataclass
class Infra:
    """The dependencies a bench (or a test) may fault: a restartable PostgreSQL
    cluster for the stores (``store == "pg"``), a restartable Prefect server (None:
    the caller's, which is never faulted) and the fault log."""

    store: str = "sqlite"
    pg: PrivateCluster | None = None
    prefect: PrivatePrefectServer | None = None
    log: list[InfraEvent] = field(default_factory=list)
    #: one fault of a kind at a time: a restart while the same server restarts is
    #: not a fault of its own, and two lock holders would only queue
    _busy: dict[str, asyncio.Lock] = field(default_factory=dict)
    #: faults in progress (every rig's); ``_idle`` is set while there is none. Every
    #: rig runs on the one event loop: no lock guards these.
    active: int = 0
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        if self.store not in ("sqlite", "pg"):
            raise ValueError(f"store must be 'sqlite' or 'pg', not {self.store!r}")
        if self.store == "pg" and self.pg is None:
            raise ValueError("store 'pg' needs a PrivateCluster (pg=...)")
        self._idle.set()

    @property
    def prefect_restarts(self) -> bool:
        """Whether this Prefect server may be restarted (a private one)."""
        return self.prefect is not None

    def store_url(self, workdir: Path) -> str:
        """The store URL of a rig working in ``workdir``."""
        if self.store == "pg":
            assert self.pg is not None
            return self.pg.url
        return f"sqlite+aiosqlite:///{_sqlite_file(workdir)}"

    def overlapping(self, rig: str, began: float, ended: float) -> list[str]:
        """The faults of other rigs that ran while a schedule of ``rig`` did."""
        return [
            f"{e.what} (from {e.rig})"
            for e in self.log
            if e.rig != rig and e.began < ended and e.ended > began
        ]

    def faulted_since(self, began: float) -> bool:
        """Whether a fault (any rig's) ran at some time since ``began``."""
        return self.active > 0 or any(e.ended > began for e in self.log)

    async def quiet(self, limit_s: float = 120.0) -> None:
        """Wait until no fault of any rig is in progress: "after the fault clears"."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), limit_s)

    async def act(self, action: str, seconds: float, *, rig: str, workdir: Path) -> str:
        """Carry out one fault of ``action`` for ``seconds`` (its downtime or how long
        it holds) and undo it; what happened, in a line."""
        key = f"{action}:{rig}" if action in ("store-lock", "results-unwritable") else action
        lock = self._busy.setdefault(key, asyncio.Lock())
        if lock.locked():
            return f"{action} skipped (one already running)"
        async with lock:
            began = time.monotonic()
            self.active += 1
            self._idle.clear()
            try:
                what = await self._act(action, seconds, workdir)
            finally:
                self.active -= 1
                if not self.active:
                    self._idle.set()
                self.log.append(InfraEvent(began, time.monotonic(), rig, f"{action} {seconds:g}s"))
            return what

    async def _act(self, action: str, seconds: float, workdir: Path) -> str:
        if action == "store-restart":
            assert self.pg is not None, "store-restart needs the PostgreSQL store"
            await asyncio.to_thread(self.pg.stop)
            try:
                await asyncio.sleep(seconds)
            finally:
                await asyncio.to_thread(self.pg.start)
            return f"store restarted (down {seconds:g} s)"
        if action == "store-drop-conns":
            assert self.pg is not None, "store-drop-conns needs the PostgreSQL store"
            n = await _terminate_backends(self.pg.url)
            return f"store connections terminated ({n})"
        if action == "store-lock":
            holder = await asyncio.to_thread(LockHolder, _sqlite_file(workdir))
            try:
                await asyncio.sleep(seconds)
            finally:
                await asyncio.to_thread(holder.release)
                await asyncio.to_thread(holder.close)
            return f"store write lock held {seconds:g} s"
        if action == "prefect-restart":
            assert self.prefect is not None, "prefect-restart needs a private Prefect server"
            await asyncio.to_thread(self.prefect.kill)
            try:
                await asyncio.sleep(seconds)
            finally:
                took = await asyncio.to_thread(self.prefect.start)
            return f"Prefect API restarted (down {seconds:g} s + {took:.1f} s to start)"
        if action == "results-unwritable":
            results = results_dir(workdir)
            await asyncio.to_thread(make_unwritable, results)
            try:
                await asyncio.sleep(seconds)
            finally:
                await asyncio.to_thread(make_writable, results)
            return f"result storage unwritable {seconds:g} s"
        raise ValueError(f"unknown infra action {action!r}")


async def _terminate_backends(url: str) -> int:
    """``pg_terminate_backend`` of every other client connection to ``url``'s database."""
    import asyncpg  # type: ignore[import-untyped]
    from sqlalchemy.engine import make_url

    u = make_url(url)
    conn: Any = await asyncpg.connect(
        host=u.host, port=u.port, user=u.username, database=u.database
    )
    try:
        rows = await conn.fetch(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() "
            "AND backend_type = 'client backend'"
        )
    finally:
        await conn.close()
    return len(rows)
