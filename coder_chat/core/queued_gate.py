"""The queued-prompt gate: when does a prompt queued behind a running job become ours?

A prompt posted while the chat is busy is queued (agent-semantics §3.3). Until
it materialises as a user message, every event on the stream belongs to the
predecessor's run, so the translator attributes nothing. This module decides,
event by event, whether the gate stays up, opens ("anchors") on our own user
message, or hit a dead end. It is pure: no I/O, no clock.

* **Exact** (servers that stamp ``queued_message_id``): a user message past the
  cursor whose stamp equals our entry id anchors at once; a different stamp is
  never ours, even with identical content (two jobs may queue the same text).
* **Heuristic** (unstamped servers): a user message whose content equals the
  entry's (canonical JSON) becomes the *candidate*; later events are buffered.
  The next ``queue_update`` decides: our entry still listed → it was someone
  else's prompt (drop candidate and buffer); entry gone → anchor on the
  candidate and replay the buffer; entry gone without a candidate → lost.
  With no entry id at all, the first content match anchors.
* **Dead ends** (``queued_submission_lost``): an ``error`` while gated (chatd
  does not promote the queue after an error settle), or the entry left the
  queue without a matching user message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from coder_chat.core.fields import canonical_json, int_or_none
from coder_chat.core.fields import field as read

__all__ = ["Anchored", "GateStep", "Lost", "QueuedGate", "QueuedPromptGate"]


@dataclass(frozen=True, slots=True)
class QueuedGate:
    """The queue entry a queued submission is waiting on.

    ``queued_id`` is the entry id from the POST response (``None`` if the server
    sent none); ``content`` is the entry's content, compared canonically.
    """

    queued_id: int | None
    content: Any


@dataclass(frozen=True, slots=True)
class Anchored:
    """The gate opened: ``message_id`` is our prompt; ``replay`` the events buffered after it."""

    message_id: int
    replay: list[Any] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Lost:
    """The queued prompt will never run as ours (raised as ``queued_submission_lost``)."""

    message: str


#: ``None`` = still gated.
GateStep = Anchored | Lost | None


class QueuedPromptGate:
    """Watches the stream for the materialisation of one queue entry.

    Args:
        entry: the queue entry (id and content) from the POST response.
        cursor: the pre-turn cursor; only user messages past it are candidates.
    """

    def __init__(self, entry: QueuedGate, cursor: int) -> None:
        self.entry = entry
        self.cursor = cursor
        self._content = canonical_json(entry.content)
        self._candidate: int | None = None
        self._buffer: list[Any] = []

    @property
    def queued_id(self) -> int | None:
        return self.entry.queued_id

    @property
    def candidate(self) -> int | None:
        """The heuristic candidate awaiting the next ``queue_update`` (if any)."""
        return self._candidate

    def feed(self, event: Any, etype: Any = None) -> GateStep:
        """Look at one stream event; say whether the gate stays up, anchors, or is lost."""
        if etype is None:
            etype = read(event, "type")
        entry_id = self.entry.queued_id
        if etype == "message":
            msg = read(event, "message")
            mid = int_or_none(read(msg, "id"))
            if read(msg, "role") == "user" and mid is not None and mid > self.cursor:
                stamp = int_or_none(read(msg, "queued_message_id"))
                if entry_id is not None and stamp is not None:
                    if stamp == entry_id:
                        return Anchored(mid)
                    return self._hold(event)
                if canonical_json(read(msg, "content", [])) == self._content:
                    if entry_id is None:
                        return Anchored(mid)
                    if self._candidate is None:
                        self._candidate = mid
                        self._buffer = []
                        return None
            return self._hold(event)
        if etype == "queue_update":
            if entry_id is None:
                return None
            listed = {
                int_or_none(read(q, "id")) for q in (read(event, "queued_messages", []) or [])
            }
            if entry_id in listed:
                # Our entry is still waiting: the candidate was someone else's prompt.
                self._candidate = None
                self._buffer = []
                return None
            if self._candidate is not None:
                replay, self._buffer = self._buffer, []
                return Anchored(self._candidate, replay)
            return Lost("queued message left the queue without materialising in the chat")
        if etype == "error":
            return Lost(
                "the chat errored while the queued message was waiting: "
                + str(read(read(event, "error"), "message", "unknown error"))
            )
        return self._hold(event)

    def _hold(self, event: Any) -> GateStep:
        if self._candidate is not None:
            self._buffer.append(event)
        return None
