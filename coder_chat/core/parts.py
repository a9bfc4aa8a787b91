"""What a segment's translation emits: text, reasoning, tool calls/results, sources, errors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "ErrorPart",
    "Part",
    "ReasoningDelta",
    "ServerToolResult",
    "Source",
    "TextDelta",
    "ToolCall",
]


@dataclass(frozen=True, slots=True)
class TextDelta:
    """Assistant text, emitted as soon as it is known (delta or snapshot tail)."""

    text: str
    message_id: int | None = None
    type: Literal["text"] = "text"


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """Assistant reasoning text."""

    text: str
    message_id: int | None = None
    type: Literal["reasoning"] = "reasoning"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A tool call. Client calls carry ``input`` as the raw JSON *string* from ``action_required``."""

    tool_call_id: str
    tool_name: str
    input: Any
    provider_executed: bool
    type: Literal["tool-call"] = "tool-call"


@dataclass(frozen=True, slots=True)
class ServerToolResult:
    """The result of a provider-executed (server-side) tool call, as the model saw it.

    Not to be confused with :class:`coder_chat.models.ToolResult`, the body this
    process posts to answer a *client* tool call.
    """

    tool_call_id: str
    tool_name: str
    result: Any
    is_error: bool
    provider_executed: bool = True
    type: Literal["tool-result"] = "tool-result"


@dataclass(frozen=True, slots=True)
class Source:
    """A cited source (deduplicated by ``source_id`` or url)."""

    source_id: str
    url: str
    title: str | None = None
    type: Literal["source"] = "source"


@dataclass(frozen=True, slots=True)
class ErrorPart:
    """A server ``error`` event; the agent raises it as a ``CoderChatError``."""

    payload: dict[str, Any]
    type: Literal["error"] = "error"


Part = TextDelta | ReasoningDelta | ToolCall | ServerToolResult | Source | ErrorPart
