"""The send journal: its entry, how entries are made, and what an entry says about a step.

One entry per chat (durable design, "settle-wait"): written ahead of every send
(``submitting``, ``attempt`` = the step's attempt count *before* the send) and
ahead of the ledger reconcile's network calls (``resumed`` / ``cut-short``).
Entries are made only through the named constructors
(:meth:`JournalEntry.submitting`, :meth:`JournalEntry.resumed`,
:meth:`JournalEntry.cut_short`) and read only through :func:`classify_entry`,
which says, against a step's marker and its attempt count in history, whether
the entry is that step's unsent send, its landed send, a revival, a cut-short
verdict, a stale verdict of an earlier attempt, or another step's entry — and
when the attempt's turn runs out (:attr:`EntryReading.deadline`).

Pure: no I/O, no store. ``prefect_coder.blocks.state`` stores this very model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "EntryReading",
    "JournalEntry",
    "JournalState",
    "JournalView",
    "Standing",
    "classify_entry",
]

JournalState = Literal["submitting", "resumed", "cut-short"]


class JournalEntry(BaseModel):
    """The per-attempt send journal entry of one chat.

    ``at`` is Unix epoch *seconds* (``time.time()``) at write time, as the writer saw it;
    recovery compares it to its own clock to sleep out the commit window.

    ``deadline`` (epoch seconds, optional): when the attempt's turn bound runs out —
    for a ``submitting`` entry the send's ``at`` plus the STEP's turn timeout, for
    ``resumed`` the revival's ``at`` plus it. ``sweep-stuck-turns`` leaves a crashed
    attempt live until then (its workflow's recovery follows it), and recovery
    follows it for as long. ``None`` (entries written before the field existed, and
    ``cut-short`` verdicts): readers fall back to ``at`` + their own turn timeout
    (:func:`classify_entry`'s ``turn_timeout``).

    ``updated_at``: the store's (database clock) time of the write; set by the store.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    state: JournalState
    marker: str
    attempt: Annotated[int, Field(strict=True, ge=0)]
    at: float = Field(default_factory=time.time)
    deadline: float | None = None
    updated_at: datetime | None = None

    @classmethod
    def submitting(
        cls,
        marker: str,
        attempt: int,
        *,
        turn_timeout: float | None = None,
        at: float | None = None,
    ) -> JournalEntry:
        """A send's write-ahead: ``attempt`` is the step's count before the send.
        ``turn_timeout``: the step's; the entry records ``at`` + it as the attempt's
        deadline (None: no deadline recorded). ``at``: now unless given."""
        return cls._timed("submitting", marker, attempt, turn_timeout, at)

    @classmethod
    def resumed(
        cls,
        marker: str,
        attempt: int,
        *,
        turn_timeout: float | None = None,
        at: float | None = None,
    ) -> JournalEntry:
        """A reconcile's verdict "answered, not cut short": the revived run is the
        attempt's own; it gets ``turn_timeout`` from ``at`` (None: no deadline)."""
        return cls._timed("resumed", marker, attempt, turn_timeout, at)

    @classmethod
    def cut_short(cls, marker: str, attempt: int, *, at: float | None = None) -> JournalEntry:
        """The verdict "this attempt was (or may have been) stopped": resubmit it,
        never return it. A verdict bounds no turn: no deadline."""
        return cls._timed("cut-short", marker, attempt, None, at)

    @classmethod
    def _timed(
        cls,
        state: JournalState,
        marker: str,
        attempt: int,
        turn_timeout: float | None,
        at: float | None,
    ) -> JournalEntry:
        written = time.time() if at is None else at
        deadline = None if turn_timeout is None else written + turn_timeout
        return cls(state=state, marker=marker, attempt=attempt, at=written, deadline=deadline)

    def turn_s(self, fallback: float) -> float:
        """The step's turn timeout as this entry recorded it (``deadline - at``), else
        ``fallback`` (no deadline, or one not after ``at``). For giving a revival of
        the attempt a turn of its own, as long as the step's."""
        return _turn_s(self, fallback)


class JournalView(Protocol):
    """What the readers use of an entry (:class:`JournalEntry` fits)."""

    @property
    def state(self) -> str: ...
    @property
    def marker(self) -> str: ...
    @property
    def attempt(self) -> int: ...
    @property
    def at(self) -> float: ...
    @property
    def deadline(self) -> float | None: ...


def _turn_s(entry: JournalView, fallback: float) -> float:
    if entry.deadline is not None and entry.deadline > entry.at:
        return entry.deadline - entry.at
    return fallback


class Standing(StrEnum):
    """What a journal entry says about a step whose history holds ``attempts``."""

    #: ``submitting`` at the count: the send has not landed (or not yet).
    UNSENT = "unsent"
    #: ``submitting`` below the count: the send landed; a live run is that attempt's.
    LANDED = "landed"
    #: ``resumed`` at the count: a recovery pass answered its pause and revived it.
    REVIVED = "revived"
    #: ``cut-short`` at the count: it was (or may have been) stopped: resubmit it.
    CUT_SHORT = "cut-short"
    #: This step's marker, but the count moved on (a resubmission landed) or a
    #: verdict of an attempt the count does not match: it says nothing now.
    STALE = "stale"
    #: No entry, or another step's.
    OTHER_STEP = "other-step"


@dataclass(frozen=True, slots=True)
class EntryReading:
    """:func:`classify_entry`'s answer."""

    standing: Standing
    entry: JournalView | None
    #: The step's attempts in history the entry was read against.
    attempts: int
    #: When the attempt's turn runs out (epoch seconds): the entry's recorded
    #: deadline, else its ``at`` + the reader's turn timeout; None without an entry
    #: (or without either).
    deadline: float | None

    @property
    def this_attempt(self) -> bool:
        """The entry is about the attempt history shows last (marker and count match)."""
        return self.standing in (Standing.UNSENT, Standing.REVIVED, Standing.CUT_SHORT)

    def left(self, now: float) -> float:
        """Seconds until :attr:`deadline`, counted from ``now`` — or from the entry's
        ``at`` when our clock is behind the writer's: a skewed clock never stretches
        a turn. ``<= 0``: the deadline passed."""
        assert self.entry is not None and self.deadline is not None
        return self.deadline - max(now, self.entry.at)

    def crashed_attempt_left(self, now: float) -> float | None:
        """Seconds left of the step's crashed attempt's turn when its run is live on the
        chat — its send landed, or a recovery pass revived it — else None (also once
        the deadline passed). Nobody cuts such a run short before then: its
        workflow's recovery follows it."""
        if self.standing is Standing.LANDED or (
            self.standing is Standing.REVIVED and self.attempts > 0
        ):
            left = self.left(now)
            return left if left > 0 else None
        return None


def classify_entry(
    entry: JournalView | None, marker: str, attempts: int, *, turn_timeout: float | None = None
) -> EntryReading:
    """What ``entry`` says about the step ``marker`` whose history holds ``attempts``
    (user messages carrying the marker, contiguous at the tail).

    Entries are per attempt, so a verdict from attempt N never classifies attempt
    N+1 (a double crash), and a later step on the same chat never inherits it:
    every resubmission that lands retires the earlier verdict by itself.
    ``turn_timeout``: the reader's own, for an entry that recorded no deadline.
    """
    if entry is None or entry.marker != marker:
        return EntryReading(Standing.OTHER_STEP, entry, attempts, None)
    if entry.state == "submitting" and attempts > entry.attempt:
        standing = Standing.LANDED
    elif entry.attempt != attempts:
        standing = Standing.STALE
    elif entry.state == "submitting":
        standing = Standing.UNSENT
    elif entry.state == "resumed":
        standing = Standing.REVIVED
    else:
        standing = Standing.CUT_SHORT
    if entry.deadline is not None and entry.deadline > entry.at:
        deadline: float | None = entry.deadline
    else:
        deadline = None if turn_timeout is None else entry.at + turn_timeout
    return EntryReading(standing, entry, attempts, deadline)
