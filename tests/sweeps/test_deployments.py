"""``prefect.yaml`` deploys both sweeps on their schedules (with ``prefect deploy``, as
the README's set-up does), one run at a time, with parameters the flows accept."""

from __future__ import annotations

import asyncio

import yaml
from flow_helpers import ROOT
from prefect.cli.deploy._models import PrefectYamlModel
from prefect.flows import load_flow_from_entrypoint
from warm_python import WarmPython

SWEEPS = {"sweep-orphans": "*/15 * * * *", "sweep-stuck-turns": "* * * * *"}


def _config() -> PrefectYamlModel:
    return PrefectYamlModel.model_validate(yaml.safe_load((ROOT / "prefect.yaml").read_text()))


def test_prefect_yaml_schedules_both_sweeps_with_valid_parameters() -> None:
    deployments = {d.name: d for d in _config().deployments}
    for name, cron in SWEEPS.items():
        d = deployments[name]
        assert [s.cron for s in d.schedules or []] == [cron]
        assert d.concurrency_limit is not None and d.concurrency_limit.limit == 1  # type: ignore[union-attr]
        assert d.entrypoint is not None
        # module entrypoints (prefect_coder.flows.deployments.<name>:<flow>)
        flow = load_flow_from_entrypoint(d.entrypoint)
        assert flow.name == name
        # every parameter the deployment sets is one the flow takes, and validates
        flow.validate_parameters(d.parameters)
        assert d.parameters["dry_run"] is False


#: What the ``prefect`` console script runs (its arguments follow ``-c CODE``).
_PREFECT_CLI = "import sys; from prefect.cli import app; sys.exit(app())"


async def test_prefect_deploy_creates_the_scheduled_sweep_deployments(
    prefect_env: object, warm_python: WarmPython
) -> None:
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    async with get_client() as client:
        try:
            await client.create_work_pool(WorkPoolCreate(name="coder-process", type="process"))
        except ObjectAlreadyExists:
            pass
    # `prefect --no-prompt deploy ...` in a process of its own, forked from the warm
    # one (it has imported Prefect already; the CLI itself is imported in the child).
    proc = await asyncio.to_thread(
        warm_python.run,
        [
            "-c",
            _PREFECT_CLI,
            "--no-prompt",
            "deploy",
            "--name",
            "sweep-orphans",
            "--name",
            "sweep-stuck-turns",
        ],
        cwd=ROOT,
        env=prefect_env.subprocess_env(),  # type: ignore[attr-defined]
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    async with get_client() as client:
        for name, cron in SWEEPS.items():
            dep = await client.read_deployment_by_name(f"{name}/{name}")
            assert [s.schedule.cron for s in dep.schedules] == [cron]  # type: ignore[union-attr]
            assert all(s.active for s in dep.schedules)
            assert dep.work_pool_name == "coder-process"
            assert dep.parameters["dry_run"] is False
            limit = dep.global_concurrency_limit
            assert limit is not None and limit.limit == 1
            assert dep.concurrency_options is not None
            assert dep.concurrency_options.collision_strategy == "CANCEL_NEW"
