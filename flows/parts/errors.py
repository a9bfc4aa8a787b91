"""Errors raised by the Prefect layer itself (the client's errors live in ``coder_chat.errors``).

Every message names the offending field and says how to fix it: these errors are
what a person sees in the Prefect UI when a deployment is started with bad
parameters, so they must be actionable without reading code.
"""

from __future__ import annotations

__all__ = ["WorkflowBusyError", "WorkflowParameterError"]


class WorkflowParameterError(ValueError):
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


class WorkflowBusyError(RuntimeError):
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
