"""Acting on a sweep's decisions: stop a run, archive a settled chat, reconcile a pause.

Acting on a chat whose workflow is known takes that workflow's lease (the same
one every turn holds), with a short wait: a live run of the workflow is never
interrupted, and the turn that created a chat cannot checkpoint it between the
sweep's check and its archive. A busy workflow is left for the next sweep.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable
from typing import Any, Literal

from coder_chat.errors import CoderApiError
from coder_chat.history import marker_attempts
from coder_chat.models import Chat
from coder_chat.rest import ChatClient
from coder_chat.stop import stop_chat
from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state import LeaseUnavailableError, workflow_key
from prefect_coder.flows.common.errors import ChatNotArchivedError
from prefect_coder.flows.observe.run_log import RunLogger
from prefect_coder.flows.recovery.send_journal import journal_cut_short
from prefect_coder.flows.sweeps.options import SweepOptions
from prefect_coder.flows.sweeps.plan import (
    CRASHED_ATTEMPT_STATUSES,
    Action,
    SweepDecision,
    busy_refinement,
    crashed_attempt_left,
    crashed_attempt_refinement,
    paused_refinement,
)
from prefect_coder.flows.sweeps.reconcile import Reconciler, ReconcileRequest
from prefect_coder.flows.sweeps.report import SweepReport, emit_chat_event

__all__ = ["ChatNotArchivedError", "SweepActor", "bring_to_rest"]


async def bring_to_rest(
    client: ChatClient,
    chat_id: str,
    *,
    bound_s: float,
    poll_s: float,
    archive: bool,
    store: StateStore | None = None,
) -> str:
    """Stop the chat's run (and archive it) with :func:`coder_chat.stop.stop_chat`
    within ``bound_s``; returns the row's outcome: each interrupt and the status
    it led to, then the archive.

    A ``requires_action`` pause needs two interrupts (the first closes the pending
    calls and the model continues); ``stop_chat`` knows the server's rules. A chat
    to archive that is not archived within the bound raises
    :class:`ChatNotArchivedError`: the row fails and its records are kept.

    With ``store``, the first interrupt of a checkpointed chat is journaled
    (``cut-short``) before it is sent, so the workflow's own recovery never
    takes the attempt it truncates for a finished one.
    """
    seen: list[str] = []

    async def note(chat: Chat) -> None:
        if store is not None and not seen:
            await journal_cut_short(client, store, chat_id)
        seen.append(chat.status)

    result = await stop_chat(
        client,
        chat_id,
        timeout=bound_s,
        archive=archive,
        before_interrupt=note,
        poll_interval=poll_s,
    )
    after = [*seen[1:], result.status or "unknown"]
    steps = [f"interrupted → {status}" for status in after] if seen else []
    if not seen:
        steps.append(f"nothing to interrupt ({result.status})")
    if not result.settled:
        steps.append("stop bound reached")
    if archive:
        if not result.archived:
            why = f"; last error: {result.last_error}" if result.last_error else ""
            raise ChatNotArchivedError(
                f"not archived within {bound_s:g}s (last status {result.status}){why}"
            )
        steps.append("already archived" if result.was_archived else "archived")
    return "; ".join(steps)


class _ActingFailed(Exception):
    """Acting on a refined decision failed (the cause is chained)."""

    def __init__(self, decision: SweepDecision) -> None:
        super().__init__(decision.chat_id)
        self.decision = decision


def _workflow_lease(
    store: StateStore, workflow_id: str, opts: SweepOptions
) -> contextlib.AbstractAsyncContextManager[Any]:
    return store.lease(workflow_key(workflow_id), ttl=opts.lease_ttl_s, wait=opts.lease_wait_s)


class SweepActor:
    """One sweep run: acts on decisions and records rows."""

    def __init__(
        self,
        kind: Literal["orphans", "stuck-turns"],
        client: ChatClient,
        store: StateStore,
        opts: SweepOptions,
        *,
        dry_run: bool,
        reconciler: Reconciler,
        tool_modules: tuple[str, ...],
        logger: RunLogger,
        turn_timeout_s: float | None = None,
    ) -> None:
        self.kind = kind
        self.client = client
        self.store = store
        self.opts = opts
        self.dry_run = dry_run
        self.reconciler = reconciler
        self.tool_modules = tool_modules
        self.logger = logger
        #: The workflows' turn timeout: a checkpointed step's crashed attempt is not
        #: cut short within it (stuck-turn sweep; None: no such protection).
        self.turn_timeout_s = turn_timeout_s
        self.report = SweepReport(sweep=kind, dry_run=dry_run, tenant=store.tenant)
        self._gate = asyncio.Semaphore(opts.concurrency)

    def record(
        self, d: SweepDecision, outcome: str = "", *, ok: bool = True, ms: float = 0.0
    ) -> None:
        self.report.add(d, outcome, ok=ok, ms=ms)

    def emit(self, event: str, d: SweepDecision, **payload: Any) -> None:
        if self.opts.emit_events:
            emit_chat_event(event, d, self.report, self.logger, **payload)

    # ----------------------------------------------------------------- acting
    async def act_group(self, workflow_id: str | None, decisions: list[SweepDecision]) -> None:
        """Act on one workflow's chats, one after the other under ONE hold of its
        lease: the sweep's own tasks must not contend for it, and the workflow's
        runs wait at most this long."""
        async with self._gate:
            if self.dry_run or workflow_id is None:
                for d in decisions:
                    await self._one(d, self._preview(d) if self.dry_run else self._apply(d))
                return
            try:
                async with _workflow_lease(self.store, workflow_id, self.opts) as held:
                    for d in decisions:
                        if held.lost:  # taken over (we stalled past its ttl): stop acting
                            self._done(
                                busy_refinement(d, lease_holder="a new holder"),
                                "lease lost: left for the next sweep",
                                0.0,
                            )
                            continue
                        await self._one(d, self._apply(d))
            except LeaseUnavailableError as exc:
                for d in decisions:
                    busy = busy_refinement(d, lease_holder=exc.holder or "another run")
                    self._done(busy, "left for the next sweep", 0.0)

    async def _one(self, d: SweepDecision, work: Awaitable[tuple[SweepDecision, str]]) -> None:
        t0 = time.perf_counter()
        try:
            final, outcome = await work
        except Exception as exc:  # one chat's failure never stops the sweep
            cause: BaseException = exc
            if isinstance(exc, _ActingFailed) and exc.__cause__ is not None:
                d, cause = exc.decision, exc.__cause__
            outcome = f"failed: {type(cause).__name__}: {str(cause)[:200]}"
            self.logger.warning("sweep of chat %s failed: %s", d.chat_id, outcome)
            self.record(d, outcome, ok=False, ms=(time.perf_counter() - t0) * 1000)
            return
        self._done(final, outcome, (time.perf_counter() - t0) * 1000)

    def _done(self, final: SweepDecision, outcome: str, ms: float) -> None:
        self.record(final, outcome, ms=ms)
        if self.kind == "stuck-turns" and final.action is not Action.KEEP:
            self.emit("coder.chat.stuck", final, outcome=outcome)
        elif final.action in (Action.RETIRE, Action.RECONCILE) and not self.dry_run:
            self.emit(
                f"coder.chat.{'retired' if final.action is Action.RETIRE else 'reconciled'}",
                final,
                outcome=outcome,
            )

    async def _ledgered(self, chat_id: str) -> bool:
        return bool(await self.store.ledger.list(chat_id))

    async def _crashed_attempt_left(
        self, d: SweepDecision, status: str
    ) -> tuple[float | None, float | None]:
        """Seconds left of the turn deadline when ``d``'s chat is the checkpointed
        step's crashed attempt (:func:`crashed_attempt_left`; else None), and the
        step's turn timeout (recorded with the journal entry, else the sweep's).

        Only for the stuck-turn sweep, a chat its workflow's checkpoint still names
        (no recovery of the workflow would ever look at another one), and a chat
        generating or paused; one history read for the step's attempt count."""
        if (
            self.kind != "stuck-turns"
            or self.turn_timeout_s is None
            or d.action not in (Action.INTERRUPT, Action.RECONCILE)
            or status not in CRASHED_ATTEMPT_STATUSES
            or not d.workflow_id
        ):
            return None, None
        cp = await self.store.checkpoints.get(d.workflow_id)
        if cp is None or cp.chat_id != d.chat_id:
            return None, None
        entry = await self.store.journal.get(d.chat_id)
        if entry is None or entry.state == "cut-short":
            return None, None  # cut short already: nothing left to protect
        attempts = await marker_attempts(
            self.client, d.chat_id, entry.marker, timeout=self.opts.request_timeout_s
        )
        # The step's own deadline, written with its send (or revival), counts: a step
        # may run with a longer turn timeout than this sweep's settings say.
        left = crashed_attempt_left(
            entry,
            attempts,
            now=time.time(),
            turn_timeout_s=self.turn_timeout_s,
        )
        return left, entry.turn_s(self.turn_timeout_s)

    async def _preview(self, d: SweepDecision) -> tuple[SweepDecision, str]:
        """Dry run: the same refinements from read-only probes; nothing is written."""
        if d.action is Action.FORGET:
            return d, "dry run: would forget the stranded record"
        if d.workflow_id:
            held = await self.store.leases.get(workflow_key(d.workflow_id))
            d = busy_refinement(d, lease_holder=held[0].holder if held else None)
            if d.action is Action.BUSY:
                return d, "dry run: busy"
        left, _ = await self._crashed_attempt_left(d, d.status)
        d = crashed_attempt_refinement(d, status=d.status, left_s=left)
        d = paused_refinement(
            d, status=d.status, has_ledger_entries=await self._ledgered(d.chat_id)
        )
        return d, f"dry run: would {d.action.value}"

    async def _apply(self, d: SweepDecision) -> tuple[SweepDecision, str]:
        if d.action is Action.FORGET:
            await self.store.forget_chat(d.chat_id)
            return d, "stranded record removed"
        return await self._apply_under_lease(d, self.opts.request_timeout_s)

    async def _apply_under_lease(
        self, d: SweepDecision, request_timeout_s: float
    ) -> tuple[SweepDecision, str]:
        # Re-check under the lease: the run we waited for may have just
        # checkpointed this very chat (its first turn's `finally`).
        if self.kind == "orphans" and d.workflow_id:
            cp = await self.store.checkpoints.get(d.workflow_id)
            if cp is not None and cp.chat_id == d.chat_id:
                return d.but(Action.KEEP, "checkpointed meanwhile"), "left alone"
        try:
            fresh = await self.client.get_chat(d.chat_id, timeout=request_timeout_s)
        except CoderApiError as exc:
            if exc.status == 404:
                await self.store.stranded.remove(d.chat_id)
                return d.but(Action.FORGET, d.reason + "; gone from the server"), "forgotten"
            raise
        if fresh.archived and d.action is Action.RETIRE:
            await self.store.forget_chat(d.chat_id)
            return d, "already archived"
        if self.kind == "stuck-turns" and fresh.status != d.status:
            return d.but(Action.KEEP, f"moved on to {fresh.status}"), "left alone"
        # Under the lease: no run of the workflow is answering. A checkpointed step's
        # crashed attempt within its turn deadline is still its workflow's to finish
        # (its recovery follows it); never cut it short (chaos seeds 14/71).
        left, turn_s = await self._crashed_attempt_left(d, fresh.status)
        d = crashed_attempt_refinement(d, status=fresh.status, left_s=left)
        if d.action is Action.LEAVE:
            return d, "left running: its workflow's recovery follows it"
        ledgered = fresh.status == "requires_action" and await self._ledgered(d.chat_id)
        d = paused_refinement(d, status=fresh.status, has_ledger_entries=ledgered)
        try:
            return await self._act(
                d, run_unstarted=left is not None, turn_s=turn_s if left is not None else None
            )
        except Exception as exc:
            # The failed row names what was attempted (e.g. the reconcile of a
            # crashed attempt's pause), not the plan's first guess.
            raise _ActingFailed(d) from exc

    async def _act(
        self, d: SweepDecision, *, run_unstarted: bool, turn_s: float | None = None
    ) -> tuple[SweepDecision, str]:
        """Reconcile, interrupt or retire ``d``'s chat (refined, under the lease).
        ``turn_s``: the crashed attempt's step's turn timeout (its revival, if the
        reconcile answers its pause, is journaled with that deadline)."""
        steps: list[str] = []
        if d.action is Action.RECONCILE:
            verdict = await self.reconciler(
                ReconcileRequest(
                    self.client,
                    self.store,
                    d.chat_id,
                    d.workflow_id,
                    self.tool_modules,
                    self.opts.interrupt_bound_s,
                    run_unstarted=run_unstarted,
                    turn_timeout_s=turn_s,
                )
            )
            if verdict == "unavailable":
                return (
                    d,
                    "left paused: its workflow's recovery answers it (a crashed attempt "
                    "within its deadline)"
                    if run_unstarted
                    else "left paused: the pause holds a committed effect and no "
                    "reconciliation ran",
                )
            if verdict == "resumed" or self.kind == "stuck-turns":
                return d, f"reconciled ({verdict})"
            steps.append(f"reconciled ({verdict})")
            d = d.but(Action.RETIRE, d.reason)
        retire = d.action is Action.RETIRE
        opts = self.opts
        steps.append(
            await bring_to_rest(
                self.client,
                d.chat_id,
                bound_s=opts.interrupt_bound_s + (opts.archive_settle_s if retire else 0.0),
                poll_s=opts.archive_retry_s,
                archive=retire,
                store=self.store,
            )
        )
        if retire:
            # Archived: its journal, ledger and stranded record have nothing left to guard.
            await self.store.forget_chat(d.chat_id)
        return d, "; ".join(steps)
