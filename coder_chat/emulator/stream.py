"""Per-subscriber stream cursor: what a ``/stream`` reader has seen and what it gets next.

This mirrors ``streamLoop.applyDBSnapshot`` (spec §3.4): every sync emits, in fixed order,
``message``* → ``queue_update`` → ``status`` → ``error`` → ``action_required`` → ``retry`` →
``preview_reset``, followed by the current episode's live parts the reader has not had yet
(replayed from ``seq`` 1 after a ``preview_reset``). No I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import statemachine as sm
from .store import ChatRec

MAX_EVENTS_PER_FRAME = 256


@dataclass
class StreamCursor:
    """What one subscriber has been sent so far."""

    chat_id: str
    after_id: int = 0
    last_history_version: int = 0
    initial: bool = True
    sent_status: str | None = None
    sent_queue_version: int = 0
    error_sent_at: int = -1
    action_sent_at: int = -1
    sent_retry_version: int = 0
    episode: tuple[int, int] | None = None
    parts_sent: int = 0
    cursor_revision: int | None = None  # after_revision (B2) / history_version (B3) seed
    status_history_version: bool = True  # B2 and later put history_version on `status`
    extra: dict[str, Any] = field(default_factory=dict)

    def sync(self, chat: ChatRec) -> list[dict[str, Any]]:
        """Events owed to this reader given the chat's current state; advances the cursor."""
        cid = chat.id
        out: list[dict[str, Any]] = []
        hv = chat.history_version
        ep = chat.episode
        prev = self.episode
        if prev is not None and prev != ep and prev not in chat.retired:
            # Tail of the episode this reader was in: parts precede the commit's message.
            buf = chat.buffers.get(prev)
            if buf and len(buf) > self.parts_sent:
                out.extend(buf[self.parts_sent :])
        if any(v > self.last_history_version for v in chat.reset_versions):
            # A soft-delete in the delta: history_reset, then every visible message
            # (after_id is ignored for this snapshot).
            out.append({"type": "history_reset", "chat_id": cid})
            for m in chat.visible_messages():
                out.append({"type": "message", "chat_id": cid, "message": m.wire})
            self.last_history_version = hv
        elif hv > self.last_history_version:
            for m in chat.messages:
                if m.revision <= self.last_history_version or m.visibility != "both":
                    continue
                if m.deleted or (self.initial and m.id <= self.after_id):
                    continue
                out.append({"type": "message", "chat_id": cid, "message": m.wire})
            self.last_history_version = hv
        if chat.queue_version > self.sent_queue_version:
            ev: dict[str, Any] = {"type": "queue_update", "chat_id": cid}
            if chat.queue:
                ev["queued_messages"] = [dict(q) for q in chat.queue]
            out.append(ev)
            self.sent_queue_version = chat.queue_version
        if chat.status != self.sent_status:
            status: dict[str, Any] = {"status": chat.status}
            if self.status_history_version:
                status["history_version"] = hv
            out.append({"type": "status", "chat_id": cid, "status": status})
            self.sent_status = chat.status
        if chat.status == sm.ERROR and self.error_sent_at != hv:
            err = chat.last_error or {
                "message": "The chat request failed unexpectedly.",
                "kind": "generic",
                "retryable": False,
            }
            out.append({"type": "error", "chat_id": cid, "error": dict(err)})
            self.error_sent_at = hv
        if chat.status == sm.REQUIRES_ACTION and self.action_sent_at != hv and chat.pending_calls:
            out.append(
                {
                    "type": "action_required",
                    "chat_id": cid,
                    "action_required": {"tool_calls": [dict(c) for c in chat.pending_calls]},
                }
            )
            self.action_sent_at = hv
        if chat.retry_version > self.sent_retry_version and chat.status == sm.RUNNING:
            if chat.retry is not None:
                out.append({"type": "retry", "chat_id": cid, "retry": dict(chat.retry)})
            self.sent_retry_version = chat.retry_version
        if ep != self.episode:
            initial_with_cursor = (
                self.episode is None
                and self.cursor_revision is not None
                and self.cursor_revision == hv
                and ep[1] == 0
            )
            changed = self.episode is None or self.episode[0] != ep[0] or ep[1] != 0
            if changed and not initial_with_cursor:
                out.append({"type": "preview_reset", "chat_id": cid})
            self.episode = ep
            self.parts_sent = 0
        # Live parts are dropped while the attempt is retired (retry stored or error).
        buf = chat.buffers.get(ep)
        if (
            buf
            and ep not in chat.retired
            and chat.retry is None
            and chat.status != sm.ERROR
            and len(buf) > self.parts_sent
        ):
            out.extend(buf[self.parts_sent :])
            self.parts_sent = len(buf)
        self.initial = False
        return out


def frames(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Split events into ≤256-event frames."""
    return [
        events[i : i + MAX_EVENTS_PER_FRAME] for i in range(0, len(events), MAX_EVENTS_PER_FRAME)
    ]
