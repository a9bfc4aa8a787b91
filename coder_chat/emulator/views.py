"""Read-only views of emulator state: wire shapes that hide internal fields, introspection."""

from __future__ import annotations

from typing import Any

from . import statemachine as sm
from .store import ChatRec


def public_queued(q: dict[str, Any]) -> dict[str, Any]:
    """A queued message as the wire ``ChatQueuedMessage`` (a copy: callers may not alias
    the stored entry)."""
    return dict(q)


def chat_info(chat: ChatRec, queue_cap: int) -> dict[str, Any]:
    """Introspection view of a chat (wire Chat + execution details)."""
    view = sm.ExecView(chat.status, len(chat.queue), chat.archived, queue_cap)
    return {
        **chat.render(),
        "queued_for_capacity": chat.queued_for_capacity,
        "queue": [public_queued(q) for q in chat.queue],
        "execution_state": sm.classify(view),
        "history_version": chat.history_version,
        "generation_attempt": chat.generation_attempt,
        "pending_tool_calls": [dict(c) for c in chat.pending_calls],
        "requires_action_deadline": chat.requires_action_deadline,
        "subscribers": len(chat.subscribers),
        "worker_active": chat.worker is not None,
        "sleeping": chat.sleeping,
        "dynamic_tools": sorted(chat.dynamic_tools),
    }


def messages_info(chat: ChatRec, include_system: bool = True) -> list[dict[str, Any]]:
    """All stored rows, oldest first, with visibility and revision."""
    return [
        {**m.wire, "visibility": m.visibility, "revision": m.revision, "deleted": m.deleted}
        for m in chat.messages
        if include_system or m.visibility == "both"
    ]
