"""The ``recover-turn`` deployment: recover a workflow's stuck or crashed step.

Triggered automatically when an ``agent-workflow`` or ``agent-turn`` run ends
Crashed (``prefect.yaml``), or run from the UI on any workflow id. Under the
workflow's lease it adopts a first turn's orphan chat (or strands orphans),
finds the step, and either recovers it read-only or hands it to ``run_turn``
(which recovers first and resubmits only when it must); with
``finish_workflow`` it then runs the rest of the workflow as an
``agent-workflow`` subflow.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

from prefect import flow
from pydantic import BaseModel, Field

from coder_chat.history import fetch_turn
from coder_chat.recovery import TurnRecovery, timeline_origin
from coder_chat.rest import ChatClient
from prefect_coder.flows.common import registry
from prefect_coder.flows.common.params import (
    AnyStep,
    Step,
    WorkflowSettings,
    agent_steps,
    step_marker,
    validate_workflow_id,
)
from prefect_coder.flows.common.resources import (
    TurnResources,
    hold_workflow_lease,
    load_resources,
)
from prefect_coder.flows.common.results import TurnResult
from prefect_coder.flows.common.toolset import Toolset, bind_crash_safe
from prefect_coder.flows.deployments.agent_workflow import agent_workflow
from prefect_coder.flows.observe.run_log import RunLogger, run_logger, run_started_at
from prefect_coder.flows.recovery.orphans import adopt_or_strand_orphans, strand_workflow_orphans
from prefect_coder.flows.recovery.recovered import (
    publish_recovery,
    recovered_result,
    recovery_timings,
    turn_history,
)
from prefect_coder.flows.turn.durable_turn import run_turn, turn_result

__all__ = ["RecoverTurnReport", "recover_turn"]


class RecoverTurnReport(BaseModel):
    """What ``recover-turn`` found and did."""

    workflow_id: str
    step: str | None = None
    chat_id: str | None = None
    action: str = Field(
        description=(
            "'nothing'; 'recovered' (a finished attempt's result, nothing sent; with "
            "resubmit=False also a still-running attempt followed to its settle); 'ran' "
            "(run_turn completed the step: a followed attempt, a stored result or a "
            "resubmission); "
            "'would-resubmit' (resubmit=False and the attempt never finished)."
        )
    )
    reason: str = ""
    result: TurnResult | None = None
    orphans: list[str] = Field(
        default_factory=list, description="Orphan chats stopped and recorded stranded."
    )
    adopted_orphan: bool = Field(
        default=False,
        description=(
            "No checkpoint named a chat, and the chat a crashed first turn created "
            "(holding only that step's prompt) was adopted as the workflow's: "
            "``chat_id`` names it."
        ),
    )
    finished_workflow: bool = False


class _Timeline:
    """Log lines that put one recovery's waits on a time line (``+N.Ns`` since the
    run started), readable from the run's logs in the UI; ``coder_chat.recovery``
    counts its own lines from the same origin (``timeline_origin``)."""

    def __init__(self, workflow_id: str, log: RunLogger) -> None:
        self.workflow_id = workflow_id
        self.log = log
        self.origin = run_started_at()
        self._last = time.monotonic()

    def mark(self, what: str) -> None:
        now = time.monotonic()
        self.log.info(
            "recover-turn %s: %s +%.1fs (%.1fs since the last mark)",
            self.workflow_id, what, time.time() - self.origin, now - self._last,
        )  # fmt: skip
        self._last = now


def _step_name(marker: str, workflow_id: str) -> str | None:
    prefix = f"[{workflow_id}/"
    if marker.startswith(prefix) and marker.endswith("]"):
        return marker[len(prefix) : -1]
    return None


async def _step_from_history(
    client: ChatClient, chat_id: str, workflow_id: str, name: str
) -> Step | None:
    """Rebuild a step (name + prompt) from its marked user message in history."""
    marker = step_marker(workflow_id, name)
    messages = await fetch_turn(client, chat_id)
    for m in sorted(messages, key=lambda m: m.id, reverse=True):
        if m.role != "user":
            continue
        text = "".join(p.text or "" for p in m.content if p.type == "text")
        idx = text.find(marker)
        if idx >= 0:
            prompt = text[idx + len(marker) :].lstrip(" ")
            return Step(name=name, prompt=prompt or "(continue)")
    return None


@dataclass
class _Plan:
    """What the inspection under the lease decided for the ``recover-turn`` flow."""

    step: Step | None = None
    toolset: Toolset | None = None


async def _inspect(
    report: RecoverTurnReport,
    *,
    client: ChatClient,
    resources: TurnResources,
    settings: WorkflowSettings,
    step: str | None,
    steps: Sequence[AnyStep] | None,
    resubmit: bool,
    timeline: _Timeline,
) -> _Plan:
    """Under the workflow's lease: sweep orphans, find the step, and — without
    ``resubmit`` — recover it read-only. Fills ``report``; returns what to run."""
    store, creds, log = resources.store, resources.credentials, run_logger(__name__)
    workflow_id = report.workflow_id
    checkpoint = await store.checkpoints.get(workflow_id)
    report.chat_id = checkpoint.chat_id if checkpoint else None
    timeline.mark("orphan check begins")
    if checkpoint is None:
        # A first turn that crashed before its checkpoint: its chat holds only that
        # step's prompt (the first of ``steps``; without them, whichever step it
        # names) and is adopted (checkpointed) and recovered below, as the
        # workflow's own rerun would; any other chat is stranded.
        found = await adopt_or_strand_orphans(
            client,
            store,
            workflow_id,
            step_marker(workflow_id, steps[0].name) if steps else None,
            turn_timeout=settings.turn_timeout_s or creds.turn_timeout,
            logger=log,
        )
        report.orphans = found.stranded
        if found.adopted is not None:
            checkpoint = await store.checkpoints.get(workflow_id)
            report.chat_id = found.adopted
            report.adopted_orphan = True
    else:
        report.orphans = await strand_workflow_orphans(
            client, store, workflow_id, keep=report.chat_id, logger=log
        )
    timeline.mark(f"orphan check done ({len(report.orphans)} stranded)")
    if checkpoint is None:
        report.reason = "no checkpoint: the workflow never got a chat to recover"
        return _Plan()
    entry = await store.journal.get(checkpoint.chat_id)
    name = step or (_step_name(entry.marker, workflow_id) if entry else None)
    if name is None:
        report.reason = "the chat's journal names no step of this workflow"
        return _Plan()
    report.step = name
    marker = step_marker(workflow_id, name)
    if entry is None or entry.marker != marker:
        report.reason = f"step {name!r} has no unfinished attempt on the chat"
        return _Plan()
    wanted = next((s for s in agent_steps(steps or []) if s.name == name), None)
    if wanted is None:
        wanted = await _step_from_history(client, checkpoint.chat_id, workflow_id, name)
    if wanted is None:
        report.reason = f"step {name!r} never sent anything on the chat"
        return _Plan()
    toolset = Toolset.of_steps(steps) if steps else Toolset(tools=sorted(registry.tool_names()))
    if resubmit:
        return _Plan(wanted, toolset)
    resolved = toolset.including(wanted).resolve()
    answer = resolved.answers.get(wanted.output_model) if wanted.output_model else None
    tools = bind_crash_safe(resolved.tools, store.ledger)
    # Following sends nothing: a crashed attempt still running is followed to its
    # settle (its client-tool pauses answered through the ledger), not cut short.
    follower = creds.get_agent(
        client=client,
        chat_id=checkpoint.chat_id,
        last_seen_message_id=checkpoint.last_seen_message_id,
        tools=tools,
    )
    # The step's own turn timeout, as run_turn reckons it: it bounds the follow and is
    # the deadline journaled with a resubmission, which a racing sweep honours.
    timings = recovery_timings(
        settings, creds.request_timeout, settings.turn_timeout_s or creds.turn_timeout
    )
    recovery = TurnRecovery(
        client,
        store,
        checkpoint.chat_id,
        marker,
        tools=tools,
        timings=timings,
        turn_timeout=timings.settle_budget,
        output_model=answer.model if answer is not None else None,
        structured_tool_name=answer.name if answer is not None else "structured_output",
        logger=log,
        follower=follower,
    )
    try:
        outcome = await recovery.run()
    finally:
        await follower.aclose()
    await publish_recovery(workflow_id, name, outcome, artifacts=settings.artifacts)
    report.reason = outcome.reason
    if outcome.followed is not None:
        report.action = "recovered"
        structured = None
        if answer is not None:
            value = answer.pick(outcome.followed)
            structured = value.model_dump(mode="json") if value is not None else None
        report.result = turn_result(
            outcome.followed,
            workflow_id=workflow_id,
            step=name,
            marker=marker,
            structured=structured,
            attempt=max(1, outcome.attempts),
            generate_ms=0.0,
        )
    elif outcome.classification == "recovered":
        report.action = "recovered"
        assert outcome.recovered is not None
        history = await turn_history(
            client,
            checkpoint.chat_id,
            outcome.recovered.user_message_id,
            bound_s=settings.settle_wait_s,
        )
        report.result = recovered_result(workflow_id, wanted, outcome, tools, history)
    else:
        report.action = "would-resubmit"
    return _Plan()


@flow(name="recover-turn", flow_run_name="recover {workflow_id}")
async def recover_turn(
    workflow_id: str,
    step: str | None = None,
    resubmit: bool = True,
    settings: WorkflowSettings | None = None,
    steps: Sequence[AnyStep] | None = None,
    finish_workflow: bool = False,
) -> RecoverTurnReport:
    """Recover a workflow's stuck or crashed step.

    Takes the workflow's lease; with no checkpoint, adopts the chat a crashed
    first turn left (strands any other orphan; with a checkpoint, strands every
    chat it does not name); finds the step (``step`` or
    the one the chat's journal names), and then either — with ``resubmit`` —
    runs it through ``run_turn``, which settles the chat (ledger reconcile before
    any interrupt), returns a finished attempt's recovered result or resubmits,
    and stores the result under the step's key so a rerun of the workflow
    continues after it; or — without ``resubmit`` — recovers read-only: returns
    the recovered result, or reports ``would-resubmit``.

    Args:
        workflow_id: the workflow to recover.
        step: step name; default: the step the chat's journal names.
        resubmit: resubmit a step whose attempt never finished.
        settings: as the workflow's (blocks, bounds).
        steps: the workflow's steps (for their tools and output models);
            default: the prompt from history and every registered tool.
        finish_workflow: with ``steps`` and ``resubmit``, then run the rest of the
            workflow (``agent-workflow`` as a subflow: finished steps come from
            storage, the chat is archived at the end unless ``keep_chat``). The
            Crashed-run trigger in ``prefect.yaml`` sets it.
    """
    log = run_logger(__name__)
    timeline = _Timeline(workflow_id, log)
    # coder_chat.recovery's lines (settle, follow) count from the run's start too.
    timeline_origin.set(timeline.origin)
    timeline.mark("flow code begins")
    settings = settings or WorkflowSettings()
    validate_workflow_id(workflow_id)
    registry.load_tool_modules(settings.tool_modules)
    resources = await load_resources(settings, warn_other_stores=True)
    timeline.mark("blocks and store loaded")
    report = RecoverTurnReport(workflow_id=workflow_id, action="nothing")
    client = resources.credentials.get_client()
    async with client, contextlib.AsyncExitStack() as stack:
        timeline.mark("lease wait begins")
        # The holder id names this run, and a holder whose run is over (the crashed
        # run this recovery was triggered by) is taken over at once: a bare lease
        # waited out the dead holder's ttl (up to lease_ttl_s, 60 s by default) —
        # the 12-37 s gaps before the first settle decision (docs/deploy.md).
        await stack.enter_async_context(
            hold_workflow_lease(workflow_id, resources.store, settings, step=step or "-")
        )
        timeline.mark("lease taken")
        plan = await _inspect(
            report,
            client=client,
            resources=resources,
            settings=settings,
            step=step,
            steps=steps,
            resubmit=resubmit,
            timeline=timeline,
        )
    if plan.step is not None:
        # run_turn recovers first (and sends only when it must), under its own
        # lease, and persists the result under the step's key.
        timeline.mark(f"run_turn begins ({plan.step.name}: lease, settle, follow or resubmit)")
        result = await run_turn(workflow_id, plan.step, settings, resources, plan.toolset)
        report.result = result
        # A recovered result took no generate() time.
        report.action = "recovered" if result.generate_ms == 0 else "ran"
        report.reason = f"run_turn returned attempt {result.attempt} of {plan.step.name!r}"
        timeline.mark(f"step {plan.step.name} result stored ({report.action})")
    if finish_workflow and steps and resubmit:
        await agent_workflow(workflow_id, steps, settings)
        report.finished_workflow = True
        timeline.mark("rest of the workflow finished")
    timeline.mark(f"ends: {report.action}")
    log.info("recover-turn %s: %s (%s)", workflow_id, report.action, report.reason)
    return report
