"""The fan-out tests' real process fleet: a process work pool, the deployments of
``prefect.yaml`` that a fan-out needs (with its triggers), and ``prefect worker start``
subprocesses, each in its own process group so a kill takes its flow runs with it."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import UUID

import yaml
from prefect.client.orchestration import PrefectClient, get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterDeploymentId,
    FlowRunFilterState,
    FlowRunFilterStateType,
    WorkPoolFilter,
    WorkPoolFilterName,
)
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.deployments.runner import EntrypointType
from prefect.events import DeploymentEventTrigger

from coder_chat.emulator import Emulator
from prefect_coder.flows.common.params import Step, WorkflowSettings, step_marker
from prefect_coder.flows.deployments.agent_fanout import FanoutItem, agent_fanout
from prefect_coder.flows.deployments.agent_workflow import agent_workflow
from prefect_coder.flows.deployments.fanout_shard import agent_fanout_shard
from prefect_coder.flows.deployments.recover_turn import recover_turn

# ``tests/`` for ``support``: bench/fanout.py imports this module outside pytest.
_TESTS = str(Path(__file__).resolve().parents[1])
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

from support.prefect_blocks import emulator_credentials, save_settings  # noqa: E402
from warm_launch import behind  # noqa: E402

TOKEN = f"tok-fanout-{uuid.uuid4().hex}-SECRET"
ROOT = Path(__file__).resolve().parents[2]
#: Short recovery constants (production: 1 s poll, horizon = request timeout).
FAST_ENV = {"PREFECT_CODER_SETTLE_POLL_S": "0.05", "PREFECT_CODER_COMMIT_HORIZON_S": "1.0"}


def _triggers(name: str) -> list[Any]:
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    entry = next(d for d in spec["deployments"] if d["name"] == name)
    return [DeploymentEventTrigger(**t) for t in entry.get("triggers", [])]


#: What :func:`deploy` deploys, in the order of the ids it returns.
DEPLOYMENTS: tuple[tuple[str, Any], ...] = (
    ("agent-workflow", agent_workflow),
    ("recover-turn", recover_turn),
    ("agent-fanout", agent_fanout),
    ("agent-fanout-shard", agent_fanout_shard),
)


def deployment_id(ids: list[UUID], name: str) -> UUID:
    """The id of deployment ``name`` among :func:`deploy`'s ids."""
    return ids[[n for n, _ in DEPLOYMENTS].index(name)]


async def runs_of(
    client: PrefectClient,
    deployment: UUID,
    states: Sequence[StateType] | None = None,
    *,
    pool: str,
) -> list[FlowRun]:
    """The flow runs of one deployment on this test's work ``pool``, optionally only in
    ``states``. The pool, not the deployment id alone: the session's server is shared,
    and other tests deploy flows under the same deployment names — the same deployment
    id, pointed at their own pool (a recovery test's Crashed ``agent-workflow`` run
    showed up among a fan-out test's runs)."""
    return await client.read_flow_runs(
        flow_run_filter=FlowRunFilter(
            deployment_id=FlowRunFilterDeploymentId(any_=[deployment]),
            state=(
                FlowRunFilterState(type=FlowRunFilterStateType(any_=list(states)))
                if states
                else None
            ),
        ),
        work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])),
        limit=200,
    )


#: The process pool's ``command`` job variable: each flow run is one ``python -m
#: prefect.engine`` process, a child of the worker, as before. Without it Prefect 3.9's
#: process worker starts a workspace supervisor that imports Prefect (≈ 3.5 CPU-s)
#: only to exec that same engine command, and after a flow-run process dies it starts
#: a third Python to look for ``on_crashed`` hooks (≈ 5.5 CPU-s; these flows have
#: none): about a third of these tests' CPU, none of it part of what they prove
#: (issue 12). The kill, the Crashed report and the triggers are the same. The
#: process is tests/warm_launch.py: with the session's warm process up it forks that
#: engine from it (≈ 3 CPU-s of imports less per run) and stands for it until it ends.
ENGINE_COMMAND = f"{sys.executable} {ROOT / 'tests' / 'warm_launch.py'}"


async def deploy(
    pool: str, untriggered: Sequence[str] = (), *, default_launch: bool | Sequence[str] = False
) -> list[UUID]:
    """The pool and the agent-workflow, recover-turn, agent-fanout and agent-fanout-shard
    deployments on it, with their Crashed triggers from ``prefect.yaml`` (except the
    deployments named in ``untriggered``: a test that re-runs one by hand); returns
    their ids (for :func:`undeploy`). Flow runs start as :data:`ENGINE_COMMAND`, or
    with ``default_launch`` exactly as ``prefect.yaml`` deploys them (no ``command``:
    the worker's workspace supervisor and its crashed-hook process), which one test
    keeps for the deployment whose run it kills, so the user's own launch path is
    proven under a kill too. ``default_launch``: True for every deployment, or the
    names of those launched that way (each such run costs ≈ 2 CPU-s more)."""
    async with get_client() as client:
        await client.create_work_pool(WorkPoolCreate(name=pool, type="process"), overwrite=True)
    ids: list[UUID] = []
    for name, fl in DEPLOYMENTS:
        dep = await fl.ato_deployment(
            name=name,
            work_pool_name=pool,
            entrypoint_type=EntrypointType.MODULE_PATH,
            triggers=[] if name in untriggered else _triggers(name),
            job_variables={"working_dir": str(ROOT)}
            if default_launch is True or (default_launch and name in default_launch)
            else {"working_dir": str(ROOT), "command": ENGINE_COMMAND},
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
    #: The worker's own process: its flow-run processes' parent (``proc`` is the
    #: launcher that stands for it when it was forked from the warm process).
    pid: int = 0

    def kill_with_children(self) -> list[int]:
        """SIGKILL the worker's process group (the worker and its flow-run processes, also
        those in a session of their own: Prefect's default launch isolates them)."""
        worker = self.pid or self.proc.pid
        children = _children(worker)
        # A flow-run process forked from the warm process (tests/warm_launch.py) is
        # killed here with the rest, not a moment later when the warm process sees its
        # launcher die: the same instant for all, as one group kill of a worker is.
        forks = [f for c in children if (f := behind(c)) != c]
        pids = [*forks, *{self.proc.pid: None, worker: None}, *children]
        for pid in forks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for group in {self.proc.pid, worker}:
            try:
                os.killpg(group, signal.SIGKILL)
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
    """A ``prefect worker start`` process (through tests/warm_launch.py: forked from the
    session's warm process when its settings allow, in its own process group that dies
    with this process; else this process becomes the worker)."""
    out = log.open("wb")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(ROOT / "tests" / "warm_launch.py"),
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
    return Worker(name, proc, log, pid=await _worker_pid(proc))


async def _worker_pid(proc: asyncio.subprocess.Process, bound_s: float = 60.0) -> int:
    """The pid ``proc`` stands for, once the launcher has forked it or become it."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline and proc.returncode is None:
        pid = _stands_for(proc.pid)
        if pid is not None:
            return pid
        await asyncio.sleep(0.05)
    return proc.pid


def _stands_for(launcher: int) -> int | None:
    """The fork a launcher stands for, itself once it became the program, or None yet."""
    pid = behind(launcher)
    if pid != launcher:
        return pid
    try:
        if b"warm_launch" not in Path(f"/proc/{launcher}/cmdline").read_bytes():
            return launcher  # it became the worker (exec)
    except OSError:
        return launcher  # gone
    return None


async def stop_worker(worker: Worker) -> None:
    if worker.proc.returncode is None:
        worker.kill_with_children()
    await worker.proc.wait()


#: The tests' workers look for scheduled runs every 2 s. Each look is a
#: ``get_scheduled_flow_runs`` on the server, which also writes the pool's and queue's
#: last poll: an idle worker polling every second cost the server process ≈ 0.053
#: CPU-s per second of its life, every 2 s ≈ 0.025 (measured twice each, issue 12;
#: PostgreSQL's share comes on top) — with two workers for two minutes, about a flow
#: run's own process. A run waits ≤ 2 s for its pickup (bounds below are tens of
#: seconds).
WORKER_QUERY_S = 2.0


def child_env(api_url: str, results_dir: Path, *, query_s: float = 1.0) -> dict[str, str]:
    """The environment of the fleet's workers and their flow runs; ``query_s``: the
    workers' poll interval (the tests pass :data:`WORKER_QUERY_S`)."""
    env = dict(os.environ)
    env.update(
        PREFECT_API_URL=api_url,
        PREFECT_RESULTS_LOCAL_STORAGE_PATH=str(results_dir),
        PREFECT_LOGGING_LEVEL="WARNING",
        PREFECT_WORKER_QUERY_SECONDS=f"{query_s:g}",
        PREFECT_WORKER_HEARTBEAT_SECONDS="5",
        **FAST_ENV,
    )
    return env


def most_at_once(intervals: Sequence[tuple[Any, Any]]) -> int:
    """The most intervals open at one instant (an end sorts before a start at a tie):
    order facts only, whatever the clock's pace."""
    edges = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


#: How often :func:`until` looks again. Each look is one or more reads of the Prefect
#: server (CPU there and here, issue 12); every wait here is for a process start or a
#: turn of seconds, so half a second of lag costs little wall.
UNTIL_EVERY_S = 0.5


#: With a ``gate``, how often :func:`until` calls ``check`` while the gate is shut.
GATED_EVERY_S = 5.0


async def until(
    what: str,
    limit_s: float,
    check: Callable[[], Awaitable[Any]],
    every_s: float = UNTIL_EVERY_S,
    *,
    gate: Callable[[], bool] | None = None,
) -> Any:
    """Poll ``check`` every ``every_s`` until it returns something truthy (returned), or
    fail naming ``what``.

    ``gate``: a local fact (the emulator's event log) that must hold before ``check``
    can succeed, e.g. every step's turn ended before a fan-out can complete. While it
    does not hold, ``check`` (reads of the Prefect server) runs only every
    :data:`GATED_EVERY_S` — not never, so a run that ended otherwise (failed) is still
    seen and reported; the wait's outcome is ``check``'s alone."""
    deadline = time.monotonic() + limit_s
    last = -math.inf
    while time.monotonic() < deadline:
        now = time.monotonic()
        if gate is None or gate() or now - last >= GATED_EVERY_S:
            last = now
            value = await check()
            if value:
                return value
        await asyncio.sleep(every_s)
    raise AssertionError(f"timed out waiting for {what}")


async def fanout_settings(
    emu: Emulator,
    store_url: str,
    cap: int | None,
    tenant: str | None = None,
    slot_wait_s: float = 120.0,
) -> WorkflowSettings:
    """Blocks of their own (credentials with a turn cap of ``cap``, the test's store, in
    ``tenant`` if given) and the fan-out's settings: short leases and slot ttl, a turn
    waits ``slot_wait_s`` for a slot, artifacts on."""
    credentials = emulator_credentials(
        emu,
        TOKEN,
        turn_timeout=60.0,
        max_concurrent_turns=cap,
        turn_slot_wait=slot_wait_s,
        turn_slot_ttl=3.0,
    )
    return await save_settings(
        "fanout",
        credentials,
        store_url,
        tenant=tenant,
        lease_wait_s=90,
        lease_ttl_s=3,
        settle_wait_s=5,
        artifacts=True,
    )


def fanout_items(run: str, count: int, steps: Sequence[str], sleep_s: float) -> list[FanoutItem]:
    """``count`` workflows ``fw-<run>-<i>``; each step a scripted turn of ``sleep_s``."""
    items = []
    for i in range(count):
        wid = f"fw-{run}-{i}"
        items.append(
            FanoutItem(
                workflow_id=wid,
                steps=[
                    Step(
                        name=s,
                        prompt=(
                            f'{step_marker(wid, s)} #emu {{"sleep": {sleep_s}, "text": "done {s}"}}'
                        ),
                    )
                    for s in steps
                ],
            )
        )
    return items


def user_messages_per_step(
    emu: Emulator, items: Sequence[FanoutItem], steps: Sequence[str]
) -> dict[str, int]:
    """How many user messages carry each step's marker: ids from the emulator's event
    log (every message the server accepted), texts from its stored rows."""
    user_ids = {
        e["details"]["id"] for e in emu.event_log(["message"]) if e["details"]["role"] == "user"
    }
    markers = [step_marker(i.workflow_id, s) for i in items for s in steps]
    counts: dict[str, int] = {}
    for chat in emu.chats():
        for m in emu.messages(chat["id"], include_system=False):
            if m["id"] in user_ids:
                text = "".join(p.get("text", "") for p in m.get("content") or [])
                for marker in markers:
                    if marker in text:
                        counts[marker] = counts.get(marker, 0) + 1
    return counts
