"""The fan-out tests' real process fleet: a process work pool, the deployments of
``prefect.yaml`` that a fan-out needs (with its triggers), and ``prefect worker start``
subprocesses, each in its own process group so a kill takes its flow runs with it."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import UUID

import yaml
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.deployments.runner import EntrypointType
from prefect.events import DeploymentEventTrigger

from prefect_coder.flows.deployments.agent_fanout import agent_fanout
from prefect_coder.flows.deployments.agent_workflow import agent_workflow
from prefect_coder.flows.deployments.fanout_shard import agent_fanout_shard
from prefect_coder.flows.deployments.recover_turn import recover_turn

TOKEN = f"tok-fanout-{uuid.uuid4().hex}-SECRET"
ROOT = Path(__file__).resolve().parents[2]
#: Short recovery constants (production: 1 s poll, horizon = request timeout).
FAST_ENV = {"PREFECT_CODER_SETTLE_POLL_S": "0.05", "PREFECT_CODER_COMMIT_HORIZON_S": "1.0"}


def _triggers(name: str) -> list[Any]:
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    entry = next(d for d in spec["deployments"] if d["name"] == name)
    return [DeploymentEventTrigger(**t) for t in entry.get("triggers", [])]


async def deploy(pool: str) -> list[UUID]:
    """The pool and the agent-workflow, recover-turn, agent-fanout and agent-fanout-shard
    deployments on it, with their Crashed triggers from ``prefect.yaml``; returns their
    ids (for :func:`undeploy`)."""
    async with get_client() as client:
        await client.create_work_pool(WorkPoolCreate(name=pool, type="process"), overwrite=True)
    ids: list[UUID] = []
    for fl, name in (
        (agent_workflow, "agent-workflow"),
        (recover_turn, "recover-turn"),
        (agent_fanout, "agent-fanout"),
        (agent_fanout_shard, "agent-fanout-shard"),
    ):
        dep = await fl.ato_deployment(
            name=name,
            work_pool_name=pool,
            entrypoint_type=EntrypointType.MODULE_PATH,
            triggers=_triggers(name),
            job_variables={"working_dir": str(ROOT)},
        )
        ids.append(await dep.aapply())
    return ids


async def undeploy(ids: list[UUID]) -> None:
    """Remove the deployments and the automations their triggers own: the session's
    Prefect server is shared, and other tests serve deployments of the same names."""
    async with get_client() as client:
        for dep_id in ids:
            await client.delete_resource_owned_automations(f"prefect.deployment.{dep_id}")
            await client.delete_deployment(dep_id)


@dataclass
class Worker:
    name: str
    proc: asyncio.subprocess.Process
    log: Path
    killed: bool = False
    children: set[int] = field(default_factory=set)

    def kill_with_children(self) -> list[int]:
        """SIGKILL the worker's process group (the worker and its flow-run processes)."""
        pids = [self.proc.pid, *_children(self.proc.pid)]
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.killed = True
        return pids


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


async def start_worker(pool: str, name: str, env: dict[str, str], log: Path, limit: int) -> Worker:
    out = log.open("wb")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "prefect",
        "worker",
        "start",
        "--pool",
        pool,
        "--type",
        "process",
        "--name",
        name,
        "--limit",
        str(limit),
        env=env,
        cwd=str(ROOT),
        stdout=out,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    out.close()
    return Worker(name, proc, log)


async def stop_worker(worker: Worker) -> None:
    if worker.proc.returncode is None:
        worker.kill_with_children()
    await worker.proc.wait()


def child_env(api_url: str, results_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PREFECT_API_URL=api_url,
        PREFECT_RESULTS_LOCAL_STORAGE_PATH=str(results_dir),
        PREFECT_LOGGING_LEVEL="WARNING",
        PREFECT_WORKER_QUERY_SECONDS="1",
        PREFECT_WORKER_HEARTBEAT_SECONDS="5",
        **FAST_ENV,
    )
    return env
