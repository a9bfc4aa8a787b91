"""The chatd wire types as pydantic models, written from the spec (chatd-wire.md §1, §3, §4).

Test-only and independent of the client's models: every model forbids extra keys, so an
internal field leaking onto the wire (or a misspelt one) fails validation, and every field
the spec marks required is required. Optional (``omitempty``) fields default to ``None``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Status = Literal["waiting", "running", "interrupting", "requires_action", "error"]
ErrorKind = Literal[
    "generic",
    "overloaded",
    "rate_limit",
    "timeout",
    "stream_silence_timeout",
    "auth",
    "config",
    "usage_limit",
    "missing_key",
    "provider_disabled",
    "content_filter",
    "hook_dispatch_failed",
    "hook_denied",
]


class Wire(BaseModel):
    """Base: unknown keys are a conformance failure."""

    model_config = ConfigDict(extra="forbid", strict=True)


# ---------------------------------------------------------------- errors (envelope)
class Validation(Wire):
    field: str
    detail: str


class ErrorEnvelope(Wire):
    """Every non-2xx body (and the promote 202 body, which has the same shape)."""

    message: str
    detail: str | None = None
    validations: list[Validation] | None = None


class ChatError(Wire):
    message: str
    detail: str | None = None
    kind: ErrorKind | None = None
    provider: str | None = None
    retryable: bool
    status_code: int | None = None


# ------------------------------------------------------------------ message parts
class TextPart(Wire):
    type: Literal["text"]
    text: str


class ReasoningPart(Wire):
    type: Literal["reasoning"]
    text: str
    created_at: str | None = None
    completed_at: str | None = None


class ToolCallPart(Wire):
    type: Literal["tool-call"]
    tool_call_id: str
    tool_name: str
    args: Any = None
    args_delta: str | None = None
    provider_executed: bool | None = None
    mcp_server_config_id: str | None = None
    parsed_commands: list[list[str]] | None = None
    hook_rewritten: bool | None = None
    created_at: str | None = None


class ToolResultPart(Wire):
    type: Literal["tool-result"]
    tool_call_id: str
    tool_name: str
    result: Any = None
    is_error: bool | None = None
    is_media: bool | None = None
    provider_executed: bool | None = None
    result_delta: str | None = None
    result_reset: bool | None = None
    created_at: str | None = None


class SourcePart(Wire):
    type: Literal["source"]
    url: str
    source_id: str | None = None
    title: str | None = None


class FilePart(Wire):
    type: Literal["file"]
    media_type: str
    name: str | None = None
    file_id: str | None = None


class FileReferencePart(Wire):
    type: Literal["file-reference"]
    file_name: str
    start_line: int
    end_line: int
    content: str


Part = Annotated[
    TextPart
    | ReasoningPart
    | ToolCallPart
    | ToolResultPart
    | SourcePart
    | FilePart
    | FileReferencePart,
    Field(discriminator="type"),
]


# ----------------------------------------------------------------------- messages
class Usage(Wire):
    input_tokens: int | None = None
    output_tokens: int | None = None
    total_tokens: int | None = None
    reasoning_tokens: int | None = None
    cache_creation_tokens: int | None = None
    cache_read_tokens: int | None = None
    context_limit: int | None = None


class ChatMessage(Wire):
    id: int
    chat_id: str
    created_by: str | None = None
    model_config_id: str | None = None
    created_at: str
    role: Literal["user", "assistant", "tool"]  # system rows are never returned
    content: list[Part] | None = None
    usage: Usage | None = None
    queued_message_id: int | None = None
    automation_id: str | None = None
    input_id: str | None = None


class ChatQueuedMessage(Wire):
    id: int
    chat_id: str
    model_config_id: str | None = None
    content: list[Part]
    created_at: str
    reasoning_effort: str | None = None
    editing_since: str | None = None
    automation_id: str | None = None
    input_id: str | None = None


# --------------------------------------------------------------------------- chats
class Chat(Wire):
    id: str
    organization_id: str
    owner_id: str
    owner_username: str | None = None
    workspace_id: str | None = None
    agent_id: str | None = None
    build_id: str | None = None
    parent_chat_id: str | None = None
    root_chat_id: str | None = None
    last_model_config_id: str
    title: str
    status: Status
    plan_mode: str | None = None
    last_error: ChatError | None = None
    last_turn_summary: str | None  # nullable, always present
    summary: str | None  # nullable, always present
    created_at: str
    updated_at: str
    archived: bool
    shared: bool
    pin_order: int
    mcp_server_ids: list[str]
    labels: dict[str, str]
    files: list[Any] | None = None
    has_unread: bool
    queued_for_capacity: bool | None = None
    warnings: list[str] | None = None
    client_type: Literal["ui", "api"]
    children: list[Chat]
    title_source: str | None = None
    title_updated_at: str | None = None
    project_id: str | None = None
    diff_statuses: Any = None


class ChatMessagesResponse(Wire):
    messages: list[ChatMessage]
    queued_messages: list[ChatQueuedMessage]
    has_more: bool
    turn_start_id: int | None = None  # B3
    history_version: int | None = None  # B3


class CreateChatMessageResponse(Wire):
    queued: bool
    message: ChatMessage | None = None
    queued_message: ChatQueuedMessage | None = None
    messages: list[ChatMessage] | None = None
    warnings: list[str] | None = None


class EditChatMessageResponse(Wire):
    message: ChatMessage
    messages: list[ChatMessage] | None = None
    deleted_message_ids: list[int] | None = None
    warnings: list[str] | None = None


class UploadChatFileResponse(Wire):
    id: str


class ChatModelsResponse(Wire):
    """GET /organizations/{org}/chats/models; the spec does not pin ChatModel's fields."""

    models: list[dict[str, Any]]
    providers: list[dict[str, Any]]
    unsupported_providers: list[dict[str, Any]]


# ---------------------------------------------------------------------- stream (§3.3)
class StreamPart(Wire):
    role: Literal["assistant", "tool"] | None = None
    part: Part
    history_version: int | None = None
    generation_attempt: int | None = None
    seq: int | None = None


class StreamStatus(Wire):
    status: Status
    history_version: int | None = None  # B2 and later


class StreamRetry(Wire):
    attempt: int
    delay_ms: int
    error: str
    kind: ErrorKind | None = None
    provider: str | None = None
    status_code: int | None = None
    retrying_at: str


class PendingToolCall(Wire):
    tool_call_id: str
    tool_name: str
    args: str  # a JSON *string*


class ActionRequired(Wire):
    tool_calls: list[PendingToolCall]


class _Event(Wire):
    chat_id: str


class MessageEvent(_Event):
    type: Literal["message"]
    message: ChatMessage


class MessagePartEvent(_Event):
    type: Literal["message_part"]
    message_part: StreamPart


class StatusEvent(_Event):
    type: Literal["status"]
    status: StreamStatus


class ErrorEvent(_Event):
    type: Literal["error"]
    error: ChatError


class QueueUpdateEvent(_Event):
    type: Literal["queue_update"]
    queued_messages: list[ChatQueuedMessage] | None = None  # absent = empty queue


class RetryEvent(_Event):
    type: Literal["retry"]
    retry: StreamRetry


class ActionRequiredEvent(_Event):
    type: Literal["action_required"]
    action_required: ActionRequired


class PreviewResetEvent(_Event):
    type: Literal["preview_reset"]


class HistoryResetEvent(_Event):
    type: Literal["history_reset"]


StreamEvent = Annotated[
    MessageEvent
    | MessagePartEvent
    | StatusEvent
    | ErrorEvent
    | QueueUpdateEvent
    | RetryEvent
    | ActionRequiredEvent
    | PreviewResetEvent
    | HistoryResetEvent,
    Field(discriminator="type"),
]


class StreamFrame(Wire):
    """Helper root: one text frame is a JSON array of events."""

    events: list[StreamEvent]


class WatchEvent(Wire):
    kind: Literal[
        "status_change",
        "summary_change",
        "chat_summary_change",
        "title_change",
        "created",
        "deleted",
        "diff_status_change",
        "action_required",
        "context_dirty",
    ]
    chat: Chat
    tool_calls: list[PendingToolCall] | None = None
    changed_diff_status: Any = None
