# The per-call `timeout=` parameter is the Follower protocol's (coder_chat.recovery).
# ruff: noqa: ASYNC109
"""The turn's agent as recovery's follower: a follow that fails sends no interrupt of
its own; recovery, which knows the attempt, brings the run to an end itself.

**The window (chaos seed 519).** Recovery follows an earlier attempt with the turn's
own agent. When that follow failed — its stream could not be re-established, say —
the agent's teardown fired a best-effort interrupt in the background, as a failed
``generate()`` does. Two things went wrong from there:

* recovery could not know whether that interrupt reached a live run or met a run
  that had finished meanwhile (its answer is swallowed), so it took the attempt for
  cut short: a FINISHED attempt was sent again;
* the background interrupt (journaled first: a store read, a history read, a store
  write) was still on its way when the turn sent the step again, and stopped the NEW
  attempt after its first words — which the turn then returned as the step's answer.

So while recovery follows, the turn's ``before_interrupt`` hook refuses every
interrupt of the agent (:class:`FollowGate`; the agent then leaves the run alone, as
its hook contract says), a failed follow waits until the agent's background requests
are done (no interrupt of it can be in flight when the step is sent again), and says
it left the run alone (``left_run_live``, as the agent's own transient failures do):
recovery then settles the chat again — the finished attempt is recovered, a live one
followed again or, past its deadline, stopped by recovery itself, journaled
``cut-short`` before its interrupt (:meth:`coder_chat.recovery.TurnRecovery.follow`).
"""

from __future__ import annotations

from dataclasses import dataclass

from coder_chat.agent import CoderAgent, GenerateResult

__all__ = ["FollowGate", "LeftToRecovery", "RecoveryFollower"]


class LeftToRecovery(Exception):
    """Raised by the turn's ``before_interrupt`` hook while recovery follows: the
    agent sends no interrupt (it logs that the chat is left for recovery)."""

    def __init__(self, chat_id: str) -> None:
        super().__init__(f"chat {chat_id}: recovery is following it; it stops the run itself")
        self.chat_id = chat_id


@dataclass(slots=True)
class FollowGate:
    """Shared by the turn's ``before_interrupt`` hook and its :class:`RecoveryFollower`:
    whether the agent's interrupts are recovery's to send. It holds no agent, so the
    hook that reads it keeps no reference cycle through the agent."""

    following: bool = False

    def check(self, chat_id: str) -> None:
        """Raise :class:`LeftToRecovery` while recovery follows with the agent."""
        if self.following:
            raise LeftToRecovery(chat_id)


class RecoveryFollower:
    """A :class:`coder_chat.recovery.Follower` over the turn's agent (see the module's
    docstring). ``wait_s`` bounds the wait for the agent's background requests after a
    failed follow (an interrupt the hook refuses ends at once)."""

    __slots__ = ("_agent", "_gate", "_wait_s", "left_run_live")

    def __init__(self, agent: CoderAgent, gate: FollowGate, *, wait_s: float) -> None:
        self._agent = agent
        self._gate = gate
        self._wait_s = wait_s
        #: The chat whose run the last failed follow left alone (None: it succeeded).
        self.left_run_live: str | None = None

    async def follow(
        self,
        *,
        timeout: float | None = None,
        user_message_id: int | None = None,
        marker: str | None = None,
    ) -> GenerateResult:
        """The agent's :meth:`~coder_chat.agent.CoderAgent.follow`, its interrupts
        refused; a failure leaves the run alone (``left_run_live``)."""
        self.left_run_live = None
        self._gate.following = True
        try:
            return await self._agent.follow(
                timeout=timeout, user_message_id=user_message_id, marker=marker
            )
        except Exception:
            # The teardown's interrupt is a background task that has not run yet: let it
            # run into the closed gate now, so none is left to land on a later send.
            await self._agent.wait_background(self._wait_s)
            self.left_run_live = self._agent.chat_id
            raise
        finally:
            # A cancellation keeps the agent's own behaviour: its interrupt, journaled
            # cut-short by the hook, once the gate is open again.
            self._gate.following = False
