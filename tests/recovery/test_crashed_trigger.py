"""The ``prefect.yaml`` triggers, on a real Prefect server: an ``agent-workflow``
(or ``agent-turn``) run whose process is SIGKILLed ends Crashed, the automation
starts ``recover-turn`` with the crashed run's parameters, and the workflow ends
as a fault-free run would.

The server is the session's Prefect test server (its automation services — event
triggers and actions — run in it); the deployments are served by a real Prefect
runner process (``serve_child.py``, triggers read from ``prefect.yaml``; one for the
module, forked from the session's warm process), which starts each flow run in its
own (spawned) subprocess.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from crash_matrix import (
    LIVE,
    STEPS,
    Case,
    chats_of,
    check,
    effects_of,
    env_for_children,
    run_workflow,
)
from payments import Payments
from prefect.client.orchestration import PrefectClient, get_client
from prefect.client.schemas.filters import (
    DeploymentFilter,
    DeploymentFilterName,
    FlowRunFilter,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.deployments import run_deployment
from recovery_env import HERE, ROOT, PrefectEnv
from warm_python import WarmPython

from coder_chat.emulator import Emulator
from prefect_coder.flows.deployments.agent_turn import agent_turn
from prefect_coder.flows.parts.params import WorkflowSettings
from prefect_coder.flows.parts.toolset import Toolset

DEPLOYMENTS = ["agent-workflow", "agent-turn", "recover-turn"]
FINAL = [StateType.COMPLETED, StateType.FAILED, StateType.CRASHED, StateType.CANCELLED]


#: Seconds between two reads of the API while waiting: the runner itself polls every
#: second (``_SERVE``), so nothing it starts is seen sooner by reading more often —
#: every read costs the test server's CPU too.
POLL_S = 1.0


async def _wait(predicate: Callable[[], Awaitable[Any]], limit_s: float, what: str) -> Any:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(POLL_S)
    raise AssertionError(f"timed out waiting for {what}")


#: The runner, forked from the session's warm process (``tests/warm_python.py``: no
#: second import of Prefect and the flows, ~5 CPU-s): ``serve_child.py`` run as
#: ``__main__`` with the runner polling every second (a Prefect setting read at
#: import time, so set here rather than in the environment, which a fork must share
#: with the warm process), and the API clients' one-certificate CA bundle
#: (``recovery_env.api_ca_bundle``) set for the whole process — and so in the
#: environment of the flow-run processes it spawns.
_SERVE = """
import os, runpy, sys
from prefect.context import refresh_global_settings_context
from prefect.settings import PREFECT_RUNNER_POLL_FREQUENCY, temporary_settings
if os.environ.get("RECOVERY_API_CA_FILE"):
    os.environ["PREFECT_API_SSL_CERT_FILE"] = os.environ["RECOVERY_API_CA_FILE"]
    refresh_global_settings_context()
with temporary_settings(updates={PREFECT_RUNNER_POLL_FREQUENCY: 1}):
    runpy.run_path(sys.argv[1], run_name="__main__")
"""


@dataclass
class Served:
    """The module's runner and its crash plan (``payment_tools``' test seam)."""

    client: PrefectClient
    plan: Path
    log: Path

    def crash_once_at(self, point: str, once: Path) -> None:
        """The runner's next flow-run processes SIGKILL themselves at ``point`` —
        once across processes (the first to get there creates ``once``)."""
        self.plan.write_text(json.dumps({"at": point, "once": str(once)}))

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


@pytest.fixture(scope="module")
async def served(
    prefect_env: PrefectEnv,
    payments: Payments,
    warm_python: WarmPython,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Served]:
    """One runner serving the deployments for the module's tests (its start and
    deployment registration paid once); its flow-run processes SIGKILL themselves at
    the crash plan's point, once."""
    root = tmp_path_factory.mktemp("trigger")
    plan, log = root / "crash-plan.json", root / "runner.log"
    env = env_for_children(prefect_env.child_env(), payments.url)
    env["CRASH_PLAN_FILE"] = str(plan)
    runner = await asyncio.to_thread(
        warm_python.start, ["-c", _SERVE, str(HERE / "serve_child.py")], env=env, cwd=ROOT
    )
    try:
        async with get_client() as client:

            async def ready() -> bool:
                if runner.poll() is not None:
                    raise AssertionError(f"the runner exited: {runner.poll()}")
                found = await client.read_deployments(
                    deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=DEPLOYMENTS))
                )
                return len(found) == len(DEPLOYMENTS)

            await _wait(ready, 180, "the served deployments")
            yield Served(client, plan, log)
    finally:
        # SIGTERM: the runner stops its loops and exits; SIGKILL if it does not.
        with contextlib.suppress(ProcessLookupError):
            os.kill(runner.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            done = await runner.communicate(15)
            log.write_text(done.stdout + done.stderr)


async def crash_then_recovery(served: Served, deployment: str, parameters: dict[str, Any]) -> Any:
    """Start ``deployment``, wait for it to end Crashed, then for the recover-turn run
    the automation started for the same workflow to finish; return that run."""
    client = served.client
    crashed_run: Any = await run_deployment(  # type: ignore[misc]
        deployment, parameters=parameters, timeout=0
    )

    async def crashed() -> bool:
        state = (await client.read_flow_run(crashed_run.id)).state
        return state is not None and state.type.value == "CRASHED"

    # Bounds, not sleeps: the runner spawns each flow run as a fresh interpreter (a full
    # Prefect import), and at load 20+ on 2 cores a run took over 90 s to crash.
    await _wait(crashed, 240, f"the {deployment} run to end Crashed")

    async def recovered() -> Any:
        # Only runs in a final state (the server filters): until the end, none.
        runs = await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=FINAL))
            ),
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["recover-turn"])),
        )
        mine = [r for r in runs if r.parameters.get("workflow_id") == parameters["workflow_id"]]
        done = [r for r in mine if r.state and r.state.is_final()]
        return done[0] if done else None

    run = await _wait(recovered, 240, "the triggered recover-turn run to finish")
    assert run.state.type.value == "COMPLETED", (run.state, served.log_tail())
    return run


async def test_crashed_agent_workflow_run_triggers_recover_turn(
    prefect_env: PrefectEnv,
    payments: Payments,
    emu: Emulator,
    settings: WorkflowSettings,
    baseline: list[str],
    served: Served,
    tmp_path: Path,
) -> None:
    workflow_id = f"r-trig-{uuid.uuid4().hex[:8]}"
    served.crash_once_at("tool.after_done:2", tmp_path / "crashed-once")
    run = await crash_then_recovery(
        served,
        "agent-workflow/agent-workflow",
        {
            "workflow_id": workflow_id,
            "steps": [s.model_dump(mode="json") for s in STEPS],
            "settings": settings.model_dump(mode="json"),
        },
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
    served: Served,
    tmp_path: Path,
) -> None:
    workflow_id = f"r-trig-turn-{uuid.uuid4().hex[:8]}"
    tools = Toolset.of_steps(STEPS)
    keep = settings.model_copy(update={"keep_chat": True})
    first = await agent_turn(workflow_id, STEPS[0], keep, tools)
    served.crash_once_at("tool.after_done:1", tmp_path / "crashed-once")
    run = await crash_then_recovery(
        served,
        "agent-turn/agent-turn",
        {
            "workflow_id": workflow_id,
            "step": STEPS[1].model_dump(mode="json"),
            "settings": keep.model_dump(mode="json"),
            "workflow_tools": tools.model_dump(mode="json"),
        },
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
