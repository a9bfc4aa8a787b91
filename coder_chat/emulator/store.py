"""JSON-shaped in-memory state of the emulated deployment: users, chats, messages, files.

Records keep wire-ready dicts where possible so rendering is a cheap copy. Nothing here does
I/O; ``core.py`` mutates these records and notifies subscribers.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from .script import Script, ScriptStep


def rfc3339(ts: float) -> str:
    """Go-style RFC 3339 timestamp with microseconds, UTC ``Z``."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class User:
    """A user of the emulated deployment; one per configured token."""

    id: str
    username: str
    token: str


@dataclass
class MsgRec:
    """A stored message row: the wire dict plus visibility and the revision it was written at."""

    wire: dict[str, Any]
    visibility: str  # "both" | "model" (system rows, tool-batch-usage)
    revision: int
    deleted: bool = False  # soft-deleted by a message edit

    @property
    def id(self) -> int:
        """Message id (global sequence)."""
        return int(self.wire["id"])


@dataclass
class TurnState:
    """Where the worker is in a chat's current turn."""

    script: Script
    step_idx: int = 0
    follow_up_pending: bool = False
    pending_enter: list[dict[str, Any]] = field(default_factory=list)
    turn_no: int = 0

    def next_step(self) -> ScriptStep | None:
        """The next step to run, or None when the turn is complete."""
        if self.step_idx < len(self.script.steps):
            return self.script.steps[self.step_idx]
        return None


@dataclass
class ChatRec:
    """One chat row plus its live execution data (episode, parts buffer, subscribers)."""

    id: str
    organization_id: str
    owner: User
    title: str
    created_at: float
    updated_at: float
    client_type: str = "api"
    status: str = "waiting"
    archived: bool = False
    labels: dict[str, str] = field(default_factory=dict)
    last_error: dict[str, Any] | None = None
    workspace_id: str | None = None
    model_config_id: str = ""
    mcp_server_ids: list[str] = field(default_factory=list)
    plan_mode: str = ""
    reasoning_effort: str | None = None
    dynamic_tools: dict[str, dict[str, Any]] = field(default_factory=dict)
    parent_chat_id: str | None = None
    pin_order: int = 0
    has_unread: bool = False
    queued_for_capacity: bool = False
    shared_with: set[str] = field(default_factory=set)
    # history and queue
    messages: list[MsgRec] = field(default_factory=list)
    queue: list[dict[str, Any]] = field(default_factory=list)  # wire ChatQueuedMessage dicts
    queue_authors: dict[int, str] = field(default_factory=dict)  # queued id → user id
    queue_version: int = 0
    history_version: int = 0
    generation_attempt: int = 0
    retry: dict[str, Any] | None = None
    retry_version: int = 0
    pending_calls: list[dict[str, Any]] = field(default_factory=list)
    requires_action_deadline: float | None = None
    # preview parts per episode (hv, attempt), already wrapped as events; the last few
    # episodes are kept so a reader that lags still gets an episode's tail before its commit
    buffers: dict[tuple[int, int], list[dict[str, Any]]] = field(default_factory=dict)
    retired: set[tuple[int, int]] = field(default_factory=set)
    # history versions at which rows were soft-deleted (→ history_reset on streams)
    reset_versions: list[int] = field(default_factory=list)
    # scripting
    next_scripts: list[Script] = field(default_factory=list)
    chat_script: Script | None = None
    turn: TurnState | None = None
    # worker
    worker: asyncio.Task[None] | None = None
    interrupt_flag: bool = False
    wake: asyncio.Event | None = None
    sleeping: bool = False  # the turn is inside a scripted Sleep (Core.end_sleeps ends it)
    owned: bool = False  # a worker holds the chat (B3's worker_id is set)
    deadline_timer: asyncio.TimerHandle | None = None
    subscribers: set[Any] = field(default_factory=set)

    def visible_messages(self) -> list[MsgRec]:
        """Client-visible rows (system and model-only rows excluded)."""
        return [m for m in self.messages if m.visibility == "both" and not m.deleted]

    def live_messages(self) -> list[MsgRec]:
        """Every non-deleted row (including model-only ones)."""
        return [m for m in self.messages if not m.deleted]

    @property
    def parts(self) -> list[dict[str, Any]]:
        """Preview parts of the current episode."""
        return self.buffers.get(self.episode, [])

    @property
    def episode(self) -> tuple[int, int]:
        """The current (history_version, generation_attempt)."""
        return (self.history_version, self.generation_attempt)

    def render(
        self, children: list[dict[str, Any]] | None = None, *, single_read: bool = False
    ) -> dict[str, Any]:
        """The wire ``Chat`` object.

        ``queued_for_capacity`` is omitempty and only derived on a single-chat read
        (GET /chats/{chat}); lists, watch events and mutation responses leave it false,
        i.e. absent, like the server."""
        out: dict[str, Any] = {
            "id": self.id,
            "organization_id": self.organization_id,
            "owner_id": self.owner.id,
            "owner_username": self.owner.username,
            "last_model_config_id": self.model_config_id,
            "title": self.title,
            "status": self.status,
            "last_turn_summary": None,
            "summary": None,
            "created_at": rfc3339(self.created_at),
            "updated_at": rfc3339(self.updated_at),
            "archived": self.archived,
            "shared": bool(self.shared_with),
            "pin_order": self.pin_order,
            "mcp_server_ids": list(self.mcp_server_ids),
            "labels": dict(self.labels),
            "has_unread": self.has_unread,
            "client_type": self.client_type,
            "children": children if children is not None else [],
        }
        if self.workspace_id:
            out["workspace_id"] = self.workspace_id
        if self.parent_chat_id:
            out["parent_chat_id"] = self.parent_chat_id
            out["root_chat_id"] = self.parent_chat_id
        if self.plan_mode:
            out["plan_mode"] = self.plan_mode
        if self.last_error is not None:
            out["last_error"] = dict(self.last_error)
        if single_read and self.queued_for_capacity:
            out["queued_for_capacity"] = True
        return out


@dataclass
class FileRec:
    """An uploaded chat file."""

    id: str
    owner_id: str
    organization_id: str
    media_type: str
    name: str
    data: bytes
    created_at: float


class Ids:
    """Id sequences: one global message sequence, one queued-message sequence."""

    def __init__(self) -> None:
        self._msg = itertools.count(1)
        self._queued = itertools.count(1)
        self._tool = itertools.count(1)

    def message(self) -> int:
        """Next message id (shared by all chats)."""
        return next(self._msg)

    def queued(self) -> int:
        """Next queued-message id."""
        return next(self._queued)

    def tool_call(self) -> str:
        """Next deterministic tool-call id."""
        return f"toolu_emu_{next(self._tool):06d}"


def new_uuid() -> str:
    """A random UUID string."""
    return str(uuid.uuid4())
