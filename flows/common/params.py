"""Flow and deployment parameters, and their validation at the edge.

The models are plain pydantic so Prefect renders them as typed forms in the UI
and stores them as JSON parameters. Semantic checks (registry look-ups, empty
step lists, duplicate names) live in :func:`validate_steps` so that every
failure becomes a :class:`~prefect_coder.flows.common.errors.WorkflowParameterError` naming the field
and the fix — raised before any chat exists.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    GetJsonSchemaHandler,
    Tag,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

from prefect_coder.blocks.bounds import DAY, HOUR
from prefect_coder.flows.common import registry
from prefect_coder.flows.common.errors import WorkflowParameterError

__all__ = [
    "DEFAULT_TOOL_MODULES",
    "AgentStep",
    "AnyStep",
    "ApprovalStep",
    "KindChoice",
    "ModelStep",
    "OutputModelName",
    "RegisteredNames",
    "Step",
    "ToolName",
    "WorkflowSettings",
    "agent_steps",
    "step_marker",
    "validate_base_url",
    "validate_steps",
    "validate_toolset",
    "validate_workflow_id",
]


# The marker "[<workflow_id>/<step>]" is matched verbatim in chat history by
# crash recovery, so neither part may contain "/" or "]" or whitespace.
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@-]{0,127}$")
_STEP_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


_PROMPT_HELP = (
    "The user prompt sent for this step. Against the demo's emulated Coder the "
    "model only answers 'Echo: ' and the prompt unless the prompt ends with a '#emu' "
    "script (docs/emulator.md). A tool call (the step offers 'record_note'): "
    '`Note it. #emu [{"tool_calls": [{"name": "record_note", "args": {"title": '
    '"t", "body": "b"}}]}, {"text": "noted"}]`. A structured answer (output_model '
    '\'fix_plan\'): `Plan it. #emu {"structured_output": {"summary": "pin the '
    'dependency", "files": ["pyproject.toml"], "risk": "low"}}`. '
    'A slow turn (watch its live artifact): `Wait. #emu {"sleep": 20, "text": '
    '"done"}`. Real Coder models know nothing of #emu: leave it out there.'
)
_NAME_HELP = (
    "Step name, unique within the workflow (letters, digits, '_', '.', '-'). "
    "With the workflow id it keys the step's stored result."
)

#: Tool modules a run imports unless its settings say otherwise (the demo's tools);
#: the deployment form's tool and output-model choices load them too.
DEFAULT_TOOL_MODULES = ("prefect_coder.flows.demo_tools",)

#: Which kind of step owns each kind-specific field (saved parameters of earlier
#: releases carry every kind's fields on one flat step: see ``_flat_fields``).
_OWNER = {
    "tools": "agent",
    "output_model": "agent",
    "api": "model",
    "model": "model",
    "system": "model",
    "timeout_s": "approval",
}

log = logging.getLogger(__name__)


_form_tools_loaded = False


def _load_form_tools() -> None:
    """Import the tool modules a deployment form offers names from — the default
    ones, ``PREFECT_CODER_TOOL_MODULES`` and the ``prefect_coder.tools`` entry points
    of this process (``prefect deploy`` builds the form here) — once per process.

    Not in a flow-run process (``PREFECT__FLOW_RUN_ID`` set): Prefect builds every
    flow's form when its module is imported, but nothing reads it there, and the
    run imports its tools itself (:func:`registry.load_tool_modules`). Never raises:
    a module that fails to import is reported by the run that needs it, with the fix."""
    global _form_tools_loaded
    if _form_tools_loaded or os.environ.get("PREFECT__FLOW_RUN_ID"):
        return
    _form_tools_loaded = True
    failed = registry.load_form_tool_modules(DEFAULT_TOOL_MODULES)
    if failed:  # a form without those names beats no form
        log.warning(
            "the step form offers no tools of %s: cannot be imported here (install the "
            "package where you deploy, or fix PREFECT_CODER_TOOL_MODULES)",
            ", ".join(failed),
        )


@dataclasses.dataclass(frozen=True)
class RegisteredNames:
    """JSON-schema hook of a name field: the names registered when the schema is
    built (``prefect deploy``: the deployment's parameter schema) become its
    ``enum``, so the Prefect form offers them as choices, and the server refuses
    another name when a run is created from the deployment. In Python the field
    stays a plain string: a name reaching a run unregistered is refused at the
    run's edge (:func:`validate_steps`), with the registered names in the error."""

    names: Callable[[], set[str]]

    def __get_pydantic_json_schema__(
        self, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        schema = handler(core_schema)
        _load_form_tools()
        names = sorted(self.names())
        if names:  # an empty enum would refuse every value
            schema["enum"] = names
        return schema


#: A registered client tool's name (the form offers the registered ones).
ToolName = Annotated[str, RegisteredNames(registry.tool_names)]
#: A registered structured-output model's name (the form offers the registered ones).
OutputModelName = Annotated[str, RegisteredNames(registry.output_model_names)]


def _open_form(required_kind: bool, help_text: str) -> Callable[[dict[str, Any]], None]:
    """The JSON schema of one kind of step (``help_text`` is its form's help, not
    the class docstring): no ``additionalProperties: false`` —
    the server validates a run's parameters against it, and saved flat steps of
    earlier releases carry the other kinds' fields (empty); the Python model drops
    those and rejects filled ones. ``kind`` is required where it is not the default,
    so exactly one kind matches a step (``oneOf``)."""

    def edit(schema: dict[str, Any]) -> None:
        schema.pop("additionalProperties", None)
        schema["description"] = help_text
        # A one-choice select in the form rather than a free text box.
        kind = schema["properties"]["kind"]
        kind["enum"] = [kind["const"]]
        if required_kind:
            schema["required"] = ["kind", *[f for f in schema.get("required", []) if f != "kind"]]

    return edit


def _flat_fields(kind: str, own: set[str], data: Any) -> Any:
    """A saved flat step (every kind's fields, the other kinds' empty) as this
    kind's fields; another kind's field that carries a value is an error naming
    it and the kind it belongs to."""
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for key, owner in _OWNER.items():
        if key in own or key not in out:
            continue
        value = out.pop(key)
        if value is None or value == [] or value == "":
            continue
        if kind == "approval" and key in ("tools", "output_model"):
            raise ValueError(
                f"{key}: an approval step calls no model, so it takes no tools or "
                "output_model; move them to the step after the approval"
            )
        if kind == "model" and key == "tools":
            raise ValueError(
                "tools: a model step has no chat, so it cannot offer client tools; "
                "make it an agent step, or drop the tools"
            )
        raise ValueError(
            f"{key}: a field of {owner} steps, not of {kind} steps; set kind to "
            f"{owner!r}, or drop {key}"
        )
    return out


class Step(BaseModel):
    """An agent step: exactly one turn of the workflow's Coder chat.

    ``Step(name=..., prompt=...)``; :class:`ModelStep` and :class:`ApprovalStep`
    are the other kinds of step (:data:`AnyStep`)."""

    model_config = ConfigDict(
        extra="forbid",
        title="Agent step",
        json_schema_extra=_open_form(False, "A turn of the workflow's Coder chat."),
    )

    name: str = Field(description=_NAME_HELP)
    prompt: str = Field(description=_PROMPT_HELP)
    kind: Literal["agent"] = Field(
        default="agent",
        description="'agent': a turn of the workflow's Coder chat.",
    )
    tools: list[ToolName] = Field(
        default_factory=list,
        description=(
            "Registered client tools this step offers the model (the choices are the "
            "tools registered when the deployment was made: docs/deploy.md)."
        ),
    )
    output_model: OutputModelName | None = Field(
        default=None,
        description=(
            "A registered structured-output model; the step's answer is then the "
            "model's validated JSON (TurnResult.structured)."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _from_flat(cls, data: Any) -> Any:
        other = data.get("kind") if isinstance(data, dict) else None
        if other in ("model", "approval"):
            # Only a direct Step(kind=...) gets here (a list of steps picks the
            # class by kind): the caller of an earlier release's flat Step.
            kind_class = "ModelStep" if other == "model" else "ApprovalStep"
            raise ValueError(
                f"kind: an agent step goes here, not a {other!r} step (agent-turn runs "
                "agent steps only; model and approval steps run in agent-workflow, and "
                f"in Python a {other!r} step is a {kind_class}(name=..., prompt=..., ...))"
            )
        return _flat_fields("agent", set(cls.model_fields), data)


#: The same class under the name of its kind.
AgentStep = Step


class ModelStep(BaseModel):
    """A model step: one AI Gateway call, no chat (docs/model-steps.md)."""

    model_config = ConfigDict(
        extra="forbid",
        title="Model step",
        json_schema_extra=_open_form(True, "One AI Gateway call, no chat (docs/model-steps.md)."),
    )

    name: str = Field(description=_NAME_HELP)
    prompt: str = Field(
        description=(
            "The prompt sent to the model; '{previous}' is replaced by the previous step's answer."
        )
    )
    kind: Literal["model"] = Field(
        default="model",
        description="'model': one AI Gateway call, no chat (docs/model-steps.md).",
    )
    model: str = Field(
        description="The model name the AI Gateway routes (e.g. 'gpt-4o-mini').",
    )
    # Nullable: steps saved by earlier releases carry "api": null (the default),
    # and the server checks a new run's parameters against this schema.
    api: Literal["openai", "anthropic"] | None = Field(
        default="openai", description="The AI Gateway surface (empty: 'openai')."
    )
    system: str | None = Field(default=None, description="An optional system prompt.")
    output_model: OutputModelName | None = Field(
        default=None,
        description=(
            "A registered structured-output model; the answer is then the model's "
            "validated JSON (one re-ask on invalid output)."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _from_flat(cls, data: Any) -> Any:
        return _flat_fields("model", set(cls.model_fields), data)


class ApprovalStep(BaseModel):
    """An approval step: the run suspends until a person approves, rejects or
    edits the next prompt (docs/approvals.md)."""

    model_config = ConfigDict(
        extra="forbid",
        title="Approval step",
        json_schema_extra=_open_form(
            True,
            "The run suspends until a person approves, rejects or edits the next "
            "prompt (docs/approvals.md).",
        ),
    )

    name: str = Field(description=_NAME_HELP)
    prompt: str = Field(description="What the person is asked (shown on the approval form).")
    kind: Literal["approval"] = Field(
        default="approval",
        description="'approval': suspend until a person decides (docs/approvals.md).",
    )
    timeout_s: float | None = Field(
        default=None,
        gt=0,
        le=30 * DAY,
        description="Seconds to wait for a decision (empty: 24 hours).",
    )

    @model_validator(mode="before")
    @classmethod
    def _from_flat(cls, data: Any) -> Any:
        return _flat_fields("approval", set(cls.model_fields), data)


@dataclasses.dataclass(frozen=True)
class KindChoice:
    """JSON-schema hook of a step union: the kinds as ``anyOf`` (the Prefect UI
    renders it as one tab per kind, each with only that kind's fields; the V1 UI
    reads no ``oneOf`` at all), with the OpenAPI ``discriminator`` naming ``kind``.
    Exactly one kind matches a step: every kind's ``kind`` is a different constant.
    ``kinds``: the union's kinds, in its order."""

    kinds: tuple[str, ...]

    def __get_pydantic_json_schema__(
        self, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        schema = handler(core_schema)
        choices = schema.pop("oneOf", None)
        if choices is None:
            return schema
        schema["anyOf"] = choices
        schema["discriminator"] = {
            "propertyName": "kind",
            "mapping": {kind: ref["$ref"] for kind, ref in zip(self.kinds, choices, strict=True)},
        }
        return schema


def _kind_of(value: Any) -> str | None:
    # A step without "kind" is an agent step (the default of every release).
    kind = value.get("kind", "agent") if isinstance(value, dict) else getattr(value, "kind", None)
    return kind if isinstance(kind, str) else None


#: Any step of a workflow, by its ``kind`` (the Prefect form shows one kind's
#: fields at a time). A step without ``kind`` is an agent step.
AnyStep = Annotated[
    Annotated[Step, Tag("agent")]
    | Annotated[ModelStep, Tag("model")]
    | Annotated[ApprovalStep, Tag("approval")],
    Discriminator(
        _kind_of,
        custom_error_type="step_kind",
        custom_error_message="kind must be 'agent', 'model' or 'approval'",
    ),
    KindChoice(("agent", "model", "approval")),
]


def agent_steps(steps: Sequence[AnyStep]) -> list[Step]:
    """The agent steps of ``steps``, in order."""
    return [s for s in steps if isinstance(s, Step)]


class WorkflowSettings(BaseModel):
    """How a workflow reaches Coder and its state store, and its time bounds."""

    model_config = ConfigDict(extra="forbid")

    credentials_block: str | None = Field(
        default=None,
        description=(
            "Name of a saved CoderCredentials block. Empty: read CODER_URL, "
            "CODER_SESSION_TOKEN and CODER_ORG_ID from the worker's environment."
        ),
    )
    store_block: str | None = Field(
        default=None,
        description=(
            "Leave empty: the store named by the credentials block (store_block) is "
            "used by every deployment. Set, it must be that same store. Empty in both: "
            "the default SQLite store under PREFECT_HOME (one machine only)."
        ),
    )
    keep_chat: bool = Field(
        default=False,
        description="Keep the chat live at the end (skip the final archive).",
    )
    request_timeout_s: float | None = Field(
        default=None,
        gt=0,
        le=DAY,
        description="Per-segment bound (REST + stream + redials). Empty: the credentials'.",
    )
    turn_timeout_s: float | None = Field(
        default=None,
        gt=0,
        le=DAY,
        description="Total wall-clock bound of one turn. Empty: the credentials'.",
    )
    lease_wait_s: float = Field(
        default=120.0,
        ge=0,
        le=DAY,
        description="How long a run waits for another run of the same workflow.",
    )
    lease_ttl_s: float = Field(
        default=60.0,
        gt=0,
        le=HOUR,
        description="Lease time-to-live; a crashed holder blocks others at most this long.",
    )
    retries: int = Field(
        default=2,
        ge=0,
        le=100,
        description=(
            "Task retries of a turn, for transient failures only (segment timeout, 5xx, "
            "429, a reset connection, an httpx timeout); each retry recovers before it sends."
        ),
    )
    retry_delay_s: float = Field(
        default=5.0, ge=0, le=HOUR, description="Delay before a turn retry."
    )
    settle_wait_s: float = Field(
        default=15.0,
        gt=0,
        le=HOUR,
        description="Bound of the interrupt-and-settle wait before any resubmission.",
    )
    redial_backoff_ms: int = Field(
        default=1000,
        ge=1,
        le=60_000,
        description="First stream redial backoff (doubles per failure; 5 failures end a turn).",
    )
    eager_checkpoint: bool = Field(
        default=True,
        description=(
            "Checkpoint a first turn's chat as soon as its stream dials (shrinks the "
            "crash window the orphan sweep covers; a retry then resumes that chat)."
        ),
    )
    artifacts: bool = Field(
        default=True,
        description=(
            "Publish a markdown artifact per turn, and a live one updated while the "
            "turn runs (streamed text, tool calls, retries, chat status; at most one "
            "update per PREFECT_CODER_PROGRESS_INTERVAL_S, default 2 s)."
        ),
    )
    tool_modules: list[str] = Field(
        default_factory=lambda: list(DEFAULT_TOOL_MODULES),
        description=(
            "Python modules imported first; they register tools and output models. Merged "
            "with the worker's shared tool modules: PREFECT_CODER_TOOL_MODULES and the "
            "'prefect_coder.tools' entry points of installed packages."
        ),
    )


def step_marker(workflow_id: str, step_name: str) -> str:
    """The step-scoped marker embedded in every prompt (stable across retries)."""
    return f"[{workflow_id}/{step_name}]"


def leading_marker(prompt: str, workflow_id: str | None = None) -> str | None:
    """The step marker a prompt starts with (:func:`step_marker`'s shape; of
    ``workflow_id``'s steps when given), else None."""
    text = prompt.lstrip()
    end = text.find("]")
    marker = text[: end + 1]
    prefix = "[" if workflow_id is None else f"[{workflow_id}/"
    return marker if end > 0 and text.startswith(prefix) and "/" in marker else None


def validate_workflow_id(workflow_id: str) -> None:
    """Reject ids that cannot be embedded in a marker or a result key."""
    if not isinstance(workflow_id, str) or not _ID_RE.match(workflow_id):
        raise WorkflowParameterError(
            "workflow_id",
            f"{workflow_id!r} is not a valid workflow id",
            "use 1-128 characters from letters, digits and '_.:@-', starting with a "
            "letter or digit (e.g. 'wf-1042')",
        )


def validate_base_url(base_url: str, field: str) -> None:
    """Reject a Coder URL that is not an absolute http(s) URL without credentials."""
    parts = urlsplit(base_url or "")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise WorkflowParameterError(
            field,
            f"{base_url!r} is not an http(s) URL",
            "set the Coder deployment URL, e.g. 'https://coder.example.com'",
        )
    if parts.username or parts.password or parts.query:
        raise WorkflowParameterError(
            field,
            "the URL carries credentials or a query string",
            "put the session token in the credentials block's token field, not in the URL",
        )


def validate_steps(
    steps: Sequence[AnyStep],
    *,
    tool_names: set[str],
    output_model_names: set[str],
) -> None:
    """Check the step list against the registry; raises on the first problem."""
    if not steps:
        raise WorkflowParameterError(
            "steps",
            "the workflow has no steps",
            "pass at least one step, e.g. [{'name': 'plan', 'prompt': '...'}]",
        )
    seen: set[str] = set()
    for i, step in enumerate(steps):
        where = f"steps[{i}]"
        if not _STEP_RE.match(step.name):
            raise WorkflowParameterError(
                f"{where}.name",
                f"{step.name!r} is not a valid step name",
                "use 1-64 characters from letters, digits and '_.-'",
            )
        if step.name in seen:
            raise WorkflowParameterError(
                f"{where}.name",
                f"step name {step.name!r} is used twice",
                "give every step a unique name (it keys the step's stored result)",
            )
        seen.add(step.name)
        if not step.prompt.strip():
            raise WorkflowParameterError(f"{where}.prompt", "the prompt is empty", "write one")
        if isinstance(step, ModelStep) and not step.model.strip():
            raise WorkflowParameterError(
                f"{where}.model",
                "a model step needs the model name",
                "set e.g. 'gpt-4o-mini' (the name the AI Gateway routes)",
            )
        if isinstance(step, ApprovalStep):
            continue
        for j, tool in enumerate(step.tools if isinstance(step, Step) else []):
            if tool not in tool_names:
                raise WorkflowParameterError(
                    f"{where}.tools[{j}]",
                    f"no client tool named {tool!r} is registered "
                    f"(registered: {', '.join(sorted(tool_names)) or 'none'})",
                    "register it with @prefect_coder.tools.registered_tool in a tool "
                    "module (settings.tool_modules, PREFECT_CODER_TOOL_MODULES or a "
                    "'prefect_coder.tools' entry point), or fix the name; a deployment's "
                    "form offers the tools registered when it was deployed (docs/deploy.md)",
                )
        if step.output_model is not None and step.output_model not in output_model_names:
            raise WorkflowParameterError(
                f"{where}.output_model",
                f"no output model named {step.output_model!r} is registered "
                f"(registered: {', '.join(sorted(output_model_names)) or 'none'})",
                "register it with @prefect_coder.tools.output_model in a tool module "
                "(settings.tool_modules, PREFECT_CODER_TOOL_MODULES or a 'prefect_coder.tools' "
                "entry point), or fix the name",
            )


def validate_toolset(
    toolset: object,
    *,
    tool_names: set[str],
    output_model_names: set[str],
    field: str = "workflow_tools",
) -> None:
    """Check a workflow tool set (``prefect_coder.flows.common.toolset.Toolset``) against the registry."""
    for j, tool in enumerate(getattr(toolset, "tools", [])):
        if tool not in tool_names:
            raise WorkflowParameterError(
                f"{field}.tools[{j}]",
                f"no client tool named {tool!r} is registered",
                "register it in a tool module (settings.tool_modules, PREFECT_CODER_TOOL_MODULES "
                "or a 'prefect_coder.tools' entry point), or fix the name",
            )
    for j, model in enumerate(getattr(toolset, "output_models", [])):
        if model not in output_model_names:
            raise WorkflowParameterError(
                f"{field}.output_models[{j}]",
                f"no output model named {model!r} is registered",
                "register it in a tool module (settings.tool_modules, PREFECT_CODER_TOOL_MODULES "
                "or a 'prefect_coder.tools' entry point), or fix the name",
            )
