"""Fleet quota: the turn slot, a deployment-wide cap on concurrently running agent turns.

The cap (``CoderCredentials.max_concurrent_turns``) is ``N`` lease rows in the
shared state store, ``turn-slot:0`` … ``turn-slot:N-1``. A turn holds one of
them from before its first request to its last (renewed in the background like
the workflow lease), so every worker process on every machine that uses the
same store sees the same N slots.

Why the store's lease table and not a Prefect global concurrency limit (both
were measured, see ``docs/fleet.md``): a Prefect limit's minimum lease is 60 s
and its hand-off is polled at ≈ 1 s, so a crashed holder blocks a slot ≈ 70 s
and a freed slot sits idle ≈ 1 s; a store slot lapses ``turn_slot_ttl`` after
its holder died (seconds, configurable) and a waiter polls every
``poll_interval`` (50 ms by default). Acquiring is one atomic statement per
free-looking slot, so two workers can never both take the same slot.

A dead holder's slot is taken over before its ttl only when Prefect shows its
run in a final state AND its workflow's chats are at rest on the server
(``slot_takeover.judge_dead_slot``): the dead process's turn goes on running
server-side, and the cap counts running turns, so the run being Crashed alone
is not enough (that let the fleet run cap + 1 turns), but nor does a worker's
death stall the fleet for the whole ttl once its turn has ended. A slot that
*lapsed* (its ttl ran out unreleased) is judged the same way — the ttl alone
let a dead or stalled holder's still-running turn be joined by another — and a
waiter of the holder's own workflow takes either at once (it is that turn's
continuation). (The workflow *lease* of such a run is taken over at once: see
``resources.hold_workflow_lease``.)

A turn that has to wait logs ``waiting for a turn slot`` once (visible in the
run's logs in the UI), shows the task run as ``Running`` named
``WaitingForTurnSlot`` once it has waited ``SHOW_WAITING_AFTER_S`` (a short
wait is not worth an API call per queued turn: it was 17% of a fan-out's CPU),
emits ``coder.turn.waiting_for_slot``
and, when ``turn_slot_wait`` runs out, fails with :class:`TurnSlotUnavailableError`.

Before the turn sends a prompt it calls :func:`confirm_turn_slot` (the agent's
``before_send``): a holder whose process stalled past the ttl between claiming
its slot and sending may have lost the slot to a waiter that saw its chats at
rest (it had sent nothing yet), and sending then would run one turn over the
cap. The check costs nothing while the background renewal is recent; after a
stall it renews the slot in the store, and a slot taken over fails the turn with
:class:`TurnSlotLostError` (nothing sent; Prefect retries the task, which waits
for a slot again).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import random
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from prefect.client.orchestration import get_client
from prefect.context import FlowRunContext, TaskRunContext
from prefect.states import Running

from prefect_coder.blocks import CoderCredentials, StateStore
from prefect_coder.blocks.state.leases import RELEASED, acquire_direct
from prefect_coder.blocks.state.schema import leases as lease_table
from prefect_coder.blocks.state.sqlite_pool import driver_rows
from prefect_coder.flows.common.errors import TurnSlotLostError, TurnSlotUnavailableError
from prefect_coder.flows.common.holders import holder_workflow_id, holders_over, run_holder
from prefect_coder.flows.fleet.takeover import Verdict, judge_dead_slot
from prefect_coder.flows.observe.observer import TurnObserver

__all__ = [
    "SLOT_PREFIX",
    "busy_slots",
    "confirm_turn_slot",
    "turn_slot",
]

SLOT_PREFIX = "turn-slot:"
#: Benchmarks set this to a list to record ("acquire" | "acquire_waited" | "release",
#: monotonic time) and ("acquire_latency", seconds from asking to holding).
SLOT_TRACE: list[tuple[str, float]] | None = None
WAITING_STATE_NAME = "WaitingForTurnSlot"
#: Seconds a turn waits on the cap before its task run shows ``WaitingForTurnSlot``.
SHOW_WAITING_AFTER_S = 1.0
#: Private: the global ``random`` is shared with (and reseeded by) other code.
_rng = random.Random()


@dataclass
class _Held:
    """The slot this context's turn holds, and when it was last known to be ours."""

    store: StateStore
    index: int
    holder: str
    ttl: float
    #: ``time.monotonic()`` after the claim or the last renewal that returned the row.
    last_ok: float


_HELD: contextvars.ContextVar[_Held | None] = contextvars.ContextVar(
    "prefect_coder_turn_slot", default=None
)


async def confirm_turn_slot() -> None:
    """Prove the slot this turn holds is still its own, right before a send.

    No-op outside :func:`turn_slot` (no cap). Free while the slot was renewed
    less than half a ttl ago: the lease row then has at least half a ttl to run,
    and nobody takes a live slot of a run that is not over. Otherwise (the
    process stalled, or the renewals failed) the slot is renewed now; a row that
    another holder took raises :class:`TurnSlotLostError`. The remaining window
    is the send's own request — a stall between this check and the request
    going out — which no client-side check closes.
    """
    held = _HELD.get()
    if held is None:
        return
    stale = time.monotonic() - held.last_ok
    if stale < held.ttl / 2:
        return
    renewed = await held.store.leases.renew(slot_key(held.index), held.holder, held.ttl)
    if renewed is None:
        raise TurnSlotLostError(held.index, stale)
    held.last_ok = time.monotonic()


def slot_key(index: int) -> str:
    """The lease key of slot ``index``."""
    return f"{SLOT_PREFIX}{index}"


async def busy_slots(store: StateStore, cap: int) -> set[int]:
    """Indices of the slots whose lease is live now (database clock)."""
    return set(await _busy_holders(store, cap))


# Every slot row of the tenant not released by its holder (live, or lapsed): a key
# range on the primary key (``turn-slot;`` is the first string after every
# ``turn-slot:…``), filtered to the cap in Python. Fixed text run through the driver:
# building the ``IN (50 keys)`` select per claim was ≈ 1 % of a fan-out worker's loop
# (docs/performance.md, round 7).
_BUSY = (
    "SELECT key, holder, expires_at - {now} FROM " + lease_table.name + " "
    "WHERE tenant = {p1} AND key >= '"
    + SLOT_PREFIX
    + "' AND key < '"
    + SLOT_PREFIX[:-1]
    + chr(ord(SLOT_PREFIX[-1]) + 1)
    + "' AND expires_at <> "
    + repr(RELEASED)
)
_SQLITE_BUSY = _BUSY.format(now="((julianday('now') - 2440587.5) * 86400.0)", p1="?")
_PG_BUSY = _BUSY.format(
    now="CAST(EXTRACT(epoch FROM clock_timestamp()) AS DOUBLE PRECISION)", p1="$1::text"
)


def _slot_index(key: str, cap: int) -> int | None:
    tail = key[len(SLOT_PREFIX) :]
    if not tail.isdigit():
        return None
    index = int(tail)
    return index if index < cap else None


async def _busy_holders(store: StateStore, cap: int) -> dict[int, tuple[str, float]]:
    """Live slots: index → (holder, seconds left)."""
    return {i: row for i, row in (await _held_rows(store, cap)).items() if row[1] > 0}


def _held_from(rows: list[Any], cap: int) -> dict[int, tuple[str, float]]:
    busy: dict[int, tuple[str, float]] = {}
    for key, holder, left in rows:
        index = _slot_index(str(key), cap)
        if index is not None:
            busy[index] = (str(holder), float(left))
    return busy


def _claim_direct(
    tenant: str,
    cap: int,
    holder: str,
    ttl: float,
    hinted: int | None,
    conn: sqlite3.Connection,
    take_writer: Callable[[], None],
) -> tuple[int | None, dict[int, tuple[str, float]]]:
    """SQLite: ``_Claimer.claim``'s store part in ONE hop to the worker — the hinted
    slot's acquire, else the read of the held slots and an acquire per free one (in
    random order) until one is won. The same statements as one by one, each atomic
    by itself; a claim that read and then acquired took two hops (three after a
    failed hint), each a thread hand-off on a busy loop (docs/performance.md, round
    10a). Returns the slot won (or None) and the held slots read (None when the hint
    won: nothing was read)."""
    if hinted is not None:
        # Released rows only: another process may have taken the slot since, and its
        # lease lapsed while its turn still runs (judged by the caller).
        got = acquire_direct(
            conn, take_writer, tenant, slot_key(hinted), holder, ttl, released_only=True
        )
        if got is not None:
            return hinted, {}
    held = _held_from(driver_rows(conn, _SQLITE_BUSY, (tenant,)), cap)
    free = [i for i in range(cap) if i not in held]
    # Random order: waiters that see the same free slot mostly try different ones.
    _rng.shuffle(free)
    for i in free:
        # Released only: a slot taken since the read may lapse before this acquire.
        got = acquire_direct(
            conn, take_writer, tenant, slot_key(i), holder, ttl, released_only=True
        )
        if got is not None:
            return i, held
    return None, held


async def _held_rows(store: StateStore, cap: int) -> dict[int, tuple[str, float]]:
    """Slots not released by their holder: index → (holder, seconds left); a lapsed
    one (its holder stopped renewing) has ≤ 0 left."""
    rows: list[Any]
    if store.backend == "sqlite":

        def body(conn: sqlite3.Connection, _take_writer: Callable[[], None]) -> list[Any]:
            # One statement on the worker's sqlite3 connection, its own read snapshot
            # (no BEGIN / COMMIT, no SQLAlchemy cursor result: docs/performance.md,
            # round 10a).
            return driver_rows(conn, _SQLITE_BUSY, (store.tenant,))

        rows = await store.run_direct(body)
    else:
        async with store.autocommit() as conn:
            rows = list((await conn.exec_driver_sql(_PG_BUSY, (store.tenant,))).all())
    return _held_from(rows, cap)


class _Claimer:
    """One turn's claim attempts: free slots first, then the slots of dead holders."""

    def __init__(
        self,
        store: StateStore,
        cap: int,
        holder: str,
        ttl: float,
        credentials: CoderCredentials | None,
        log: logging.Logger | logging.LoggerAdapter[Any],
        workflow_id: str | None = None,
        gate: _Gate | None = None,
    ) -> None:
        self.store = store
        self.cap = cap
        #: The waiter's workflow (it holds that workflow's lease).
        self.workflow_id = workflow_id
        self.gate = gate
        self.holder = holder
        self.ttl = ttl
        self.credentials = credentials
        self.log = log
        self._said: set[tuple[str, str | None]] = set()

    async def claim(self, hints: list[int] | None = None) -> int | None:
        """A slot, or None. ``hints``: slots this process released last (newest last);
        the newest is tried first with one atomic acquire and no read — in a busy
        worker it is most likely still free (a fan-out of quick turns hands slots
        on within the process), and the acquire, not the read, decides anyway."""
        store = self.store
        hinted: int | None = None
        while hints:
            hinted = hints.pop()
            if hinted < self.cap:
                break
            hinted = None
        if store.backend == "sqlite":
            index, held = await store.run_direct(
                functools.partial(
                    _claim_direct, store.tenant, self.cap, self.holder, self.ttl, hinted
                )
            )
            if index is not None:
                return index
        else:
            if hinted is not None:
                # Released rows only: another process may have taken the slot since,
                # and its lease lapsed while its turn still runs (judged below).
                got = await store.leases.acquire(
                    slot_key(hinted), self.holder, self.ttl, released_only=True
                )
                if got is not None:
                    return hinted
                # Taken by another process meanwhile: read what is free.
            held = await _held_rows(store, self.cap)
            free = [i for i in range(self.cap) if i not in held]
            # Random order: waiters that see the same free slot mostly try different ones.
            _rng.shuffle(free)
            for i in free:
                # Released only: a slot taken since the read may lapse before this acquire.
                got = await store.leases.acquire(
                    slot_key(i), self.holder, self.ttl, released_only=True
                )
                if got is not None:
                    return i
        # A lapsed slot (its holder stopped renewing, dead or stalled) stands for a
        # turn that may still run server-side, like a live slot of a run that is
        # over: both are judged (slot_takeover), never taken on the ttl alone.
        busy = {i: row for i, row in held.items() if row[1] > 0}
        lapsed = [i for i in held if i not in busy]
        _rng.shuffle(lapsed)
        for i in lapsed:
            other = held[i][0]
            verdict = await judge_dead_slot(
                store,
                other,
                self.credentials,
                lapsed=True,
                waiter_workflow=self.workflow_id,
                unknown_after=self.ttl - -held[i][1],
            )
            if verdict.take:
                # Compare-and-set: only the lapsed row of the holder just judged (a waiter
                # stalled after judging must not take another holder's row).
                got = await store.leases.take_over(
                    slot_key(i), other, self.holder, self.ttl, lapsed_only=True
                )
                if got is not None:
                    self._taken(i, other, verdict, -held[i][1], lapsed=True)
                    return i
            else:
                self._say_kept(i, other, verdict, -held[i][1], lapsed=True)
                self._call_own_workflow(i, other)
        if self.credentials is None:
            return None  # nothing to ask the server with: the ttl decides
        # All busy. A slot whose holder's run is over stands for a turn that may still
        # run server-side (chatd runs the agent loop): it is taken over only once that
        # turn's chats are at rest, never just because the run is Crashed (that let
        # the fleet run cap + 1 turns).
        over = await holders_over(
            [h for h, _ in busy.values() if holder_workflow_id(h) is not None]
        )
        for i, (other, left) in busy.items():
            if other not in over:
                continue  # live, or not known to be over: its ttl decides
            verdict = await judge_dead_slot(
                store, other, self.credentials, waiter_workflow=self.workflow_id
            )
            if verdict.take:
                got = await store.leases.take_over(slot_key(i), other, self.holder, self.ttl)
                if got is not None:
                    self._taken(i, other, verdict, left, lapsed=False)
                    return i
            else:
                self._say_kept(i, other, verdict, left, lapsed=False)
                self._call_own_workflow(i, other)
        return None

    def _call_own_workflow(self, i: int, other: str) -> None:
        """A gone holder's slot this head keeps (its chats are not at rest): if a claim
        of that holder's workflow is queued behind this one in the process, call it
        out of the queue — it may take the slot at once (slot_takeover), and it may be
        the very recovery that brings those chats to rest (a paused turn: only its
        answer does). Left queued, it waited behind a head waiting on it."""
        if self.gate is None or not self.gate.calls:
            return
        workflow_id = holder_workflow_id(other)
        fut = self.gate.calls.get(workflow_id) if workflow_id is not None else None
        if fut is not None and not fut.done():
            fut.set_result(i)

    async def claim_own(self, i: int) -> int | None:
        """Slot ``i``, called out of the queue for this claim's workflow: taken if a
        gone holder still holds it for this workflow (or it is free now), else None."""
        store = self.store
        row = (await _held_rows(store, self.cap)).get(i)
        if row is None:
            got = await store.leases.acquire(slot_key(i), self.holder, self.ttl, released_only=True)
            return i if got is not None else None
        other, left = row
        if holder_workflow_id(other) != self.workflow_id:
            return None
        lapsed = left <= 0
        verdict = await judge_dead_slot(
            store, other, self.credentials, lapsed=lapsed, waiter_workflow=self.workflow_id
        )
        if not verdict.take:
            return None
        got = await store.leases.take_over(
            slot_key(i), other, self.holder, self.ttl, lapsed_only=lapsed
        )
        if got is None:
            return None
        self._taken(i, other, verdict, -left if lapsed else left, lapsed=lapsed)
        return i

    def _taken(self, i: int, other: str, verdict: Verdict, left: float, *, lapsed: bool) -> None:
        """The log line of a slot taken from a gone holder (``left``: seconds before its
        expiry, or — lapsed — since it)."""
        when = f"lapsed {left:.1f}s ago" if lapsed else f"{left:.1f}s before its expiry"
        if verdict.same_workflow:
            # The same turn, continued by this run: routine after a crash.
            self.log.info(
                "turn slot %d taken over from %s, which ran this workflow's turn (%s)",
                i,
                other,
                when,
            )
        elif lapsed and not verdict.holder_over:
            self.log.warning("turn slot %d taken from %s: its lease %s", i, other, when)
        else:
            self.log.warning(
                "turn slot %d taken over from %s: its %s and its chats are at rest (%s)",
                i,
                other,
                "lease lapsed" if lapsed else "run is over",
                when,
            )

    def _say_kept(self, i: int, other: str, verdict: Verdict, left: float, *, lapsed: bool) -> None:
        """Say once per gone holder and chat why its slot is kept (the waiter probes
        again every second)."""
        if not verdict.holder_over or (other, verdict.chat_id) in self._said:
            return
        self._said.add((other, verdict.chat_id))
        why = (
            f"chat {verdict.chat_id} is still {verdict.status} server-side"
            if verdict.chat_id
            else f"its chats' status is {verdict.status}"
        )
        if lapsed:
            self.log.info(
                "turn slot %d: its lease lapsed %.0fs ago (holder %s) but %s; taken once its "
                "chats are at rest",
                i,
                left,
                other,
                why,
            )
        else:
            self.log.info(
                "turn slot %d: its holder's run is over but %s; taken over once its "
                "chats are at rest (or in %.0fs, its expiry)",
                i,
                why,
                left,
            )


async def _set_task_state(name: str) -> bool:
    """Force the current task run's state to ``Running`` with ``name``; False on failure."""
    ctx = TaskRunContext.get()
    if ctx is None:
        return False
    state: Any = Running(name=name)
    try:
        async with get_client() as client:
            await client.set_task_run_state(ctx.task_run.id, state, force=True)
    except Exception:  # cosmetic: the log line says the same
        logging.getLogger(__name__).debug("could not set state %s", name, exc_info=True)
        return False
    return True


class _WaitingState:
    """Shows the task run as ``Running``/``WaitingForTurnSlot`` while it waits (best effort).

    In the background and retried: the server records a task run from the
    engine's events, asynchronously, so right at task start it may not know the
    run yet (a fan-out of 50 lost about one state in three without the retry).
    """

    def __init__(self) -> None:
        self._task: asyncio.Task[None] | None = None
        self._shown = False
        self._stopped = asyncio.Event()

    def start(self) -> None:
        if self._task is None and TaskRunContext.get() is not None:
            self._task = asyncio.create_task(self._show(), name="waiting-state")

    async def _show(self) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopped.wait(), SHOW_WAITING_AFTER_S)
            return  # got a slot within SHOW_WAITING_AFTER_S: nothing to show
        # Retried for as long as the turn still waits: the server may not have
        # recorded the task run yet on a busy machine. An attempt under way when the
        # turn gets its slot is finished, not cancelled (a cancelled request may or
        # may not have landed; then the "Running" below must follow it).
        while True:
            if await _set_task_state(WAITING_STATE_NAME):
                self._shown = True
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopped.wait(), 0.25)
                return

    async def stop(self) -> None:
        self._stopped.set()
        if self._task is not None:
            await self._task
        if self._shown:
            await _set_task_state("Running")


@contextlib.asynccontextmanager
async def turn_slot(
    store: StateStore,
    cap: int | None,
    *,
    wait: float,
    ttl: float,
    workflow_id: str = "-",
    step: str = "-",
    logger: logging.Logger | logging.LoggerAdapter[Any] | None = None,
    poll_interval: float = 0.05,
    credentials: CoderCredentials | None = None,
) -> AsyncIterator[int | None]:
    """Hold one of ``cap`` deployment-wide turn slots for the block (no cap: no-op).

    Yields the slot's index (None without a cap).

    Waits up to ``wait`` seconds, then raises :class:`TurnSlotUnavailableError`.
    The slot is renewed every ``ttl/3`` and released on exit. A holder that dies
    keeps it until its workflow's chats are at rest on the server (its turn goes
    on there), which this waiter asks the Coder server about with ``credentials``
    once Prefect shows the holder's run over or its lease lapsed (``ttl`` after
    its last renewal); without credentials, the ttl decides. ``workflow_id``
    names the workflow whose turn this is — the caller holds that workflow's
    lease, so a slot its dead holder held for the same workflow is taken at once.
    """
    if cap is None:
        yield None
        return
    log = logger or logging.getLogger(__name__)
    # The holder names this flow run and the workflow: how a waiter judges it dead.
    holder = run_holder(workflow_id)
    gate = _local_gate(store)
    claimer = _Claimer(
        store,
        cap,
        holder,
        ttl,
        credentials,
        log,
        None if workflow_id == "-" else workflow_id,
        gate,
    )
    started = time.monotonic()
    deadline = started + wait
    # Only the head of this process's queue polls the store: 50 waiting turns in one
    # worker would otherwise hammer it (SQLite answers "database is locked").
    # Every claim of this process goes through its queue, even when slots are free: a
    # burst of 100 concurrent claims made SQLite fail other writes ("database is
    # locked", measured with bench/fanout.py at cap 50).
    ui = _WaitingState()
    queued = gate.lock.locked()
    announced = False
    renewer: asyncio.Task[None] | None = None
    held: _Held | None = None
    index = -1
    direct: int | None = None
    try:
        try:
            if queued:
                # Every claim of this process queues, free slots or not. A turn queued
                # behind its neighbours' claims is not waiting on the cap: announcing it
                # (log line, event, two task-run state API calls) cost a fan-out of
                # quick turns a fifth of its CPU, and at cap 50 a starved loop kept
                # nearly every claim queued for over a second. So a queued turn
                # announces only once it has queued SHOW_WAITING_AFTER_S while the head
                # of the queue finds every slot busy — then it is waiting on the cap,
                # behind the head.
                # ONE acquire for the whole wait, looked at every SHOW_WAITING_AFTER_S:
                # an acquire bounded by wait_for and started again each second cost a
                # task, a timer and a cancellation per queued claim per second (3 % of
                # a loaded fan-out worker's loop), and each restart sent the claim to
                # the back of the queue.
                acquiring = asyncio.ensure_future(gate.lock.acquire())
                # The head may call this claim out of the queue (_call_own_workflow).
                call = gate.call(claimer.workflow_id)
                try:
                    timeout = min(wait, SHOW_WAITING_AFTER_S)
                    while True:
                        waiting: set[asyncio.Future[Any]] = {acquiring}
                        if call is not None:
                            waiting.add(call)
                        done, _ = await asyncio.wait(
                            waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                        )
                        if acquiring in done:
                            break
                        if call is not None and call in done:
                            direct = await claimer.claim_own(call.result())
                            if direct is not None:
                                _drop_acquire(acquiring, gate.lock)
                                break
                            call = gate.call(claimer.workflow_id)
                        left = deadline - time.monotonic()
                        if left <= 0:
                            raise TurnSlotUnavailableError(cap, time.monotonic() - started)
                        if not announced and gate.cap_full:
                            _announce(cap, wait, workflow_id, step, log, ui)
                            announced = True
                        timeout = left if announced else min(left, SHOW_WAITING_AFTER_S)
                except BaseException:
                    _drop_acquire(acquiring, gate.lock)
                    raise
                finally:
                    gate.hang_up(claimer.workflow_id, call)
            else:
                await gate.lock.acquire()  # not locked: taken at once
            if direct is not None:
                # Called out of the queue and took its own workflow's slot.
                index, waited = direct, True
                held = _Held(store, index, holder, ttl, time.monotonic())
                renewer = asyncio.create_task(_renew(held, log), name=f"renew:{slot_key(index)}")
            else:
                try:
                    index, waited = await _wait_for_slot(
                        claimer,
                        cap,
                        started,
                        deadline,
                        workflow_id,
                        step,
                        log,
                        poll_interval,
                        ui=ui if not announced else None,
                        gate=gate,
                    )
                    # Renew from the moment the claim committed, before anything else is
                    # awaited: the waiting state's API calls below (ui.stop) took longer
                    # than the ttl on a loaded Prefect server, the unrenewed slot lapsed
                    # and the next waiter took it while this turn ran (7 turns at cap 5).
                    held = _Held(store, index, holder, ttl, time.monotonic())
                    renewer = asyncio.create_task(
                        _renew(held, log), name=f"renew:{slot_key(index)}"
                    )
                finally:
                    gate.lock.release()
        finally:
            await ui.stop()
    except BaseException:
        if renewer is not None:  # cancelled while the waiting state was put back
            await _let_go(renewer, store, index, holder, ttl, log, gate)
        raise
    assert renewer is not None and held is not None
    if announced or waited:
        log.info("got turn slot %d/%d after %.2fs", index, cap, time.monotonic() - started)
    if SLOT_TRACE is not None:
        now = time.monotonic()
        SLOT_TRACE.append(("acquire_waited" if waited else "acquire", now))
        SLOT_TRACE.append(("acquire_latency", now - started))
    # The turn's sends confirm it (confirm_turn_slot); its own context only.
    token = _HELD.set(held)
    try:
        yield index
    except (Exception, asyncio.CancelledError):
        # The turn failed or was cancelled: its run may go on server-side (a lost
        # response to a landed send, a timeout, a cancelled follow). Released, the
        # slot went to the next waiter at once, next to that run (2 turns at cap 1,
        # tests/hostloss/test_hostile_slot_release.py). Abandoned, it lapses now, and a
        # waiter takes a lapsed slot once this workflow's chats are at rest — this
        # workflow's own retry or recovery at once (slot_takeover).
        await _let_go(renewer, store, index, holder, ttl, log, gate, abandon=True)
        raise
    except BaseException:  # the generator closed, the interpreter exiting: give it up
        await _let_go(renewer, store, index, holder, ttl, log, gate)
        raise
    finally:
        with contextlib.suppress(ValueError):  # closed from another context
            _HELD.reset(token)
    await _let_go(renewer, store, index, holder, ttl, log, gate)


async def _let_go(
    renewer: asyncio.Task[None],
    store: StateStore,
    index: int,
    holder: str,
    ttl: float,
    log: logging.Logger | logging.LoggerAdapter[Any],
    gate: _Gate | None = None,
    *,
    abandon: bool = False,
) -> None:
    """Stop renewing slot ``index`` and release it (it lapses after ``ttl`` if that fails);
    a released slot becomes ``gate``'s newest claim hint. ``abandon``: let it lapse now
    instead (what it stood for may still run)."""
    renewer.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await renewer
    if SLOT_TRACE is not None:
        SLOT_TRACE.append(("release", time.monotonic()))
    try:
        if abandon:
            await store.leases.abandon(slot_key(index), holder)
            return
        released = await store.leases.release(slot_key(index), holder)
    except Exception:  # it lapses after ttl on its own
        log.warning("could not release turn slot %d; it lapses after %.0fs", index, ttl)
        return
    if released and gate is not None:
        gate.released.append(index)
        del gate.released[:-_HINTS]


async def _renew(held: _Held, log: logging.Logger | logging.LoggerAdapter[Any]) -> None:
    key, ttl = slot_key(held.index), held.ttl
    while True:
        await asyncio.sleep(ttl / 3)
        try:
            renewed = await held.store.leases.renew(key, held.holder, ttl)
        except Exception as exc:
            if time.monotonic() - held.last_ok < ttl:
                continue  # transient: retry until a whole ttl went by
            log.warning("turn slot %s could not be renewed (%s)", key, type(exc).__name__)
            return
        if renewed is None:
            # Lapsed and taken over: the fleet may run one turn over its cap until
            # this one ends. Only a store stalled for a whole ttl gets here.
            log.warning("turn slot %s was lost (not renewed within %.0fs)", key, ttl)
            return
        held.last_ok = time.monotonic()


class _Gate:
    """The FIFO queue of this process's claims on one store (per event loop), and
    whether its head is waiting on the cap (found every slot busy)."""

    __slots__ = ("calls", "cap_full", "lock", "released")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.cap_full = False
        #: Slots this process released, newest last (at most ``_HINTS``): claim hints.
        self.released: list[int] = []
        #: Queued claims by workflow: the head resolves one with the index of a slot a
        #: gone holder held for that workflow (see ``_Claimer._call_own_workflow``).
        self.calls: dict[str, asyncio.Future[int]] = {}

    def call(self, workflow_id: str | None) -> asyncio.Future[int] | None:
        """Register a queued claim of ``workflow_id`` to be called out of the queue."""
        if workflow_id is None:
            return None
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.calls[workflow_id] = fut
        return fut

    def hang_up(self, workflow_id: str | None, fut: asyncio.Future[int] | None) -> None:
        if workflow_id is not None and fut is not None and self.calls.get(workflow_id) is fut:
            del self.calls[workflow_id]


_gates: dict[tuple[int, str, str], _Gate] = {}
#: How many released slots a gate remembers as claim hints.
_HINTS = 64


def _local_gate(store: StateStore) -> _Gate:
    """This process's claim queue on one store (per event loop)."""
    key = (id(asyncio.get_running_loop()), store.url, store.tenant)
    gate = _gates.get(key)
    if gate is None:
        gate = _gates[key] = _Gate()
    return gate


def _drop_acquire(acquiring: asyncio.Future[Any], lock: asyncio.Lock) -> None:
    """Give up a pending ``lock.acquire()`` task: cancel it, or — when it got the lock
    already — release the lock (a cancelled acquire that was just woken hands the
    lock to the next waiter itself: ``asyncio.Lock``)."""
    if acquiring.cancel():
        return
    if not acquiring.cancelled() and acquiring.exception() is None:
        lock.release()


def _announce(
    cap: int,
    wait: float,
    workflow_id: str,
    step: str,
    log: logging.Logger | logging.LoggerAdapter[Any],
    ui: _WaitingState,
) -> None:
    """The visible "waiting" signals: a log line, an event, a named UI state."""
    log.info(
        "waiting for a turn slot: all %d slots busy (step %s of %s; waits up to %.0fs)",
        cap,
        step,
        workflow_id,
        wait,
    )
    if TaskRunContext.get() is not None or FlowRunContext.get() is not None:
        # Outside a run, emitting would start a temporary Prefect server (seconds).
        TurnObserver(workflow_id=workflow_id, step=step, logger=log).emit(
            "coder.turn.waiting_for_slot", {"cap": cap}
        )
    ui.start()


async def _wait_for_slot(
    claimer: _Claimer,
    cap: int,
    started: float,
    deadline: float,
    workflow_id: str,
    step: str,
    log: logging.Logger | logging.LoggerAdapter[Any],
    poll_interval: float,
    *,
    ui: _WaitingState | None,
    gate: _Gate,
) -> tuple[int, bool]:
    index = await claimer.claim(gate.released)
    if index is not None:
        return index, False
    if ui is not None:  # not announced yet
        _announce(cap, deadline - started, workflow_id, step, log, ui)
    # The turns queued behind this one are waiting on the cap too (they announce).
    gate.cap_full = True
    try:
        while index is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TurnSlotUnavailableError(cap, time.monotonic() - started)
            # Jitter spreads the pollers of a large fan-out over the interval.
            await asyncio.sleep(min(left, poll_interval * (0.5 + _rng.random())))
            index = await claimer.claim(gate.released)
    finally:
        gate.cap_full = False
    return index, True
