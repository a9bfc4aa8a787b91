"""Re-attaching to a turn: which turn to follow, and which of its steps are already done.

A process that dies mid-turn leaves a chat whose run goes on without it. A new
process re-attaches (``CoderAgent.follow``) by reading history once and then
following the stream. These pure functions decide from that history read:

* **which turn** is meant (:func:`pick_turn`): an explicit user message id; else
  the newest user message carrying the step's marker; else the first user
  message after the checkpointed cursor (the checkpoint precedes the turn that
  was running); with no cursor, the chat's last user message;
* **how far history must be paged** for that (:func:`history_covers`);
* a prompt carrying the marker that is still **queued** behind another run
  (:func:`pick_queued`): the follower waits behind the queued-prompt gate for
  it to be promoted, exactly as the ``generate()`` that queued it would have;
* **which steps are already done** (:func:`plan_follow`): a step is one model
  call whose client tool calls, if any, all have results in history. Those
  steps are rebuilt from history; the live part of the turn — the step still
  generating, or paused waiting for client results — is read from the stream,
  starting right after the last done step. Reading from there (not from the
  user message) is what keeps the final step's text apart from the earlier
  steps' text, as a process that never died would have reported it.

No I/O here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from coder_chat.core.attempts import carries_marker
from coder_chat.core.fields import field as read
from coder_chat.core.fields import int_or_none, plain, tool_args_json
from coder_chat.core.queued_gate import QueuedGate

__all__ = [
    "DoneStep",
    "FollowPlan",
    "history_covers",
    "pick_queued",
    "pick_turn",
    "plan_follow",
]


@dataclass(frozen=True, slots=True)
class DoneStep:
    """A step already finished in history: a client tool round whose results were posted."""

    #: The step's messages (assistant, then the tool messages with the results), ascending.
    messages: tuple[Any, ...]
    #: Its client calls: ``tool_call_id``, ``tool_name``, ``args`` (JSON string).
    calls: tuple[Mapping[str, str], ...]
    #: ``tool_call_id`` → ``(output, is_error)`` as posted.
    outputs: Mapping[str, tuple[Any, bool]]
    #: The message id the step's window starts after.
    after_id: int

    @property
    def last_id(self) -> int:
        return max(_id(m) for m in self.messages)


@dataclass(frozen=True, slots=True)
class FollowPlan:
    """What a follower rebuilds from history and where it starts reading the stream."""

    #: The followed prompt; ``None`` while it is still queued (see ``queued``).
    user_message_id: int | None
    done_steps: tuple[DoneStep, ...] = ()
    #: The live step's window opens after this id (the last done step, or the prompt;
    #: for a queued prompt, the newest message when the queue was read).
    cursor: int = 0
    #: Client calls already answered in history (replayed pauses for them are ignored).
    answered_call_ids: frozenset[str] = field(default_factory=frozenset)
    #: The queue entry of a prompt not yet promoted: follow behind the queued gate.
    queued: QueuedGate | None = None


def _id(message: Any) -> int:
    return int_or_none(read(message, "id")) or 0


def _is_user(message: Any) -> bool:
    return read(message, "role") == "user"


def history_covers(
    messages: Sequence[Any],
    *,
    after_id: int | None,
    user_message_id: int | None = None,
    marker: str | None = None,
) -> bool:
    """True once a newest-first history read holds enough to :func:`pick_turn`."""
    if user_message_id is not None:
        return any(_id(m) <= user_message_id for m in messages)
    if marker is not None:
        return any(_is_user(m) and carries_marker(m, marker) for m in messages)
    if after_id is not None:
        return any(_id(m) <= after_id for m in messages)
    return any(_is_user(m) for m in messages)


def pick_turn(
    messages: Iterable[Any],
    *,
    after_id: int | None,
    user_message_id: int | None = None,
    marker: str | None = None,
) -> int | None:
    """The id of the user message that started the turn to follow, or ``None``.

    Precedence: ``user_message_id`` (must be a user message in ``messages``),
    then the newest user message containing ``marker``, then the first user
    message after ``after_id``, then (no cursor) the last user message.
    """
    users = sorted(_id(m) for m in messages if _is_user(m))
    if user_message_id is not None:
        return user_message_id if user_message_id in users else None
    if marker is not None:
        marked = [_id(m) for m in messages if _is_user(m) and carries_marker(m, marker)]
        return max(marked) if marked else None
    if after_id is not None:
        return next((u for u in users if u > after_id), None)
    return users[-1] if users else None


def pick_queued(queued_messages: Iterable[Any], marker: str) -> QueuedGate | None:
    """The newest queue entry whose text carries ``marker``: a prompt sent, not yet run."""
    matching = [q for q in queued_messages if carries_marker(q, marker)]
    if not matching:
        return None
    entry = max(matching, key=_id)  # queue ids increase
    return QueuedGate(_id(entry), read(entry, "content", []))


def plan_follow(
    messages: Iterable[Any], *, user_message_id: int, client_tool_names: AbstractSet[str]
) -> FollowPlan:
    """Split the turn that ``user_message_id`` started into done steps and the live rest.

    The turn ends at the next user message (a later turn; the live reader
    settles there as a promotion). A step closes as soon as every client call
    of its assistant message has a result; a step without client calls is the
    final one and is always read live (it may still be generating).
    """
    turn = sorted((m for m in messages if _id(m) > user_message_id), key=_id)
    done: list[DoneStep] = []
    answered: set[str] = set()
    current: list[Any] = []
    calls: dict[str, Mapping[str, str]] = {}
    outputs: dict[str, tuple[Any, bool]] = {}
    after = user_message_id
    for message in turn:
        if _is_user(message):
            break
        current.append(message)
        for part in read(message, "content", []) or []:
            ptype = read(part, "type")
            cid = read(part, "tool_call_id")
            if not isinstance(cid, str) or not cid:
                continue
            if (
                ptype == "tool-call"
                and read(message, "role") == "assistant"
                and not read(part, "provider_executed")
                and read(part, "tool_name") in client_tool_names
            ):
                calls[cid] = {
                    "tool_call_id": cid,
                    "tool_name": str(read(part, "tool_name")),
                    "args": tool_args_json(part),
                }
            elif ptype == "tool-result" and cid in calls and cid not in outputs:
                outputs[cid] = (plain(read(part, "result")), bool(read(part, "is_error")))
        if calls and all(cid in outputs for cid in calls):
            step = DoneStep(tuple(current), tuple(calls.values()), dict(outputs), after)
            done.append(step)
            answered.update(calls)
            after = step.last_id
            current, calls, outputs = [], {}, {}
    return FollowPlan(user_message_id, tuple(done), after, frozenset(answered))
