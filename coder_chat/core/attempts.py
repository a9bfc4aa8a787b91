"""A step's attempts in a chat's history: one index over the messages, pure.

A step's prompt carries its marker (``"<marker> <prompt>"``) in a text part of a
user message; each such user message is one *attempt* of the step (a send that
landed). Steps run sequentially on a chat, so one step's attempts sit together:
:meth:`StepAttempts.of` finds the step's newest block of attempts and answers
everything recovery asks of it — how many, the last one's user message id,
whether it is the chat's newest turn, whether anything answered it, and how many
attempts count as the chat's *tail* (what the send journal's ``attempt`` is
compared with).

Messages in any order, plain dicts or ``models.ChatMessage``; a newest-first
read may stop as soon as :attr:`StepAttempts.tail_complete` (or
:attr:`StepAttempts.found`) holds.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from coder_chat.core.fields import field, int_or_none
from coder_chat.core.recovery import is_answered

__all__ = ["StepAttempts", "carries_marker"]


def carries_marker(message: Any, marker: str) -> bool:
    """True when a text part of ``message`` contains ``marker`` (a step's prompt)."""
    return any(
        field(p, "type") == "text" and marker in (field(p, "text", "") or "")
        for p in field(message, "content", []) or []
    )


def _id(message: Any) -> int:
    return int_or_none(field(message, "id")) or 0


@dataclass(frozen=True, slots=True)
class StepAttempts:
    """Where a step's attempts sit in the messages read (see :meth:`of`)."""

    marker: str
    #: User messages carrying the marker in the step's newest block (its attempts).
    attempts: int
    #: The newest of them (the step's last attempt); None if the marker is absent.
    last_user_message_id: int | None
    #: The last attempt is the chat's newest user message: nothing was sent after it.
    #: False when the marker is absent.
    tail: bool
    #: An assistant message follows the last attempt (before the next user message).
    answered: bool
    #: The block is closed by an older user message without the marker: reading
    #: further back cannot add attempts to it.
    closed: bool
    #: Any user message at all was read.
    any_user: bool

    @property
    def found(self) -> bool:
        """The step has an attempt in the messages read."""
        return self.last_user_message_id is not None

    @property
    def tail_attempts(self) -> int:
        """Attempts of the step at the tail of the chat: :attr:`attempts` when the step
        is the newest turn, else 0 (a later prompt follows). The count the send
        journal's ``attempt`` is compared with."""
        return self.attempts if self.tail else 0

    @property
    def tail_complete(self) -> bool:
        """:attr:`tail_attempts` cannot grow by reading further back: a user message
        without the marker was reached (a later one, or the one before the block)."""
        return (self.any_user and not self.tail) or self.closed

    @classmethod
    def of(cls, messages: Iterable[Any], marker: str) -> StepAttempts:
        """Index ``messages`` (any order) for the step ``marker``: ONE pass over its
        user messages, newest first; matching is by message part (a text part of a
        user message contains the marker)."""
        ordered = sorted(messages, key=_id)
        users = [m for m in reversed(ordered) if field(m, "role") == "user"]
        later = False
        for i, m in enumerate(users):
            if not carries_marker(m, marker):
                later = True
                continue
            attempts, closed = 0, False
            for older in users[i:]:
                if not carries_marker(older, marker):
                    closed = True
                    break
                attempts += 1
            last = _id(m)
            return cls(
                marker,
                attempts,
                last,
                tail=not later,
                answered=is_answered(ordered, last),
                closed=closed,
                any_user=True,
            )
        return cls(marker, 0, None, False, False, closed=False, any_user=bool(users))
