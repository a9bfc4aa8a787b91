"""Replay dedup and forward-progress accounting for the chat stream
(agent-semantics §4.3, §4.4). Pure, no I/O.

* Deltas (``message_part``) carry an episode ``(history_version,
  generation_attempt)`` and a ``seq`` contiguous from 1 per episode. On every
  reconnect chatd replays the in-progress episode from seq 1, so a delta of
  the current episode with ``seq <= last`` is a replay: suppressed, not
  forwarded, not progress. Anything else advances the position and is
  progress.
* Deltas without full coordinates (old servers) cannot be deduped. They are
  forwarded but set a flag that makes the next connection drop terminal
  (a redial would replay and duplicate them). A newly committed message (id
  above the highest seen) clears it: chatd never streams more parts for a
  committed step, so nothing of that preview can be replayed into the turn.
* Snapshots (``message``) are always forwarded (content dedup is the
  translator's job); one counts as progress when its serialised JSON differs
  from the last seen for that id (a new commit or a revision). Redials reuse
  the turn's original ``after_id``, so unchanged messages come back verbatim
  and are correctly not progress.
* Nothing else (statuses, queue updates, resets, errors, unknown types)
  counts as progress.
* **Revision cursor.** B2 and later builds put the chat's ``history_version`` on
  every ``status`` event; chatd sends a sync's messages before its status, so
  once that event is read every message up to that version has been read too.
  :attr:`ReplayFilter.history_version` keeps the highest one seen, and a redial
  passes it back (``after_revision`` / ``history_version``) so the server re-sends
  only what changed since. B1 sends none: its redials resume from ``after_id``
  alone and re-sent messages are dropped by id (the translator's ledger).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

__all__ = ["Observation", "ReplayFilter"]


@dataclass(frozen=True, slots=True)
class Observation:
    """Verdict on one stream event."""

    forward: bool  # hand to the consumer (False only for a replayed delta)
    progress: bool  # counts as forward progress for the redial budget


_FORWARD = Observation(True, False)
_PROGRESS = Observation(True, True)
_SUPPRESS = Observation(False, False)


def _digest(message: Any) -> str:
    if hasattr(message, "model_dump"):
        data = message.model_dump(mode="json")
    else:
        data = message
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


class ReplayFilter:
    """Per-reader dedup state; lives across redials of one reader.

    ``after_id`` seeds the highest-seen message id (messages at or below it
    are the caller's history, not new commits).
    """

    __slots__ = (
        "_digests",
        "_episode",
        "_max_message_id",
        "_seq",
        "history_version",
        "untrackable_outstanding",
    )

    def __init__(self, after_id: int | None = None) -> None:
        self._episode: tuple[int, int] | None = None
        self._seq: int | None = None
        self._max_message_id: int = after_id or 0
        self._digests: dict[int, str] = {}
        self.untrackable_outstanding = False
        #: Highest ``history_version`` a ``status`` event reported (None: the server
        #: sends none, B1); the revision cursor for the next dial.
        self.history_version: int | None = None

    @property
    def position(self) -> tuple[int, int, int] | None:
        """Last forwarded delta (history_version, generation_attempt, seq)."""
        if self._episode is None or self._seq is None:
            return None
        return (*self._episode, self._seq)

    @property
    def max_message_id(self) -> int:
        return self._max_message_id

    def observe_delta(
        self, history_version: int | None, generation_attempt: int | None, seq: int | None
    ) -> Observation:
        if history_version is None or generation_attempt is None or seq is None:
            self.untrackable_outstanding = True
            return _FORWARD
        episode = (history_version, generation_attempt)
        if episode == self._episode and self._seq is not None and seq <= self._seq:
            return _SUPPRESS
        self._episode = episode
        self._seq = seq
        return _PROGRESS

    def observe_message(self, message_id: int, message: Any) -> Observation:
        """``message`` is the ChatMessage model (or its JSON dict)."""
        digest = _digest(message)
        changed = self._digests.get(message_id) != digest
        self._digests[message_id] = digest
        if message_id > self._max_message_id:
            self._max_message_id = message_id
            self.untrackable_outstanding = False
        return _PROGRESS if changed else _FORWARD

    def observe(self, event: Any) -> Observation:
        """Classify a ``ChatStreamEvent``."""
        kind = getattr(event, "type", None)
        if kind == "message_part":
            part = event.message_part
            if part is None:
                return _FORWARD
            return self.observe_delta(part.history_version, part.generation_attempt, part.seq)
        if kind == "message" and event.message is not None:
            return self.observe_message(event.message.id, event.message)
        if kind == "status" and event.status is not None:
            self.observe_status(event.status.history_version)
        return _FORWARD

    def observe_status(self, history_version: int | None) -> None:
        """Record a ``status`` event's ``history_version`` (absent on B1)."""
        if history_version is not None and history_version > (self.history_version or 0):
            self.history_version = history_version
