"""The client tools a workflow's chat knows, resolved from registry names.

chatd takes client tool definitions only at chat creation (``unsafe_dynamic_tools``
on ``POST /chats``); later messages carry no tool list. So the *workflow* owns
its tool set: the union of every step's tools and output models is declared
when the first step creates the chat, and every step's agent holds the whole
set locally (the client classifies calls as client/server by name and must be
able to run any declared tool the model calls).

Structured-output models become client tools too. One model keeps the
conventional name ``structured_output``; several get one tool each,
``structured_output_<model>``, because one tool cannot carry two schemas.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from coder_chat.crash_safe import (
    BeforeEffect,
    CrashSafeTool,
    ToolLedgerStore,
    ledgered,
    needs_ledger,
)
from coder_chat.tools import STRUCTURED_OUTPUT_TOOL, ClientTool, StructuredOutput, structured_output
from prefect_coder.flows.common import registry
from prefect_coder.flows.common.params import AnyStep, ModelStep, Step

__all__ = ["ResolvedTools", "Toolset", "bind_crash_safe"]


class Toolset(BaseModel):
    """Registry names of the client tools and output models of one workflow's chat."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tools: list[str] = Field(default_factory=list, description="Registered client tool names.")
    output_models: list[str] = Field(
        default_factory=list, description="Registered structured-output model names."
    )

    @classmethod
    def of_steps(cls, steps: Sequence[AnyStep]) -> Toolset:
        """The union over ``steps``, in first-use order (an approval step names
        none; a model step's output model is declared like an agent step's)."""
        tools: list[str] = []
        models: list[str] = []
        for step in steps:
            if not isinstance(step, Step | ModelStep):
                continue
            if isinstance(step, Step):
                tools += [t for t in step.tools if t not in tools]
            if step.output_model and step.output_model not in models:
                models.append(step.output_model)
        return cls(tools=tools, output_models=models)

    def including(self, step: Step) -> Toolset:
        """This set plus whatever ``step`` names (a step always has its own tools)."""
        tools = self.tools + [t for t in step.tools if t not in self.tools]
        models = list(self.output_models)
        if step.output_model and step.output_model not in models:
            models.append(step.output_model)
        return Toolset(tools=tools, output_models=models)

    def output_tool_name(self, model: str) -> str:
        """The tool name under which ``model``'s answers are filed."""
        if len(self.output_models) <= 1:
            return STRUCTURED_OUTPUT_TOOL
        return f"{STRUCTURED_OUTPUT_TOOL}_{model}"

    def resolve(self) -> ResolvedTools:
        """Registry look-up (names were validated at the edge)."""
        tools: list[ClientTool[Any]] = [registry.get_tool(n) for n in self.tools]
        answers: dict[str, StructuredOutput[Any]] = {}
        for model in self.output_models:
            answer = structured_output(
                registry.get_output_model(model), name=self.output_tool_name(model)
            )
            answers[model] = answer
            tools.append(answer)
        return ResolvedTools(tools, answers)


class ResolvedTools:
    """Client tools for the agent, and the structured-output tool per model name."""

    def __init__(self, tools: list[ClientTool[Any]], answers: dict[str, StructuredOutput[Any]]):
        self.tools = tools
        self.answers = answers


def bind_crash_safe(
    tools: Sequence[ClientTool[Any]],
    ledger: ToolLedgerStore,
    *,
    before_effect: BeforeEffect | None = None,
) -> list[ClientTool[Any]]:
    """``tools`` as a durable workflow runs them: every client tool behind the
    write-ahead ledger, bound to ``ledger``.

    Crash-safe by default: a plain registered tool is wrapped
    (:func:`coder_chat.crash_safe.ledgered`), so a crash after its effect leaves a
    ``committing`` entry that recovery re-drives with the *same* idempotency key
    — instead of finding no entry, cutting the attempt short and letting the
    resubmitted turn call the tool again under a new key. Tools declared side-effect
    free (``@registered_tool(..., pure=True)``, :func:`coder_chat.crash_safe.pure`,
    structured-output answers) run as they are: recovery simply runs them again.

    A turn passes its eager checkpoint's ``before_effect``: the chat must be
    findable before any effect.

    Every crash-safe tool matches earlier attempts (``match_earlier_attempts``): a
    step resubmitted after its attempt was cut short (past its turn deadline, a
    known failure) lets the model call an already-applied tool again under a NEW
    call id; that call is answered from the earlier call's recorded output instead
    of applying the effect a second time (docs/durable-turns.md, "Resubmitted
    attempts and applied tool calls").
    """
    out: list[ClientTool[Any]] = []
    for tool in tools:
        if needs_ledger(tool):
            tool = ledgered(tool)
        if isinstance(tool, CrashSafeTool):
            tool = tool.bind(ledger, before_effect=before_effect, match_earlier_attempts=True)
        out.append(tool)
    return out
