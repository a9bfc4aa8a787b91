"""The workflow's summary artifact: one table, every step with its state, a preview of
its result, its attempts and the decisions taken on the way (approvals, recoveries).

Before it, the run page showed one card per turn and nothing for the workflow as a
whole; decisions were log lines only (issue 31 §3). Rendered from plain rows the
workflow builds (this room imports nothing of the others), published keyed — so a
rerun of the workflow adds a version of the same card — off the critical path.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any

from prefect.artifacts import MarkdownArtifact
from prefect.utilities.context import get_task_and_flow_run_ids

from prefect_coder.flows.observe.artifacts import artifact_key, table_cell
from prefect_coder.flows.observe.background import defer

__all__ = ["SummaryRow", "publish_workflow_summary", "render_workflow_summary", "summary_key"]


@dataclass(frozen=True, slots=True)
class SummaryRow:
    """One step as the summary shows it (no prompt, no arguments: a preview only)."""

    step: str
    kind: str
    state: str  # completed / failed / rejected / not run / …
    preview: str = ""
    attempts: int | None = None
    decision: str = ""


def summary_key(workflow_id: str) -> str:
    """The summary card's key (lowercase letters, digits and dashes)."""
    return artifact_key(workflow_id, "summary", kind="workflow")


def render_workflow_summary(workflow_id: str, rows: Sequence[SummaryRow], *, outcome: str) -> str:
    """The summary's markdown: the workflow's outcome, then one row per step."""
    lines = [
        f"# Workflow `{workflow_id}`: {outcome}",
        "",
        "| step | kind | state | result | attempts | decisions |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        attempts = "" if row.attempts is None else str(row.attempts)
        lines.append(
            f"| `{table_cell(row.step)}` | {row.kind} | {row.state} | {table_cell(row.preview, 80)} "
            f"| {attempts} | {table_cell(row.decision, 80)} |"
        )
    return "\n".join(lines) + "\n"


def publish_workflow_summary(workflow_id: str, rows: Sequence[SummaryRow], *, outcome: str) -> None:
    """Create the summary card for the current flow run in this loop's next background
    batch (rendering and the API call happen off the workflow's path)."""
    _task_run_id, flow_run_id = get_task_and_flow_run_ids()
    if flow_run_id is None:
        return  # not in a flow run: nothing to attach the card to

    def create() -> Awaitable[Any]:
        return MarkdownArtifact(
            key=summary_key(workflow_id),
            description=f"Workflow {workflow_id}: {outcome}",
            markdown=render_workflow_summary(workflow_id, rows, outcome=outcome),
            flow_run_id=flow_run_id,
        ).acreate()

    defer(create, name=f"workflow summary {workflow_id}")
