"""The ``sweep-stuck-turns`` deployment: interrupt (or reconcile) turns nobody finishes."""

from __future__ import annotations

from prefect import flow

from prefect_coder.flows.deployments.sweep_settings import SweepSettings
from prefect_coder.flows.observe.run_log import run_logger
from prefect_coder.flows.sweeps.options import SweepOptions
from prefect_coder.flows.sweeps.reconcile import reconcile_with_ledger
from prefect_coder.flows.sweeps.report import (
    SweepReport,
    emit_sweep_summary,
    publish_sweep_artifact,
)
from prefect_coder.flows.sweeps.run import (
    DEFAULT_ACTION_BUDGET_S,
    check_seconds,
    default_turn_budget_s,
    load_sweep_resources,
    run_stuck_sweep,
)

__all__ = ["sweep_stuck_turns"]


@flow(name="sweep-stuck-turns", flow_run_name="sweep-stuck-turns")
async def sweep_stuck_turns(
    settings: SweepSettings | None = None,
    dry_run: bool = False,
    turn_budget_s: float | None = None,
    action_budget_s: float = DEFAULT_ACTION_BUDGET_S,
    options: SweepOptions | None = None,
) -> SweepReport:
    """Interrupt (or reconcile) this collection's chats whose turn is stuck.

    ``running``/``interrupting`` with no change (``updated_at``) for longer than
    ``turn_budget_s``, or ``requires_action`` for longer than ``action_budget_s``
    with no live run of its workflow answering → interrupt (a pause with a committed
    effect on the ledger is reconciled instead). A checkpointed step's crashed
    attempt still within its turn deadline (its journaled send + the turn timeout)
    is never cut short: running, it is left to its workflow's recovery (which
    follows it); paused, its calls are answered through the ledger — those that
    never ran are run. Every stuck chat emits a
    ``coder.chat.stuck`` Prefect event (for automations) and a row of the table
    artifact; a chat whose workflow has a live run is reported, not touched.

    Args:
        settings: credentials and store blocks, lease bounds, tool modules (a
            workflow's settings are accepted too; their turn-only keys are ignored).
        dry_run: decide, report and emit, change nothing.
        turn_budget_s: default: the turn timeout plus 60 s.
        action_budget_s: how long a client-tool pause may wait for its answer.
        options: concurrency, page size, interrupt bound.
    """
    check_seconds("turn_budget_s", turn_budget_s, allow_zero=False)
    check_seconds("action_budget_s", action_budget_s, allow_zero=False)
    sweep_settings, resources, turn_timeout = await load_sweep_resources(
        (settings or SweepSettings()).workflow_settings()
    )
    opts = options or SweepOptions()
    budget = turn_budget_s if turn_budget_s is not None else default_turn_budget_s(turn_timeout)
    async with resources.credentials.get_client() as client:
        report = await run_stuck_sweep(
            client,
            resources.store,
            turn_budget_s=budget,
            turn_timeout_s=turn_timeout,
            action_budget_s=action_budget_s,
            dry_run=dry_run,
            options=opts,
            reconciler=reconcile_with_ledger,
            tool_modules=tuple(sweep_settings.tool_modules),
        )
    await publish_sweep_artifact(
        report,
        f"Turn budget {budget:g}s, action budget {action_budget_s:g}s; crashed attempts "
        f"are left within their send + the {turn_timeout:g}s turn timeout.",
        opts.max_table_rows,
    )
    if opts.emit_events:
        emit_sweep_summary(report, run_logger(__name__))
    return report
