"""Serve ``agent-workflow`` and ``recover-turn`` (with the Crashed trigger taken from
``prefect.yaml``) from one Prefect runner process, for the trigger test."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from prefect import serve
from prefect.deployments.runner import RunnerDeployment
from prefect.events import DeploymentEventTrigger

from prefect_coder.flows.deployments.agent_turn import agent_turn
from prefect_coder.flows.deployments.agent_workflow import agent_workflow
from prefect_coder.flows.deployments.recover_turn import recover_turn

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    recover = next(d for d in spec["deployments"] if d["name"] == "recover-turn")
    triggers: list[Any] = [DeploymentEventTrigger(**t) for t in recover["triggers"]]
    deployments = [
        agent_workflow.to_deployment(name="agent-workflow"),
        agent_turn.to_deployment(name="agent-turn"),
        recover_turn.to_deployment(name="recover-turn", triggers=triggers),
    ]
    assert all(isinstance(d, RunnerDeployment) for d in deployments)
    serve(*deployments, print_starting_message=False)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
