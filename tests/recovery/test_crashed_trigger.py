"""The ``prefect.yaml`` triggers, on a real Prefect server: an ``agent-workflow``
(or ``agent-turn``) run whose process is SIGKILLed ends Crashed, the automation
starts ``recover-turn`` with the crashed run's parameters, and the workflow ends
as a fault-free run would.

The server is the session's Prefect test server (its automation services — event
triggers and actions — run in it); the deployments are on a process work pool, as
``prefect.yaml`` deploys them (triggers read from it), served by a real ``prefect
worker start`` process (one for the module, forked from the session's warm process),
which starts each flow run as a child process of its own: ``tests/warm_launch.py``,
the pool's ``command`` (as in the fan-out tests), which forks the engine from the
warm process and stands for it — a SIGKILL of the engine ends the worker's child
with the same signal, and the worker reports the run Crashed.

(Until round 11c a Prefect runner, ``prefect.serve``, ran these deployments: it
starts every flow run as a *spawned* interpreter that imports Prefect and the flows
again, ≈ 4 CPU-s per run, four runs per module — the file's largest cost. The worker
is also the launch path ``prefect.yaml`` documents.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import UUID

import payment_tools  # noqa: F401  # charge_card in the deployments' tools enum (docs/deploy.md)
import pytest
import yaml
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
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.filters import (
    DeploymentFilter,
    DeploymentFilterName,
    FlowRunFilter,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.deployments import run_deployment
from prefect.deployments.runner import EntrypointType
from prefect.events import DeploymentEventTrigger
from recovery_env import ROOT, PrefectEnv
from warm_python import WarmPython

from coder_chat.emulator import Emulator
from prefect_coder.flows.common.params import WorkflowSettings
from prefect_coder.flows.common.toolset import Toolset
from prefect_coder.flows.deployments.agent_turn import agent_turn
from prefect_coder.flows.deployments.agent_workflow import agent_workflow
from prefect_coder.flows.deployments.recover_turn import recover_turn

FINAL = [StateType.COMPLETED, StateType.FAILED, StateType.CRASHED, StateType.CANCELLED]

#: What the module deploys: ``prefect.yaml``'s names and flows.
DEPLOYMENTS: tuple[tuple[str, Any], ...] = (
    ("agent-workflow", agent_workflow),
    ("agent-turn", agent_turn),
    ("recover-turn", recover_turn),
)

#: The pool's ``command`` job variable: each flow run is a child process of the worker,
#: ``tests/warm_launch.py``, which forks ``python -m prefect.engine`` from the session's
#: warm process (no second import of Prefect and the flows) and ends as the engine
#: does — killed by the same signal when the engine was SIGKILLed.
ENGINE_COMMAND = f"{sys.executable} {ROOT / 'tests' / 'warm_launch.py'}"

#: How often the worker looks for scheduled runs (a read of the server each time;
#: Prefect's default is 10 s). Each run waits at most this long for its pickup.
WORKER_QUERY_S = 2

#: Seconds between two reads of the API while waiting: the worker itself polls every
#: :data:`WORKER_QUERY_S`, so nothing it starts is seen sooner by reading more often —
#: every read costs the test server's CPU too.
POLL_S = 2.0


async def _wait(predicate: Callable[[], Awaitable[Any]], limit_s: float, what: str) -> Any:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(POLL_S)
    raise AssertionError(f"timed out waiting for {what}")


#: The worker, forked from the session's warm process (``tests/warm_python.py``: no
#: second import of Prefect and the flows): ``prefect worker start`` on the pool, its
#: poll interval set here (a Prefect setting read at import time, which a fork must
#: share with the warm process; the worker hands it down to its flow runs, whose
#: engines never read it). No ``PREFECT_API_SSL_CERT_FILE`` of its own (the crash
#: children's ``recovery_env.api_ca_bundle``): the worker hands its environment down
#: too, and a flow run whose import-time settings differ from the warm process's gets
#: a fresh interpreter (the session's own one-certificate bundle applies already).
_WORKER = """
import os, runpy, sys
from prefect.settings import PREFECT_WORKER_QUERY_SECONDS, temporary_settings
# The worker's output and its flow runs' go to the log as they come (for a failure's
# message while the worker still runs).
log = os.open(sys.argv[3], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
os.dup2(log, 1)
os.dup2(log, 2)
sys.stdout.reconfigure(line_buffering=True)
sys.stderr.reconfigure(line_buffering=True)
with temporary_settings(updates={PREFECT_WORKER_QUERY_SECONDS: int(sys.argv[1])}):
    sys.argv = ["prefect", "worker", "start", "--pool", sys.argv[2], "--type", "process",
                "--name", sys.argv[2] + "-w"]
    runpy.run_module("prefect", run_name="__main__")
"""


@dataclass
class Served:
    """The module's worker and its crash plan (``payment_tools``' test seam)."""

    client: PrefectClient
    plan: Path
    log: Path

    def crash_once_at(self, point: str, once: Path) -> None:
        """The worker's next flow-run processes SIGKILL themselves at ``point`` —
        once across processes (the first to get there creates ``once``)."""
        self.plan.write_text(json.dumps({"at": point, "once": str(once)}))

    def log_tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-4000:]
        except OSError:
            return ""


async def _deploy(client: PrefectClient, pool: str) -> list[UUID]:
    """The pool and the deployments on it, with their triggers from ``prefect.yaml``;
    their ids."""
    await client.create_work_pool(WorkPoolCreate(name=pool, type="process"), overwrite=True)
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    ids = []
    for name, fl in DEPLOYMENTS:
        entry = next(d for d in spec["deployments"] if d["name"] == name)
        dep = await fl.ato_deployment(
            name=name,
            work_pool_name=pool,
            entrypoint_type=EntrypointType.MODULE_PATH,
            triggers=[DeploymentEventTrigger(**t) for t in entry.get("triggers", [])],
            job_variables={"working_dir": str(ROOT), "command": ENGINE_COMMAND},
        )
        ids.append(await dep.aapply())
    return ids


@pytest.fixture(scope="module")
async def served(
    prefect_env: PrefectEnv,
    payments: Payments,
    warm_python: WarmPython,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Served]:
    """One worker serving the deployments for the module's tests (its start and
    deployment registration paid once); its flow-run processes SIGKILL themselves at
    the crash plan's point, once. The deployments and the automations their triggers
    own are removed at the end: the session's server is shared, and other files
    deploy the same names."""
    root = tmp_path_factory.mktemp("trigger")
    plan, log = root / "crash-plan.json", root / "worker.log"
    env = env_for_children(prefect_env.child_env(), payments.url)
    env["CRASH_PLAN_FILE"] = str(plan)
    pool = f"recovery-trigger-{uuid.uuid4().hex[:6]}"
    async with get_client() as client:
        ids = await _deploy(client, pool)
        worker = await asyncio.to_thread(
            warm_python.start,
            ["-c", _WORKER, str(WORKER_QUERY_S), pool, str(log)],
            env=env,
            cwd=ROOT,
        )
        try:
            yield Served(client, plan, log)
        finally:
            # SIGTERM: the worker stops its loops and exits; SIGKILL if it does not.
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                await worker.communicate(15)
            for dep_id in ids:
                await client.delete_resource_owned_automations(f"prefect.deployment.{dep_id}")
                await client.delete_deployment(dep_id)
            await client.delete_work_pool(pool)


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

    # Bounds, not sleeps: at load 20+ on 2 cores a run (then spawned as a fresh
    # interpreter) took over 90 s to crash.
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
