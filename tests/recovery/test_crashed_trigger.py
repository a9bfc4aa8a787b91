"""The ``prefect.yaml`` triggers, on a real Prefect server: an ``agent-workflow``
(or ``agent-turn``) run whose process is SIGKILLed ends Crashed, the automation
starts ``recover-turn`` with the crashed run's parameters, and the workflow ends
as a fault-free run would.

The server is the session's Prefect test server (its automation services — event
triggers and actions — run in it); the deployments are served by a real Prefect
runner process (``serve_child.py``, triggers read from ``prefect.yaml``), which
starts each flow run in its own subprocess.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from crash_matrix import STEPS, Case, chats_of, effects_of, env_for_children, run_workflow
from payments import Payments
from prefect.client.orchestration import PrefectClient, get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
from prefect.deployments import run_deployment
from recovery_env import HERE, ROOT, PrefectEnv
from test_crash_matrix import LIVE, check

from coder_chat.emulator import Emulator
from prefect_coder.flows.deployments.agent_turn import agent_turn
from prefect_coder.flows.parts.params import WorkflowSettings
from prefect_coder.flows.parts.toolset import Toolset

DEPLOYMENTS = ["agent-workflow", "agent-turn", "recover-turn"]


async def _wait(predicate: Callable[[], Awaitable[Any]], limit_s: float, what: str) -> Any:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


@contextlib.asynccontextmanager
async def served(
    prefect_env: PrefectEnv, payments: Payments, tmp_path: Path, crash_at: str
) -> AsyncIterator[PrefectClient]:
    """A runner serving the deployments; its flow-run processes SIGKILL themselves
    at ``crash_at`` once (``payment_tools``' test seam)."""
    env = env_for_children(prefect_env.child_env(), payments.url)
    env.update(
        PREFECT_RUNNER_POLL_FREQUENCY="1",
        CRASH_AT=crash_at,
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

            async def ready() -> bool:
                found = await client.read_deployments(
                    deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=DEPLOYMENTS))
                )
                return len(found) == len(DEPLOYMENTS)

            await _wait(ready, 60, "the served deployments")
            yield client
    finally:
        runner.terminate()
        try:
            await asyncio.wait_for(runner.wait(), 15)
        except TimeoutError:
            runner.kill()
            await runner.wait()
        log.close()


async def crash_then_recovery(
    client: PrefectClient, deployment: str, parameters: dict[str, Any], tmp_path: Path
) -> Any:
    """Start ``deployment``, wait for it to end Crashed, then for the recover-turn run
    the automation started for the same workflow to finish; return that run."""
    crashed_run: Any = await run_deployment(  # type: ignore[misc]
        deployment, parameters=parameters, timeout=0
    )

    async def crashed() -> bool:
        state = (await client.read_flow_run(crashed_run.id)).state
        return state is not None and state.type.value == "CRASHED"

    await _wait(crashed, 90, f"the {deployment} run to end Crashed")

    async def recovered() -> Any:
        runs = await client.read_flow_runs(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["recover-turn"]))
        )
        mine = [r for r in runs if r.parameters.get("workflow_id") == parameters["workflow_id"]]
        done = [r for r in mine if r.state and r.state.is_final()]
        return done[0] if done else None

    run = await _wait(recovered, 120, "the triggered recover-turn run to finish")
    log = (tmp_path / "runner.log").read_text(errors="replace")[-4000:]
    assert run.state.type.value == "COMPLETED", (run.state, log)
    return run


async def test_crashed_agent_workflow_run_triggers_recover_turn(
    prefect_env: PrefectEnv,
    payments: Payments,
    emu: Emulator,
    settings: WorkflowSettings,
    baseline: list[str],
    tmp_path: Path,
) -> None:
    workflow_id = f"r-trig-{uuid.uuid4().hex[:8]}"
    async with served(prefect_env, payments, tmp_path, "tool.after_done:2") as client:
        run = await crash_then_recovery(
            client,
            "agent-workflow/agent-workflow",
            {
                "workflow_id": workflow_id,
                "steps": [s.model_dump(mode="json") for s in STEPS],
                "settings": settings.model_dump(mode="json"),
            },
            tmp_path,
        )
        assert run.parameters["finish_workflow"] is True
        assert run.parameters["steps"][1]["name"] == "pay"  # a list, not a string
    # A rerun returns every step from storage: the results the recovery produced.
    results = await run_workflow(workflow_id, STEPS, settings)
    await check(Case("trigger"), workflow_id, results, baseline, payments, emu)


async def test_crashed_agent_turn_run_triggers_recover_turn_for_its_step(
    prefect_env: PrefectEnv,
    payments: Payments,
    emu: Emulator,
    settings: WorkflowSettings,
    baseline: list[str],
    tmp_path: Path,
) -> None:
    workflow_id = f"r-trig-turn-{uuid.uuid4().hex[:8]}"
    tools = Toolset.of_steps(STEPS)
    keep = settings.model_copy(update={"keep_chat": True})
    first = await agent_turn(workflow_id, STEPS[0], keep, tools)
    async with served(prefect_env, payments, tmp_path, "tool.after_done:1") as client:
        run = await crash_then_recovery(
            client,
            "agent-turn/agent-turn",
            {
                "workflow_id": workflow_id,
                "step": STEPS[1].model_dump(mode="json"),
                "settings": keep.model_dump(mode="json"),
                "workflow_tools": tools.model_dump(mode="json"),
            },
            tmp_path,
        )
        assert run.parameters["step"] == "pay"
        assert [s["name"] for s in run.parameters["steps"]] == ["pay"]
    # The step's result is stored: running the step again returns it, sends nothing.
    second = await agent_turn(workflow_id, STEPS[1], keep, tools)
    assert [first.text, second.text] == baseline
    chats = chats_of(emu, workflow_id)
    assert [c["id"] for c in chats] == [first.chat_id]
    assert sorted(effects_of(payments, [first.chat_id]).values()) == [1, 1]
    assert emu.chat(first.chat_id)["status"] not in LIVE
