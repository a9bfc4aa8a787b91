"""Human approval between turns: a workflow step of kind ``"approval"``.

At an approval step the flow run *suspends* (``asuspend_flow_run`` with a typed
:class:`ApprovalInput`): the run's process exits, freeing its infrastructure,
and the run shows as ``Suspended`` in the Prefect UI with a **Resume** form —
approve, reject, or edit the next step's prompt. Meanwhile the chat sits idle in
``waiting`` (the previous turn finished; nothing is pending), never in
``requires_action``, whose server-side deadline is 5 minutes.

On resume Prefect reschedules the run; a worker starts it again from the top.
Finished turns and model steps return their persisted results (nothing is sent
again), the same suspend call returns the submitted input (Prefect keys it by
``approval-<step>``), and the decision itself is persisted under the step's
key so that a later re-run of the workflow does not ask again.

* approve: continue with the next step as written;
* edit: continue with ``next_prompt`` as the next step's prompt;
* reject: archive the chat (unless ``keep_chat``) and end the workflow
  (``Completed``, the last result is the rejection).

What a person typed is never dropped without a word: the form starts with the
next step's prompt filled in, and a prompt changed there while the decision
stays on "approve" counts as an edit (:func:`resolve_decision`; the run's log
says so and the stored decision is ``edit``).

Prefect's engine logs a suspended run's exit ("Finished in state Suspended")
at ERROR, although nothing failed. The step says at INFO, before suspending,
that the run waits for a decision and where to give it, and lowers that one
engine line to INFO (:class:`SuspendedIsNotAnError`); every other line keeps
its level.

Suspending needs a deployment (Prefect refuses to suspend a run without one,
and a subflow cannot suspend). The timeout is the step's ``timeout_s``
(default 24 h); when it passes, Prefect's server marks the run ``Failed``
("The flow was paused and never resumed.") without running any of our code, so
``expire_approvals`` (:mod:`prefect_coder.flows.deployments.expire_approvals`,
scheduled in ``prefect.yaml``) applies the
workflow's failure handler to such runs: it archives their chats.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any, Literal, cast
from uuid import UUID

from prefect import task
from prefect.context import FlowRunContext
from prefect.flow_runs import asuspend_flow_run
from prefect.input import RunInput
from prefect.logging import get_run_logger
from prefect.runtime import flow_run as current_flow_run
from pydantic import BaseModel, Field

from coder_chat.crash_safe import crash_point
from prefect_coder.flows.common.params import AnyStep, ApprovalStep
from prefect_coder.flows.common.result_write import write_step_result
from prefect_coder.flows.common.results import result_key
from prefect_coder.flows.observe.run_log import RunLogger
from prefect_coder.flows.turn.approval_earlier import (
    answer_given_to_an_earlier_run,
    tag_as_asked,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ApprovalInput",
    "ApprovalResult",
    "SuspendedIsNotAnError",
    "approval_key",
    "await_approval",
    "record_approval",
    "resolve_decision",
]

#: How long an approval waits when its step sets no ``timeout_s``.
DEFAULT_TIMEOUT_S = 24 * 3600


class ApprovalInput(RunInput):
    """What the person submits in the Prefect UI's Resume form."""

    decision: Literal["approve", "reject", "edit"] = Field(
        default="approve",
        description=(
            "approve: continue (a changed next_prompt counts as an edit); "
            "edit: continue with next_prompt; reject: archive the chat."
        ),
    )
    next_prompt: str | None = Field(
        default=None,
        description="The next step's prompt; change it to edit (under approve or edit).",
    )
    comment: str | None = Field(default=None, description="Optional note, kept in the result.")


class ApprovalResult(BaseModel):
    """An approval step's outcome (persisted under the step's key)."""

    kind: Literal["approval"] = "approval"
    workflow_id: str
    step: str
    decision: Literal["approve", "reject", "edit"]
    next_prompt: str | None = None
    comment: str | None = None
    decided_at: str


class SuspendedIsNotAnError(logging.Filter):
    """Lowers Prefect's "Finished in state Suspended(...)" / "Paused(...)" line to INFO.

    The engine logs every non-completed exit at ERROR; a run suspended for an
    approval is waiting, not failing, and a red line there sends people looking
    for a fault. Only that exact engine line is touched.
    """

    _PREFIXES = ("Finished in state Suspended(", "Finished in state Paused(")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.ERROR and record.getMessage().startswith(self._PREFIXES):
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


_ENGINE_LOGGER = "prefect.flow_runs"


def _lower_suspended_exit_line() -> None:
    engine = logging.getLogger(_ENGINE_LOGGER)
    if not any(isinstance(f, SuspendedIsNotAnError) for f in engine.filters):
        engine.addFilter(SuspendedIsNotAnError())


def resolve_decision(
    answer: ApprovalInput, written_prompt: str | None
) -> tuple[Literal["approve", "reject", "edit"], str | None]:
    """The decision to act on and the next step's prompt (``None``: as written).

    * "edit" with an empty prompt keeps the prompt as written (an approval);
    * "approve" with a prompt that differs from the written one is an edit —
      the form starts filled with the written prompt, so a difference is what the
      person typed, and it is never thrown away silently;
    * "reject" ignores the prompt field.
    """
    typed = (answer.next_prompt or "").strip()
    if answer.decision == "reject":
        return "reject", None
    if answer.decision == "edit":
        return ("edit", answer.next_prompt) if typed else ("approve", None)
    if typed and typed != (written_prompt or "").strip():
        return "edit", answer.next_prompt
    return "approve", None


def approval_key(workflow_id: str, step_name: str) -> str:
    """Storage key of an approval decision (stable across runs)."""
    return result_key(workflow_id, step_name, kind="approval")


def _approval_cache_key(_context: object, parameters: dict[str, Any]) -> str:
    return approval_key(str(parameters["workflow_id"]), str(parameters["step_name"]))


@task(
    name="record-approval",
    task_run_name="{workflow_id}/{step_name}",
    cache_key_fn=_approval_cache_key,
    persist_result=True,
    result_serializer="json",
    # Only the write can fail here (ResultNotPersistedError): retried, so a person's
    # decision is not lost to a short storage fault.
    retries=2,
    retry_delay_seconds=2,
)
async def record_approval(
    workflow_id: str, step_name: str, decision: ApprovalResult
) -> ApprovalResult:
    """Persist the decision (a cached no-op when it was recorded before); a write the
    result storage refuses fails the task loudly instead of a silent Completed."""
    return await write_step_result(decision, workflow_id=workflow_id, step=step_name)


async def _stored_decision(workflow_id: str, step_name: str) -> ApprovalResult | None:
    ctx = FlowRunContext.get()
    store = getattr(ctx, "result_store", None) if ctx is not None else None
    if store is None:
        return None
    key = approval_key(workflow_id, step_name)
    # Not aexists(): in a flow-run context (Prefect 3.9.1) it answered False for a
    # record the task had written (measured), so read and treat "missing" as None.
    try:
        # Tasks write the record whole (no separate metadata file): read it that way.
        value = (await store.model_copy(update={"metadata_storage": None}).aread(key)).result
    except Exception:
        return None
    return value if isinstance(value, ApprovalResult) else ApprovalResult.model_validate(value)


def _description(
    workflow_id: str, step: ApprovalStep, last_text: str | None, next_step: AnyStep | None
) -> str:
    lines = [f"**Approval `{step.name}` of workflow `{workflow_id}`**", "", step.prompt, ""]
    if last_text:
        lines += ["Last answer:", "", "> " + last_text[:2000].replace("\n", "\n> "), ""]
    if next_step is not None:
        lines += [f"Next step `{next_step.name}` will send:", "", "> " + next_step.prompt[:2000]]
    else:
        lines += ["This is the last step: approving ends the workflow."]
    lines += [
        "",
        "Choose **approve**, **reject** (archives the chat) or **edit** (set next_prompt);"
        " a next_prompt changed under **approve** is taken as an edit.",
    ]
    return "\n".join(lines)


async def await_approval(
    workflow_id: str,
    step: ApprovalStep,
    *,
    last_text: str | None = None,
    next_step: AnyStep | None = None,
) -> ApprovalResult:
    """Suspend the flow run until a person decides (flow level only).

    Returns at once with the stored decision when this step was decided before.
    The first call raises Prefect's ``Pause`` signal (the process exits); the
    call in the resumed run returns the submitted input.
    """
    logger: RunLogger = get_run_logger()
    stored = await _stored_decision(workflow_id, step.name)
    if stored is not None:
        logger.info("approval %s was decided before: %s", step.name, stored.decision)
        return stored
    timeout_s = int(step.timeout_s or DEFAULT_TIMEOUT_S)
    earlier = await _earlier_answer(workflow_id, step.name, timeout_s, logger)
    if earlier is not None:
        answer_run, answer = earlier
        logger.info(
            "approval %s was decided on an earlier run (%s) that ended before it recorded "
            "the decision: taking that decision, not asking again",
            step.name,
            answer_run,
        )
        return await _record(workflow_id, step.name, answer, next_step, logger)
    form = ApprovalInput.with_initial_data(
        description=_description(workflow_id, step, last_text, next_step),
        decision="approve",
        next_prompt=next_step.prompt if next_step is not None else None,
    )
    await _tag_as_asked(workflow_id, step.name, logger)
    where = current_flow_run.get_flow_run_ui_url() or "the run's page in the Prefect UI"
    logger.info(
        "approval %s: this run now waits for a decision (approve, edit or reject) for up to "
        "%ss; give it with the Resume button at %s",
        step.name,
        timeout_s,
        where,
    )
    _lower_suspended_exit_line()
    answer = cast(
        ApprovalInput,
        await asuspend_flow_run(
            wait_for_input=form, timeout=timeout_s, key=f"approval-{step.name}"
        ),
    )
    crash_point("approval.answered")  # test seam: the answer read, not yet recorded
    return await _record(workflow_id, step.name, answer, next_step, logger)


async def _earlier_answer(
    workflow_id: str, step_name: str, timeout_s: int, logger: RunLogger
) -> tuple[UUID, ApprovalInput] | None:
    """The answer a person gave an earlier run of this workflow at this step (see
    :mod:`.approval_earlier`); None when there is none or the lookup failed (then the
    run asks: a second question costs a person's time, a wrong answer the workflow)."""
    ctx = FlowRunContext.get()
    run = getattr(ctx, "flow_run", None)
    flow = getattr(ctx, "flow", None)
    if run is None or flow is None:
        return None
    try:
        found = await answer_given_to_an_earlier_run(
            flow_name=flow.name,
            current_run=run.id,
            workflow_id=workflow_id,
            step_name=step_name,
            within_s=timeout_s,
        )
        if found is None:
            return None
        return found.flow_run_id, ApprovalInput(**found.values)
    except Exception as exc:  # the question is asked again; say why
        logger.warning(
            "approval %s: could not look for a decision given to an earlier run (%s: %s); "
            "asking for one",
            step_name,
            type(exc).__name__,
            str(exc)[:200],
        )
        return None


async def _tag_as_asked(workflow_id: str, step_name: str, logger: RunLogger) -> None:
    """Tag this run as one that asked (:func:`.approval_earlier.asked_tag`), so that a
    later run finds its answer exactly; a failure is logged: the later run then scans
    the flow's recent runs instead."""
    ctx = FlowRunContext.get()
    run = getattr(ctx, "flow_run", None)
    if run is None:
        return
    try:
        await tag_as_asked(run.id, list(run.tags or []), workflow_id)
    except Exception as exc:
        logger.warning(
            "approval %s: could not tag this run as asking (%s); a later run looks for its "
            "answer among the flow's recent runs",
            step_name,
            type(exc).__name__,
        )


async def _record(
    workflow_id: str,
    step_name: str,
    answer: ApprovalInput,
    next_step: AnyStep | None,
    logger: RunLogger,
) -> ApprovalResult:
    """The person's answer as the step's decision, recorded under the step's key."""
    written = next_step.prompt if next_step is not None else None
    decision, next_prompt = resolve_decision(answer, written)
    if decision == "edit" and answer.decision == "approve":
        logger.info(
            "approval %s: the next prompt was changed in the form under 'approve': "
            "treated as an edit",
            step_name,
        )
    result = ApprovalResult(
        workflow_id=workflow_id,
        step=step_name,
        decision=decision,
        next_prompt=next_prompt,
        comment=answer.comment,
        decided_at=datetime.now(UTC).isoformat(),
    )
    logger.info("approval %s: %s", step_name, decision)
    return await record_approval(workflow_id, step_name, result)
