"""The reconciliation sweeps, as scheduled Prefect flows.

* :func:`sweep_orphans` — list every chat this collection labelled (archived or
  not, every page), compare with the state store (checkpoints, stranded
  records), and retire every chat no checkpoint accounts for once it is older
  than the grace period. "The reconciliation sweep is not optional": a crash or
  a lost create response leaves chats no checkpoint names.
* :func:`sweep_stuck_turns` — chats of this collection in ``running`` /
  ``interrupting`` longer than the turn budget, or paused in
  ``requires_action`` with nobody answering → interrupt (or reconcile) and emit
  ``coder.chat.stuck`` so automations can alert.

Both take ``dry_run`` and publish a table artifact per run: what was found, what
was done, why, how long it took. The decisions are pure
(:mod:`prefect_coder.flows.parts.sweep_plan`); this module lists, reads the store once, and acts
with bounded concurrency.

Acting on a chat whose workflow is known takes that workflow's lease (the same
one every turn holds), with a short wait: a live run of the workflow is never
interrupted, and the turn that created a chat cannot checkpoint it between the
sweep's check and its archive. A busy workflow is left for the next sweep.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from prefect.artifacts import acreate_table_artifact
from prefect.events import emit_event
from prefect_coder.blocks import JournalEntry, LeaseUnavailableError, StateStore, workflow_key
from prefect_coder.flows.parts import registry
from prefect_coder.flows.parts.errors import WorkflowParameterError
from prefect_coder.flows.parts.labels import scope_labels
from prefect_coder.flows.parts.observe import chat_resource
from prefect_coder.flows.parts.params import WorkflowSettings
from prefect_coder.flows.parts.resources import TurnResources, load_resources
from prefect_coder.flows.parts.run_log import RunLogger, run_logger
from prefect_coder.flows.parts.sweep_plan import (
    Accounting,
    Action,
    ChatFacts,
    SweepDecision,
    busy_refinement,
    paused_refinement,
    plan_orphan,
    plan_stuck,
)
from prefect_coder.flows.parts.toolset import Toolset, bind_crash_safe
from pydantic import BaseModel, ConfigDict, Field

from coder_chat.errors import CoderApiError
from coder_chat.models import Chat
from coder_chat.recovery import RecoveryTimings, TurnRecovery
from coder_chat.rest import ChatClient

__all__ = [
    "DEFAULT_ACTION_BUDGET_S",
    "ReconcileRequest",
    "Reconciler",
    "SweepOptions",
    "SweepReport",
    "SweepRow",
    "archive_settled",
    "check_seconds",
    "default_grace_s",
    "default_turn_budget_s",
    "emit_sweep_summary",
    "list_owned_chats",
    "load_sweep_resources",
    "publish_sweep_artifact",
    "reconcile_unavailable",
    "reconcile_with_ledger",
    "run_orphan_sweep",
    "run_stuck_sweep",
    "stop_run",
]

#: A sweep whose bounds were not given derives them from the turn timeout.
DEFAULT_ACTION_BUDGET_S = 600.0
_SETTLED = frozenset({"waiting", "completed", "error"})


class SweepOptions(BaseModel):
    """Tuning of a sweep run (the defaults suit a production deployment)."""

    model_config = ConfigDict(extra="forbid")

    concurrency: int = Field(default=8, ge=1, le=256, description="Chats acted on at once.")
    page_size: int = Field(default=200, ge=2, le=1000, description="Chats per listing page.")
    page_overlap: int = Field(
        default=5,
        ge=0,
        description=(
            "Chats each page re-reads of the previous one: the listing is ordered by "
            "updated_at, so chats archived meanwhile shift later ones forward."
        ),
    )
    lease_wait_s: float = Field(
        default=1.0, ge=0, description="Wait for a workflow's lease before leaving it for later."
    )
    lease_ttl_s: float = Field(default=60.0, gt=0, description="Ttl of the lease a sweep holds.")
    interrupt_bound_s: float = Field(
        default=15.0, gt=0, description="Bound of the interrupts that stop a run (409 is fine)."
    )
    archive_settle_s: float = Field(
        default=15.0, gt=0, description="How long an archive retries 409 while a run winds down."
    )
    archive_retry_s: float = Field(default=1.0, gt=0, description="Pause between archive retries.")
    request_timeout_s: float = Field(default=30.0, gt=0, description="Bound of each REST call.")
    max_table_rows: int = Field(
        default=500, ge=1, description="Rows of the table artifact (the rest are counted)."
    )
    include_archived: bool = Field(
        default=True,
        description=(
            "The orphan sweep also lists archived chats (to settle stranded records of "
            "chats archived elsewhere). Off: stranded chats are looked up one by one."
        ),
    )
    emit_events: bool = Field(
        default=True, description="Emit a Prefect event per chat acted on (and per run)."
    )


class SweepRow(BaseModel):
    """One chat the sweep did (or would do) something about."""

    chat_id: str
    workflow_id: str | None = None
    status: str
    archived: bool = False
    age_s: float | None = None
    idle_s: float | None = None
    decision: str
    reason: str
    outcome: str = ""
    ok: bool = True
    duration_ms: float = 0.0


class SweepReport(BaseModel):
    """What one sweep run found and did."""

    sweep: Literal["orphans", "stuck-turns"]
    dry_run: bool
    tenant: str
    listed: int = 0
    counts: dict[str, int] = Field(default_factory=dict)
    failed: int = 0
    rows: list[SweepRow] = Field(default_factory=list)
    list_s: float = 0.0
    duration_s: float = 0.0

    @property
    def chats_per_s(self) -> float:
        """Listed chats per second of the whole run."""
        return self.listed / self.duration_s if self.duration_s > 0 else 0.0

    def count(self, action: Action | str) -> int:
        """How many chats got ``action``."""
        return self.counts.get(str(action), 0)


@dataclass(frozen=True, slots=True)
class ReconcileRequest:
    """What the pause reconciliation needs (the seam to the crash-recovery code)."""

    client: ChatClient
    store: StateStore
    chat_id: str
    workflow_id: str | None
    tool_modules: tuple[str, ...]
    bound_s: float


#: ``"resumed"`` (recorded results submitted: the run continues), ``"cut-short"``
#: (fell back to an interrupt: nothing was committed for some call),
#: ``"nothing"`` (no pending call), ``"unavailable"`` (cannot reconcile here).
Reconciler = Callable[[ReconcileRequest], Awaitable[str]]


async def reconcile_unavailable(req: ReconcileRequest) -> str:
    """Fallback seam: leave the pause alone (never interrupt a committed effect)."""
    return "unavailable"


# --------------------------------------------------------------------------- listing


async def list_owned_chats(
    client: ChatClient,
    tenant: str,
    *,
    archived: bool | None,
    page_size: int = 200,
    overlap: int = 5,
    request_timeout_s: float | None = None,
) -> dict[str, Chat]:
    """Every chat labelled by this collection for ``tenant``, by id (archived, unarchived
    or both for ``None``).

    Pages by offset until a short page. Each page starts ``overlap`` chats before the
    previous one ended: a chat leaving the listing meanwhile (archived by this or
    another sweep) shifts the rest forward, and the overlap re-reads what shifted
    instead of skipping it. Duplicates collapse by id; a chat missed anyway (more
    shifts than the overlap) is found by the next sweep.
    """
    labels = scope_labels(tenant)
    overlap = max(0, min(overlap, page_size - 1))
    states = [False, True] if archived is None else [archived]
    seen: dict[str, Chat] = {}
    for state in states:
        offset = 0
        while True:
            page = await client.list_chats(
                q=f"archived:{'true' if state else 'false'}",
                labels=labels,
                limit=page_size,
                offset=offset,
                timeout=request_timeout_s,
            )
            for chat in page:
                seen[chat.id] = chat
            if len(page) < page_size:
                break
            offset += page_size - overlap
    return seen


async def _accounting(store: StateStore) -> Accounting:
    checkpoints = await store.checkpoints.list()
    stranded = await store.stranded.list()
    return Accounting(
        tenant=store.tenant,
        checkpointed={c.chat_id: c.workflow_id for c in checkpoints},
        stranded={s.chat_id: (s.workflow_id, s.reason) for s in stranded},
    )


# --------------------------------------------------------------------------- actions


def _is(exc: BaseException, status: int) -> bool:
    return isinstance(exc, CoderApiError) and exc.status == status


async def stop_run(
    client: ChatClient, chat_id: str, *, bound_s: float, request_timeout_s: float
) -> str:
    """Interrupt until no run is left, within ``bound_s``; returns what happened.

    An interrupt of a ``requires_action`` pause closes the pending calls with error
    results and the model *continues* (``running``), so a second interrupt is needed
    to stop it. A 409 means nothing is interruptible now: the good case.
    """
    deadline = time.monotonic() + bound_s
    steps: list[str] = []
    for _ in range(4):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            chat = await client.interrupt_chat(chat_id, timeout=min(request_timeout_s, left))
        except CoderApiError as exc:
            if exc.status != 409:
                raise
            probe = await client.get_chat(chat_id, timeout=min(request_timeout_s, max(0.001, left)))
            if probe.status in ("running", "requires_action"):
                continue  # it started again between our reads: interrupt that too
            steps.append(f"409 ({probe.status})")
            return "; ".join(steps)
        steps.append(f"interrupted → {chat.status}")
        if chat.status not in ("running", "requires_action"):
            return "; ".join(steps)
    return "; ".join([*steps, "interrupt bound reached"])


async def archive_settled(
    client: ChatClient,
    chat_id: str,
    *,
    settle_s: float,
    retry_s: float,
    request_timeout_s: float,
) -> str:
    """Archive, retrying 409 while an interrupted run winds down (≈ the SDK's
    ``archive()``); an already archived chat counts as archived."""
    deadline = time.monotonic() + settle_s
    tries = 0
    while True:
        tries += 1
        left = max(0.001, deadline - time.monotonic())
        try:
            await client.archive_chat(chat_id, timeout=min(request_timeout_s, left))
            return "archived" if tries == 1 else f"archived after {tries} tries"
        except CoderApiError as exc:
            if exc.status == 400 and "already archived" in (exc.message or "").lower():
                return "already archived"
            if exc.status != 409 or time.monotonic() + retry_s >= deadline:
                raise
        await asyncio.sleep(retry_s)


def _workflow_lease(
    store: StateStore, workflow_id: str, opts: SweepOptions
) -> contextlib.AbstractAsyncContextManager[Any]:
    return store.lease(workflow_key(workflow_id), ttl=opts.lease_ttl_s, wait=opts.lease_wait_s)


class _Sweeper:
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
    ) -> None:
        self.kind = kind
        self.client = client
        self.store = store
        self.opts = opts
        self.dry_run = dry_run
        self.reconciler = reconciler
        self.tool_modules = tool_modules
        self.logger = logger
        self.report = SweepReport(sweep=kind, dry_run=dry_run, tenant=store.tenant)
        self._gate = asyncio.Semaphore(opts.concurrency)

    # ----------------------------------------------------------------- bookkeeping
    def record(
        self, d: SweepDecision, outcome: str = "", *, ok: bool = True, ms: float = 0.0
    ) -> None:
        counts = self.report.counts
        counts[d.action.value] = counts.get(d.action.value, 0) + 1
        if not ok:
            self.report.failed += 1
        if d.action in (Action.KEEP, Action.IGNORE) and ok:
            return  # the table lists what needed attention, not every healthy chat
        self.report.rows.append(
            SweepRow(
                chat_id=d.chat_id,
                workflow_id=d.workflow_id,
                status=d.status,
                archived=d.archived,
                age_s=None if d.age_s is None else round(d.age_s, 1),
                idle_s=None if d.idle_s is None else round(d.idle_s, 1),
                decision=d.action.value,
                reason=d.reason,
                outcome=outcome,
                ok=ok,
                duration_ms=round(ms, 1),
            )
        )

    def emit(self, event: str, d: SweepDecision, **payload: Any) -> None:
        if not self.opts.emit_events:
            return
        related = []
        if d.workflow_id:
            related.append(
                {
                    "prefect.resource.id": f"coder.workflow.{d.workflow_id}",
                    "prefect.resource.role": "workflow",
                }
            )
        try:
            emit_event(
                event,
                resource=chat_resource(d.chat_id, d.workflow_id or ""),
                related=related,
                payload={
                    "sweep": self.kind,
                    "dry_run": self.dry_run,
                    "status": d.status,
                    "action": d.action.value,
                    "reason": d.reason,
                    "age_s": d.age_s,
                    "idle_s": d.idle_s,
                    **payload,
                },
            )
        except Exception:  # observability never breaks a sweep
            self.logger.debug("could not emit %s", event, exc_info=True)

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
            outcome = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
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

    async def _preview(self, d: SweepDecision) -> tuple[SweepDecision, str]:
        """Dry run: the same refinements from read-only probes; nothing is written."""
        if d.action is Action.FORGET:
            return d, "dry run: would forget the stranded record"
        if d.workflow_id:
            held = await self.store.leases.get(workflow_key(d.workflow_id))
            d = busy_refinement(d, lease_holder=held[0].holder if held else None)
            if d.action is Action.BUSY:
                return d, "dry run: busy"
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
        ledgered = fresh.status == "requires_action" and await self._ledgered(d.chat_id)
        d = paused_refinement(d, status=fresh.status, has_ledger_entries=ledgered)
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
                )
            )
            if verdict == "unavailable":
                return (
                    d,
                    "left paused: the pause holds a committed effect and no reconciliation ran",
                )
            if verdict == "resumed" or self.kind == "stuck-turns":
                return d, f"reconciled ({verdict})"
            steps.append(f"reconciled ({verdict})")
            d = d.but(Action.RETIRE, d.reason)
        steps.append(
            await stop_run(
                self.client,
                d.chat_id,
                bound_s=self.opts.interrupt_bound_s,
                request_timeout_s=request_timeout_s,
            )
        )
        if d.action is Action.RETIRE:
            steps.append(
                await archive_settled(
                    self.client,
                    d.chat_id,
                    settle_s=self.opts.archive_settle_s,
                    retry_s=self.opts.archive_retry_s,
                    request_timeout_s=request_timeout_s,
                )
            )
            # Archived: its journal, ledger and stranded record have nothing left to guard.
            await self.store.forget_chat(d.chat_id)
        return d, "; ".join(steps)


# --------------------------------------------------------------------------- the sweeps


async def _finish(sweeper: _Sweeper, started: float, actions: list[SweepDecision]) -> SweepReport:
    # One task per workflow (its chats in sequence under one lease hold); chats
    # without a known workflow each get their own.
    groups: dict[tuple[str, str], list[SweepDecision]] = {}
    for d in actions:
        key = ("workflow", d.workflow_id) if d.workflow_id else ("chat", d.chat_id)
        groups.setdefault(key, []).append(d)
    await asyncio.gather(
        *(
            sweeper.act_group(key[1] if key[0] == "workflow" else None, ds)
            for key, ds in groups.items()
        )
    )
    report = sweeper.report
    report.duration_s = round(time.perf_counter() - started, 3)
    order = {a.value: i for i, a in enumerate(Action)}
    report.rows.sort(key=lambda r: (order.get(r.decision, 99), r.chat_id))
    return report


class _Begun(NamedTuple):
    """What both sweeps start from: the sweeper, the store's accounting, the listing."""

    sweeper: _Sweeper
    accounting: Accounting
    chats: dict[str, Chat]
    started: float
    logger: RunLogger


async def _begin(
    kind: Literal["orphans", "stuck-turns"],
    client: ChatClient,
    store: StateStore,
    opts: SweepOptions,
    *,
    archived: bool | None,
    dry_run: bool,
    reconciler: Reconciler,
    tool_modules: tuple[str, ...],
) -> _Begun:
    logger = run_logger(__name__)
    started = time.perf_counter()
    sweeper = _Sweeper(
        kind,
        client,
        store,
        opts,
        dry_run=dry_run,
        reconciler=reconciler,
        tool_modules=tool_modules,
        logger=logger,
    )
    acct = await _accounting(store)
    chats = await list_owned_chats(
        client,
        store.tenant,
        archived=archived,
        page_size=opts.page_size,
        overlap=opts.page_overlap,
        request_timeout_s=opts.request_timeout_s,
    )
    return _Begun(sweeper, acct, chats, started, logger)


async def run_orphan_sweep(
    client: ChatClient,
    store: StateStore,
    *,
    grace_s: float,
    dry_run: bool = False,
    options: SweepOptions | None = None,
    reconciler: Reconciler = reconcile_unavailable,
    tool_modules: tuple[str, ...] = (),
    now: Callable[[], float] = time.time,
) -> SweepReport:
    """List, decide, retire (see :func:`sweep_orphans`); usable without a flow run."""
    opts = options or SweepOptions()
    sweeper, acct, chats, started, logger = await _begin(
        "orphans",
        client,
        store,
        opts,
        archived=None if opts.include_archived else False,
        dry_run=dry_run,
        reconciler=reconciler,
        tool_modules=tool_modules,
    )
    actions: list[SweepDecision] = []
    # Stranded chats are ours by record even without labels (created before labels
    # existed): look up each one the labelled listing did not show.
    for chat_id, (workflow_id, why) in acct.stranded.items():
        if chat_id in chats:
            continue
        try:
            chats[chat_id] = await client.get_chat(chat_id, timeout=opts.request_timeout_s)
        except CoderApiError as exc:
            gone = SweepDecision(
                chat_id, Action.FORGET, f"stranded ({why})", "unknown", workflow_id=workflow_id
            )
            if exc.status == 404:
                actions.append(gone.but(Action.FORGET, gone.reason + ", gone from the server"))
            else:
                sweeper.record(
                    gone.but(Action.KEEP, gone.reason), f"lookup failed: {exc}", ok=False
                )
    sweeper.report.listed = len(chats)
    sweeper.report.list_s = round(time.perf_counter() - started, 3)
    at = now()
    for chat in chats.values():
        d = plan_orphan(ChatFacts.of(chat), acct, now=at, grace_s=grace_s)
        if d.action in (Action.RETIRE, Action.FORGET):
            actions.append(d)
        else:
            sweeper.record(d)
    report = await _finish(sweeper, started, actions)
    logger.info(
        "orphan sweep%s: %d chats listed, %s in %.2fs",
        " (dry run)" if dry_run else "",
        report.listed,
        report.counts,
        report.duration_s,
    )
    return report


async def run_stuck_sweep(
    client: ChatClient,
    store: StateStore,
    *,
    turn_budget_s: float,
    action_budget_s: float = DEFAULT_ACTION_BUDGET_S,
    dry_run: bool = False,
    options: SweepOptions | None = None,
    reconciler: Reconciler = reconcile_unavailable,
    tool_modules: tuple[str, ...] = (),
    now: Callable[[], float] = time.time,
) -> SweepReport:
    """List, decide, interrupt (see :func:`sweep_stuck_turns`); usable without a flow run."""
    opts = options or SweepOptions()
    sweeper, acct, chats, started, logger = await _begin(
        "stuck-turns",
        client,
        store,
        opts,
        archived=False,
        dry_run=dry_run,
        reconciler=reconciler,
        tool_modules=tool_modules,
    )
    sweeper.report.listed = len(chats)
    sweeper.report.list_s = round(time.perf_counter() - started, 3)
    at = now()
    actions: list[SweepDecision] = []
    for chat in chats.values():
        d = plan_stuck(
            ChatFacts.of(chat),
            acct,
            now=at,
            turn_budget_s=turn_budget_s,
            action_budget_s=action_budget_s,
        )
        if d.action is Action.INTERRUPT:
            actions.append(d)
        else:
            sweeper.record(d)
    report = await _finish(sweeper, started, actions)
    logger.info(
        "stuck-turn sweep%s: %d chats listed, %s in %.2fs",
        " (dry run)" if dry_run else "",
        report.listed,
        report.counts,
        report.duration_s,
    )
    return report


# --------------------------------------------------------------------------- flows


def default_grace_s(turn_timeout_s: float) -> float:
    """Twice the turn timeout: a first turn checkpoints its chat at most one turn
    timeout after creating it; the rest covers its lease wait and clock skew."""
    return 2.0 * turn_timeout_s


def default_turn_budget_s(turn_timeout_s: float) -> float:
    """The turn timeout plus a minute: a healthy turn changes its chat well within it."""
    return turn_timeout_s + 60.0


def check_seconds(name: str, value: float | None, *, allow_zero: bool) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        raise WorkflowParameterError(
            name, f"{value!r} is not a usable number of seconds", "pass a positive number"
        )


def render_sweep_markdown(report: SweepReport, limits: str) -> str:
    """The artifact's description: the totals of the run."""
    counts = ", ".join(f"{k} {v}" for k, v in sorted(report.counts.items())) or "nothing"
    return (
        f"**{report.sweep} sweep{' (dry run)' if report.dry_run else ''}** of tenant "
        f"`{report.tenant}`: {report.listed} labelled chats listed in {report.list_s:.2f}s, "
        f"run took {report.duration_s:.2f}s ({report.chats_per_s:.0f} chats/s). "
        f"Decisions: {counts}; failed: {report.failed}. {limits}"
    )


async def publish_sweep_artifact(report: SweepReport, limits: str, max_rows: int) -> None:
    """One table artifact per run: what was found, what was done, why, how long."""
    rows = [
        {
            "chat": r.chat_id,
            "workflow": r.workflow_id or "",
            "status": r.status,
            "archived": r.archived,
            "age s": r.age_s,
            "idle s": r.idle_s,
            "decision": r.decision,
            "why": r.reason,
            "done": r.outcome,
            "ok": r.ok,
            "ms": r.duration_ms,
        }
        for r in report.rows[:max_rows]
    ]
    if len(report.rows) > max_rows:
        rows.append({"chat": f"… {len(report.rows) - max_rows} more rows (see the flow result)"})
    if not rows:
        rows = [{"chat": "(nothing needed attention)", "decision": "", "why": ""}]
    await acreate_table_artifact(
        table=rows,
        key=f"coder-sweep-{report.sweep}",
        description=render_sweep_markdown(report, limits),
    )


def emit_sweep_summary(report: SweepReport, logger: RunLogger) -> None:
    try:
        emit_event(
            f"coder.sweep.{report.sweep}.completed",
            resource={"prefect.resource.id": f"coder.sweep.{report.sweep}.{report.tenant}"},
            payload={
                "dry_run": report.dry_run,
                "listed": report.listed,
                "counts": report.counts,
                "failed": report.failed,
                "duration_s": report.duration_s,
            },
        )
    except Exception:
        logger.debug("could not emit the sweep summary", exc_info=True)


_MARKER = re.compile(r"\[([A-Za-z0-9][A-Za-z0-9_.:@-]{0,127})/([A-Za-z0-9][A-Za-z0-9_.-]{0,63})\]")


async def _marker_of(req: ReconcileRequest) -> str | None:
    """The step marker of the paused attempt: the chat's journal names it; else the
    newest marked user message in history."""
    entry = await req.store.journal.get(req.chat_id)
    if entry is not None and entry.marker:
        return str(entry.marker)
    page = await req.client.get_messages(req.chat_id, limit=50, timeout=req.bound_s)
    for message in sorted(page.messages, key=lambda m: m.id, reverse=True):
        if message.role != "user":
            continue
        text = "".join(p.text or "" for p in message.content if p.type == "text")
        found = _MARKER.search(text)
        if found and (req.workflow_id is None or found.group(1) == req.workflow_id):
            return found.group(0)
    return None


async def reconcile_with_ledger(req: ReconcileRequest) -> str:
    """Answer a ``requires_action`` pause from the tool ledger with the crash-recovery
    code (``coder_chat.recovery.TurnRecovery.reconcile``): recorded ``done`` outputs
    are submitted, ``committing`` entries re-driven with the same idempotency key,
    and only a call nothing was committed for falls back to an interrupt. The
    verdict is journaled under the step's marker, so the workflow's own recovery
    of that attempt later classifies it correctly."""
    marker = await _marker_of(req)
    if marker is None:
        return "unavailable"
    registry.load_tool_modules(list(req.tool_modules))
    # History does not say which calls were client tools: reconciliation only sees
    # the names registered here. A ledgered tool this process does not know would
    # look like "nothing of ours pending" and be interrupted away — leave it paused.
    known = registry.tool_names()
    if any(
        e.tool_name and e.tool_name not in known for e in await req.store.ledger.list(req.chat_id)
    ):
        return "unavailable"
    tools = Toolset(tools=sorted(registry.tool_names())).resolve().tools
    recovery = TurnRecovery(
        req.client,
        req.store,
        req.chat_id,
        marker,
        tools=bind_crash_safe(tools, req.store.ledger),
        journal_entry=JournalEntry,
        timings=RecoveryTimings(probe_bound=req.bound_s, poll_interval=min(1.0, req.bound_s)),
        logger=run_logger(__name__),
    )
    attempts = await recovery.attempts(timeout=req.bound_s)
    unstarted = await recovery.reconcile(attempts, timeout=req.bound_s)
    return "cut-short" if unstarted else "resumed"


async def load_sweep_resources(
    settings: WorkflowSettings | None,
) -> tuple[WorkflowSettings, TurnResources, float]:
    """A sweep flow's settings, blocks and turn timeout (its bounds derive from it)."""
    settings = settings or WorkflowSettings()
    resources = await load_resources(settings)
    turn_timeout = settings.turn_timeout_s or resources.credentials.turn_timeout
    return settings, resources, float(turn_timeout)
