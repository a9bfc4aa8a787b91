# The per-call `timeout=` parameter is part of the module contract (docs/architecture.md).
# ruff: noqa: ASYNC109
"""What every stage of a step's recovery shares: its state, its decision log and
timeline, the step's attempt count, its journal writes, bringing the chat to rest,
and the lost-outcome check (:class:`RecoveryShell`; the stages build on it)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel

from coder_chat.core.attempts import StepAttempts
from coder_chat.core.fields import field, int_or_none
from coder_chat.core.journal import JournalEntry, JournalView
from coder_chat.core.recovery import RecoveryDecision, lost_outcomes
from coder_chat.crash_safe import crash_point
from coder_chat.history import fetch_until
from coder_chat.models import Chat
from coder_chat.rest import ChatClient
from coder_chat.stop import StopResult, stop_chat
from coder_chat.tools import ClientTool

from .contract import (
    Follower,
    RecoveryStore,
    RecoveryTimings,
    ToolOutcomeLostError,
    timeline_origin,
)

__all__ = ["Paused", "RecoveryShell", "newest_user_message_id"]

#: One logger for every stage: recovery's lines read as one timeline.
_log = logging.getLogger("coder_chat.recovery")


def newest_user_message_id(messages: Iterable[Any]) -> int | None:
    """The id of the newest user message among ``messages`` (any order); None: none.

    A turn starts only with a user message landing (a send, a queued prompt's
    promotion), so this id names the newest turn a history read can hold."""
    ids = [int_or_none(field(m, "id")) or 0 for m in messages if field(m, "role") == "user"]
    return max(ids, default=None)


class Paused(Exception):
    """A stop found the chat paused on client tools before its first interrupt."""


class RecoveryShell:
    """The state and the I/O helpers of one step's recovery (see
    :class:`coder_chat.recovery.TurnRecovery`, which takes the same arguments)."""

    def __init__(
        self,
        client: ChatClient,
        store: RecoveryStore,
        chat_id: str,
        marker: str,
        *,
        tools: Sequence[ClientTool[Any]] = (),
        timings: RecoveryTimings | None = None,
        known_failure: bool = False,
        output_model: type[BaseModel] | None = None,
        structured_tool_name: str = "structured_output",
        clock: Callable[[], float] = time.time,
        logger: logging.Logger | logging.LoggerAdapter[Any] | None = None,
        follower: Follower | None = None,
        turn_timeout: float | None = None,
    ) -> None:
        self.client = client
        self.store = store
        self.chat_id = chat_id
        self.marker = marker
        self.tools: Mapping[str, ClientTool[Any]] = {t.name: t for t in tools}
        self.timings = timings or RecoveryTimings()
        self.known_failure = known_failure
        self.output_model = output_model
        self.structured_tool_name = structured_tool_name
        self.clock = clock
        self.log = logger or _log
        self.follower = follower
        self.turn_timeout = turn_timeout
        #: The step's turn timeout as the crashed attempt's entry recorded it.
        self._attempt_turn_s: float | None = None
        self.decisions: list[RecoveryDecision] = []
        # Set once following found no turn: settle the ordinary way from then on.
        self._follow_off = False
        self._refollows = 0
        #: The newest user message the last :meth:`attempts` read saw (None: none):
        #: what the settle poll's status read after it covered (see ``check_result``).
        self.counted_user_id: int | None = None
        self._t0 = timeline_origin.get() or time.time()

    # ------------------------------------------------------------------ helpers

    def _decide(self, stage: str, seen: str, decided: str, why: str) -> None:
        d = RecoveryDecision(stage, seen, decided, why)
        self.decisions.append(d)
        self.log.info(
            "recovery [%s] %s: saw %s → %s (%s) +%.1fs",
            self.chat_id, stage, seen, decided, why, self._elapsed(),
        )  # fmt: skip

    def _elapsed(self) -> float:
        return time.time() - self._t0

    def _mark(self, what: str) -> None:
        """A timeline line (``+N.Ns`` since :data:`timeline_origin`): where the time went."""
        self.log.info("recovery [%s] %s +%.1fs", self.chat_id, what, self._elapsed())

    async def attempts(self, *, timeout: float | None = None) -> int:
        """Committed attempts of the step: user messages carrying the marker.

        Steps run sequentially, so they sit contiguous at the tail of history:
        page newest-first and stop at the first user message without the marker.
        Records the newest user message read (:attr:`counted_user_id`).
        """
        messages, _ = await fetch_until(
            self.client,
            self.chat_id,
            lambda ms: StepAttempts.of(ms, self.marker).tail_complete,
            timeout=timeout,
        )
        self.counted_user_id = newest_user_message_id(messages)
        return StepAttempts.of(messages, self.marker).tail_attempts

    async def _journal(self, state: Literal["resumed", "cut-short", "submitting"], n: int) -> None:
        at = self.clock()
        # A send is bounded by this process's turn timeout; a revived run by its
        # attempt's (recorded with the crashed send), this process's if unknown.
        # A verdict (cut-short) bounds nothing.
        if state == "submitting":
            entry = JournalEntry.submitting(self.marker, n, turn_timeout=self.turn_timeout, at=at)
        elif state == "resumed":
            entry = JournalEntry.resumed(
                self.marker, n, turn_timeout=self._attempt_turn_s or self.turn_timeout, at=at
            )
        else:
            entry = JournalEntry.cut_short(self.marker, n, at=at)
        await self.store.journal.set(self.chat_id, entry)

    def _note_attempt_turn(self, entry: JournalView) -> float | None:
        """The crashed attempt's turn timeout as its entry recorded it (None: not
        recorded), kept: a revival this recovery journals gets as long (the step's
        turn timeout, not ours)."""
        if entry.deadline is None or entry.deadline <= entry.at:
            return None
        self._attempt_turn_s = entry.deadline - entry.at
        return self._attempt_turn_s

    async def _stop(
        self,
        timeout: float,
        *,
        journal_cut_short: int | None = None,
        stop_a_pause: bool = True,
    ) -> tuple[StopResult, bool]:
        """Bring the chat to rest with the one stop primitive (``stop_chat``).

        An interrupt of a ``requires_action`` pause makes chatd close the pending
        calls with synthetic errors and RESUME the model; ``stop_chat`` interrupts
        that run again instead of leaving it to call a tool anew. With
        ``journal_cut_short`` (the attempt count) every interrupt is preceded by
        a "cut-short" journal write, so a crash right after an accepted
        interrupt leaves the verdict behind. ``stop_a_pause=False``: a pause that
        appears before the first interrupt is not interrupted (:class:`Paused`
        is raised): it is the pending record of tool calls, reconcile it.

        Returns the stop result and whether an interrupt may have landed
        (accepted, or sent and its answer lost).
        """
        sent = 0

        async def before(chat: Chat) -> None:
            nonlocal sent
            if not stop_a_pause and sent == 0 and chat.status == "requires_action":
                raise Paused
            if journal_cut_short is not None:
                await self._journal("cut-short", journal_cut_short)
                crash_point("recovery.before_interrupt")
            sent += 1

        result = await stop_chat(
            self.client,
            self.chat_id,
            timeout=max(0.001, timeout),
            before_interrupt=before,
            poll_interval=self.timings.poll_interval,
        )
        landed = result.interrupts > 0 or (sent > 0 and result.last_error is not None)
        return result, landed

    async def _raise_lost_outcomes(self, results: Any) -> None:
        """Raise :class:`ToolOutcomeLostError` when history says a client call timed
        out although the ledger shows its effect ran (see the error's docstring)."""
        rows = list(results)
        states: dict[str, str | None] = {}
        entries: dict[str, Any] = {}
        for call_id, _, _output, is_error in rows:
            if not is_error or call_id in states:
                continue
            entry = await self.store.ledger.get(self.chat_id, call_id)
            states[call_id] = None if entry is None else entry.state
            entries[call_id] = entry
        lost = lost_outcomes(rows, states)
        if not lost:
            return
        calls = [
            (call_id, name, state, getattr(entries[call_id], "output", None))
            for call_id, name, state in lost
        ]
        self._decide(
            "result",
            "; ".join(f"{n} {c}: 'timed out' in history, ledger {st}" for c, n, st in lost),
            "fail the step",
            "an applied effect recorded as a failure: neither return nor resubmit",
        )
        raise ToolOutcomeLostError(self.chat_id, self.marker, calls)

    async def journal_resubmission(self, attempts: int) -> None:
        """Write-ahead of a resubmission: ``submitting`` with the current count.

        It supersedes the "cut-short" verdict it acts on — safely: an unlanded
        send over an existing attempt makes the next settle-wait pin cut_short
        right back.
        """
        await self._journal("submitting", attempts)
        self._decide("resubmit", f"{attempts} attempt(s)", "journal submitting", "write-ahead")
