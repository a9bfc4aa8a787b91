"""The step form a deployment's run form is drawn from: one choice of kind (agent,
model, approval), each with only its own fields; the registered tool and output-model
names as choices; steps saved by earlier releases (flat, every kind's fields) still
valid on the server and in the flow; a bad kind, field or tool refused with a
message naming it.

The schema is built as ``prefect deploy`` builds it (``parameter_schema`` on the
flow), and checked as the server checks a new run's parameters against it
(``prefect.utilities.schema_tools.validation.validate``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from prefect.exceptions import ParameterTypeError
from prefect.utilities.callables import parameter_schema
from prefect.utilities.schema_tools.validation import ValidationError
from prefect.utilities.schema_tools.validation import validate as server_validate
from pydantic import BaseModel
from pydantic import ValidationError as PydanticError

from coder_chat.tools import client_tool
from prefect_coder import ApprovalStep, ModelStep, Step
from prefect_coder.errors import WorkflowParameterError
from prefect_coder.flows.common import registry
from prefect_coder.flows.common.params import validate_steps
from prefect_coder.flows.deployments.agent_fanout import agent_fanout
from prefect_coder.flows.deployments.agent_turn import agent_turn
from prefect_coder.flows.deployments.agent_workflow import agent_workflow
from prefect_coder.flows.deployments.fanout_shard import agent_fanout_shard
from prefect_coder.flows.deployments.recover_turn import recover_turn

#: Each kind's fields, and nothing else, in its form.
FIELDS = {
    "agent": {"name", "prompt", "kind", "tools", "output_model"},
    "model": {"name", "prompt", "kind", "model", "api", "system", "output_model"},
    "approval": {"name", "prompt", "kind", "timeout_s"},
}

#: Steps as earlier releases saved them (one flat model: every kind's fields).
FLAT = [
    {"name": "a", "prompt": "p", "tools": ["lookup_build"], "output_model": None,
     "kind": "agent", "api": None, "model": None, "system": None, "timeout_s": None},
    {"name": "m", "prompt": "p {previous}", "tools": [], "output_model": "fix_plan",
     "kind": "model", "api": None, "model": "gpt-x", "system": "be brief", "timeout_s": None},
    {"name": "r", "prompt": "Ship it?", "tools": [], "output_model": None,
     "kind": "approval", "api": None, "model": None, "system": None, "timeout_s": 600},
    {"name": "b", "prompt": "no kind: an agent step"},
]  # fmt: skip


class ProbeArgs(BaseModel):
    """Arguments of the probe tool (module level: the tool's schema resolves them)."""

    x: int


def _schema(flow: Any) -> dict[str, Any]:
    return parameter_schema(flow).model_dump_for_openapi()


def _kinds(schema: dict[str, Any], union: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The kinds of a step union, each its schema (after ``$ref``)."""
    assert "oneOf" not in union  # the V1 UI reads anyOf only
    assert union["discriminator"]["propertyName"] == "kind"
    kinds = {}
    for choice in union["anyOf"]:
        definition = schema["definitions"][choice["$ref"].rsplit("/", 1)[-1]]
        kind = definition["properties"]["kind"]
        assert kind["enum"] == [kind["const"]]  # a one-choice select, not free text
        kinds[kind["const"]] = definition
    assert set(union["discriminator"]["mapping"]) == set(kinds)
    return kinds


def _step_unions(flow: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    schema = _schema(flow)
    defs, props = schema["definitions"], schema["properties"]
    if flow in (agent_fanout, agent_fanout_shard):
        return schema, defs["FanoutItem"]["properties"]["steps"]["items"]
    steps = props["steps"]
    if "anyOf" in steps:  # recover-turn: list | None
        (steps,) = [s for s in steps["anyOf"] if s.get("type") == "array"]
    return schema, steps["items"]


@pytest.mark.parametrize(
    "flow", [agent_workflow, recover_turn, agent_fanout, agent_fanout_shard], ids=lambda f: f.name
)
def test_each_kind_shows_only_its_own_fields(flow: Any) -> None:
    schema, union = _step_unions(flow)
    kinds = _kinds(schema, union)
    assert {k: set(d["properties"]) for k, d in kinds.items()} == FIELDS
    assert "kind" in kinds["model"]["required"] and "kind" in kinds["approval"]["required"]
    assert "kind" not in kinds["agent"].get("required", [])  # no kind: an agent step
    assert "model" in kinds["model"]["required"]
    assert {k: d["title"] for k, d in kinds.items()} == {
        "agent": "Agent step",
        "model": "Model step",
        "approval": "Approval step",
    }


def test_agent_turn_takes_agent_steps_only() -> None:
    schema = _schema(agent_turn)
    ref = schema["properties"]["step"]["$ref"].rsplit("/", 1)[-1]
    assert set(schema["definitions"][ref]["properties"]) == FIELDS["agent"]
    with pytest.raises(ParameterTypeError, match="agent-turn runs agent steps only"):
        agent_turn.validate_parameters(
            {"workflow_id": "wf", "step": {"name": "r", "prompt": "ok?", "kind": "approval"}}
        )


def test_tools_and_output_models_are_the_registered_names() -> None:
    schema = _schema(agent_workflow)
    agent = _kinds(schema, schema["properties"]["steps"]["items"])["agent"]
    tools = agent["properties"]["tools"]["items"]["enum"]
    assert tools == sorted(registry.tool_names())
    assert {"lookup_build", "record_note"} <= set(tools)  # the demo's, loaded for the form
    (named,) = [c for c in agent["properties"]["output_model"]["anyOf"] if "enum" in c]
    assert "fix_plan" in named["enum"] and named["enum"] == sorted(registry.output_model_names())


def test_a_tool_registered_before_the_schema_is_built_is_offered() -> None:
    # What `prefect deploy` does: import the flow (and the tool modules), then build.
    name = f"form_probe_{uuid.uuid4().hex[:8]}"

    async def probe(args: ProbeArgs, ctx: Any) -> int:
        return args.x

    assert name not in str(_schema(agent_workflow))
    registry.register_tool(client_tool(name=name, description="probe")(probe))
    schema = _schema(agent_workflow)
    agent = _kinds(schema, schema["properties"]["steps"]["items"])["agent"]
    assert name in agent["properties"]["tools"]["items"]["enum"]


@pytest.mark.parametrize("flow", [agent_workflow, recover_turn], ids=lambda f: f.name)
def test_flat_steps_of_earlier_releases_still_validate(flow: Any) -> None:
    params = {"workflow_id": "wf-old", "steps": FLAT}
    server_validate(params, _schema(flow), raise_on_error=True)  # a new run from them
    steps = flow.validate_parameters(params)["steps"]  # the flow run's own check
    a, m, r, b = steps
    assert isinstance(a, Step) and a.tools == ["lookup_build"]
    assert isinstance(m, ModelStep) and (m.model, m.system) == ("gpt-x", "be brief")
    assert m.output_model == "fix_plan"
    assert isinstance(r, ApprovalStep) and r.timeout_s == 600
    assert isinstance(b, Step) and b.kind == "agent"
    # and as the fan-out takes them (no approval steps there: refused at its edge)
    fan = {"workflows": [{"workflow_id": "w", "steps": [FLAT[0], FLAT[1], FLAT[3]]}]}
    server_validate(fan, _schema(agent_fanout), raise_on_error=True)
    assert len(agent_fanout.validate_parameters(fan)["workflows"][0].steps) == 3


def test_a_bad_kind_is_refused_by_name() -> None:
    params = {
        "workflow_id": "wf",
        "steps": [FLAT[0], {"name": "x", "prompt": "p", "kind": "robot"}],
    }
    with pytest.raises(ParameterTypeError) as caught:
        agent_workflow.validate_parameters(params)
    assert "steps.1" in str(caught.value)
    assert "kind must be 'agent', 'model' or 'approval'" in str(caught.value)
    with pytest.raises(ValidationError):
        server_validate(params, _schema(agent_workflow), raise_on_error=True)


@pytest.mark.parametrize(
    ("step", "words"),
    [
        ({"kind": "approval", "tools": ["lookup_build"]}, "an approval step calls no model"),
        ({"kind": "model", "model": "m", "tools": ["lookup_build"]}, "a model step has no chat"),
        ({"kind": "agent", "model": "gpt-x"}, "model: a field of model steps"),
        ({"timeout_s": 60}, "timeout_s: a field of approval steps"),
        ({"kind": "model"}, "steps.0.model.model: Field required"),
    ],
)
def test_a_field_of_another_kind_is_refused_with_its_kind(step: dict[str, Any], words: str) -> None:
    params = {"workflow_id": "wf", "steps": [{"name": "s", "prompt": "p", **step}]}
    with pytest.raises(ParameterTypeError) as caught:
        agent_workflow.validate_parameters(params)
    assert words in str(caught.value) and "steps.0" in str(caught.value)


def test_an_unregistered_tool_is_refused_with_the_registered_names() -> None:
    bad = {"name": "s", "prompt": "p", "tools": ["no_such_tool"]}
    # when the run is created: the schema's choices
    with pytest.raises(ValidationError, match="'no_such_tool' is not one of") as caught:
        server_validate({"workflow_id": "wf", "steps": [bad]}, _schema(agent_workflow), True)
    assert "steps" in str(caught.value) and "lookup_build" in str(caught.value)
    # and in the flow run, before any chat exists
    (step,) = agent_workflow.validate_parameters({"workflow_id": "wf", "steps": [bad]})["steps"]
    with pytest.raises(WorkflowParameterError) as refused:
        validate_steps(
            [step],
            tool_names=registry.tool_names(),
            output_model_names=registry.output_model_names(),
        )
    assert refused.value.field == "steps[0].tools[0]"
    assert "registered: " in str(refused.value) and "lookup_build" in str(refused.value)


def test_python_callers_build_each_kind_by_its_class() -> None:
    assert Step(name="a", prompt="p").kind == "agent"
    assert ModelStep(name="m", prompt="p", model="gpt-x").api == "openai"
    assert ApprovalStep(name="r", prompt="ok?", timeout_s=60).kind == "approval"
    with pytest.raises(PydanticError, match=r"ApprovalStep\(name="):
        Step(name="r", prompt="ok?", kind="approval")  # type: ignore[arg-type]
    with pytest.raises(PydanticError, match=r"ModelStep\(name="):
        Step(name="m", prompt="p", kind="model")  # type: ignore[arg-type]


USER_TOOLS = """
from pydantic import BaseModel
from prefect_coder.tools import output_model, registered_tool


class Ticket(BaseModel):
    title: str


@registered_tool(name="open_ticket", description="Open a ticket.")
async def open_ticket(args: Ticket, ctx) -> str:
    return args.title


@output_model("triage")
class Triage(BaseModel):
    severity: int
"""

DEPLOY = """
import json
from prefect.utilities.callables import parameter_schema
from prefect_coder.flows.deployments.agent_workflow import agent_workflow

schema = parameter_schema(agent_workflow).model_dump_for_openapi()
agent = schema["definitions"]["Step"]["properties"]
named = [c for c in agent["output_model"]["anyOf"] if "enum" in c]
print("FORM " + json.dumps({"tools": agent["tools"]["items"].get("enum"),
                            "models": named[0]["enum"] if named else None}))
"""


def test_prefect_deploy_offers_the_tools_of_prefect_coder_tool_modules(tmp_path: Path) -> None:
    # docs/deploy.md: a user's module named where `prefect deploy` runs is in the form.
    # A fresh interpreter, as `prefect deploy` is: the form is built at its import.
    (tmp_path / "user_form_tools.py").write_text(USER_TOOLS)
    env = {k: v for k, v in os.environ.items() if k != "PREFECT__FLOW_RUN_ID"}
    env["PREFECT_CODER_TOOL_MODULES"] = "user_form_tools"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp_path), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", DEPLOY], env=env, capture_output=True, text=True, timeout=120
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("FORM ")]
    assert proc.returncode == 0 and lines, proc.stderr[-2000:]
    form = json.loads(lines[-1][len("FORM ") :])
    assert form["tools"] == ["lookup_build", "open_ticket", "record_note"]
    assert form["models"] == ["fix_plan", "triage"]
