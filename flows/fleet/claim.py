"""One turn's claim on the turn slots: a free slot, else the slot of a gone holder.

The slots are ``N`` lease rows of the store, ``turn-slot:0`` … ``turn-slot:N-1``.
A free one (never held, or released) is won with ONE store call,
``store.leases.claim_any``, which also reads the rows of the slots it did not win.
A slot whose holder is gone — its lease *lapsed* (the holder stopped renewing:
dead, or stalled), or live but its Prefect run is over — is judged
(``takeover.judge_dead_slot``: is its workflow's turn at rest server-side?) and
taken with ``store.leases.take_over``, a compare-and-set on the holder. Either
way the claim ends holding a store ``HeldLease``, renewed in the background.
"""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Mapping
from typing import Any

from prefect_coder.blocks import CoderCredentials, StateStore
from prefect_coder.blocks.state import HeldLease
from prefect_coder.flows.common.holders import holder_workflow_id, holders_over
from prefect_coder.flows.fleet.takeover import Verdict, judge_dead_slot
from prefect_coder.flows.fleet.waiting import Gate

__all__ = ["SLOT_PREFIX", "Claimer", "slot_index", "slot_key", "slot_keys"]

SLOT_PREFIX = "turn-slot:"
#: Private: the global ``random`` is shared with (and reseeded by) other code.
_rng = random.Random()
Log = logging.Logger | logging.LoggerAdapter[Any]


def slot_key(index: int) -> str:
    """The lease key of slot ``index``."""
    return f"{SLOT_PREFIX}{index}"


@functools.lru_cache(maxsize=16)
def slot_keys(cap: int) -> tuple[str, ...]:
    """The lease keys of slots ``0 … cap-1`` (built once per cap: a claim per turn)."""
    return tuple(slot_key(i) for i in range(cap))


def slot_index(key: str) -> int:
    """The index of the slot whose lease key is ``key``."""
    return int(key[len(SLOT_PREFIX) :])


class Claimer:
    """One turn's claim attempts: free slots first, then the slots of gone holders."""

    def __init__(
        self,
        store: StateStore,
        cap: int,
        holder: str,
        ttl: float,
        credentials: CoderCredentials | None,
        log: Log,
        workflow_id: str | None = None,
        gate: Gate | None = None,
    ) -> None:
        self.store = store
        self.cap = cap
        self.keys = slot_keys(cap)
        #: The waiter's workflow (it holds that workflow's lease).
        self.workflow_id = workflow_id
        self.gate = gate
        self.holder = holder
        self.ttl = ttl
        self.credentials = credentials
        self.log = log
        self._said: set[tuple[str, str | None]] = set()

    async def claim(self, hints: list[int] | None = None) -> HeldLease | None:
        """A slot, held, or None. ``hints``: slots this process released last (newest
        last); the newest is tried first with one atomic acquire and no read — in a
        busy worker it is most likely still free (a fan-out of quick turns hands slots
        on within the process), and the acquire, not the read, decides anyway."""
        store = self.store
        hinted: int | None = None
        while hints:
            hinted = hints.pop()
            if hinted < self.cap:
                break
            hinted = None
        # Free slots only (never held, or released): another process may have taken the
        # hinted slot since, and its lease lapsed while its turn still runs.
        got = await store.leases.claim_any(
            self.keys,
            self.holder,
            self.ttl,
            first=None if hinted is None else slot_key(hinted),
            logger=self.log,
        )
        if got.lease is not None:
            return got.lease
        held = {slot_index(key): row for key, row in got.holders.items()}
        # A lapsed slot (its holder stopped renewing, dead or stalled) stands for a
        # turn that may still run server-side, like a live slot of a run that is
        # over: both are judged (takeover), never taken on the ttl alone.
        busy = {i: row for i, row in held.items() if row.left > 0}
        lapsed = [i for i in held if i not in busy]
        _rng.shuffle(lapsed)
        for i in lapsed:
            other, left = held[i]
            verdict = await judge_dead_slot(
                store,
                other,
                self.credentials,
                lapsed=True,
                waiter_workflow=self.workflow_id,
                unknown_after=self.ttl + left,
            )
            if verdict.take:
                # Compare-and-set: only the lapsed row of the holder just judged (a waiter
                # stalled after judging must not take another holder's row).
                taken = await self._take(i, other, verdict, -left, lapsed=True)
                if taken is not None:
                    return taken
            else:
                self._say_kept(i, other, verdict, -left, lapsed=True)
                self._call_own_workflow(i, other)
        if self.credentials is None:
            return None  # nothing to ask the server with: the ttl decides
        return await self._claim_over(busy)

    async def _claim_over(self, busy: Mapping[int, tuple[str, float]]) -> HeldLease | None:
        """All busy. A slot whose holder's run is over stands for a turn that may still
        run server-side (chatd runs the agent loop): it is taken over only once that
        turn's chats are at rest, never just because the run is Crashed (that let the
        fleet run cap + 1 turns)."""
        over = await holders_over(
            [h for h, _ in busy.values() if holder_workflow_id(h) is not None]
        )
        for i, (other, left) in busy.items():
            if other not in over:
                continue  # live, or not known to be over: its ttl decides
            verdict = await judge_dead_slot(
                self.store, other, self.credentials, waiter_workflow=self.workflow_id
            )
            if verdict.take:
                taken = await self._take(i, other, verdict, left, lapsed=False)
                if taken is not None:
                    return taken
            else:
                self._say_kept(i, other, verdict, left, lapsed=False)
                self._call_own_workflow(i, other)
        return None

    async def _take(
        self, i: int, other: str, verdict: Verdict, left: float, *, lapsed: bool
    ) -> HeldLease | None:
        """Slot ``i`` taken from ``other`` (judged gone), held; None if it moved on."""
        leases = self.store.leases
        got = await leases.take_over(slot_key(i), other, self.holder, self.ttl, lapsed_only=lapsed)
        if got is None:
            return None
        self._taken(i, other, verdict, left, lapsed=lapsed)
        return leases.keep(got, self.ttl, logger=self.log)

    def _call_own_workflow(self, i: int, other: str) -> None:
        """A gone holder's slot this head keeps (its chats are not at rest): if a claim
        of that holder's workflow is queued behind this one in the process, call it
        out of the queue — it may take the slot at once (takeover), and it may be the
        very recovery that brings those chats to rest (a paused turn: only its answer
        does). Left queued, it waited behind a head waiting on it."""
        if self.gate is None or not self.gate.calls:
            return
        workflow_id = holder_workflow_id(other)
        fut = self.gate.calls.get(workflow_id) if workflow_id is not None else None
        if fut is not None and not fut.done():
            fut.set_result(i)

    async def claim_own(self, i: int) -> HeldLease | None:
        """Slot ``i``, called out of the queue for this claim's workflow: taken if a
        gone holder still holds it for this workflow (or it is free now), else None."""
        got = await self.store.leases.claim_any(
            (slot_key(i),), self.holder, self.ttl, logger=self.log
        )
        if got.lease is not None:
            return got.lease
        row = got.holders.get(slot_key(i))
        if row is None:
            return None  # taken meanwhile, and released again: the queue decides
        other, left = row
        if holder_workflow_id(other) != self.workflow_id:
            return None
        lapsed = left <= 0
        verdict = await judge_dead_slot(
            self.store, other, self.credentials, lapsed=lapsed, waiter_workflow=self.workflow_id
        )
        if not verdict.take:
            return None
        return await self._take(i, other, verdict, -left if lapsed else left, lapsed=lapsed)

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
