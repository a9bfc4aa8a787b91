"""Issue 30, item 7, for the two step kinds without a chat turn: a model step's answer
and a person's approval decision are written by their own tasks too, so a write the
result storage refuses is a visible retry — never a task Completed with nothing stored
(before: Prefect's commit logged the failure and the task stayed Completed).

The storage directory is made unwritable for real (``unwritable.py``) before the
task runs and writable again once Prefect shows the task waiting for its retry.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName
from pydantic import SecretStr
from unwritable import make_unwritable, make_writable

from coder_chat.emulator.server import Emulator
from prefect_coder.blocks import ChatStateStore, CoderCredentials
from prefect_coder.flows.common.params import ModelStep, WorkflowSettings
from prefect_coder.flows.turn.approval_step import ApprovalResult, approval_key, record_approval
from prefect_coder.flows.turn.model_step import model_result_key, model_step


async def _writable_at_the_retry(results_dir: Path, task_run_name: str) -> None:
    """Make the storage writable once the task run waits for its retry (the task must
    get there: before the fix it Completed)."""
    async with get_client() as client:
        for _ in range(600):
            runs = await client.read_task_runs(
                task_run_filter=TaskRunFilter(name=TaskRunFilterName(any_=[task_run_name]))
            )
            if any(r.state is not None and r.state.name == "AwaitingRetry" for r in runs):
                make_writable(results_dir)
                return
            assert not any(r.state is not None and r.state.is_final() for r in runs), [
                r.state for r in runs
            ]
            await asyncio.sleep(0.05)
    raise AssertionError(f"{task_run_name} never waited for a retry")


async def _run_count(task_run_name: str) -> int:
    """The task run's attempts, once the server has its final state (task-run states
    reach it through events, in batches)."""
    async with get_client() as client:
        for _ in range(200):
            [run] = await client.read_task_runs(
                task_run_filter=TaskRunFilter(name=TaskRunFilterName(any_=[task_run_name]))
            )
            if run.state is not None and run.state.is_final():
                assert run.state.is_completed(), run.state
                return int(run.run_count)
            await asyncio.sleep(0.05)
    raise AssertionError(f"{task_run_name} never reached a final state")


async def test_an_approval_decision_the_storage_refuses_is_retried_not_lost(
    prefect_harness: Any, results_dir: Path
) -> None:
    workflow_id = f"rs-ap-{uuid.uuid4().hex[:8]}"
    decision = ApprovalResult(
        workflow_id=workflow_id, step="review", decision="approve", decided_at="2026-12-06T00:00Z"
    )

    @flow(name="record-a-decision")
    async def record() -> ApprovalResult:
        return await record_approval(workflow_id, "review", decision)

    make_unwritable(results_dir)
    running = asyncio.create_task(record())
    await _writable_at_the_retry(results_dir, f"{workflow_id}/review")
    assert await running == decision
    stored = json.loads((results_dir / approval_key(workflow_id, "review")).read_text())
    assert json.loads(stored["result"])["data"]["decision"] == "approve"
    # A visible retry (more than one if a slow poll missed the first wait).
    assert await _run_count(f"{workflow_id}/review") >= 2


async def test_a_model_answer_the_storage_refuses_is_retried_not_lost(
    prefect_harness: Any, chatd_emulator: Emulator, tmp_path: Path, results_dir: Path
) -> None:
    emu = chatd_emulator
    suffix = uuid.uuid4().hex[:8]
    await CoderCredentials(
        base_url=emu.base_url,
        organization_id=uuid.UUID(emu.organization_id),
        token=SecretStr(emu.token),
        request_timeout=15.0,
    ).save(f"rs-m-coder-{suffix}", overwrite=True)
    await ChatStateStore(url=f"sqlite+aiosqlite:///{tmp_path}/state.db").save(
        f"rs-m-store-{suffix}", overwrite=True
    )
    settings = WorkflowSettings(
        credentials_block=f"rs-m-coder-{suffix}",
        store_block=f"rs-m-store-{suffix}",
        artifacts=False,
    )
    workflow_id = f"rs-m-{suffix}"
    step = ModelStep(name="plan", model="gpt-x", prompt="Plan a fix")

    @flow(name="one-model-step")
    async def one() -> Any:
        return await model_step.with_options(retry_delay_seconds=2)(workflow_id, step, settings)

    make_unwritable(results_dir)
    running = asyncio.create_task(one())
    await _writable_at_the_retry(results_dir, f"{workflow_id}/plan")
    result = await running
    stored = json.loads((results_dir / model_result_key(workflow_id, "plan")).read_text())
    assert json.loads(stored["result"])["data"]["text"] == result.text
    # Each attempt asked the model (a model step has no history to recover an answer
    # from); the last one's answer is the one stored.
    attempts = await _run_count(f"{workflow_id}/plan")
    assert attempts >= 2 and len(emu.event_log(["aibridge"])) == attempts
