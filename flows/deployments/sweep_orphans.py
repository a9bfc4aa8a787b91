"""The ``sweep-orphans`` deployment: retire every chat of this collection no checkpoint accounts for."""

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
    check_seconds,
    default_grace_s,
    load_sweep_resources,
    run_orphan_sweep,
)

__all__ = ["sweep_orphans"]


@flow(name="sweep-orphans", flow_run_name="sweep-orphans")
async def sweep_orphans(
    settings: SweepSettings | None = None,
    dry_run: bool = False,
    grace_s: float | None = None,
    options: SweepOptions | None = None,
) -> SweepReport:
    """Retire every chat this collection created that no checkpoint accounts for.

    Lists every labelled chat of the store's tenant (archived or not, every page),
    compares with the checkpoints and stranded records, and retires (bounded
    interrupt, then archive retrying 409) each unaccounted chat older than
    ``grace_s`` and each stranded one; a chat paused with a committed effect on the
    tool ledger is reconciled, not interrupted. Checkpointed chats are never
    archived here. Publishes a table artifact.

    Args:
        settings: credentials and store blocks, lease bounds, tool modules (a
            workflow's settings are accepted too; their turn-only keys are ignored).
        dry_run: decide and report, change nothing.
        grace_s: minimum age (``created_at``) of an unaccounted chat before it is
            retired; protects a live first turn. Default: twice the turn timeout.
        options: concurrency, page size, interrupt/archive bounds.
    """
    check_seconds("grace_s", grace_s, allow_zero=True)
    sweep_settings, resources, turn_timeout = await load_sweep_resources(
        (settings or SweepSettings()).workflow_settings()
    )
    opts = options or SweepOptions()
    grace = grace_s if grace_s is not None else default_grace_s(turn_timeout)
    logger = run_logger(__name__)
    if grace < turn_timeout:
        logger.warning(
            "grace_s=%gs is shorter than the turn timeout (%gs): a first turn's chat is only "
            "protected by its workflow's lease until its checkpoint is written",
            grace,
            turn_timeout,
        )
    async with resources.credentials.get_client() as client:
        report = await run_orphan_sweep(
            client,
            resources.store,
            grace_s=grace,
            dry_run=dry_run,
            options=opts,
            reconciler=reconcile_with_ledger,
            tool_modules=tuple(sweep_settings.tool_modules),
        )
    await publish_sweep_artifact(report, f"Grace period {grace:g}s.", opts.max_table_rows)
    if opts.emit_events:
        emit_sweep_summary(report, logger)
    return report
