"""A lost host is recovered: a flow-run process with heartbeats on is SIGKILLed together
with its parent (the worker), and the zombie automation (``apply_zombie_automation``,
what ``prefect-coder automations apply`` creates) marks its run Crashed, which emits the
``prefect.flow-run.Crashed`` event the ``recover-turn`` triggers listen for.

Real parts only: the session's Prefect test server (its trigger services run in it), a
real ``prefect.engine`` process (``python -m prefect.engine``'s ``__main__``) under a real
parent, both forked from the session's warm process (no Prefect import of their own), a
real kill -9 of their process group. Prefect's bounds make this the slowest test of its
folder: heartbeats every 30 s at least, and a proactive ``within`` of 10 s at least; the
run is killed right after its first heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

from prefect.client.orchestration import PrefectClient, get_client
from prefect.flows import Flow
from warm_python import Child, WarmPython
from zombie_flow import FLOW_NAME, sleeper

from prefect_coder.flows.deployments.zombies import apply_zombie_automation

ROOT = Path(__file__).resolve().parents[2]
WITHIN_S = 10.0  # Prefect's minimum for a proactive trigger

#: The lost host: a parent standing for the worker (it waits for its flow-run process,
#: in a process group of its own so one kill -9 ends both) and ``python -m
#: prefect.engine``'s ``__main__`` with heartbeats every 30 s. The heartbeat setting
#: is applied at run time (the engine reads it then): a PREFECT_* variable of its own
#: would make the warm process start a fresh interpreter (a second Prefect import).
_LOST_HOST = """
import os, runpy, sys
os.setpgid(0, 0)
engine = os.fork()
if engine:
    os.waitpid(engine, 0)
    sys.exit(0)
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: 30}):
    sys.modules.pop("prefect.engine", None)
    runpy.run_module("prefect.engine", run_name="__main__", alter_sys=True)
"""


async def _events(client: PrefectClient, name: str, run_id: uuid.UUID) -> list[dict[str, Any]]:
    response = await client._client.post(
        "/events/filter",
        json={
            "filter": {
                "event": {"name": [name]},
                "resource": {"id": [f"prefect.flow-run.{run_id}"]},
                "order": "ASC",
            },
            "limit": 50,
        },
    )
    response.raise_for_status()
    return list(response.json()["events"])


async def _until(what: str, limit_s: float, check: Any) -> Any:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        value = await check()
        if value:
            return value
        await asyncio.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


async def test_lost_host_run_is_marked_crashed_by_the_zombie_automation(
    warm_python: WarmPython, tmp_path: Path
) -> None:
    name = f"hostloss-zombie-{uuid.uuid4().hex[:8]}"
    applied = await apply_zombie_automation(
        heartbeat_s=30, within_s=WITHIN_S, flows=[FLOW_NAME], name=name
    )
    assert applied.action == "created"
    # Idempotent by name: applying again changes nothing; new values update in place.
    again = await apply_zombie_automation(
        heartbeat_s=30, within_s=WITHIN_S, flows=[FLOW_NAME], name=name
    )
    assert (again.action, again.automation.id) == ("unchanged", applied.automation.id)
    assert isinstance(sleeper, Flow)
    proc: Child | None = None
    try:
        async with get_client() as client:
            run = await client.create_flow_run(sleeper)
            env = dict(
                warm_python.env,
                PREFECT__FLOW_RUN_ID=str(run.id),
                PREFECT__FLOW_ENTRYPOINT="tests/hostloss/zombie_flow.py:sleeper",
            )
            proc = await asyncio.to_thread(warm_python.start, ["-c", _LOST_HOST], env=env, cwd=ROOT)
            beats = await _until(
                "the first heartbeat",
                120,
                lambda: _events(client, "prefect.flow-run.heartbeat", run.id),
            )
            assert beats
            os.killpg(proc.pid, signal.SIGKILL)  # worker and flow-run process at once
            killed = time.monotonic()
            done = await proc.communicate(30)
            assert done.returncode == -signal.SIGKILL
            assert "STARTED" in done.stdout.splitlines()  # the flow ran, then died

            async def crashed() -> Any:
                state = (await client.read_flow_run(run.id)).state
                return state if state is not None and state.is_crashed() else None

            state = await _until("the zombie automation to crash the run", 180, crashed)
            detected_s = time.monotonic() - killed
            assert "zombie automation" in (state.message or "")
            # The event the recover-turn triggers (prefect.yaml) fire on.
            assert await _until(
                "the Crashed event",
                30,
                lambda: _events(client, "prefect.flow-run.Crashed", run.id),
            )
            print(f"\nzombie detection: kill -> Crashed in {detected_s:.1f}s (within={WITHIN_S}s)")
            (tmp_path / "detected_s").write_text(f"{detected_s:.1f}")
    finally:
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.kill()
            await proc.communicate(30)
        assert applied.automation.id is not None
        async with get_client() as client:
            await client.delete_automation(applied.automation.id)
