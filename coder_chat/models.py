"""Pydantic v2 models of the chatd wire shapes (chatd-wire spec §1, §3, §4).

Tolerance rules (a newer server must not break an older client):

* every model allows and preserves unknown fields (``extra="allow"``);
  ``model_dump()`` returns them, so nothing the server sent is lost;
* enum-like fields (chat ``status``, part ``type``, event ``type``, message
  ``role``, error ``kind``) are plain ``str``; the known values are listed in
  :class:`ChatStatus`, :data:`TERMINAL_STATUSES`, :data:`AT_REST_STATUSES`,
  :data:`EVENT_TYPES` and
  :data:`PART_TYPES` for comparison only. Legacy statuses (``pending``,
  ``paused``, ``completed``) parse; the client never sends a status;
* raw-JSON fields (``tool-call.args``, ``tool-result.result``) are ``Any``. To
  tell "absent" from JSON ``null`` use ``"args" in part.model_fields_set``.

Request models serialise with :meth:`WireModel.wire` (``None`` fields are
omitted, except where ``null`` is meaningful, e.g. ``ToolResult.output``).
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "AT_REST_STATUSES",
    "EVENT_TYPES",
    "PART_TYPES",
    "TERMINAL_STATUSES",
    "ActionRequired",
    "ActionRequiredToolCall",
    "Chat",
    "ChatError",
    "ChatInputPart",
    "ChatMessage",
    "ChatMessagePart",
    "ChatMessagesResponse",
    "ChatQueuedMessage",
    "ChatStatus",
    "ChatStreamEvent",
    "ChatUsage",
    "ChatWatchEvent",
    "CreateChatMessageRequest",
    "CreateChatMessageResponse",
    "CreateChatRequest",
    "DynamicToolDefinition",
    "MessagePartEvent",
    "RetryPayload",
    "StatusPayload",
    "ToolResult",
    "UpdateChatRequest",
    "Usage",
    "WireModel",
    "parse_frame",
]


class WireModel(BaseModel):
    """Base of every wire model: unknown fields allowed and preserved."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    def wire(self) -> dict[str, Any]:
        """JSON-ready dict for a request body: ``None`` fields omitted."""
        return self.model_dump(mode="json", exclude_none=True)


class ChatStatus(StrEnum):
    """Known chat statuses. ``Chat.status`` stays a ``str`` so unknown ones parse."""

    WAITING = "waiting"
    RUNNING = "running"
    INTERRUPTING = "interrupting"
    REQUIRES_ACTION = "requires_action"
    ERROR = "error"
    # legacy / bleeding edge: tolerated, never emitted by the client
    PENDING = "pending"
    PAUSED = "paused"
    COMPLETED = "completed"


#: Statuses that end a segment (agent-semantics §1; ``completed`` is legacy).
TERMINAL_STATUSES: frozenset[str] = frozenset({"waiting", "completed", "error", "requires_action"})

#: Terminal statuses with no run left at all: no pending tool calls either (a
#: ``requires_action`` pause keeps its run alive). A stop or a settle-wait ends here.
AT_REST_STATUSES: frozenset[str] = TERMINAL_STATUSES - {"requires_action"}

#: The nine stream event types of chatd-wire §3.3.
EVENT_TYPES: frozenset[str] = frozenset(
    {
        "message_part",
        "message",
        "status",
        "error",
        "queue_update",
        "retry",
        "action_required",
        "preview_reset",
        "history_reset",
    }
)

#: Message part kinds with client meaning (others are tolerated and kept).
PART_TYPES: frozenset[str] = frozenset(
    {"text", "reasoning", "tool-call", "tool-result", "source", "file"}
)


# --------------------------------------------------------------------------- parts


class ChatMessagePart(WireModel):
    """One flat part struct with a ``type`` discriminator (chatd-wire §4).

    Only the fields of the part's kind are set; everything else stays ``None``
    (check ``model_fields_set`` for presence). Unknown kinds parse with their
    fields kept as extras.
    """

    type: str
    # text / reasoning (deltas in message_part events, full text in snapshots)
    text: str | None = None
    created_at: str | None = None
    completed_at: str | None = None
    # tool-call / tool-result
    tool_call_id: str | None = None
    tool_name: str | None = None
    args: Any = None
    args_delta: str | None = None
    provider_executed: bool | None = None
    result: Any = None
    result_delta: str | None = None
    result_reset: bool | None = None
    is_error: bool | None = None
    is_media: bool | None = None
    # source
    source_id: str | None = None
    url: str | None = None
    title: str | None = None
    # file
    file_id: str | None = None
    media_type: str | None = None
    name: str | None = None

    def wire(self) -> dict[str, Any]:
        """Fields that were set (JSON ``null`` args/results kept)."""
        return self.model_dump(mode="json", exclude_unset=True)


class ChatInputPart(WireModel):
    """An input part of a create/send request: ``text`` or ``file`` (by ``file_id``)."""

    type: str
    text: str | None = None
    file_id: str | None = None

    @classmethod
    def text_part(cls, text: str) -> ChatInputPart:
        return cls(type="text", text=text)

    @classmethod
    def file_part(cls, file_id: str) -> ChatInputPart:
        return cls(type="file", file_id=file_id)


class ChatUsage(WireModel):
    """The ``usage`` dict of an assistant message. Unknown counters kept as extras."""

    input_tokens: int | None = None
    output_tokens: int | None = None
    total_tokens: int | None = None
    reasoning_tokens: int | None = None
    cache_creation_tokens: int | None = None
    cache_read_tokens: int | None = None
    context_limit: int | None = None
    total_cost_micros: int | None = None
    total_runtime_ms: int | None = None


#: Alias: the wire usage dict (``core.usage`` holds the normalised per-turn usage).
Usage = ChatUsage


# --------------------------------------------------------------------------- messages


class ChatMessage(WireModel):
    """A committed chat message (``id`` from one global increasing sequence)."""

    id: int
    chat_id: str | None = None
    created_by: str | None = None
    model_config_id: str | None = None
    created_at: str | None = None
    role: str
    content: list[ChatMessagePart] = Field(default_factory=list)
    usage: ChatUsage | None = None
    queued_message_id: int | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _null_content(cls, v: Any) -> Any:
        return [] if v is None else v


class ChatQueuedMessage(WireModel):
    """A queued user message (``id`` in the queue's own id space)."""

    id: int
    chat_id: str | None = None
    model_config_id: str | None = None
    content: list[ChatMessagePart] = Field(default_factory=list)
    created_at: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _null_content(cls, v: Any) -> Any:
        return [] if v is None else v


class ChatError(WireModel):
    """``last_error`` / ``error`` event payload."""

    message: str = "The chat request failed unexpectedly."
    detail: str | None = None
    kind: str | None = None
    provider: str | None = None
    retryable: bool = False
    status_code: int | None = None


class Chat(WireModel):
    """A chat as returned by create/get/list/interrupt."""

    id: str
    organization_id: str | None = None
    owner_id: str | None = None
    workspace_id: str | None = None
    parent_chat_id: str | None = None
    root_chat_id: str | None = None
    last_model_config_id: str | None = None
    title: str | None = None
    status: str
    last_error: ChatError | None = None
    created_at: str | None = None
    updated_at: str | None = None
    archived: bool = False
    pin_order: int | None = None
    mcp_server_ids: list[str] = Field(default_factory=list)
    labels: dict[str, str] = Field(default_factory=dict)
    client_type: str | None = None
    children: list[Chat] = Field(default_factory=list)
    queued_for_capacity: bool | None = None

    @field_validator("mcp_server_ids", "children", mode="before")
    @classmethod
    def _null_list(cls, v: Any) -> Any:
        return [] if v is None else v

    @field_validator("labels", mode="before")
    @classmethod
    def _null_labels(cls, v: Any) -> Any:
        return {} if v is None else v


class ChatMessagesResponse(WireModel):
    """``GET /{id}/messages``: newest-first without ``after_id``, ascending with it."""

    messages: list[ChatMessage] = Field(default_factory=list)
    queued_messages: list[ChatQueuedMessage] = Field(default_factory=list)
    has_more: bool = False
    # B3 only (None on older builds): the newest visible user message (newest-first
    # pages) and, on the cursor-less newest page, the chat's history version (a valid
    # stream revision cursor).
    turn_start_id: int | None = None
    history_version: int | None = None

    @field_validator("messages", "queued_messages", mode="before")
    @classmethod
    def _null_list(cls, v: Any) -> Any:
        return [] if v is None else v


# --------------------------------------------------------------------------- requests


class DynamicToolDefinition(WireModel):
    """A client tool declared at chat creation (``unsafe_dynamic_tools``)."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class CreateChatRequest(WireModel):
    """``POST /chats`` body."""

    organization_id: str
    content: list[ChatInputPart]
    client_type: str = "api"
    system_prompt: str | None = None
    unsafe_dynamic_tools: list[DynamicToolDefinition] | None = None
    model_config_id: str | None = None
    workspace_id: str | None = None
    mcp_server_ids: list[str] | None = None
    plan_mode: str | None = None
    reasoning_effort: str | None = None
    labels: dict[str, str] | None = None
    title: str | None = None


class CreateChatMessageRequest(WireModel):
    """``POST /{id}/messages`` body."""

    content: list[ChatInputPart]
    model_config_id: str | None = None
    mcp_server_ids: list[str] | None = None
    busy_behavior: str | None = None
    plan_mode: str | None = None
    reasoning_effort: str | None = None


class CreateChatMessageResponse(WireModel):
    """Either a committed ``message`` or ``queued: true`` with ``queued_message``."""

    queued: bool = False
    message: ChatMessage | None = None
    queued_message: ChatQueuedMessage | None = None
    messages: list[ChatMessage] | None = None
    warnings: list[Any] | None = None


class UpdateChatRequest(WireModel):
    """``PATCH /{id}`` body; ``None`` fields are not sent (``labels`` replaces the map)."""

    title: str | None = None
    archived: bool | None = None
    workspace_id: str | None = None
    pin_order: int | None = None
    labels: dict[str, str] | None = None
    plan_mode: str | None = None


class ToolResult(WireModel):
    """One entry of ``POST /{id}/tool-results``. ``output`` is any JSON (``null`` kept)."""

    tool_call_id: str
    output: Any = None
    is_error: bool = False

    def wire(self) -> dict[str, Any]:
        data = self.model_dump(mode="json")
        data["output"] = data.get("output")
        return data


# --------------------------------------------------------------------------- stream


class MessagePartEvent(WireModel):
    """``message_part`` payload: a live preview chunk with its episode coordinates."""

    role: str | None = None
    part: ChatMessagePart
    history_version: int | None = None
    generation_attempt: int | None = None
    seq: int | None = None

    @property
    def has_coordinates(self) -> bool:
        """True when the delta carries a full (history_version, generation_attempt, seq)."""
        return (
            self.history_version is not None
            and self.generation_attempt is not None
            and self.seq is not None
        )


class StatusPayload(WireModel):
    status: str
    history_version: int | None = None


class RetryPayload(WireModel):
    attempt: int | None = None
    delay_ms: int | None = None
    error: str | None = None
    kind: str | None = None
    provider: str | None = None
    status_code: int | None = None
    retrying_at: str | None = None


class ActionRequiredToolCall(WireModel):
    """A pending client tool call; ``args`` is the raw JSON *string* of the input."""

    tool_call_id: str
    tool_name: str
    args: str = "{}"

    @field_validator("args", mode="before")
    @classmethod
    def _args_as_json_text(cls, v: Any) -> Any:
        # The wire carries a string; tolerate a server that sends the object itself.
        if v is None:
            return "{}"
        if isinstance(v, str):
            return v
        return json.dumps(v, separators=(",", ":"))


class ActionRequired(WireModel):
    tool_calls: list[ActionRequiredToolCall] = Field(default_factory=list)

    @field_validator("tool_calls", mode="before")
    @classmethod
    def _null_list(cls, v: Any) -> Any:
        return [] if v is None else v


class ChatStreamEvent(WireModel):
    """One stream event. Unknown ``type`` values parse (and are ignored downstream).

    For ``queue_update`` an absent ``queued_messages`` key means the queue is
    empty: :attr:`queued_messages` is then ``[]`` (it stays ``None`` for other types).
    """

    type: str
    chat_id: str | None = None
    message: ChatMessage | None = None
    message_part: MessagePartEvent | None = None
    status: StatusPayload | None = None
    error: ChatError | None = None
    retry: RetryPayload | None = None
    queued_messages: list[ChatQueuedMessage] | None = None
    action_required: ActionRequired | None = None

    @model_validator(mode="after")
    def _empty_queue(self) -> ChatStreamEvent:
        if self.type == "queue_update" and self.queued_messages is None:
            self.queued_messages = []
        return self


def parse_frame(data: str | bytes) -> list[ChatStreamEvent]:
    """Decode one WebSocket text frame: a JSON array of events (a single object is
    tolerated). Raises ``ValueError`` (incl. pydantic ``ValidationError``) when the
    frame is not JSON or an element is not an event object.
    """
    raw = json.loads(data)
    items = raw if isinstance(raw, list) else [raw]
    events: list[ChatStreamEvent] = []
    for item in items:
        if not isinstance(item, dict):
            raise ValueError(f"stream frame element is not an object: {type(item).__name__}")
        events.append(ChatStreamEvent.model_validate(item))
    return events


class ChatWatchEvent(WireModel):
    """One ``/chats/watch`` frame (a single JSON object, not an array).

    ``kind``: ``status_change``, ``summary_change``, ``chat_summary_change``,
    ``title_change``, ``created``, ``deleted``, ``diff_status_change``,
    ``action_required`` (carries ``tool_calls``), ``context_dirty`` or a future kind.
    """

    kind: str
    chat: Chat | None = None
    tool_calls: list[ActionRequiredToolCall] | None = None
