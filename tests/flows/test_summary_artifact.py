"""The workflow's summary card: every step with its state, a preview of its result, its
attempts and the decisions taken (issue 31 §3: decisions were log lines only)."""

from __future__ import annotations

import asyncio
from typing import Any

from flow_helpers import emu_directive, say
from prefect import get_client

from prefect_coder.flows.common.params import ApprovalStep, Step, WorkflowSettings
from prefect_coder.flows.common.results import TurnResult
from prefect_coder.flows.observe.summary import render_workflow_summary, summary_key
from prefect_coder.flows.turn.approval_step import ApprovalResult
from prefect_coder.flows.workflow.steps import summary_rows


def _turn(step: str, text: str, attempt: int = 1) -> TurnResult:
    return TurnResult(
        workflow_id="wf", step=step, marker=f"[wf/{step}]", chat_id="c", text=text, attempt=attempt
    )


def test_rows_show_every_step_and_each_decision() -> None:
    steps = [
        Step(name="draft", prompt="d"),
        ApprovalStep(name="review", prompt="r"),
        Step(name="apply", prompt="a"),
        Step(name="report", prompt="p"),
    ]
    results: list[Any] = [
        _turn("draft", "the plan", attempt=2),
        ApprovalResult(
            workflow_id="wf",
            step="review",
            decision="edit",
            next_prompt="x",
            comment="tighter",
            decided_at="2026-12-06T00:00:00Z",
        ),
    ]
    rows, outcome = summary_rows(steps, results, RuntimeError("boom"))
    assert outcome == "failed at `apply` (RuntimeError)"
    assert [(r.step, r.state) for r in rows] == [
        ("draft", "completed"),
        ("review", "decided"),
        ("apply", "failed: RuntimeError"),
        ("report", "not run"),
    ]
    assert rows[0].decision == "recovered or resubmitted (attempt 2)" and rows[0].attempts == 2
    assert rows[1].decision == "edit (tighter): the next prompt was edited"
    md = render_workflow_summary("wf", rows, outcome=outcome)
    assert "| `draft` | agent | completed | the plan | 2 |" in md
    assert md.startswith("# Workflow `wf`: failed at `apply` (RuntimeError)")

    rejected = [results[0], results[1].model_copy(update={"decision": "reject"})]
    rows, outcome = summary_rows(steps, rejected, None)
    assert outcome == "stopped: `review` rejected"
    assert [r.state for r in rows] == ["completed", "rejected", "not run", "not run"]


async def test_a_workflow_publishes_its_summary_card(
    settings: WorkflowSettings, workflow_id: str
) -> None:
    from prefect_coder.flows.deployments.agent_workflow import agent_workflow

    steps = [
        Step(name="one", prompt="a" + say("first answer")),
        Step(name="two", prompt="b" + emu_directive({"text": "second | answer"})),
    ]
    await agent_workflow(workflow_id, steps, settings)
    async with get_client() as client:
        # Published in the loop's background batch, flushed at the flow's end.
        for _ in range(40):
            cards = [
                a
                for a in await client.read_artifacts(limit=200)
                if a.key == summary_key(workflow_id)
            ]
            if cards:
                break
            await asyncio.sleep(0.25)
    (card,) = cards
    md = str(card.data)
    assert md.startswith(f"# Workflow `{workflow_id}`: completed")
    assert "| `one` | agent | completed | first answer | 1 |" in md
    assert "second \\| answer" in md  # a table cell cannot break the table
    assert card.flow_run_id is not None and card.task_run_id is None


def test_a_run_suspended_at_an_approval_is_waiting_not_failed() -> None:
    steps = [Step(name="draft", prompt="d"), ApprovalStep(name="review", prompt="r")]
    rows, outcome = summary_rows(steps, [_turn("draft", "plan")], None, waiting=True)
    assert outcome == "waiting for approval at `review`"
    assert [r.state for r in rows] == ["completed", "waiting on a person"]
