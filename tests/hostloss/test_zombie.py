"""A lost host is recovered: a flow-run process with heartbeats on is SIGKILLed together
with its parent (the worker), and the zombie automation (``apply_zombie_automation``,
what ``prefect-coder automations apply`` creates) marks its run Crashed, which emits the
``prefect.flow-run.Crashed`` event the ``recover-turn`` triggers listen for.

Real parts only: the session's Prefect test server (its trigger services run in it), a
real ``python -m prefect.engine`` process under a real parent, a real kill -9. Prefect's
bounds make this the slowest test of its folder: heartbeats every 30 s at least, and a
proactive ``within`` of 10 s at least; the run is killed right after its first heartbeat.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from prefect.client.orchestration import PrefectClient, get_client
from prefect.flows import Flow
from zombie_flow import FLOW_NAME, sleeper

from prefect_coder.flows.deployments.zombies import apply_zombie_automation

ROOT = Path(__file__).resolve().parents[2]
WITHIN_S = 10.0  # Prefect's minimum for a proactive trigger


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
    prefect_harness: Any, tmp_path: Path
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
    proc: asyncio.subprocess.Process | None = None
    try:
        async with get_client() as client:
            run = await client.create_flow_run(sleeper)
            env = dict(
                os.environ,
                PYTHONPATH=str(ROOT),
                PREFECT_API_URL=str(prefect_harness.api_url),
                PREFECT__FLOW_RUN_ID=str(run.id),
                PREFECT__FLOW_ENTRYPOINT="tests/hostloss/zombie_flow.py:sleeper",
                PREFECT_FLOWS_HEARTBEAT_FREQUENCY="30",
                PREFECT_LOGGING_LEVEL="WARNING",
            )
            # The parent shell stands for the worker: both die together, as on a lost host.
            proc = await asyncio.create_subprocess_exec(
                "sh", "-c", f"{sys.executable} -m prefect.engine & wait",
                cwd=ROOT, env=env, start_new_session=True,
                stdout=asyncio.subprocess.PIPE,
            )  # fmt: skip
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 120)
            assert line.strip() == b"STARTED"
            beats = await _until(
                "the first heartbeat",
                60,
                lambda: _events(client, "prefect.flow-run.heartbeat", run.id),
            )
            assert beats
            os.killpg(proc.pid, signal.SIGKILL)  # worker and flow-run process at once
            killed = time.monotonic()
            await proc.wait()

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
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        assert applied.automation.id is not None
        async with get_client() as client:
            await client.delete_automation(applied.automation.id)
