"""Issue 29, fixes 2 and 3 (fix 1, an approval never crashed by the zombie automation,
is proven with a real suspended run in ``test_reconcile_deployed.py``):

* every flow a ``prefect.yaml`` deployment runs is one the zombie automation watches
  (``agent-fanout-shard`` was missing: a shard on a dead host stayed Running for ever);
* the ``agent-fanout`` Crashed trigger, on the real test server, starts the new run
  with ALL the crashed run's parameters (it dropped ``workflow_deployment``,
  ``shard_deployment`` and ``poll_interval_s``).
"""

from __future__ import annotations

import asyncio
import importlib
import time
import uuid
from pathlib import Path
from typing import Any

import yaml
from fanout_env import _triggers
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterDeploymentId
from prefect.client.schemas.objects import StateType
from prefect.states import Crashed

from prefect_coder.blocks import ChatStateStore, StateStore
from prefect_coder.flows.deployments.agent_fanout import agent_fanout
from prefect_coder.flows.deployments.reconcile_workflows import reconcile_workflows
from prefect_coder.flows.deployments.sweep_settings import SweepSettings
from prefect_coder.flows.deployments.zombies import PRODUCT_FLOWS, zombie_automation

ROOT = Path(__file__).resolve().parents[2]


def test_every_deployed_flow_is_watched_by_the_zombie_automation() -> None:
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    names = []
    for entry in spec["deployments"]:
        module, attr = entry["entrypoint"].split(":")
        names.append(getattr(importlib.import_module(module), attr).name)
    assert "agent-fanout-shard" in names and "reconcile-workflows" in names
    assert sorted(set(names) - set(PRODUCT_FLOWS)) == []


def test_a_suspended_or_paused_run_satisfies_the_zombie_trigger() -> None:
    trigger: Any = zombie_automation().trigger
    assert {"prefect.flow-run.Suspended", "prefect.flow-run.Paused"} <= set(trigger.expect)
    assert "prefect.flow-run.Crashed" in trigger.expect


async def test_the_fanout_crashed_trigger_passes_all_parameters(prefect_server: Path) -> None:
    # The trigger matches the deployment by name: named as prefect.yaml names it.
    dep = await agent_fanout.ato_deployment(name="agent-fanout", triggers=_triggers("agent-fanout"))
    dep_id = await dep.aapply()
    parameters = {
        "workflows": [{"workflow_id": "w-1", "steps": [{"name": "s", "prompt": "p"}]}],
        "settings": {"credentials_block": "c", "store_block": "s", "lease_ttl_s": 7},
        "max_parallel": 3,
        "fail_on_error": False,
        "workflow_deployment": "agent-workflow/elsewhere",
        "poll_interval_s": 0.5,
        "shard_size": 4,
        "shard_deployment": "agent-fanout-shard/elsewhere",
    }
    try:
        async with get_client() as client:
            run = await client.create_flow_run_from_deployment(dep_id, parameters=parameters)
            await client.set_flow_run_state(run.id, Crashed(message="test: host lost"), force=True)
            deadline = time.monotonic() + 60
            rerun = None
            while rerun is None and time.monotonic() < deadline:
                runs = await client.read_flow_runs(
                    flow_run_filter=FlowRunFilter(
                        deployment_id=FlowRunFilterDeploymentId(any_=[dep_id])
                    )
                )
                rerun = next((r for r in runs if r.id != run.id), None)
                await asyncio.sleep(0.5)
            assert rerun is not None, "the Crashed trigger started no new run"
            assert rerun.parameters == parameters
            assert rerun.state is not None and rerun.state.type == StateType.SCHEDULED
            await client.delete_flow_run(rerun.id)
            await client.delete_flow_run(run.id)
    finally:
        async with get_client() as client:
            await client.delete_resource_owned_automations(f"prefect.deployment.{dep_id}")
            await client.delete_deployment(dep_id)


def test_the_shipped_reconciler_parameters_validate() -> None:
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    [entry] = [d for d in spec["deployments"] if d["name"] == "reconcile-workflows"]
    params = reconcile_workflows.validate_parameters(entry["parameters"])
    assert params["run_for_s"] < entry["schedules"][0]["interval"]  # no overlap to cancel
    assert entry["concurrency_limit"]["limit"] == 1


async def test_a_looping_reconciler_ticks_until_its_time_is_up(
    prefect_server: Path, tmp_path: Path
) -> None:
    store = StateStore(f"sqlite+aiosqlite:///{tmp_path / 'state.db'}")
    block = f"loop-{uuid.uuid4().hex[:8]}"
    await ChatStateStore(url=store.url).save(block, overwrite=True)
    settings = SweepSettings(store_block=block)
    # A record of a run that does not exist: every tick reruns it (no deployment: the
    # act fails and says so), so the ticks are counted from the rows' reasons.
    await store.workflows.started(
        "workflow:gone",
        deployment=str(uuid.uuid4()),
        parameters={"workflow_id": "gone"},
        flow_run_id=str(uuid.uuid4()),
        workflow_id="gone",
    )
    started = time.monotonic()
    rows = await reconcile_workflows(settings, dry_run=True, run_for_s=1.5, tick_s=0.5)
    assert time.monotonic() - started >= 1.0  # it looped
    assert [(r.key, r.action) for r in rows] == [("workflow:gone", "recover")]
    record = await store.workflows.get("workflow:gone")
    assert record is not None and record.attempts == 0  # dry run: nothing done
    await store.aclose()
