"""The chatd execution-state machine (current "chatstate" era), pure: no I/O, no clock.

An execution state is ``status x queue empty/non-empty x archived`` (spec §2). Each
transition takes a :class:`ExecView` snapshot and returns an :class:`Outcome` — the new
status plus an ordered tuple of :class:`Effect` the server shell must apply — or raises
:class:`Refused` carrying the exact HTTP status and Coder error message.

Keeping this pure lets the tests enumerate every (state, trigger) pair without sockets;
the shell in ``server.py`` only applies effects.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

WAITING = "waiting"
RUNNING = "running"
INTERRUPTING = "interrupting"
REQUIRES_ACTION = "requires_action"
ERROR = "error"
STATUSES = (WAITING, RUNNING, INTERRUPTING, REQUIRES_ACTION, ERROR)

# Synthetic tool-result reasons (spec §4), literal.
REASON_INTERRUPT = "Tool execution interrupted by user"
REASON_USER_MESSAGE = "Tool execution interrupted by user message"
REASON_NEW_USER_MESSAGE = "Tool execution interrupted by new user message"
REASON_PROMOTION = "Tool execution interrupted by queued message promotion"
REASON_TIMEOUT = "Tool execution timed out"

MSG_INVALID_STATE = "Chat is in an invalid state."
MSG_SEND_REFUSED = "Chat is not in a state that accepts new messages."
MSG_QUEUE_FULL = "Message queue is full."
MSG_NOT_INTERRUPTIBLE = "Chat is not in an interruptible state."
MSG_NOT_WAITING_TOOLS = "Chat is not waiting for tool results."
MSG_ARCHIVE_BUSY = "Cannot archive an active chat. Interrupt or wait for the chat to finish first."
MSG_ALREADY_ARCHIVED = "Chat is already archived."
MSG_ALREADY_UNARCHIVED = "Chat is already not archived."
MSG_NO_QUEUE_DELETE = "Chat has no queued messages to delete."
MSG_NO_QUEUE_PROMOTE = "Chat has no queued messages to promote."
MSG_QUEUED_NOT_FOUND = "Queued message not found."


class Refused(Exception):
    """A transition the server refuses; carries the HTTP status and Coder envelope."""

    def __init__(self, status: int, message: str, detail: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.detail = detail


class EffectKind(enum.Enum):
    """What the shell must do, in order."""

    CLOSE_OPEN_TOOL_CALLS = "close_open_tool_calls"  # synthetic results for every open call
    CANCEL_PENDING_DYNAMIC = "cancel_pending_dynamic"  # synthetic results for pending dynamic calls
    INSERT_MESSAGE = "insert_message"  # insert the request's user message into history
    ENQUEUE = "enqueue"  # append the request's user message to the queue
    PROMOTE_HEAD = "promote_head"  # move queue head into history
    MOVE_TO_HEAD = "move_to_head"  # move the named queued row to the queue head
    DELETE_QUEUED = "delete_queued"  # drop the named queued row
    CLEAR_ERROR = "clear_error"
    SET_ERROR = "set_error"
    START_TURN = "start_turn"  # a worker must (keep) run(ning) the chat
    SIGNAL_INTERRUPT = "signal_interrupt"  # ask the worker to stop the current turn
    ARM_DEADLINE = "arm_deadline"  # requires_action deadline timer
    DISARM_DEADLINE = "disarm_deadline"
    INSERT_TOOL_RESULTS = "insert_tool_results"
    SET_ARCHIVED = "set_archived"


@dataclass(frozen=True)
class Effect:
    """One effect; ``reason`` is set for synthetic tool results."""

    kind: EffectKind
    reason: str | None = None
    value: Any = None


@dataclass(frozen=True)
class ExecView:
    """The facts a transition needs: status, queue length, archived, queue cap."""

    status: str
    queue_len: int = 0
    archived: bool = False
    queue_cap: int = 20


@dataclass(frozen=True)
class Outcome:
    """Result of a transition: the new status, whether the send was queued, effects."""

    status: str
    effects: tuple[Effect, ...] = ()
    queued: bool = False
    archived: bool | None = None

    def kinds(self) -> list[EffectKind]:
        """Effect kinds in order (handy for tests)."""
        return [e.kind for e in self.effects]


def classify(view: ExecView) -> str:
    """Name the execution state: W, E0, E1, R0, R1, I0, I1, A0, A1, XW, XE0, XE1 or INVALID."""
    q = 1 if view.queue_len > 0 else 0
    if view.archived:
        if view.status == WAITING and q == 0:
            return "XW"
        if view.status == ERROR:
            return f"XE{q}"
        return "INVALID"
    if view.status == WAITING:
        return "W" if q == 0 else "INVALID"
    code = {ERROR: "E", RUNNING: "R", INTERRUPTING: "I", REQUIRES_ACTION: "A"}.get(view.status)
    if code is None:
        return "INVALID"
    return f"{code}{q}"


def is_valid(view: ExecView) -> bool:
    """True when the view is one of the named execution states."""
    return classify(view) != "INVALID"


def _require_valid(view: ExecView) -> str:
    state = classify(view)
    if state == "INVALID":
        raise Refused(409, MSG_INVALID_STATE)
    return state


def _e(kind: EffectKind, reason: str | None = None, value: Any = None) -> Effect:
    return Effect(kind, reason, value)


def create_chat(*, empty_content: bool = False) -> Outcome:
    """POST /chats: N → R0 (or W for an empty-content chat, B3)."""
    if empty_content:
        return Outcome(WAITING)
    return Outcome(RUNNING, (_e(EffectKind.INSERT_MESSAGE), _e(EffectKind.START_TURN)))


def send_message(view: ExecView, busy_behavior: str = "queue", *, owned: bool = True) -> Outcome:
    """POST /messages (``chatstate.Tx.SendMessage``), after the handler's own 400 checks.

    ``owned=False`` (B3: no worker holds the chat) makes an interrupting send from R*/I*
    finish the interruption in the same transaction: the queue head is promoted at once
    (from R0/I0 that head is the new message itself, so it is not reported as queued)."""
    state = _require_valid(view)
    if state.startswith("X"):
        # The handler returns 400 for archived before this; keep the machine total.
        raise Refused(409, MSG_SEND_REFUSED)
    interrupt = busy_behavior == "interrupt"
    if state in ("W", "E0"):
        effects = [_e(EffectKind.CLOSE_OPEN_TOOL_CALLS, REASON_NEW_USER_MESSAGE)]
        if state == "E0":
            effects.append(_e(EffectKind.CLEAR_ERROR))
        effects += [_e(EffectKind.INSERT_MESSAGE), _e(EffectKind.START_TURN)]
        return Outcome(RUNNING, tuple(effects))
    # Every other state queues, so the cap applies (count >= cap before insert).
    if view.queue_len >= view.queue_cap:
        raise Refused(429, MSG_QUEUE_FULL, f"Maximum {view.queue_cap} messages can be queued.")
    if state == "E1":
        return Outcome(
            RUNNING,
            (
                _e(EffectKind.ENQUEUE),
                _e(EffectKind.CLOSE_OPEN_TOOL_CALLS, REASON_PROMOTION),
                _e(EffectKind.CLEAR_ERROR),
                _e(EffectKind.PROMOTE_HEAD),
                _e(EffectKind.START_TURN),
            ),
            queued=True,
        )
    if interrupt and not owned and state in ("R0", "R1", "I0", "I1"):
        return Outcome(
            RUNNING,
            (_e(EffectKind.ENQUEUE), _e(EffectKind.PROMOTE_HEAD), _e(EffectKind.START_TURN)),
            queued=state.endswith("1"),
        )
    if state in ("R0", "R1"):
        if interrupt:
            return Outcome(
                INTERRUPTING,
                (_e(EffectKind.ENQUEUE), _e(EffectKind.SIGNAL_INTERRUPT)),
                queued=True,
            )
        return Outcome(RUNNING, (_e(EffectKind.ENQUEUE),), queued=True)
    if state in ("I0", "I1"):
        return Outcome(INTERRUPTING, (_e(EffectKind.ENQUEUE),), queued=True)
    if state in ("A0", "A1"):
        if interrupt:
            return Outcome(
                RUNNING,
                (
                    _e(EffectKind.ENQUEUE),
                    _e(EffectKind.DISARM_DEADLINE),
                    _e(EffectKind.CANCEL_PENDING_DYNAMIC, REASON_USER_MESSAGE),
                    _e(EffectKind.START_TURN),
                ),
                queued=True,
            )
        return Outcome(REQUIRES_ACTION, (_e(EffectKind.ENQUEUE),), queued=True)
    raise Refused(409, MSG_SEND_REFUSED)  # pragma: no cover - all states handled


def commit_step(view: ExecView) -> Outcome:
    """Worker committed an LLM step: R*/I* stay as they are."""
    state = _require_valid(view)
    if state[0] not in "RI":
        raise Refused(409, MSG_INVALID_STATE)
    return Outcome(view.status)


def finish_turn(view: ExecView) -> Outcome:
    """Worker finished a turn: R0 → W; R1 → head promoted, still running (no terminal)."""
    state = _require_valid(view)
    if state == "R0":
        return Outcome(WAITING)
    if state == "R1":
        return Outcome(RUNNING, (_e(EffectKind.PROMOTE_HEAD), _e(EffectKind.START_TURN)))
    if state in ("I0", "I1"):
        return finish_interruption(view)
    raise Refused(409, MSG_INVALID_STATE)


def enter_requires_action(view: ExecView) -> Outcome:
    """Model called a dynamic tool: R0 → A0, R1 → A1 (deadline armed)."""
    state = _require_valid(view)
    if state not in ("R0", "R1"):
        raise Refused(409, MSG_INVALID_STATE)
    return Outcome(REQUIRES_ACTION, (_e(EffectKind.ARM_DEADLINE),))


def validate_tool_results(pending_ids: Sequence[str], results: Sequence[Mapping[str, Any]]) -> None:
    """Tool-result validation in the server's order: dup → bad JSON → missing → unexpected."""
    seen: set[str] = set()
    for r in results:
        tid = str(r.get("tool_call_id", ""))
        if tid in seen:
            raise Refused(400, "Duplicate tool_call_id in results.", f'Duplicate "{tid}".')
        seen.add(tid)
    for r in results:
        if "output" not in r:
            raise Refused(400, "Tool result output must be valid JSON.")
        out = r["output"]
        if isinstance(out, _RawJSON):
            try:
                json.loads(out.text)
            except ValueError as exc:
                raise Refused(400, "Tool result output must be valid JSON.") from exc
    for pid in pending_ids:
        if pid not in seen:
            raise Refused(400, "Missing tool result.", f'Missing result for tool call "{pid}".')
    pending = set(pending_ids)
    for tid in seen:
        if tid not in pending:
            raise Refused(400, "Unexpected tool result.", f'No pending tool call with ID "{tid}".')


@dataclass(frozen=True)
class _RawJSON:
    text: str = field(default="")


def complete_requires_action(view: ExecView) -> Outcome:
    """Tool results accepted (status check only; validate ids separately): A0→R0, A1→R1."""
    state = _require_valid(view)
    if state not in ("A0", "A1"):
        raise Refused(
            409,
            MSG_NOT_WAITING_TOOLS,
            f'chat status is "{view.status}", expected "requires_action"',
        )
    return Outcome(
        RUNNING,
        (
            _e(EffectKind.DISARM_DEADLINE),
            _e(EffectKind.INSERT_TOOL_RESULTS),
            _e(EffectKind.START_TURN),
        ),
    )


def cancel_requires_action(view: ExecView) -> Outcome:
    """The requires_action deadline passed: A* → R* with ``Tool execution timed out``."""
    state = _require_valid(view)
    if state not in ("A0", "A1"):
        raise Refused(409, MSG_INVALID_STATE)
    return Outcome(
        RUNNING,
        (_e(EffectKind.CANCEL_PENDING_DYNAMIC, REASON_TIMEOUT), _e(EffectKind.START_TURN)),
    )


def interrupt(view: ExecView, *, owned: bool = True) -> Outcome:
    """POST /interrupt: R→I; A→R with synthetic results; else 409.

    ``owned=False`` (B3: no worker holds the chat, e.g. waiting for capacity) finishes the
    interruption in the same transaction: R0/I0 → W, R1/I1 → head promoted, running."""
    state = classify(view)
    if not owned and state in ("R0", "R1", "I0", "I1"):
        return finish_interruption(ExecView(INTERRUPTING, view.queue_len, view.archived))
    if state in ("R0", "R1"):
        return Outcome(INTERRUPTING, (_e(EffectKind.SIGNAL_INTERRUPT),))
    if state in ("A0", "A1"):
        return Outcome(
            RUNNING,
            (
                _e(EffectKind.DISARM_DEADLINE),
                _e(EffectKind.CANCEL_PENDING_DYNAMIC, REASON_INTERRUPT),
                _e(EffectKind.START_TURN),
            ),
        )
    if state == "INVALID":
        raise Refused(409, MSG_INVALID_STATE)
    raise Refused(409, MSG_NOT_INTERRUPTIBLE)


def finish_interruption(view: ExecView) -> Outcome:
    """Worker wound down an interrupt: I0 → W; I1 → head promoted, running."""
    state = _require_valid(view)
    if state == "I0":
        return Outcome(WAITING)
    if state == "I1":
        return Outcome(RUNNING, (_e(EffectKind.PROMOTE_HEAD), _e(EffectKind.START_TURN)))
    raise Refused(409, MSG_INVALID_STATE)


def finish_error(view: ExecView) -> Outcome:
    """Retries exhausted or fatal: R0 → E0, R1 → E1 (also I* — the turn died)."""
    state = _require_valid(view)
    if state[0] not in "RI":
        raise Refused(409, MSG_INVALID_STATE)
    return Outcome(ERROR, (_e(EffectKind.SET_ERROR),))


def delete_queued(view: ExecView, found: bool) -> Outcome:
    """DELETE /queue/{id}: E1/R1/I1/A1 → same status (queue shrinks)."""
    state = _require_valid(view)
    if view.queue_len == 0:
        raise Refused(409, MSG_NO_QUEUE_DELETE)
    if not found:
        raise Refused(404, MSG_QUEUED_NOT_FOUND)
    if state.startswith("X"):
        # Archived chats keep their queue; deleting from it leaves status alone.
        return Outcome(view.status, (_e(EffectKind.DELETE_QUEUED),), archived=True)
    return Outcome(view.status, (_e(EffectKind.DELETE_QUEUED),))


def promote_queued(view: ExecView, found: bool) -> Outcome:
    """POST /queue/{id}/promote: E1,A1 → running now; R1,I1 → interrupting, promoted after."""
    if view.archived:
        raise Refused(400, "Cannot promote queued messages in an archived chat.")
    state = _require_valid(view)
    if view.queue_len == 0 or state in ("W", "E0", "R0", "I0", "A0"):
        raise Refused(409, MSG_NO_QUEUE_PROMOTE)
    if not found:
        raise Refused(404, MSG_QUEUED_NOT_FOUND)
    move = _e(EffectKind.MOVE_TO_HEAD)
    if state == "E1":
        return Outcome(
            RUNNING,
            (
                move,
                _e(EffectKind.CLOSE_OPEN_TOOL_CALLS, REASON_PROMOTION),
                _e(EffectKind.CLEAR_ERROR),
                _e(EffectKind.PROMOTE_HEAD),
                _e(EffectKind.START_TURN),
            ),
        )
    if state == "A1":
        return Outcome(
            RUNNING,
            (
                move,
                _e(EffectKind.DISARM_DEADLINE),
                _e(EffectKind.CANCEL_PENDING_DYNAMIC, REASON_PROMOTION),
                _e(EffectKind.PROMOTE_HEAD),
                _e(EffectKind.START_TURN),
            ),
        )
    if state == "R1":
        return Outcome(INTERRUPTING, (move, _e(EffectKind.SIGNAL_INTERRUPT)))
    # I1: already winding down; the moved head is promoted when it finishes.
    return Outcome(INTERRUPTING, (move,))


def set_archived(view: ExecView, archived: bool) -> Outcome:
    """PATCH archived: W↔XW, E0↔XE0, E1↔XE1; busy → 409; no-op → 400."""
    if archived == view.archived:
        raise Refused(400, MSG_ALREADY_ARCHIVED if archived else MSG_ALREADY_UNARCHIVED)
    state = classify(view)
    if state in ("R0", "R1", "I0", "I1", "A0", "A1"):
        raise Refused(409, MSG_ARCHIVE_BUSY)
    if state == "INVALID":
        raise Refused(409, MSG_INVALID_STATE)
    return Outcome(view.status, (_e(EffectKind.SET_ARCHIVED, value=archived),), archived=archived)


def edit_message(view: ExecView) -> Outcome:
    """PATCH /messages/{id}: any non-archived state → R0 (queue cleared, later rows
    soft-deleted, the current turn abandoned)."""
    if view.archived:
        raise Refused(400, "Cannot edit messages in an archived chat.")
    _require_valid(view)
    return Outcome(
        RUNNING,
        (
            _e(EffectKind.DISARM_DEADLINE),
            _e(EffectKind.CLEAR_ERROR),
            _e(EffectKind.START_TURN),
        ),
    )


def raw_json(text: str) -> Any:
    """Wrap raw (unparsed) JSON text so :func:`validate_tool_results` can check it."""
    return _RawJSON(text)


ALL_VIEWS: tuple[ExecView, ...] = tuple(
    ExecView(status=s, queue_len=q, archived=a)
    for s in STATUSES
    for q in (0, 1)
    for a in (False, True)
)
