"""What a turn returns: :class:`GenerateResult` and its parts.

Plain frozen values, built by :class:`coder_chat.agent.CoderAgent` from the
translator of each segment — or, for a tool round a follower finds already
finished, from history (:func:`step_from_history`) — so a followed turn reads
exactly like one that was generated in this process.
"""

from __future__ import annotations

import json
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from coder_chat.core.follow import DoneStep
from coder_chat.core.translator import ServerToolResult, Source, ToolCall, TurnTranslator
from coder_chat.core.usage import Usage

__all__ = [
    "ArchiveResult",
    "ClientToolCall",
    "GenerateResult",
    "InterruptResult",
    "StepResult",
    "StructuredResult",
    "decode_args",
    "step_from_history",
]

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class ClientToolCall:
    """A client tool call of the turn and what this process answered."""

    tool_call_id: str
    tool_name: str
    #: The model's arguments, JSON-decoded (the raw string if it was not JSON).
    input: Any
    output: Any
    is_error: bool
    step: int


@dataclass(frozen=True, slots=True)
class StepResult:
    """One segment of the turn (one model round-trip)."""

    step: int
    text: str
    reasoning: str
    finish_reason: str
    raw_status: str | None
    usage: Usage
    client_tool_calls: list[ClientToolCall]
    server_tool_calls: list[ToolCall]
    server_tool_results: list[ServerToolResult]
    sources: list[Source]
    message_ids: list[int]

    @property
    def provider_metadata(self) -> dict[str, Any]:
        """``{"coder": {"total_cost_micros", "total_runtime_ms"}}`` when reported."""
        coder = {
            k: v
            for k, v in (
                ("total_cost_micros", self.usage.total_cost_micros),
                ("total_runtime_ms", self.usage.total_runtime_ms),
            )
            if v is not None
        }
        return {"coder": coder} if coder else {}


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """What one :meth:`CoderAgent.generate` turn produced.

    ``text`` is the FINAL step's text (the text after the last client tool
    call); earlier steps' text lives in ``steps``. ``usage`` sums all steps.
    """

    text: str
    finish_reason: str
    raw_status: str | None
    usage: Usage
    steps: list[StepResult]
    chat_id: str
    user_message_id: int | None
    message_ids: list[int]
    client_tool_calls: list[ClientToolCall]
    server_tool_calls: list[ToolCall]
    server_tool_results: list[ServerToolResult]

    @property
    def reasoning(self) -> str:
        return self.steps[-1].reasoning if self.steps else ""

    @property
    def tool_calls(self) -> list[ClientToolCall | ToolCall]:
        """Client and server tool calls of the whole turn."""
        return [*self.client_tool_calls, *self.server_tool_calls]

    @property
    def sources(self) -> list[Source]:
        return [s for step in self.steps for s in step.sources]

    @property
    def total_cost_micros(self) -> int | None:
        """Turn cost = sum of the steps' reported cost."""
        costs = [s.usage.total_cost_micros for s in self.steps]
        known = [c for c in costs if c is not None]
        return sum(known) if known else None


@dataclass(frozen=True, slots=True)
class StructuredResult(Generic[M]):
    """Outcome of :meth:`CoderAgent.generate_structured`.

    ``value`` is the last validating answer (``None`` if none validated even
    after the nudge); ``result`` the turn that produced it; ``nudged`` whether a
    second turn was needed.
    """

    value: M | None
    result: GenerateResult
    nudged: bool


@dataclass(frozen=True, slots=True)
class InterruptResult:
    interrupted: bool
    chat_id: str | None = None


@dataclass(frozen=True, slots=True)
class ArchiveResult:
    archived: bool
    chat_id: str | None = None
    archived_chat_ids: list[str] = field(default_factory=list)


def step_from_history(
    done: DoneStep, step_no: int, client_tool_names: AbstractSet[str]
) -> StepResult:
    """A finished tool round, rebuilt from history the way the live reader would have."""
    tr = TurnTranslator(
        client_tool_names=client_tool_names, cursor=done.after_id, anchor_on_first_user=False
    )
    for message in done.messages:
        tr.feed({"type": "message", "message": message})
    tr.finish()
    calls = [
        ClientToolCall(
            c["tool_call_id"],
            c["tool_name"],
            decode_args(c["args"]),
            *done.outputs[c["tool_call_id"]],
            step_no,
        )
        for c in done.calls
    ]
    return StepResult(
        step=step_no,
        text=tr.text,
        reasoning=tr.reasoning,
        finish_reason="tool-calls",
        raw_status="requires_action",
        usage=tr.usage,
        client_tool_calls=calls,
        server_tool_calls=list(tr.server_calls),
        server_tool_results=list(tr.server_results),
        sources=list(tr.sources),
        message_ids=list(tr.message_ids),
    )


def decode_args(raw: Any) -> Any:
    """A client call's raw JSON argument string, decoded (the string itself if not JSON)."""
    if isinstance(raw, str):
        try:
            return json.loads(raw) if raw else {}
        except ValueError:
            return raw
    return raw
