"""Which turn :meth:`~coder_chat.agent.CoderAgent.follow` re-attaches to.

The I/O half of a follow's start: one history read (newest first, paged until
the turn's prompt is on hand) and, for a marker not yet in history, one read of
the queue. The pure choices — which user message, which rounds already
finished, where the stream resumes — are :mod:`coder_chat.core.follow`'s.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from coder_chat.core.follow import (
    FollowPlan,
    history_covers,
    pick_queued,
    pick_turn,
    plan_follow,
)
from coder_chat.errors import CoderAgentError
from coder_chat.history import fetch_until
from coder_chat.rest import ChatClient

__all__ = ["FollowHint", "NoTurnToFollowError", "find_turn_to_follow"]


class NoTurnToFollowError(CoderAgentError):
    """:meth:`CoderAgent.follow` found no user message to follow.

    With no hint, the chat has no user message after ``last_seen_message_id``
    (nothing was submitted since the checkpoint, or a submitted prompt is still
    queued behind another run: pass its marker to follow it); with a hint, no
    user message (and, for a marker, no queued prompt) matches it.
    """

    def __init__(
        self, chat_id: str, cursor: int | None, user_message_id: int | None, marker: str | None
    ) -> None:
        if user_message_id is not None:
            what = f"user message {user_message_id}"
        elif marker is not None:
            what = f"a user message carrying marker {marker!r}"
        elif cursor is not None:
            what = f"a user message after message {cursor}"
        else:
            what = "a user message"
        super().__init__(f"no turn to follow in chat {chat_id}: history holds no {what}")
        self.chat_id = chat_id
        self.cursor = cursor
        self.user_message_id = user_message_id
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        # Prefect persists a failed task's exception: rebuild it from its fields
        # (the default would call __init__ with the message alone and fail).
        return (type(self), (self.chat_id, self.cursor, self.user_message_id, self.marker))


@dataclass(frozen=True, slots=True)
class FollowHint:
    """What ``follow()`` was told about the turn (both ``None``: the first after the cursor)."""

    user_message_id: int | None
    marker: str | None


async def find_turn_to_follow(
    client: ChatClient,
    chat_id: str,
    hint: FollowHint,
    cursor: int | None,
    client_tool_names: AbstractSet[str],
) -> FollowPlan:
    """Plan the follow of ``chat_id``'s turn; :class:`NoTurnToFollowError` if none."""
    names = client_tool_names
    plan = await _plan_from_history(client, chat_id, hint, cursor, names)
    if plan is None and hint.marker is not None and hint.user_message_id is None:
        # Not in history: the prompt may still be queued behind another run.
        # One response gives the queue and the newest id together, so the
        # promoted prompt (if it comes) is past the cursor we dial from.
        page = await client.get_messages(chat_id, limit=1)
        entry = pick_queued(page.queued_messages, hint.marker)
        if entry is not None:
            newest = page.messages[0].id if page.messages else 0
            return FollowPlan(None, cursor=newest, queued=entry)
        # Promoted between the two reads: then it is in history now.
        plan = await _plan_from_history(client, chat_id, hint, cursor, names)
    if plan is None:
        raise NoTurnToFollowError(chat_id, cursor, hint.user_message_id, hint.marker)
    return plan


async def _plan_from_history(
    client: ChatClient,
    chat_id: str,
    hint: FollowHint,
    cursor: int | None,
    client_tool_names: AbstractSet[str],
) -> FollowPlan | None:
    messages, _ = await fetch_until(
        client,
        chat_id,
        lambda ms: history_covers(
            ms, after_id=cursor, user_message_id=hint.user_message_id, marker=hint.marker
        ),
    )
    uid = pick_turn(
        messages, after_id=cursor, user_message_id=hint.user_message_id, marker=hint.marker
    )
    if uid is None:
        return None
    return plan_follow(messages, user_message_id=uid, client_tool_names=client_tool_names)
