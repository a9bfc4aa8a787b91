"""Errors raised by the flows (all :class:`PrefectCoderError`; the client's errors live in
``coder_chat.errors``, and :mod:`prefect_coder.errors` gathers the product's).

Every message names the offending field and says how to fix it: these errors are
what a person sees in the Prefect UI when a deployment is started with bad
parameters, so they must be actionable without reading code.
"""

from __future__ import annotations

from coder_chat.errors import CoderAgentError
from prefect_coder.blocks.errors import PrefectCoderError

__all__ = [
    "ChatNotArchivedError",
    "StructuredAnswerError",
    "TurnSlotLostError",
    "TurnSlotUnavailableError",
    "WorkflowBusyError",
    "WorkflowParameterError",
]


class WorkflowParameterError(PrefectCoderError, ValueError):
    """A flow/deployment parameter is invalid. Raised before any chat is created.

    ``field`` is the dotted parameter path (e.g. ``steps[1].tools[0]``) and
    ``fix`` a one-line remedy; both are part of the message.
    """

    def __init__(self, field: str, problem: str, fix: str) -> None:
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(f"{field}: {problem}. Fix: {fix}")

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.field, self.problem, self.fix))


class WorkflowBusyError(PrefectCoderError, RuntimeError):
    """Another run holds the workflow's lease for longer than this run may wait.

    Two flow runs that target the same workflow never run turns at the same time
    (a chat is single-flight server-side; a second prompt would queue behind the
    live run and burn its timeout). The waiting run gives up with this error.
    """

    def __init__(self, workflow_id: str, waited_s: float) -> None:
        self.workflow_id = workflow_id
        self.waited_s = waited_s
        super().__init__(
            f"workflow {workflow_id!r} is busy: another run held its lease for "
            f"{waited_s:.1f}s, longer than settings.lease_wait_s. Only one run may drive "
            "a workflow's chat at a time; wait for the other run to finish (or raise "
            "settings.lease_wait_s) and start this run again."
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.workflow_id, self.waited_s))


class TurnSlotUnavailableError(PrefectCoderError, RuntimeError):
    """No turn slot became free within ``turn_slot_wait`` (the fleet is at its cap)."""

    def __init__(self, cap: int, waited_s: float) -> None:
        self.cap = cap
        self.waited_s = waited_s
        super().__init__(
            f"no turn slot became free in {waited_s:.1f}s: all {cap} slots of "
            "CoderCredentials.max_concurrent_turns stayed busy. Raise turn_slot_wait, raise "
            "max_concurrent_turns (within the deployment's chat capacity), or start fewer "
            "workflows at once."
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.cap, self.waited_s))


class TurnSlotLostError(PrefectCoderError, RuntimeError):
    """The turn's slot was taken over before the turn sent its prompt: its process
    stalled past ``turn_slot_ttl`` after claiming it, and a waiter took it. Nothing
    was sent; the task is retried (and waits for a slot again)."""

    retryable = True

    def __init__(self, index: int, stale_s: float) -> None:
        self.index = index
        self.stale_s = stale_s
        super().__init__(
            f"turn slot {index} was taken over before this turn sent anything (not "
            f"renewed for {stale_s:.1f}s: the process stalled past "
            "CoderCredentials.turn_slot_ttl); nothing was sent and the turn is retried. "
            "If this repeats, the worker is starved: give it more CPU or raise "
            "turn_slot_ttl."
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.index, self.stale_s))


class StructuredAnswerError(PrefectCoderError, CoderAgentError):
    """A structured step's model filed no answer that validates, even after the
    re-ask: the step fails (a ``Completed`` step with ``structured=None`` would
    pass a missing answer off as a result). Not retried by Prefect: the same
    prompt on the same chat meets the same model.

    ``step``, ``output_model``, ``chat_id`` and ``attempts`` (sends of the step,
    the re-ask included) name what failed; the chat keeps the filed calls.
    """

    def __init__(self, step: str, output_model: str | None, chat_id: str | None, attempts: int):
        super().__init__(
            f"step {step!r} asked for {output_model!r} but the model filed no valid answer, "
            f"also not after the re-ask (chat {chat_id}, {attempts} send(s))"
        )
        self.step = step
        self.output_model = output_model
        self.chat_id = chat_id
        self.attempts = attempts

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.step, self.output_model, self.chat_id, self.attempts))


class ChatNotArchivedError(PrefectCoderError, RuntimeError):
    """A chat to retire did not come to rest and archive within the sweep's bounds."""
