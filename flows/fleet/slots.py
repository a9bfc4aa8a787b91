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
``poll_interval`` (50 ms by default). A claim is ONE store call,
``store.leases.claim_any`` (one atomic statement per free-looking slot, so two
workers can never both take the same slot), and the slot is then a store
``HeldLease``: renewed, fenced and confirmed like the workflow's lease.

A dead holder's slot is taken over before its ttl only when Prefect shows its
run in a final state AND its workflow's chats are at rest on the server
(``takeover.judge_dead_slot``, used by ``claim.Claimer``): the dead process's
turn goes on running server-side, and the cap counts running turns, so the run
being Crashed alone is not enough (that let the fleet run cap + 1 turns), but nor does a worker's
death stall the fleet for the whole ttl once its turn has ended. A slot that
*lapsed* (its ttl ran out unreleased) is judged the same way — the ttl alone
let a dead or stalled holder's still-running turn be joined by another — and a
waiter of the holder's own workflow takes either at once (it is that turn's
continuation). (The workflow *lease* of such a run is taken over at once: see
``resources.hold_workflow_lease``.) ``waiting.py`` holds this process's claim queue
and what a waiting turn shows.

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
import logging
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from prefect_coder.blocks import CoderCredentials, StateStore
from prefect_coder.blocks.state import HeldLease, LeaseLostError
from prefect_coder.flows.common.errors import TurnSlotLostError, TurnSlotUnavailableError
from prefect_coder.flows.common.holders import run_holder
from prefect_coder.flows.fleet.claim import (
    SLOT_PREFIX,
    Claimer,
    Log,
    slot_index,
    slot_key,
    slot_keys,
)
from prefect_coder.flows.fleet.waiting import (
    WAITING_STATE_NAME,
    Gate,
    WaitingState,
    announce,
    drop_acquire,
    local_gate,
)

__all__ = [
    "SLOT_PREFIX",
    "WAITING_STATE_NAME",
    "TurnSlotLostError",
    "TurnSlotUnavailableError",
    "busy_slots",
    "confirm_turn_slot",
    "slot_key",
    "turn_slot",
]

#: Benchmarks set this to a list to record ("acquire" | "acquire_waited" | "release",
#: monotonic time) and ("acquire_latency", seconds from asking to holding).
SLOT_TRACE: list[tuple[str, float]] | None = None
#: Seconds a turn waits on the cap before its task run shows ``WaitingForTurnSlot``.
SHOW_WAITING_AFTER_S = 1.0
#: Private: the global ``random`` is shared with (and reseeded by) other code.
_rng = random.Random()


@dataclass(frozen=True)
class _Held:
    """The slot this context's turn holds: its index and its store lease."""

    index: int
    lease: HeldLease


_HELD: contextvars.ContextVar[_Held | None] = contextvars.ContextVar(
    "prefect_coder_turn_slot", default=None
)


async def confirm_turn_slot() -> None:
    """Prove the slot this turn holds is still its own, right before a send.

    No-op outside :func:`turn_slot` (no cap). The store's one confirm rule
    (``HeldLease.confirm``): while the slot was renewed less than half a ttl ago, one
    read of the row's holder and fence — a live slot can still be taken over at once
    when its run was judged over (``takeover.py``); otherwise (the process stalled, or
    the renewals failed) the slot is renewed now. A row that another holder took (or
    fenced anew), or a renewal that found it so, raises :class:`TurnSlotLostError`. The remaining
    window is the send's own request — a stall between this check and the request
    going out — which no client-side check closes.
    """
    held = _HELD.get()
    if held is None:
        return
    stale = time.monotonic() - held.lease.last_ok
    try:
        await held.lease.confirm()
    except LeaseLostError as exc:
        raise TurnSlotLostError(held.index, stale) from exc


async def busy_slots(store: StateStore, cap: int) -> set[int]:
    """Indices of the slots whose lease is live now (database clock)."""
    rows = await store.leases.holders(slot_keys(cap))
    return {slot_index(key) for key, row in rows.items() if row.left > 0}


@contextlib.asynccontextmanager
async def turn_slot(
    store: StateStore,
    cap: int | None,
    *,
    wait: float,
    ttl: float,
    workflow_id: str = "-",
    step: str = "-",
    logger: Log | None = None,
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
    gate = local_gate(store.url, store.tenant)
    claimer = Claimer(
        store,
        cap,
        # The holder names this flow run and the workflow: how a waiter judges it dead.
        run_holder(workflow_id),
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
    ui = WaitingState(SHOW_WAITING_AFTER_S)
    queued = gate.lock.locked()
    announced = False
    # The slot's store lease, renewed in the background from the moment its claim
    # committed (``claim_any`` / ``keep``), before anything else is awaited: the waiting
    # state's API calls below (ui.stop) took longer than the ttl on a loaded Prefect
    # server, the unrenewed slot lapsed and the next waiter took it while this turn ran
    # (7 turns at cap 5).
    lease: HeldLease | None = None
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
                            lease = await claimer.claim_own(call.result())
                            if lease is not None:
                                drop_acquire(acquiring, gate.lock)
                                break
                            call = gate.call(claimer.workflow_id)
                        left = deadline - time.monotonic()
                        if left <= 0:
                            raise TurnSlotUnavailableError(cap, time.monotonic() - started)
                        if not announced and gate.cap_full:
                            announce(cap, wait, workflow_id, step, log, ui)
                            announced = True
                        timeout = left if announced else min(left, SHOW_WAITING_AFTER_S)
                except BaseException:
                    drop_acquire(acquiring, gate.lock)
                    raise
                finally:
                    gate.hang_up(claimer.workflow_id, call)
            else:
                await gate.lock.acquire()  # not locked: taken at once
            # Called out of the queue, it took its own workflow's slot (claim_own).
            waited = lease is not None
            if lease is None:
                try:
                    lease, waited = await _wait_for_slot(
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
                finally:
                    gate.lock.release()
        finally:
            await ui.stop()
    except BaseException:
        if lease is not None:  # cancelled while the waiting state was put back
            await _let_go(lease, log, gate)
        raise
    index = slot_index(lease.key)
    if announced or waited:
        log.info("got turn slot %d/%d after %.2fs", index, cap, time.monotonic() - started)
    if SLOT_TRACE is not None:
        now = time.monotonic()
        SLOT_TRACE.append(("acquire_waited" if waited else "acquire", now))
        SLOT_TRACE.append(("acquire_latency", now - started))
    # The turn's sends confirm it (confirm_turn_slot); its own context only.
    token = _HELD.set(_Held(index, lease))
    try:
        yield index
    except (Exception, asyncio.CancelledError):
        # The turn failed or was cancelled: its run may go on server-side (a lost
        # response to a landed send, a timeout, a cancelled follow). Released, the
        # slot went to the next waiter at once, next to that run (2 turns at cap 1,
        # tests/hostloss/test_hostile_slot_release.py). Abandoned, it lapses now, and a
        # waiter takes a lapsed slot once this workflow's chats are at rest — this
        # workflow's own retry or recovery at once (takeover).
        await _let_go(lease, log, gate, abandon=True)
        raise
    except BaseException:  # the generator closed, the interpreter exiting: give it up
        await _let_go(lease, log, gate)
        raise
    finally:
        with contextlib.suppress(ValueError):  # closed from another context
            _HELD.reset(token)
    await _let_go(lease, log, gate)


async def _let_go(
    lease: HeldLease, log: Log, gate: Gate | None = None, *, abandon: bool = False
) -> None:
    """Stop renewing the slot and release it (it lapses after its ttl if that fails); a
    released slot becomes ``gate``'s newest claim hint. ``abandon``: let it lapse now
    instead (what it stood for may still run)."""
    if SLOT_TRACE is not None:
        SLOT_TRACE.append(("release", time.monotonic()))
    index = slot_index(lease.key)
    try:
        if abandon:
            await lease.abandon()
            return
        released = await lease.release()
    except Exception:  # it lapses after ttl on its own
        log.warning("could not release turn slot %d; it lapses after %.0fs", index, lease.ttl)
        return
    if released and gate is not None:
        gate.hint(index)


async def _wait_for_slot(
    claimer: Claimer,
    cap: int,
    started: float,
    deadline: float,
    workflow_id: str,
    step: str,
    log: Log,
    poll_interval: float,
    *,
    ui: WaitingState | None,
    gate: Gate,
) -> tuple[HeldLease, bool]:
    """Claim until a slot is held (polling, with jitter, while every slot is busy);
    the slot's lease and whether it had to wait. TurnSlotUnavailableError at
    ``deadline``."""
    lease = await claimer.claim(gate.released)
    if lease is not None:
        return lease, False
    if ui is not None:  # not announced yet
        announce(cap, deadline - started, workflow_id, step, log, ui)
    # The turns queued behind this one are waiting on the cap too (they announce).
    gate.cap_full = True
    try:
        while lease is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TurnSlotUnavailableError(cap, time.monotonic() - started)
            # Jitter spreads the pollers of a large fan-out over the interval.
            await asyncio.sleep(min(left, poll_interval * (0.5 + _rng.random())))
            lease = await claimer.claim(gate.released)
    finally:
        gate.cap_full = False
    return lease, True
