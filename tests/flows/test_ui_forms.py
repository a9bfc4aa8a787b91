"""What the Prefect UI's run forms and run lists show: sweep forms carry sweep
settings only (and still take the workflows' settings), the prompt says how to
script the demo model, and every flow names its runs (no random names)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from flow_helpers import ROOT
from prefect.utilities.callables import parameter_schema

from prefect_coder.flows.common.params import Step, WorkflowSettings
from prefect_coder.flows.deployments.agent_turn import agent_turn
from prefect_coder.flows.deployments.agent_workflow import agent_workflow
from prefect_coder.flows.deployments.expire_approvals import expire_approvals
from prefect_coder.flows.deployments.recover_turn import recover_turn
from prefect_coder.flows.deployments.sweep_orphans import sweep_orphans
from prefect_coder.flows.deployments.sweep_settings import SweepSettings
from prefect_coder.flows.deployments.sweep_stuck_turns import sweep_stuck_turns

SWEEPS = (sweep_orphans, sweep_stuck_turns)
TURN_ONLY = {"keep_chat", "retries", "retry_delay_s", "artifacts", "eager_checkpoint"}


def _form_settings(flow: Any) -> set[str]:
    schema = parameter_schema(flow).model_dump()
    return set(schema["definitions"]["SweepSettings"]["properties"])


def test_sweep_forms_show_only_sweep_settings() -> None:
    for flow in SWEEPS:
        fields = _form_settings(flow)
        assert not fields & TURN_ONLY, (flow.name, fields & TURN_ONLY)
        assert {"credentials_block", "store_block", "turn_timeout_s"} <= fields


def test_sweeps_still_take_the_workflows_settings() -> None:
    deployments = yaml.safe_load(Path(ROOT, "prefect.yaml").read_text())["deployments"]
    for flow in SWEEPS:
        (dep,) = [d for d in deployments if d["name"] == flow.name]
        params = flow.validate_parameters(dep["parameters"])
        assert isinstance(params["settings"], SweepSettings)
        # a Python caller's WorkflowSettings object keeps working
        given = WorkflowSettings(store_block="s", lease_wait_s=7, keep_chat=True)
        params = flow.validate_parameters({"settings": given})
        assert params["settings"].workflow_settings().lease_wait_s == 7
        assert params["settings"].store_block == "s"


def test_the_prompt_says_how_to_script_the_demo_model() -> None:
    text = Step.model_fields["prompt"].description or ""
    assert "Echo" in text and "#emu" in text
    for example in ('"tool_calls"', '"structured_output"', '"sleep"'):
        assert example in text, example


def _descriptions(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["description"]] if isinstance(node.get("description"), str) else []
        return found + [d for v in node.values() for d in _descriptions(v)]
    if isinstance(node, list):
        return [d for v in node for d in _descriptions(v)]
    return []


def test_no_form_help_text_holds_an_html_tag() -> None:
    # The Prefect UI renders a field's description as HTML: "<prompt>" vanished from
    # the help text as an unknown tag.
    import re

    flows = (agent_workflow, agent_turn, recover_turn, expire_approvals, *SWEEPS)
    texts = [t for flow in flows for t in _descriptions(parameter_schema(flow).model_dump())]
    assert any("#emu" in t for t in texts)  # the scan sees the step form
    tagged = [t for t in texts if re.search(r"<[A-Za-z_/][^>]*>", t)]
    assert not tagged, tagged


def test_every_run_is_named_from_its_parameters_not_at_random() -> None:
    names = {
        flow.name: flow.flow_run_name
        for flow in (agent_workflow, agent_turn, recover_turn, expire_approvals, *SWEEPS)
    }
    assert names["agent-workflow"] == "{workflow_id}"
    assert names["expire-approvals"] == "expire-approvals"
    assert names["sweep-orphans"] == "sweep-orphans"
    assert all(names.values()), names
