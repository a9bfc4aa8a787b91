"""Flow and deployment parameters, and their validation at the edge.

The models are plain pydantic so Prefect renders them as typed forms in the UI
and stores them as JSON parameters. Semantic checks (registry look-ups, empty
step lists, duplicate names) live in :func:`validate_steps` so that every
failure becomes a :class:`~prefect_coder.flows.common.errors.WorkflowParameterError` naming the field
and the fix — raised before any chat exists.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field

from prefect_coder.blocks.bounds import DAY, HOUR
from prefect_coder.flows.common.errors import WorkflowParameterError

__all__ = [
    "Step",
    "WorkflowSettings",
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


class Step(BaseModel):
    """One step of a workflow: exactly one agent turn."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        description=(
            "Step name, unique within the workflow (letters, digits, '_', '.', '-'). "
            "With the workflow id it keys the step's stored result."
        )
    )
    prompt: str = Field(
        description=(
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
    )
    tools: list[str] = Field(
        default_factory=list,
        description="Names of registered client tools this step offers the model.",
    )
    output_model: str | None = Field(
        default=None,
        description=(
            "Name of a registered structured-output model; the step's answer is then "
            "the model's validated JSON (TurnResult.structured)."
        ),
    )
    kind: Literal["agent", "model", "approval"] = Field(
        default="agent",
        description=(
            "'agent': a turn of the workflow's chat. 'model': one AI Gateway call, no chat "
            "(docs/model-steps.md). 'approval': suspend until a person approves, rejects "
            "or edits the next prompt (docs/approvals.md); the prompt is shown to them."
        ),
    )
    api: Literal["openai", "anthropic"] | None = Field(
        default=None,
        description="Model steps: the AI Gateway surface (default 'openai').",
    )
    model: str | None = Field(
        default=None,
        description="Model steps: the model name the AI Gateway routes (e.g. 'gpt-4o-mini').",
    )
    system: str | None = Field(default=None, description="Model steps: an optional system prompt.")
    timeout_s: float | None = Field(
        default=None,
        gt=0,
        le=30 * DAY,
        description="Approval steps: seconds to wait for a decision (empty: 24 hours).",
    )


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
        default_factory=lambda: ["prefect_coder.flows.demo_tools"],
        description=(
            "Python modules imported first; they register tools and output models. Merged "
            "with the worker's shared tool modules: PREFECT_CODER_TOOL_MODULES and the "
            "'prefect_coder.tools' entry points of installed packages."
        ),
    )


def step_marker(workflow_id: str, step_name: str) -> str:
    """The step-scoped marker embedded in every prompt (stable across retries)."""
    return f"[{workflow_id}/{step_name}]"


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
    steps: Sequence[Step],
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
        if step.kind == "model" and not step.model:
            raise WorkflowParameterError(
                f"{where}.model",
                "a model step needs the model name",
                "set e.g. 'gpt-4o-mini' (the name the AI Gateway routes)",
            )
        if step.kind == "approval" and (step.tools or step.output_model):
            raise WorkflowParameterError(
                f"{where}.kind",
                "an approval step calls no model, so it takes no tools or output_model",
                "move them to the step after the approval",
            )
        if step.kind == "model" and step.tools:
            raise WorkflowParameterError(
                f"{where}.tools",
                "a model step has no chat, so it cannot offer client tools",
                "make it an agent step, or drop the tools",
            )
        for j, tool in enumerate(step.tools):
            if tool not in tool_names:
                raise WorkflowParameterError(
                    f"{where}.tools[{j}]",
                    f"no client tool named {tool!r} is registered "
                    f"(registered: {', '.join(sorted(tool_names)) or 'none'})",
                    "register it with @prefect_coder.tools.registered_tool in a tool "
                    "module (settings.tool_modules, PREFECT_CODER_TOOL_MODULES or a "
                    "'prefect_coder.tools' entry point), or fix the name",
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
