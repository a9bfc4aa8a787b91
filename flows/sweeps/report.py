"""What a sweep run reports: its rows and totals, the table artifact, the Prefect events."""

from __future__ import annotations

from typing import Any, Literal

from prefect.artifacts import acreate_table_artifact
from prefect.events import emit_event
from pydantic import BaseModel, Field

from prefect_coder.flows.observe.observer import chat_resource
from prefect_coder.flows.observe.run_log import RunLogger
from prefect_coder.flows.sweeps.plan import Action, SweepDecision

__all__ = [
    "SweepReport",
    "SweepRow",
    "emit_chat_event",
    "emit_sweep_summary",
    "publish_sweep_artifact",
    "render_sweep_markdown",
]


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

    def add(self, d: SweepDecision, outcome: str = "", *, ok: bool = True, ms: float = 0.0) -> None:
        """Count ``d`` and, when it needed attention or failed, add its row."""
        self.counts[d.action.value] = self.counts.get(d.action.value, 0) + 1
        if not ok:
            self.failed += 1
        if d.action in (Action.KEEP, Action.IGNORE) and ok:
            return  # the table lists what needed attention, not every healthy chat
        self.rows.append(
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


def emit_chat_event(
    event: str, d: SweepDecision, report: SweepReport, logger: RunLogger, **payload: Any
) -> None:
    """One Prefect event about one chat the sweep acted on (best effort)."""
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
                "sweep": report.sweep,
                "dry_run": report.dry_run,
                "status": d.status,
                "action": d.action.value,
                "reason": d.reason,
                "age_s": d.age_s,
                "idle_s": d.idle_s,
                **payload,
            },
        )
    except Exception:  # observability never breaks a sweep
        logger.debug("could not emit %s", event, exc_info=True)


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
