"""Redial backoff and budget of the chat stream (agent-semantics §4.2). Pure, no I/O.

Schedule: the wait starts at ``initial_ms`` and doubles after every wait up to
``cap_ms``, with no jitter; forward progress resets it to ``initial_ms`` and
clears the failure count. **Every** ended connection counts as one
consecutive failure, as in the reference SDK: progress clears the count while
the connection lives, and its ending then counts 1. So the drop that starts an
outage is failure #1 even though that connection made progress, and reaching
``max_consecutive_failures`` gives up. With the defaults an outage costs waits
of 1, 2, 4, 8 s and fails on the 5th ending (≈ 15 s), not ≈ 31 s as it would if
the first drop were free.

Progress is counted per *connection*, not per event, because chatd replays a
``status`` and the in-progress episode on every reconnect: counting mere
receipt would let a half-dead server (accepts, replays, drops) redial forever.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BackoffPolicy", "RedialBudget", "RedialDecision"]


@dataclass(frozen=True, slots=True)
class BackoffPolicy:
    """Backoff constants. Tests use millisecond-scale values."""

    initial_ms: int = 1_000
    cap_ms: int = 30_000
    factor: int = 2
    max_consecutive_failures: int = 5

    def __post_init__(self) -> None:
        if self.initial_ms < 0 or self.cap_ms < self.initial_ms:
            raise ValueError("backoff needs 0 <= initial_ms <= cap_ms")
        if self.factor < 1:
            raise ValueError("backoff factor must be >= 1")
        if self.max_consecutive_failures < 1:
            raise ValueError("max_consecutive_failures must be >= 1")


@dataclass(frozen=True, slots=True)
class RedialDecision:
    """What to do after a connection ended."""

    give_up: bool
    consecutive_failures: int
    backoff_ms: int  # the wait before the next dial (meaningless when give_up)


class RedialBudget:
    """Mutable budget state for one stream reader."""

    __slots__ = ("_backoff_ms", "_failures", "policy")

    def __init__(self, policy: BackoffPolicy | None = None) -> None:
        self.policy = policy or BackoffPolicy()
        self._backoff_ms = self.policy.initial_ms
        self._failures = 0

    @property
    def consecutive_failures(self) -> int:
        return self._failures

    @property
    def next_backoff_ms(self) -> int:
        return self._backoff_ms

    def progress(self) -> None:
        """Forward progress was made on the current connection."""
        self._failures = 0
        self._backoff_ms = self.policy.initial_ms

    def connection_ended(self, *, progressed: bool) -> RedialDecision:
        """Account for an ended connection (drop, refused upgrade, network error).

        ``progressed``: the connection made forward progress (same as having
        called :meth:`progress` during it): the count restarts, then this ending
        counts as the first failure.
        """
        if progressed:
            self.progress()
        self._failures += 1
        if self._failures >= self.policy.max_consecutive_failures:
            return RedialDecision(True, self._failures, self._backoff_ms)
        wait = self._backoff_ms
        self._backoff_ms = min(self._backoff_ms * self.policy.factor, self.policy.cap_ms)
        return RedialDecision(False, self._failures, wait)
