"""Which stream events belong to a turn segment, and what they add up to.

:class:`TurnTranslator` is a pure state machine (no I/O, no clock): the agent
feeds it every event the stream reader yields, in order, and asks it after each
event whether the segment is over. It implements agent-semantics §3.3-§3.7:

* the **attribution window** (messages at or below the effective cursor are
  history or replays and are ignored; a fresh chat anchors on its first user
  snapshot);
* the **promotion-boundary settle** (a newer user message mid-run means chatd
  promoted the next prompt and our run is over, with no terminal status);
* usage per assistant message keyed by id, server-side tool calls/results and
  sources deduplicated by id, client tool calls from ``action_required``;
* the segment's finish reason.

Two rules it delegates, each its own small pure module with its own tests:
the **queued gate** (:mod:`coder_chat.core.queued_gate`: when a prompt queued
behind a running predecessor becomes ours) and the **text ledger**
(:mod:`coder_chat.core.text_ledger`: deltas vs snapshots, so a reconnect never
loses or duplicates text).

Events may be plain dicts (decoded JSON) or attribute-style models; both are
read through :func:`coder_chat.core.fields.field`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, Literal

from coder_chat.core.fields import canonical_json, field, plain, tool_args_json
from coder_chat.core.fields import int_or_none as _int
from coder_chat.core.parts import (
    ErrorPart,
    Part,
    ReasoningDelta,
    ServerToolResult,
    Source,
    TextDelta,
    ToolCall,
)
from coder_chat.core.queued_gate import Anchored, QueuedGate, QueuedPromptGate
from coder_chat.core.text_ledger import Episode, TextLedger
from coder_chat.core.usage import Usage, usage_of_messages
from coder_chat.models import TERMINAL_STATUSES

__all__ = [
    "REQUIRES_ACTION_SAFETY_VALVE",
    "ErrorPart",
    "FinishReason",
    "Part",
    "QueuedGate",
    "ReasoningDelta",
    "ServerToolResult",
    "Source",
    "TextDelta",
    "ToolCall",
    "TurnFailure",
    "TurnTranslator",
    "canonical_json",
    "field",
    "pending_client_calls",
    "plain",
]

#: Events tolerated after ``requires_action`` without a client call before giving up.
REQUIRES_ACTION_SAFETY_VALVE = 200

FinishReason = Literal["stop", "tool-calls", "error"]


@dataclass(frozen=True, slots=True)
class TurnFailure:
    """A dead end the agent raises as ``CoderChatError`` (non-retryable)."""

    kind: str
    message: str


# --------------------------------------------------------------------------- translator


class TurnTranslator:
    """Attribution + reconciliation for ONE segment of a turn. Feed events; read the state.

    Args:
        client_tool_names: names of the tools this process executes.
        cursor: the segment's ``afterId`` (0 = none: a fresh chat anchors on its
            first user snapshot).
        submitted_tool_call_ids: ids whose results this session already posted
            (a live set; replayed pauses for them are ignored).
        queued: the queue entry when the submission was queued behind another run.
        safety_valve: events tolerated after ``requires_action`` without a client call.
        closed_episodes: episodes whose step already committed (a live set shared
            by the segments of one turn); late replays of their deltas are ignored.
        anchor_on_first_user: the first user message past ``cursor`` is the
            turn's own prompt (its id becomes the effective cursor), not a
            promotion boundary. Default: only for a fresh chat (``cursor`` 0, not
            queued); a follower re-attaching from a pre-turn cursor sets it.
    """

    def __init__(
        self,
        *,
        client_tool_names: AbstractSet[str] = frozenset(),
        cursor: int = 0,
        submitted_tool_call_ids: AbstractSet[str] = frozenset(),
        queued: QueuedGate | None = None,
        safety_valve: int = REQUIRES_ACTION_SAFETY_VALVE,
        closed_episodes: set[Episode] | None = None,
        anchor_on_first_user: bool | None = None,
    ) -> None:
        self.client_tool_names = frozenset(client_tool_names)
        self.cursor = max(0, cursor)
        self._submitted = submitted_tool_call_ids
        self._gate = QueuedPromptGate(queued, self.cursor) if queued is not None else None
        if anchor_on_first_user is None:
            anchor_on_first_user = queued is None and self.cursor == 0
        self._await_first_user = anchor_on_first_user
        self._safety_valve = safety_valve

        self.effective_cursor = self.cursor
        self.max_message_id = 0
        self.terminal_status: str | None = None
        self.last_status: str | None = None
        self.error: dict[str, Any] | None = None
        self.failure: TurnFailure | None = None
        self.promoted = False
        self.events_fed = 0
        self._events_since_requires_action = 0

        # Closed episodes are shared by the segments of one turn (a resume segment
        # reads the same stream).
        self._ledger = TextLedger(closed_episodes)
        self._usage: dict[int, dict[str, Any]] = {}
        self.message_ids: list[int] = []
        self.client_calls: list[ToolCall] = []
        self._client_call_ids: set[str] = set()
        self.server_calls: list[ToolCall] = []
        self._server_call_ids: set[str] = set()
        self.server_results: list[ServerToolResult] = []
        self._server_result_ids: set[str] = set()
        self.sources: list[Source] = []
        self._source_ids: set[str] = set()

    # ------------------------------------------------------------------ queries

    @property
    def gated(self) -> bool:
        """True while a queued submission has not yet materialised."""
        return self._gate is not None

    @property
    def queued_id(self) -> int | None:
        """The queue entry id while gated (what an abort withdraws)."""
        return self._gate.queued_id if self._gate is not None else None

    @property
    def frozen(self) -> bool:
        """True once a promotion boundary settled the segment."""
        return self.promoted

    @property
    def text(self) -> str:
        """The segment's text so far (text blocks in order)."""
        return self._ledger.text

    @property
    def reasoning(self) -> str:
        """The segment's reasoning text so far."""
        return self._ledger.reasoning

    @property
    def usage(self) -> Usage:
        """Usage summed over the segment's assistant messages (keyed by id)."""
        return usage_of_messages(self._usage)

    @property
    def usage_by_message(self) -> dict[int, dict[str, Any]]:
        """Raw wire usage per assistant message id."""
        return dict(self._usage)

    @property
    def settled(self) -> bool:
        """True when the segment reached an end the agent should not wait past."""
        if self.promoted or self.failure is not None or self.error is not None:
            return True
        status = self.terminal_status
        if status is None:
            return False
        if status != "requires_action":
            return True
        if self.client_calls:
            return True
        return self._events_since_requires_action > self._safety_valve

    @property
    def reached_terminal(self) -> bool:
        """True if the server run settled (terminal status seen) or a promotion ended it."""
        return self.promoted or self.terminal_status is not None

    @property
    def awaiting_action(self) -> bool:
        """``requires_action`` recorded but no client call yet: the lost-event grace applies."""
        return (
            not self.promoted
            and self._gate is None
            and self.terminal_status == "requires_action"
            and not self.client_calls
        )

    @property
    def finish_reason(self) -> FinishReason:
        """The segment's finish reason (§3.7)."""
        if self.error is not None or self.terminal_status == "error":
            return "error"
        if self.promoted:
            return "stop"
        if self.client_calls or self.terminal_status == "requires_action":
            return "tool-calls"
        return "stop"

    @property
    def raw_status(self) -> str | None:
        """The terminal status behind the finish reason (``None`` for a promotion settle)."""
        return None if self.promoted else self.terminal_status

    # ------------------------------------------------------------------ feeding

    def feed_many(self, events: Iterable[Any]) -> list[Part]:
        """Feed several events; return everything they emitted."""
        out: list[Part] = []
        for event in events:
            out.extend(self.feed(event))
        return out

    def feed(self, event: Any) -> list[Part]:
        """Ingest one stream event; return the parts it newly attributes to the segment."""
        if self.promoted or self.failure is not None:
            return []
        self.events_fed += 1
        etype = field(event, "type")
        if etype == "message":
            mid = _int(field(field(event, "message"), "id"))
            if mid is not None and mid > self.max_message_id:
                self.max_message_id = mid
        if self._gate is not None:
            return self._feed_gated(self._gate, event, etype)
        if self.terminal_status == "requires_action" and not self.client_calls:
            self._events_since_requires_action += 1
        return self._ingest(event, etype)

    def finish(self) -> list[Part]:
        """Flush deferred revisions at segment end; returns what that emitted."""
        return self._ledger.flush()

    def ingest_recovered(
        self, messages: Sequence[Any], calls: Sequence[Mapping[str, Any]]
    ) -> list[Part]:
        """Feed history recovered after a lost ``action_required`` (§3.5).

        ``messages`` are re-ingested as synthetic ``message`` events (the
        ledger makes re-ingest harmless); ``calls`` (``tool_call_id``,
        ``tool_name``, ``args`` JSON string) become one synthetic
        ``action_required``.
        """
        out: list[Part] = []
        for msg in sorted(messages, key=lambda m: _int(field(m, "id")) or 0):
            out.extend(self.feed({"type": "message", "message": msg}))
        out.extend(
            self.feed({"type": "action_required", "action_required": {"tool_calls": list(calls)}})
        )
        return out

    # ------------------------------------------------------------------ gate

    def _feed_gated(self, gate: QueuedPromptGate, event: Any, etype: Any) -> list[Part]:
        step = gate.feed(event, etype)
        if step is None:
            return []
        if isinstance(step, Anchored):
            return self._anchor(step.message_id, replay=step.replay)
        self.failure = TurnFailure("queued_submission_lost", step.message)
        return []

    def _anchor(self, message_id: int, *, replay: list[Any]) -> list[Part]:
        self._gate = None
        self.effective_cursor = max(self.effective_cursor, message_id)
        self._await_first_user = False
        out: list[Part] = []
        for event in replay:
            out.extend(self.feed(event))
            self.events_fed -= 1  # replayed, not new
        return out

    # ------------------------------------------------------------------ ingest

    def _ingest(self, event: Any, etype: Any) -> list[Part]:
        if etype == "message_part":
            return self._ingest_delta(field(event, "message_part"))
        if etype == "message":
            return self._ingest_message(field(event, "message"))
        if etype == "status":
            status = field(field(event, "status"), "status")
            if isinstance(status, str):
                self.last_status = status
                if status in TERMINAL_STATUSES:
                    if status == "requires_action" and self.terminal_status != status:
                        self._events_since_requires_action = 0
                    self.terminal_status = status
                else:
                    # A redial replays the connect-time status, possibly a stale
                    # requires_action: only the latest status counts.
                    self.terminal_status = None
            return []
        if etype == "error":
            out = self._ledger.flush()
            payload = plain(field(event, "error", {})) or {}
            self.error = payload if isinstance(payload, dict) else {"message": str(payload)}
            out.append(ErrorPart(self.error))
            return out
        if etype == "action_required":
            out2: list[Part] = []
            calls = field(field(event, "action_required"), "tool_calls", []) or []
            for call in calls:
                call_id = field(call, "tool_call_id")
                name = field(call, "tool_name")
                if not isinstance(call_id, str) or not isinstance(name, str):
                    continue
                if call_id in self._client_call_ids or call_id in self._submitted:
                    continue
                args = field(call, "args", "{}")
                if not isinstance(args, str):
                    args = json.dumps(plain(args))
                tc = ToolCall(call_id, name, args, provider_executed=False)
                self._client_call_ids.add(call_id)
                self.client_calls.append(tc)
                out2.append(tc)
            return out2
        if etype == "retry":
            # The failed attempt's previewed text will never be committed.
            self._ledger.drop_pending()
            return []
        return []

    def _ingest_delta(self, mp: Any) -> list[Part]:
        part = field(mp, "part")
        ptype = field(part, "type")
        if ptype in ("text", "reasoning"):
            episode: Episode = (field(mp, "history_version"), field(mp, "generation_attempt"))
            return self._ledger.delta(ptype, field(part, "text", ""), episode)
        if ptype == "tool-call":
            return self._server_call(part, require_args=True)
        if ptype == "tool-result":
            return self._server_result(part)
        if ptype == "source":
            return self._source(part)
        return []

    def _ingest_message(self, msg: Any) -> list[Part]:
        mid = _int(field(msg, "id"))
        role = field(msg, "role")
        if mid is None or mid <= self.effective_cursor:
            return []
        if role == "user":
            if self._await_first_user:
                # Fresh chat: the first user snapshot is this turn's own prompt.
                self._await_first_user = False
                self.effective_cursor = mid
                return []
            # chatd promoted the next queued prompt with no terminal status for ours.
            flushed = self._ledger.flush()
            self.promoted = True
            self.terminal_status = None
            return flushed
        if role not in ("assistant", "tool"):
            return []
        if mid not in self.message_ids:
            self.message_ids.append(mid)
        content = field(msg, "content", []) or []
        out: list[Part] = []
        if role == "assistant":
            usage = field(msg, "usage")
            if usage is not None:
                raw = plain(usage)
                if isinstance(raw, dict):
                    self._usage[mid] = raw
            out.extend(self._ledger.commit(mid, content))
        for part in content:
            ptype = field(part, "type")
            if ptype == "tool-call":
                out.extend(self._server_call(part, require_args=False))
            elif ptype == "tool-result":
                out.extend(self._server_result(part))
            elif ptype == "source" and role == "assistant":
                out.extend(self._source(part))
        return out

    # ------------------------------------------------------------------ tools/sources

    def _server_call(self, part: Any, *, require_args: bool) -> list[Part]:
        call_id = field(part, "tool_call_id")
        name = field(part, "tool_name")
        if not isinstance(call_id, str) or not isinstance(name, str):
            return []
        if name in self.client_tool_names:
            return []  # client calls come only from action_required
        if call_id in self._server_call_ids:
            return []
        args = field(part, "args")
        if require_args and args is None:
            return []  # still streaming args_delta
        tc = ToolCall(call_id, name, plain(args) if args is not None else {}, True)
        self._server_call_ids.add(call_id)
        self.server_calls.append(tc)
        return [tc]

    def _server_result(self, part: Any) -> list[Part]:
        call_id = field(part, "tool_call_id")
        if not isinstance(call_id, str) or call_id not in self._server_call_ids:
            return []
        if call_id in self._server_result_ids:
            return []
        name = field(part, "tool_name")
        if not isinstance(name, str):
            name = next((c.tool_name for c in self.server_calls if c.tool_call_id == call_id), "")
        tr = ServerToolResult(
            call_id, name, plain(field(part, "result")), bool(field(part, "is_error"))
        )
        self._server_result_ids.add(call_id)
        self.server_results.append(tr)
        return [tr]

    def _source(self, part: Any) -> list[Part]:
        url = field(part, "url")
        if not isinstance(url, str) or not url:
            return []
        source_id = field(part, "source_id") or url
        if source_id in self._source_ids:
            return []
        self._source_ids.add(source_id)
        src = Source(str(source_id), url, field(part, "title"))
        self.sources.append(src)
        return [src]


# --------------------------------------------------------------------------- recovery


def pending_client_calls(
    messages: Iterable[Any],
    *,
    after_id: int,
    client_tool_names: AbstractSet[str],
    submitted_tool_call_ids: AbstractSet[str] = frozenset(),
) -> tuple[list[Any], list[dict[str, Any]]]:
    """Client calls a lost ``action_required`` would have announced (§3.5).

    Keeps messages with id > ``after_id`` sorted ascending, takes the LAST
    assistant message, and returns ``(turn_messages, calls)`` where ``calls``
    are its non-provider-executed client tool calls not answered by a later
    ``tool-result`` and not already submitted, with ``args`` re-serialised to a
    JSON string (absent → ``{}``, JSON null preserved).
    """
    turn = sorted(
        (m for m in messages if (_int(field(m, "id")) or 0) > after_id),
        key=lambda m: _int(field(m, "id")) or 0,
    )
    last_idx = None
    for i in range(len(turn) - 1, -1, -1):
        if field(turn[i], "role") == "assistant":
            last_idx = i
            break
    if last_idx is None:
        return turn, []
    answered: set[str] = set()
    for msg in turn[last_idx + 1 :]:
        for part in field(msg, "content", []) or []:
            if field(part, "type") == "tool-result":
                cid = field(part, "tool_call_id")
                if isinstance(cid, str):
                    answered.add(cid)
    calls: list[dict[str, Any]] = []
    for part in field(turn[last_idx], "content", []) or []:
        if field(part, "type") != "tool-call" or field(part, "provider_executed"):
            continue
        cid = field(part, "tool_call_id")
        name = field(part, "tool_name")
        if not isinstance(cid, str) or not cid or not isinstance(name, str) or not name:
            continue
        if name not in client_tool_names or cid in answered or cid in submitted_tool_call_ids:
            continue
        calls.append({"tool_call_id": cid, "tool_name": name, "args": tool_args_json(part)})
    return turn, calls
