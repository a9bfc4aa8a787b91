"""The ``prefect.yaml`` trigger, on a real Prefect server: an ``agent-workflow`` run
whose process is SIGKILLed ends Crashed, the automation starts ``recover-turn``
with the crashed run's parameters, and the workflow ends as a fault-free run would.

The server is the session's Prefect test server (its automation services — event
triggers and actions — run in it); the deployments are served by a real Prefect
runner process, which starts each flow run in its own subprocess.
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from conftest import HERE, ROOT, PrefectEnv
from crash_matrix import STEPS, Case, env_for_children, run_workflow
from payments import Payments
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    DeploymentFilter,
    DeploymentFilterName,
    FlowRunFilter,
)
from prefect.deployments import run_deployment
from test_crash_matrix import check

from coder_chat.emulator import Emulator
from flows.params import WorkflowSettings


@pytest.fixture
def trigger_settings(coder_block: str, sqlite_block: str, payments: Payments) -> WorkflowSettings:
    return WorkflowSettings(
        credentials_block=coder_block,
        store_block=sqlite_block,
        retries=0,
        retry_delay_s=0,
        lease_wait_s=30,
        lease_ttl_s=1,
        settle_wait_s=5,
        redial_backoff_ms=20,
        artifacts=False,
        tool_modules=["flows.demo_tools", "payment_tools"],
    )


async def _wait(predicate, limit_s: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


async def test_crashed_agent_workflow_run_triggers_recover_turn(
    prefect_env: PrefectEnv,
    payments: Payments,
    emu: Emulator,
    trigger_settings: WorkflowSettings,
    tmp_path: Path,
) -> None:
    baseline = [
        r.text
        for r in await run_workflow(f"r-trig-base-{uuid.uuid4().hex[:6]}", STEPS, trigger_settings)
    ]
    env = env_for_children(prefect_env.child_env(), payments.url)
    env.update(
        PREFECT_RUNNER_POLL_FREQUENCY="1",
        CRASH_AT="tool.after_done:2",
        CRASH_ONCE_FILE=str(tmp_path / "crashed-once"),
    )
    log = (tmp_path / "runner.log").open("wb")
    runner = await asyncio.create_subprocess_exec(
        sys.executable,
        str(HERE / "serve_child.py"),
        env=env,
        cwd=str(ROOT),
        stdout=log,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        async with get_client() as client:

            async def deployments_ready() -> bool:
                found = await client.read_deployments(
                    deployment_filter=DeploymentFilter(
                        name=DeploymentFilterName(any_=["agent-workflow", "recover-turn"])
                    )
                )
                return len(found) == 2

            await _wait(deployments_ready, 60, "the served deployments")
            workflow_id = f"r-trig-{uuid.uuid4().hex[:8]}"
            crashed_run: Any = await run_deployment(  # type: ignore[misc]
                "agent-workflow/agent-workflow",
                parameters={
                    "workflow_id": workflow_id,
                    "steps": [s.model_dump(mode="json") for s in STEPS],
                    "settings": trigger_settings.model_dump(mode="json"),
                },
                timeout=0,
            )

            async def crashed() -> bool:
                run = await client.read_flow_run(crashed_run.id)
                state = run.state
                return state is not None and state.type.value == "CRASHED"

            await _wait(crashed, 90, "the agent-workflow run to end Crashed")

            async def recovered() -> object:
                runs = await client.read_flow_runs(
                    deployment_filter=DeploymentFilter(
                        name=DeploymentFilterName(any_=["recover-turn"])
                    ),
                    flow_run_filter=FlowRunFilter(),
                )
                mine = [r for r in runs if r.parameters.get("workflow_id") == workflow_id]
                done = [r for r in mine if r.state and r.state.is_final()]
                return done[0] if done else None

            run = await _wait(recovered, 120, "the triggered recover-turn run to finish")
            assert run.state.type.value == "COMPLETED", (run.state, log_tail(tmp_path))
            assert run.parameters["finish_workflow"] is True
            assert run.parameters["steps"][1]["name"] == "pay"
    finally:
        runner.terminate()
        try:
            await asyncio.wait_for(runner.wait(), 15)
        except TimeoutError:
            runner.kill()
            await runner.wait()
        log.close()
    # A rerun returns every step from storage: the results the recovery produced.
    results = await run_workflow(workflow_id, STEPS, trigger_settings)
    await check(Case("trigger"), workflow_id, results, baseline, payments, emu)


def log_tail(tmp_path: Path) -> str:
    return (tmp_path / "runner.log").read_text(errors="replace")[-4000:]
