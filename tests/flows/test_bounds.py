"""Every duration and count a user sets has a finite upper bound, shown by the Prefect
form (the JSON schema's ``maximum``), and a value past it — ``1e308``, ``inf``, ``nan``
— is refused at the edge naming the field, before any chat or store row exists
(issue 30: ``lease_ttl_s=inf`` once left a lease row expiring at ``inf`` for good)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from flow_helpers import say
from pydantic import BaseModel, ValidationError

from coder_chat.emulator import Emulator
from prefect_coder.blocks import ChatStateStore, CoderCredentials
from prefect_coder.flows.common.params import ApprovalStep, Step, WorkflowSettings
from prefect_coder.flows.deployments.agent_workflow import agent_workflow
from prefect_coder.flows.deployments.sweep_settings import SweepSettings
from prefect_coder.flows.sweeps.options import SweepOptions

MODELS: list[type[BaseModel]] = [
    ApprovalStep,
    WorkflowSettings,
    SweepSettings,
    SweepOptions,
    CoderCredentials,
    ChatStateStore,
]


def _numeric_fields(model: type[BaseModel]) -> dict[str, dict[str, Any]]:
    """The schema of each number/integer field (what the Prefect form renders)."""
    schema = model.model_json_schema()
    found = {}
    for name, prop in schema["properties"].items():
        options = prop.get("anyOf", [prop])
        for option in options:
            if option.get("type") in ("number", "integer"):
                found[name] = option
    return found


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_every_number_a_user_sets_has_a_finite_maximum_in_the_form(
    model: type[BaseModel],
) -> None:
    fields = _numeric_fields(model)
    assert fields, f"{model.__name__} has no numeric field: the scan sees nothing"
    unbounded = [n for n, s in fields.items() if not math.isfinite(s.get("maximum", math.inf))]
    assert not unbounded, f"{model.__name__}: no upper bound for {unbounded}"


def _minimal(model: type[BaseModel]) -> dict[str, Any]:
    if model is ApprovalStep:
        return {"name": "s", "prompt": "p"}
    if model is CoderCredentials:
        return {
            "base_url": "https://coder.example.com",
            "organization_id": "00000000-0000-0000-0000-000000000001",
            "token": "t",
        }
    return {}


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
@pytest.mark.parametrize("bad", [1e308, math.inf, math.nan])
def test_a_value_past_the_bound_is_refused_naming_the_field(
    model: type[BaseModel], bad: float
) -> None:
    for name, schema in _numeric_fields(model).items():
        value: float | int = bad
        if schema["type"] == "integer":
            if not math.isfinite(bad):
                continue  # not an integer at all: pydantic's own type error
            value = 10**12
        with pytest.raises(ValidationError) as info:
            model.model_validate({**_minimal(model), name: value})
        errors = info.value.errors()
        assert [e["loc"] for e in errors] == [(name,)], (model.__name__, name)
        # The message is the fix: the bound to stay within.
        assert errors[0]["msg"].startswith("Input should be less than or equal to"), errors
    # The defaults themselves are within the bounds.
    model.model_validate(_minimal(model))


async def test_a_workflow_with_an_infinite_lease_ttl_fails_before_any_chat(
    emu: Emulator, settings: WorkflowSettings, workflow_id: str
) -> None:
    chats = len(emu.chats())
    raw = {**settings.model_dump(), "lease_ttl_s": math.inf}
    with pytest.raises(Exception) as info:
        await agent_workflow(workflow_id, [Step(name="s", prompt="hi" + say("hi"))], raw)
    text = str(info.value)
    assert "lease_ttl_s" in text and "3600" in text, text
    assert len(emu.chats()) == chats
