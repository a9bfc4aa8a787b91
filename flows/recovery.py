"""Crash recovery in the Prefect layer: automatic in ``run_turn``, and the ``recover-turn`` flow.

``run_turn`` calls into this module at three points (see ``flows/turn.py``):

* :func:`recover_before_send` — on a checkpointed chat, before the step's send.
  If the journal shows this step already sent (an unfinished attempt: a crash,
  a failure, a rerun), it runs the durable design's recovery
  (:class:`coder_chat.recovery.TurnRecovery`: settle-wait, ledger reconcile,
  result check) and either returns the recovered result — nothing is sent — or
  journals the resubmission write-ahead. So a plain retry or rerun of a crashed
  flow run is safe.
* :func:`sweep_orphans` — on a workflow without a checkpoint: a crash after the
  chat was created but before its id was checkpointed leaves an orphan that may
  still be generating. Chats carry the workflow's label, so the sweep finds
  every orphan, interrupts it and records it stranded (the archive retires it).
* :class:`EagerCheckpoint` — shrinks that orphan window: the chat id is
  checkpointed (with the first send's journal entry) as soon as the stream
  dials, and crash-safe tools await it before any effect, so no client-tool
  effect can ever run on a chat nobody can find after a crash.

Each recovery decision is logged and published as a table artifact (what was
seen, what was decided, why).

Test seam: :func:`coder_chat.crash_safe.crash_point` names points (``turn.*``,
``tool.*``, ``recovery.*``) where the crash-matrix tests SIGKILL the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from prefect import flow
from prefect.artifacts import acreate_table_artifact
from prefect.logging import get_run_logger
from prefect_coder.blocks import JournalEntry, LeaseUnavailableError, StateStore, workflow_key
from prefect_coder.flows import registry
from prefect_coder.flows.errors import WorkflowBusyError
from prefect_coder.flows.labels import LABEL_WORKFLOW, label_value, owned_by, scope_labels
from prefect_coder.flows.params import Step, WorkflowSettings, step_marker, validate_workflow_id
from prefect_coder.flows.resources import TurnResources, load_resources
from prefect_coder.flows.results import ToolCallRecord, TurnResult
from prefect_coder.flows.toolset import Toolset
from pydantic import BaseModel, Field

from coder_chat.crash_safe import CrashSafeTool, crash_point
from coder_chat.errors import CoderApiError
from coder_chat.events import HttpRequest, HttpResponse, TransportEvent, WsDial, WsEvent
from coder_chat.history import DynamicToolPart, count_marker_attempts, fetch_turn, fetch_until
from coder_chat.recovery import RecoveryOutcome, RecoveryTimings, TurnRecovery
from coder_chat.rest import ChatClient
from coder_chat.tools import ClientTool, StructuredOutput, ToolContext

__all__ = [
    "WORKFLOW_LABEL",
    "EagerCheckpoint",
    "RecoverTurnReport",
    "SendPlan",
    "bind_crash_safe",
    "note_failed_attempt",
    "recover_before_send",
    "recover_turn",
    "recovery_timings",
    "sweep_orphans",
]

#: Label every workflow chat carries (``prefect_coder.flows.labels``), so orphans of a crashed
#: first turn are findable.
WORKFLOW_LABEL = LABEL_WORKFLOW

_NOT_KEY = re.compile(r"[^a-z0-9-]+")


def _logger() -> logging.Logger | logging.LoggerAdapter[Any]:
    try:
        return get_run_logger()
    except Exception:
        return logging.getLogger("prefect_coder.flows.recovery")


def _env_float(name: str) -> float | None:
    raw = os.environ.get(name)
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if value >= 0 else None


def recovery_timings(
    settings: WorkflowSettings, request_timeout: float | None, turn_timeout: float | None
) -> RecoveryTimings:
    """Recovery bounds of a workflow.

    * probe/interrupt bound: ``settings.settle_wait_s`` (15 s);
    * commit horizon: the per-segment ``request_timeout`` — the design's
      conservative horizon for a send still in flight (300 s) — or
      ``PREFECT_CODER_COMMIT_HORIZON_S``;
    * settle budget: the turn's total bound (600 s), turn-scale;
    * poll interval: 1 s, or ``PREFECT_CODER_SETTLE_POLL_S``.
    """
    d = RecoveryTimings()
    horizon = _env_float("PREFECT_CODER_COMMIT_HORIZON_S")
    poll = _env_float("PREFECT_CODER_SETTLE_POLL_S")
    return RecoveryTimings(
        probe_bound=settings.settle_wait_s,
        settle_budget=turn_timeout or d.settle_budget,
        poll_interval=d.poll_interval if poll is None else poll,
        commit_horizon=horizon if horizon is not None else (request_timeout or d.commit_horizon),
    )


# --------------------------------------------------------------------------- eager checkpoint


class EagerCheckpoint:
    """Checkpoint a first turn's chat as soon as its id is known.

    A hard crash after the chat was created but before the ``finally``
    checkpoint leaves a chat nobody can resume — and, if the crash hit a client
    tool, an effect recorded under a chat id nobody knows. So the chat id (and
    the first send's ``"submitting"`` journal entry, which the send had no chat
    to be written under) is made durable from the first ``ws:dial`` event, and
    every crash-safe tool awaits :meth:`ensure` before its write-ahead.

    Also the transport hook of the turn's named crash points (test seam).
    """

    def __init__(
        self,
        store: StateStore,
        workflow_id: str,
        marker: str,
        *,
        had_chat: bool,
        started_at: float | None = None,
    ) -> None:
        self.store = store
        self.workflow_id = workflow_id
        self.marker = marker
        self.had_chat = had_chat
        self.started_at = started_at or time.time()
        self.written: str | None = None
        self._streamed = False
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()

    async def ensure(self, chat_id: str) -> None:
        """Make ``chat_id`` the workflow's checkpoint (first turn only; idempotent)."""
        if self.had_chat or self.written == chat_id:
            return
        async with self._lock:
            if self.written == chat_id:
                return
            async with self.store.transaction() as tx:
                await tx.checkpoints.set(self.workflow_id, chat_id, None)
                # The first send's write-ahead, late: the count before it was 0.
                await tx.journal.set(
                    chat_id,
                    JournalEntry(
                        state="submitting", marker=self.marker, attempt=0, at=self.started_at
                    ),
                )
            self.written = chat_id
        crash_point("turn.after_checkpoint")

    async def before_effect(self, ctx: ToolContext) -> None:
        """``before_effect`` of crash-safe tools: the chat must be findable first."""
        await self.ensure(ctx.chat_id)

    def chain(self, inner: Callable[[TransportEvent], object] | None) -> Callable[..., None]:
        """A transport hook: this one first, then ``inner``."""

        def hook(ev: TransportEvent) -> None:
            self(ev)
            if inner is not None:
                inner(ev)

        return hook

    def __call__(self, ev: TransportEvent) -> None:
        if isinstance(ev, HttpRequest) and ev.op == "createChat":
            crash_point("turn.before_create")
        elif isinstance(ev, HttpRequest) and ev.op == "createChatMessage":
            # the send write-ahead is journaled; the request is about to leave
            crash_point("turn.sending")
        elif isinstance(ev, HttpResponse) and ev.op == "createChat" and ev.ok:
            crash_point("turn.after_create")
        elif isinstance(ev, WsDial) and not self.had_chat and self.written != ev.chat_id:
            with contextlib.suppress(RuntimeError):  # no running loop: nothing to do
                task = asyncio.get_running_loop().create_task(self.ensure(ev.chat_id))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        elif isinstance(ev, WsEvent) and not self._streamed and (self.had_chat or self.written):
            if getattr(ev.event, "type", None) == "message_part":
                self._streamed = True  # once per turn: the first streamed part
                crash_point("turn.mid_stream")

    async def drain(self) -> None:
        """Wait for scheduled checkpoint writes (call before the ``finally`` checkpoint)."""
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def after_turn(self, agent_chat_id: str | None) -> None:
        """The SDK discarded the session (stream lost on the chat it created): clear
        the eagerly checkpointed id, or "starts fresh after a discard" silently turns
        into resuming the dead chat (it is recorded stranded for the sweep)."""
        await self.drain()
        if self.written and agent_chat_id is None:
            cp = await self.store.checkpoints.get(self.workflow_id)
            if cp is not None and cp.chat_id == self.written:
                await self.store.checkpoints.clear(self.workflow_id)


def bind_crash_safe(
    tools: Sequence[ClientTool[Any]], store: StateStore, eager: EagerCheckpoint | None
) -> list[ClientTool[Any]]:
    """The turn's tools with every crash-safe tool bound to the store's ledger."""
    before = eager.before_effect if eager is not None else None
    return [
        t.bind(store.ledger, before_effect=before) if isinstance(t, CrashSafeTool) else t
        for t in tools
    ]


# --------------------------------------------------------------------------- orphans


async def sweep_orphans(
    client: ChatClient,
    store: StateStore,
    workflow_id: str,
    *,
    keep: str | None = None,
    bound_s: float = 15.0,
    logger: logging.Logger | logging.LoggerAdapter[Any] | None = None,
) -> list[str]:
    """Interrupt every live chat of the workflow no checkpoint accounts for, and
    record it stranded so the archive retires it. Returns their ids.

    Widened as the design asks: regardless of status (an orphaned first turn may
    settle on its own and then sit live and unarchived forever), and every
    orphan, not just the first.
    """
    log = logger or _logger()
    found: list[str] = []
    labels = {**scope_labels(store.tenant), WORKFLOW_LABEL: label_value(workflow_id)}
    async for chat in client.iter_chats(labels=labels, timeout=bound_s):
        # Re-checked: a server that ignored the filter must never make us touch
        # someone else's chat.
        if chat.id == keep or not owned_by(chat.labels, store.tenant):
            continue
        found.append(chat.id)
        try:
            await client.interrupt_chat(chat.id, timeout=bound_s)
        except CoderApiError as exc:
            if exc.status != 409:  # 409: nothing running — the good case
                raise
        await store.stranded.record(workflow_id, chat.id, "orphan: no checkpoint names it")
        log.warning(
            "orphan chat %s of workflow %s interrupted, recorded for the archive",
            chat.id,
            workflow_id,
        )
    return found


# --------------------------------------------------------------------------- automatic recovery


@dataclass(frozen=True, slots=True)
class SendPlan:
    """What ``run_turn`` does next on a checkpointed chat."""

    #: 1-based number of the attempt about to be sent (or recovered).
    attempt: int
    #: Set when the crashed attempt finished: return it, send nothing.
    result: TurnResult | None = None
    outcome: RecoveryOutcome | None = None


def recovered_result(
    workflow_id: str,
    step: Step,
    outcome: RecoveryOutcome,
    tools: Sequence[ClientTool[Any]],
) -> TurnResult:
    """The step's result rebuilt from history (what ``generate()`` would have returned)."""
    rec = outcome.recovered
    assert rec is not None
    names = {t.name for t in tools}
    calls = [
        ToolCallRecord(
            id=p.tool_call_id,
            name=p.tool_name,
            kind="client" if p.tool_name in names else "server",
            args=p.input,
            output=p.output if p.state == "output-available" else p.error_text,
            is_error=p.state == "output-error",
        )
        for p in rec.parts
        if isinstance(p, DynamicToolPart)
    ]
    structured = rec.structured.model_dump(mode="json") if rec.structured is not None else None
    return TurnResult(
        workflow_id=workflow_id,
        step=step.name,
        marker=outcome.marker,
        chat_id=outcome.chat_id,
        text=rec.text,
        finish_reason="stop",
        usage={},
        user_message_id=rec.user_message_id,
        tool_calls=calls,
        structured=structured,
        attempt=max(1, outcome.attempts),
        generate_ms=0.0,
    )


def _artifact_key(workflow_id: str, step_name: str) -> str:
    digest = hashlib.sha256(f"{workflow_id}\x00{step_name}".encode()).hexdigest()[:8]
    slug = _NOT_KEY.sub("-", f"{workflow_id}-{step_name}".lower()).strip("-")[:70]
    return f"coder-recovery-{slug}-{digest}"


async def publish_recovery(
    workflow_id: str, step_name: str, outcome: RecoveryOutcome, *, artifacts: bool = True
) -> None:
    """Log the verdict and publish the decisions as a table artifact."""
    log = _logger()
    log.info(
        "recovery of %s/%s on chat %s: %s (%s); %d decision(s), horizon slept %.2fs",
        workflow_id,
        step_name,
        outcome.chat_id,
        outcome.classification,
        outcome.reason,
        len(outcome.decisions),
        outcome.horizon_slept_s,
    )
    if not artifacts:
        return
    try:
        await acreate_table_artifact(
            key=_artifact_key(workflow_id, step_name),
            table=[d.row() for d in outcome.decisions],
            description=(
                f"Crash recovery of step `{step_name}` of `{workflow_id}` on chat "
                f"`{outcome.chat_id}`: **{outcome.classification}** — {outcome.reason}"
            ),
        )
    except Exception:
        log.warning("could not publish the recovery artifact", exc_info=True)


async def recover_before_send(
    *,
    client: ChatClient,
    store: StateStore,
    workflow_id: str,
    step: Step,
    chat_id: str,
    tools: Sequence[ClientTool[Any]],
    answer: StructuredOutput[Any] | None,
    timings: RecoveryTimings,
    known_failure: bool,
    artifacts: bool = True,
) -> SendPlan:
    """Run before every send of ``step`` on a checkpointed chat.

    No journal entry for this step's marker proves no send of it ever started
    (every send is journaled first), so the first send only writes its
    write-ahead. Otherwise an earlier attempt is unfinished: recover it.
    """
    marker = step_marker(workflow_id, step.name)
    entry = await store.journal.get(chat_id)
    if entry is None or entry.marker != marker:
        # Write-ahead BEFORE the send: no entry proves no send ever started. The
        # count before this step's first send is 0 (an earlier send would have
        # journaled this marker).
        await store.journal.set(chat_id, JournalEntry(state="submitting", marker=marker, attempt=0))
        return SendPlan(attempt=1)
    recovery = TurnRecovery(
        client,
        store,
        chat_id,
        marker,
        tools=tools,
        journal_entry=JournalEntry,
        timings=timings,
        known_failure=known_failure,
        output_model=answer.model if answer is not None else None,
        structured_tool_name=answer.name if answer is not None else "structured_output",
        logger=_logger(),
    )
    outcome = await recovery.run()
    await publish_recovery(workflow_id, step.name, outcome, artifacts=artifacts)
    if outcome.classification == "recovered":
        return SendPlan(
            attempt=max(1, outcome.attempts),
            result=recovered_result(workflow_id, step, outcome, tools),
            outcome=outcome,
        )
    crash_point("recovery.before_resubmit")
    await recovery.journal_resubmission(outcome.attempts)
    # At least the second try: the journal proves an earlier send of this step
    # started, even when it never landed.
    return SendPlan(attempt=max(2, outcome.attempts + 1), outcome=outcome)


async def note_failed_attempt(
    client: ChatClient, store: StateStore, chat_id: str | None, marker: str
) -> None:
    """After a *known* failure of a send (timeout, abort, error), journal the tail
    attempt "cut-short" so that a later recovery — in another flow run, without
    the reason at hand — cannot trust its own 409: the failure already fired the
    SDK's best-effort interrupt, which may have stopped the run before recovery
    looked. Scoped by (marker, count) like every entry: if the send never landed,
    the verdict applies to the attempt the step was resubmitting over, which was
    cut short or errored anyway. Best-effort and bounded; shielded, because it also
    runs while the turn is being cancelled."""
    if not chat_id:
        return
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.shield(_note_failed_attempt(client, store, chat_id, marker))


async def _note_failed_attempt(
    client: ChatClient, store: StateStore, chat_id: str, marker: str
) -> None:
    try:
        messages, _ = await fetch_until(
            client,
            chat_id,
            lambda ms: count_marker_attempts(ms, marker)[1],
            timeout=5.0,
        )
        count = count_marker_attempts(messages, marker)[0]
        await store.journal.set(
            chat_id, JournalEntry(state="cut-short", marker=marker, attempt=count)
        )
    except Exception:
        _logger().warning("could not journal the failed attempt on chat %s", chat_id, exc_info=True)


# --------------------------------------------------------------------------- recover-turn flow


class RecoverTurnReport(BaseModel):
    """What ``recover-turn`` found and did."""

    workflow_id: str
    step: str | None = None
    chat_id: str | None = None
    action: str = Field(
        description=(
            "'nothing'; 'recovered' (a finished attempt's result, nothing sent); 'ran' "
            "(run_turn completed the step: stored result or resubmission); "
            "'would-resubmit' (resubmit=False and the attempt never finished)."
        )
    )
    reason: str = ""
    result: TurnResult | None = None
    orphans: list[str] = Field(default_factory=list)
    finished_workflow: bool = False


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
    steps: list[Step] | None,
    resubmit: bool,
) -> _Plan:
    """Under the workflow's lease: sweep orphans, find the step, and — without
    ``resubmit`` — recover it read-only. Fills ``report``; returns what to run."""
    store, creds, log = resources.store, resources.credentials, _logger()
    workflow_id = report.workflow_id
    checkpoint = await store.checkpoints.get(workflow_id)
    report.chat_id = checkpoint.chat_id if checkpoint else None
    report.orphans = await sweep_orphans(
        client, store, workflow_id, keep=report.chat_id, logger=log
    )
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
    wanted = next((s for s in steps or [] if s.name == name), None)
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
    tools = bind_crash_safe(resolved.tools, store, None)
    recovery = TurnRecovery(
        client,
        store,
        checkpoint.chat_id,
        marker,
        tools=tools,
        journal_entry=JournalEntry,
        timings=recovery_timings(settings, creds.request_timeout, creds.turn_timeout),
        output_model=answer.model if answer is not None else None,
        structured_tool_name=answer.name if answer is not None else "structured_output",
        logger=log,
    )
    outcome = await recovery.run()
    await publish_recovery(workflow_id, name, outcome, artifacts=settings.artifacts)
    report.reason = outcome.reason
    if outcome.classification == "recovered":
        report.action = "recovered"
        report.result = recovered_result(workflow_id, wanted, outcome, tools)
    else:
        report.action = "would-resubmit"
    return _Plan()


@flow(name="recover-turn", flow_run_name="recover {workflow_id}")
async def recover_turn(
    workflow_id: str,
    step: str | None = None,
    resubmit: bool = True,
    settings: WorkflowSettings | None = None,
    steps: list[Step] | None = None,
    finish_workflow: bool = False,
) -> RecoverTurnReport:
    """Recover a workflow's stuck or crashed step.

    Takes the workflow's lease, sweeps orphan chats, finds the step (``step`` or
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
    from prefect_coder.flows.turn import run_turn  # prefect_coder.flows.turn imports this module

    settings = settings or WorkflowSettings()
    validate_workflow_id(workflow_id)
    registry.load_tool_modules(settings.tool_modules)
    resources = await load_resources(settings)
    report = RecoverTurnReport(workflow_id=workflow_id, action="nothing")
    client = resources.credentials.get_client()
    try:
        try:
            lease = resources.store.lease(
                workflow_key(workflow_id), ttl=settings.lease_ttl_s, wait=settings.lease_wait_s
            )
            await lease.__aenter__()
        except LeaseUnavailableError as exc:
            raise WorkflowBusyError(workflow_id, exc.waited) from None
        try:
            plan = await _inspect(
                report,
                client=client,
                resources=resources,
                settings=settings,
                step=step,
                steps=steps,
                resubmit=resubmit,
            )
        finally:
            await lease.__aexit__(None, None, None)
    finally:
        await client.aclose()
    if plan.step is not None:
        # run_turn recovers first (and sends only when it must), under its own
        # lease, and persists the result under the step's key.
        result = await run_turn(workflow_id, plan.step, settings, resources, plan.toolset)
        report.result = result
        # A recovered result took no generate() time.
        report.action = "recovered" if result.generate_ms == 0 else "ran"
        report.reason = f"run_turn returned attempt {result.attempt} of {plan.step.name!r}"
    if finish_workflow and steps and resubmit:
        from prefect_coder.flows.workflow import (
            agent_workflow,  # prefect_coder.flows.workflow imports prefect_coder.flows.turn
        )

        await agent_workflow(workflow_id, steps, settings)
        report.finished_workflow = True
    log = _logger()
    log.info("recover-turn %s: %s (%s)", workflow_id, report.action, report.reason)
    return report
