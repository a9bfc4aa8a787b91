"""One sweep run: list, plan, act, report (the body of the two sweep deployments).

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
was done, why, how long it took. Its jobs live in their own
modules: listing (:mod:`.sweep_listing`), planning — pure —
(:mod:`.sweep_plan`), acting under the workflow's lease (:mod:`.sweep_acting`,
:mod:`.sweep_reconcile`) and reporting (:mod:`.sweep_report`); this module runs
them in order, with bounded concurrency.

Acting on a chat whose workflow is known takes that workflow's lease (the same
one every turn holds), with a short wait: a live run of the workflow is never
interrupted, and the turn that created a chat cannot checkpoint it between the
sweep's check and its archive. A busy workflow is left for the next sweep.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Literal, NamedTuple

from coder_chat.errors import CoderApiError
from coder_chat.models import Chat
from coder_chat.rest import ChatClient
from prefect_coder.blocks import StateStore
from prefect_coder.flows.common.errors import WorkflowParameterError
from prefect_coder.flows.common.params import WorkflowSettings
from prefect_coder.flows.common.resources import TurnResources, load_resources
from prefect_coder.flows.observe.run_log import RunLogger, run_logger
from prefect_coder.flows.sweeps.acting import SweepActor
from prefect_coder.flows.sweeps.listing import list_owned_chats, store_accounting
from prefect_coder.flows.sweeps.options import SweepOptions
from prefect_coder.flows.sweeps.plan import (
    Accounting,
    Action,
    ChatFacts,
    SweepDecision,
    plan_orphan,
    plan_stuck,
)
from prefect_coder.flows.sweeps.reconcile import Reconciler, reconcile_unavailable
from prefect_coder.flows.sweeps.report import SweepReport

__all__ = [
    "DEFAULT_ACTION_BUDGET_S",
    "check_seconds",
    "default_grace_s",
    "default_turn_budget_s",
    "load_sweep_resources",
    "run_orphan_sweep",
    "run_stuck_sweep",
]

#: A sweep whose bounds were not given derives them from the turn timeout.
DEFAULT_ACTION_BUDGET_S = 120.0  # + the 1-min schedule < chatd's 300 s pause timeout


async def _finish(sweeper: SweepActor, started: float, actions: list[SweepDecision]) -> SweepReport:
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

    sweeper: SweepActor
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
    turn_timeout_s: float | None = None,
) -> _Begun:
    logger = run_logger(__name__)
    started = time.perf_counter()
    sweeper = SweepActor(
        kind,
        client,
        store,
        opts,
        dry_run=dry_run,
        reconciler=reconciler,
        tool_modules=tool_modules,
        logger=logger,
        turn_timeout_s=turn_timeout_s,
    )
    acct = await store_accounting(store)
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
    turn_timeout_s: float | None,
    action_budget_s: float = DEFAULT_ACTION_BUDGET_S,
    dry_run: bool = False,
    options: SweepOptions | None = None,
    reconciler: Reconciler = reconcile_unavailable,
    tool_modules: tuple[str, ...] = (),
    now: Callable[[], float] = time.time,
) -> SweepReport:
    """List, decide, interrupt (see :func:`sweep_stuck_turns`); usable without a flow run.

    ``turn_timeout_s``: the workflows' turn timeout. A checkpointed step's crashed
    attempt (the live run is that step's own: its send landed, or a recovery pass
    revived it) is never cut short within its journaled send + this bound: left
    running for its workflow's recovery, or its pause answered through the ledger
    (``sweep_plan.crashed_attempt_refinement``). ``None`` turns that rule off —
    only for callers that know no workflow recovers these chats."""
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
        turn_timeout_s=turn_timeout_s,
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


async def load_sweep_resources(
    settings: WorkflowSettings | None,
) -> tuple[WorkflowSettings, TurnResources, float]:
    """A sweep flow's settings, blocks and turn timeout (its bounds derive from it)."""
    settings = settings or WorkflowSettings()
    resources = await load_resources(settings)
    turn_timeout = settings.turn_timeout_s or resources.credentials.turn_timeout
    return settings, resources, float(turn_timeout)
