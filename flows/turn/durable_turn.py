"""The durable turn: one agent turn per Prefect task, checkpointed in ``finally``.

Walk of one turn (``execute_turn``):

1. Prefect looks the step's result key up first (``turn_cache_key``): a step
   that already finished returns its stored result and sends nothing.
2. Take the workflow's lease (single-flight across workers) unless the calling
   flow holds it already; a turn that took it itself re-checks the stored result
   under the lease, because the holder it waited for may have just finished this
   very step (a flow that held it when Prefect looked the result up needs not).
3. ``store.turns.begin`` (one transaction): load the checkpoint (chat id +
   optional cursor) and its chat's journal entry; on a checkpointed chat whose
   entry does not name this step's marker, journal "submitting" (marker,
   attempt 0, time) — the write-ahead, BEFORE the send. No checkpoint, and an
   earlier hold of the lease may have left a chat: the orphan check adopts the
   chat a crashed first attempt created (checkpointed now, recovered in 4 —
   never sent again) and strands any other. Build the agent.
4. If this step already sent before (the journal names its marker) run crash
   recovery first (``recover_before_send``: settle-wait, tool ledger
   reconciliation, result recovery — a finished attempt's result is returned
   instead of resending), journaling a resubmission write-ahead.
5. ``generate()`` with the marker in the prompt, a per-segment
   ``request_timeout`` and a total deadline (or the followed attempt's outcome),
   and at most one re-ask of a structured answer.

Steps 3-5 are a controller: the turn observes a :class:`~prefect_coder.flows.turn.decide.TurnSnapshot`,
:func:`~prefect_coder.flows.turn.decide.decide` (pure) says what is next — look for
orphans, recover, move to an adopted or a fresh chat, return, fail, send, follow,
re-ask, settle — and one act per kind (:class:`_TurnActs`) does it, until the turn
returns or settles. Each rule of ``decide`` names the failure window it closes.
6. ``finally``: checkpoint the chat id (+ cursor only when defined); when the
   SDK discarded the session, record the stranded chat for the sweep instead.
7. Publish the artifact and the ``coder.turn.settled`` event; Prefect persists
   the JSON result under the step's key.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any

from prefect import task
from prefect.context import TaskRunContext

from coder_chat.agent import AgentHooks, CoderAgent, GenerateResult
from coder_chat.crash_safe import crash_point
from coder_chat.events import TransportEvent, WsDial
from coder_chat.history import fetch_until
from coder_chat.recovery import RecoveryTimings
from coder_chat.rest import ChatClient
from coder_chat.stream import StreamOptions
from coder_chat.tools import ClientTool, StructuredOutput
from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state import HeldLease, JournalEntry
from prefect_coder.blocks.state.errors import StoreUnavailableError
from prefect_coder.blocks.state.records import TurnStart
from prefect_coder.flows.common.errors import StructuredAnswerError
from prefect_coder.flows.common.labels import chat_labels, current_flow_run_id
from prefect_coder.flows.common.params import Step, WorkflowSettings, step_marker
from prefect_coder.flows.common.resources import TurnResources, hold_workflow_lease, load_resources
from prefect_coder.flows.common.result_write import write_step_result
from prefect_coder.flows.common.results import (
    ToolCallRecord,
    TurnResult,
    result_key,
    turn_cache_key,
)
from prefect_coder.flows.common.retry import is_retryable_failure, retry_if_retryable
from prefect_coder.flows.common.toolset import Toolset, bind_crash_safe
from prefect_coder.flows.fleet.slots import confirm_turn_slot, turn_slot
from prefect_coder.flows.observe.artifacts import publish_turn_artifact
from prefect_coder.flows.observe.live_progress import LiveProgress
from prefect_coder.flows.observe.observer import TurnObserver
from prefect_coder.flows.observe.run_log import RunLogger, run_logger
from prefect_coder.flows.recovery.before_send import recover_before_send
from prefect_coder.flows.recovery.chat_state import note_live
from prefect_coder.flows.recovery.eager_checkpoint import EagerCheckpoint
from prefect_coder.flows.recovery.orphans import adopt_or_strand_orphans, may_have_orphans
from prefect_coder.flows.recovery.recovered import recovery_timings
from prefect_coder.flows.recovery.send_journal import (
    journal_cut_short,
    journal_send,
    note_failed_attempt,
)
from prefect_coder.flows.turn.decide import (
    AfterSends,
    Answered,
    CheckOrphans,
    CheckpointChat,
    CheckpointFirstSend,
    FailStructured,
    Finished,
    Follow,
    MoveToChat,
    MoveToFreshChat,
    Reask,
    Recover,
    Return,
    Send,
    Settle,
    StandDown,
    TurnSnapshot,
    after_sends,
    decide,
)
from prefect_coder.flows.turn.follower import FollowGate, RecoveryFollower

__all__ = [
    "execute_turn",
    "is_retryable_failure",
    "retry_if_retryable",
    "run_turn",
    "turn_result",
]


async def _prompt_was(agent: CoderAgent, user_message_id: int | None, text: str) -> bool:
    """Whether the user message that started a turn carries exactly ``text`` (one
    history read, newest first): tells a recovered or followed re-ask apart."""
    if user_message_id is None or agent.chat_id is None:
        return False
    messages, _ = await fetch_until(
        agent.client, agent.chat_id, lambda ms: any(m.id <= user_message_id for m in ms)
    )
    for m in messages:
        if m.id == user_message_id:
            return "".join(p.text or "" for p in m.content if p.type == "text").strip() == text
    return False


def _usage_dict(usage: Any) -> dict[str, Any]:
    if usage is None:
        return {}
    if dataclasses.is_dataclass(usage) and not isinstance(usage, type):
        data = dataclasses.asdict(usage)
    elif hasattr(usage, "model_dump"):
        data = usage.model_dump()
    else:
        data = dict(usage)
    return {k: v for k, v in data.items() if k != "raw" and v is not None}


def _tool_records(gen: GenerateResult) -> list[ToolCallRecord]:
    records = [
        ToolCallRecord(
            id=call.tool_call_id,
            name=call.tool_name,
            kind="client",
            args=_jsonable(call.input),
            output=_jsonable(call.output),
            is_error=call.is_error,
        )
        for call in gen.client_tool_calls
    ]
    results = {r.tool_call_id: r for r in gen.server_tool_results}
    for call in gen.server_tool_calls:
        res = results.get(call.tool_call_id)
        records.append(
            ToolCallRecord(
                id=call.tool_call_id,
                name=call.tool_name,
                kind="server",
                args=_jsonable(call.input),
                output=_jsonable(res.result) if res else None,
                is_error=bool(res and res.is_error),
            )
        )
    return records


def _jsonable(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    return value


def turn_result(
    gen: GenerateResult,
    *,
    workflow_id: str,
    step: str,
    marker: str,
    structured: dict[str, Any] | None,
    attempt: int,
    generate_ms: float,
) -> TurnResult:
    """The step's persisted result from a ``generate()`` (or followed) result."""
    return TurnResult(
        workflow_id=workflow_id,
        step=step,
        marker=marker,
        chat_id=gen.chat_id,
        text=gen.text,
        finish_reason=gen.finish_reason,
        usage=_usage_dict(gen.usage),
        user_message_id=gen.user_message_id,
        message_ids=list(gen.message_ids or []),
        tool_calls=_tool_records(gen),
        structured=structured,
        attempt=attempt,
        generate_ms=round(generate_ms, 2),
    )


async def _stored_result(key: str) -> TurnResult | None:
    """The step's persisted result, if a concurrent run recorded it meanwhile."""
    ctx = TaskRunContext.get()
    if ctx is None or ctx.result_store is None:
        return None
    store = ctx.result_store
    if not await store.aexists(key):
        return None
    value = (await store.aread(key)).result
    return value if isinstance(value, TurnResult) else TurnResult.model_validate(value)


async def _record_after_turn(
    store: StateStore,
    *,
    workflow_id: str,
    agent: Any,
    had_chat: bool,
    failed: BaseException | None,
    marker: str,
    started_at: float,
    turn_timeout: float,
    logger: RunLogger,
    observer: TurnObserver,
    eagerly_journaled: str | None = None,
) -> str | None:
    """The ``finally`` checkpoint: every exit of a turn goes through here. Returns the
    chat it checkpointed (None: none).

    ``eagerly_journaled``: the chat this turn's eager checkpoint already recorded
    together with this step's write-ahead (marker, attempt 0) — its journal entry
    then needs no read. What is written on which exit:
    :func:`prefect_coder.flows.turn.decide.after_sends`."""
    chat_id = agent.chat_id
    cursor = agent.last_seen_message_id
    stranded: list[str] = list(getattr(agent, "stranded_chat_ids", None) or ())
    if not chat_id and not had_chat and stranded:
        # The SDK discarded the chat this first turn created (its stream could not be
        # re-established): the turn may have run there — a tool's effect committed
        # under that chat's keys. Checkpointed, not stranded: the retry recovers the
        # step ON it (its ledger answers a repeated call) instead of sending it again
        # in a new chat, where the model's repeat is a new key (chaos seed 540: a
        # charge applied twice). Older discards of the same turn stay stranded.
        chat_id, cursor = stranded.pop(), None
    for dropped in stranded:
        reason = f"{type(failed).__name__} on its first turn" if failed else "discarded"
        await store.stranded.record(workflow_id, dropped, reason)
        logger.warning("chat %s stranded (%s); recorded for the sweep", dropped, reason)
        observer.chat_id = dropped
        observer.emit("coder.chat.stranded", {"reason": reason})
    record = after_sends(
        AfterSends(
            on_chat=bool(chat_id),
            had_chat=had_chat,
            failed=failed is not None,
            # The agent's ``left_run_live``: a transient failure after a send landed
            # fired no interrupt; the retry follows that run instead of cutting it.
            left_live=bool(chat_id) and agent.left_run_live is not None,
            eagerly_journaled=bool(chat_id) and eagerly_journaled == chat_id,
        )
    )
    if isinstance(record, CheckpointChat):
        # The send's turn deadline goes with its entry (JournalEntry.deadline): the
        # stuck-turn sweep leaves a crashed attempt live until then.
        journal = (
            None
            if record.journal is None
            else JournalEntry.submitting(
                marker, record.journal, turn_timeout=turn_timeout, at=started_at
            )
        )
        await store.turns.record(workflow_id, chat_id, cursor, journal=journal)
        return chat_id
    if isinstance(record, CheckpointFirstSend):
        async with store.transaction() as tx:
            entry = await tx.journal.get(chat_id)
            await tx.checkpoints.set(workflow_id, chat_id, cursor)
            if not record.unless_named or entry is None or entry.marker != marker:
                await tx.journal.set(
                    chat_id,
                    JournalEntry.submitting(
                        marker, record.attempt, turn_timeout=turn_timeout, at=started_at
                    ),
                )
        return chat_id
    return None


async def execute_turn(
    workflow_id: str,
    step: Step,
    settings: WorkflowSettings,
    resources: TurnResources,
    *,
    toolset: Toolset | None = None,
    retry_reason: str | None = None,
) -> TurnResult:
    """Run one step's turn durably (the body of :func:`run_turn`).

    ``toolset`` is the workflow's whole tool set (declared when the first step
    creates the chat; see :mod:`prefect_coder.flows.common.toolset`); the step's own tools are always
    included. ``retry_reason`` is set when Prefect retries the task.

    The step's start and end are lines of the run's log (its attempt, time and how it
    ended — never its prompt or answer): the run page tells what a turn did while it
    ran (issue 31 §3), with a line per tool call in between.
    """
    logger = run_logger(__name__)
    started = time.monotonic()
    logger.info(
        "step %s: started%s",
        step.name,
        f" (Prefect retry: {retry_reason})" if retry_reason else "",
    )
    try:
        result = await _execute_turn(
            workflow_id, step, settings, resources, logger, toolset, retry_reason
        )
    except asyncio.CancelledError:
        logger.warning("step %s: cancelled after %.1f s", step.name, time.monotonic() - started)
        raise
    except Exception as exc:
        logger.warning(
            "step %s: failed after %.1f s: %s (%s)",
            step.name,
            time.monotonic() - started,
            type(exc).__name__,
            "retryable" if is_retryable_failure(exc) else "not retryable",
        )
        raise
    logger.info(
        "step %s: completed in %.1f s (attempt %d, chat %s, %d tool call(s))",
        step.name,
        time.monotonic() - started,
        result.attempt,
        result.chat_id,
        len(result.tool_calls),
    )
    return result


async def _execute_turn(
    workflow_id: str,
    step: Step,
    settings: WorkflowSettings,
    resources: TurnResources,
    logger: RunLogger,
    toolset: Toolset | None,
    retry_reason: str | None,
) -> TurnResult:
    marker = step_marker(workflow_id, step.name)
    resolved = (toolset or Toolset()).including(step).resolve()
    tools = resolved.tools
    answer = resolved.answers.get(step.output_model) if step.output_model else None
    store = resources.store
    async with contextlib.AsyncExitStack() as stack:
        if resources.lease is not None:
            # The calling flow holds the workflow's lease for all of its turns, and
            # held it when Prefect looked the step's result up at task start: no
            # other run can have finished the step since, so no re-check (it costs
            # two result-storage path resolutions per turn).
            resources.lease.raise_if_lost()
            held = resources.lease
        else:
            held = await stack.enter_async_context(
                hold_workflow_lease(workflow_id, store, settings, step=step.name)
            )
            # We may have waited for the lease while its holder finished this very step.
            stored = await _stored_result(result_key(workflow_id, step.name))
            if stored is not None:
                logger.info("step %s finished in another run meanwhile; nothing sent", step.name)
                return stored
        creds = resources.credentials
        # Fleet quota (flows/fleet/slots.py): a deployment-wide cap on running turns.
        async with turn_slot(
            store,
            creds.max_concurrent_turns,
            wait=creds.turn_slot_wait,
            ttl=creds.turn_slot_ttl,
            workflow_id=workflow_id,
            step=step.name,
            logger=logger,
            credentials=creds,  # asks whether a dead holder's turn still runs
        ):
            crash_point("turn.slot_held")  # test seam: a stall after the claim
            return await _turn_under_lease(
                workflow_id,
                step,
                settings,
                resources,
                marker,
                tools,
                answer,
                retry_reason,
                logger,
                orphans_possible=may_have_orphans(held, retried=retry_reason is not None),
                lease=held,
            )
    raise AssertionError("unreachable")  # pragma: no cover


async def _release_client(client: ChatClient, resources: TurnResources) -> None:
    """Close a client built for this turn only; detach the shared one's events."""
    if resources.client is None:
        await client.aclose()
    elif resources.router is not None:
        resources.router.target = None


def _settled_answer(
    step: Step, answer: StructuredOutput[Any] | None, gen: GenerateResult, attempt: int
) -> dict[str, Any] | None:
    """The settled turn's structured answer (the Settle act, after the checkpoint)."""
    if answer is None:
        return None
    value = answer.pick(gen)
    if value is None:
        # Never "Completed" with structured=None: the caller asked for an answer.
        raise StructuredAnswerError(step.name, step.output_model, gen.chat_id, attempt)
    return value.model_dump(mode="json")


@dataclasses.dataclass(slots=True)
class _TurnActs:
    """A turn's acts between its decisions (:mod:`prefect_coder.flows.turn.decide`):
    one method per kind of act that does I/O, each handing back what it observed."""

    prompt: str
    reask: str
    agent: CoderAgent
    store: StateStore
    observer: TurnObserver
    eager: EagerCheckpoint
    workflow_id: str
    step: Step
    marker: str
    tools: list[ClientTool[Any]]
    answer: StructuredOutput[Any] | None
    settings: WorkflowSettings
    timings: RecoveryTimings
    turn_timeout: float
    known_failure: bool
    #: Markers of the steps before this one in its workflow (None: order unknown).
    earlier: frozenset[str] | None
    #: What the last ``store.turns.begin`` read and wrote: the journal recovery starts from.
    start: TurnStart
    #: Closed while recovery follows with the agent: its interrupts are recovery's.
    gate: FollowGate

    async def recover(self, s: TurnSnapshot, action: Recover) -> TurnSnapshot:
        """Recover: an earlier attempt on the chat followed, read back or resubmitted."""
        found = await recover_before_send(
            client=self.agent.client,
            store=self.store,
            workflow_id=self.workflow_id,
            step=self.step,
            chat_id=action.chat_id,
            tools=self.tools,
            answer=self.answer,
            timings=self.timings,
            known_failure=self.known_failure,
            artifacts=self.settings.artifacts,
            # A failed follow leaves the run to recovery, which stops it (journaled
            # first) or finds it finished — never the agent's blind background interrupt,
            # which could land on the step's next send (chaos seed 519).
            follower=RecoveryFollower(self.agent, self.gate, wait_s=self.timings.probe_bound),
            entry=self.start.journal,
            journaled=self.start.journaled,
            replaced=self.start.replaced,
            earlier=self.earlier,
        )
        was_reask = None
        if isinstance(found, Finished) and self.answer is not None:
            if found.result.structured is None:
                # The finished attempt filed no valid answer: was it the re-ask already?
                was_reask = await _prompt_was(self.agent, found.result.user_message_id, self.reask)
        return dataclasses.replace(s, found=found, finished_was_reask=was_reask)

    async def move_to_chat(self, s: TurnSnapshot, action: MoveToChat) -> TurnSnapshot:
        """MoveToChat: the adopted chat is the checkpoint now; recovered next."""
        self.agent.resume(action.chat_id)
        self.observer.chat_id = action.chat_id
        self.start = await self.store.turns.begin(
            self.workflow_id, self.marker, turn_timeout_s=self.turn_timeout
        )
        return dataclasses.replace(
            s, chat_id=action.chat_id, found=None, finished_was_reask=None, moved=True
        )

    def move_to_fresh_chat(self, s: TurnSnapshot, action: MoveToFreshChat) -> TurnSnapshot:
        """MoveToFreshChat: the send creates the chat, checkpointed as a first turn's."""
        self.agent.reset_session()
        self.eager.moved(checkpointed=False)
        return dataclasses.replace(
            s, chat_id=None, found=None, attempt=action.attempt, orphans_pending=False
        )

    async def send(self, action: Send | Follow | Reask) -> GenerateResult:
        """Send, Follow or Reask: what the chat's turn returned."""
        if isinstance(action, Follow):
            return action.gen
        if isinstance(action, Reask):
            # A structured step whose answer did not validate: ask once more
            # (journaled like every send), as generate_structured does.
            assert self.agent.chat_id is not None
            await journal_send(
                self.agent.client,
                self.store,
                self.agent.chat_id,
                self.marker,
                turn_timeout=self.turn_timeout,
            )
            return await self.agent.generate(self.reask, timeout=self.turn_timeout)
        return await self.agent.generate(self.prompt, timeout=self.turn_timeout)

    async def answered(self, gen: GenerateResult, *, reasked: bool) -> Answered:
        """What the re-ask rule reads of a turn's outcome (the prompt only when it
        decides: a structured step's invalid answer on an idle chat, not re-asked)."""
        if self.answer is None:
            return Answered()
        valid = self.answer.pick(gen) is not None
        idle = gen.finish_reason == "stop"
        was_reask = None
        if not valid and idle and not reasked:
            was_reask = await _prompt_was(self.agent, gen.user_message_id, self.reask)
        return Answered(valid=valid, idle=idle, was_reask=was_reask)


async def _turn_under_lease(
    workflow_id: str,
    step: Step,
    settings: WorkflowSettings,
    resources: TurnResources,
    marker: str,
    tools: list[ClientTool[Any]],
    answer: StructuredOutput[Any] | None,
    retry_reason: str | None,
    logger: RunLogger,
    *,
    orphans_possible: bool = True,
    lease: HeldLease | None = None,
) -> TurnResult:
    store = resources.store
    creds = resources.credentials
    request_timeout = settings.request_timeout_s or creds.request_timeout
    turn_timeout = settings.turn_timeout_s or creds.turn_timeout
    # ONE transaction: the checkpoint, its chat's journal entry and — when this
    # step's marker is not journaled yet — the send's write-ahead (with its turn
    # deadline). Under the lease, before any send (the agent built below does no
    # I/O before generate()).
    start = await store.turns.begin(workflow_id, marker, turn_timeout_s=turn_timeout)
    chat_id = start.checkpoint.chat_id if start.checkpoint else None
    # The live artifact (flows/observe/live_progress.py): fed by the observer, published
    # off the hot path, finished by the observer's settled/failed event.
    progress = (
        LiveProgress(
            workflow_id=workflow_id, step=step.name, base_url=creds.base_url, note=retry_reason
        )
        if settings.artifacts
        else None
    )
    observer = TurnObserver(
        workflow_id=workflow_id, step=step.name, logger=logger, chat_id=chat_id, progress=progress
    )
    # Crash recovery (flows/recovery/eager_checkpoint.py, orphan_check.py): a first turn's chat is checkpointed as
    # soon as it exists, crash-safe tools write the ledger, chats carry the
    # workflow label so orphans are findable.
    eager = EagerCheckpoint(
        store, workflow_id, marker, had_chat=chat_id is not None, turn_timeout=turn_timeout
    )
    tools = bind_crash_safe(tools, store.ledger, before_effect=eager.before_effect)
    full_hook = eager.chain(observer)

    def hook(ev: TransportEvent) -> None:
        # settings.eager_checkpoint off: no checkpoint from the stream's first dial
        # (crash-safe tools still make the chat durable before any effect); the
        # orphan sweep then covers the whole create-to-checkpoint window.
        if settings.eager_checkpoint or not isinstance(ev, WsDial):
            full_hook(ev)
        else:
            observer(ev)

    shared = resources.client
    if shared is not None and resources.router is not None:
        resources.router.target = hook  # the shared client's HTTP/WS events

    # The turn's client (the flow's shared one, else its own): named here rather than
    # read from the agent inside the callback below, which the agent holds — a closure
    # over the agent made the two a reference cycle that kept every turn's agent, its
    # stream reader and all they held alive until the garbage collector's next pass
    # (docs/performance.md, round 11b).
    client = shared if shared is not None else creds.get_client(on_transport_event=hook)

    # While recovery follows an earlier attempt with this agent, the agent's interrupts
    # are recovery's to send (flows/turn/follower.py, chaos seed 519).
    gate = FollowGate()

    async def journal_before_interrupt(cid: str) -> None:
        gate.check(cid)
        await journal_cut_short(client, store, cid)

    async def still_ours(_cid: str | None) -> None:
        # Right before a prompt goes out: the workflow's lease and the turn's slot
        # are still this run's. A process that stalled since it took them (a
        # starved loop, a paused VM) may have lost them; sending then would drive
        # the chat next to the run that took the workflow over, or run a turn over
        # the fleet's cap. Free unless the last renewal is old (HeldLease.confirm,
        # flows/fleet/slots.py confirm_turn_slot).
        if lease is not None:
            await lease.confirm()
        await confirm_turn_slot()

    # Observe what the turn starts from; from here on decide() says what is next and
    # one act per kind does it (flows/turn/decide.py: the rules and the failure window
    # each closes).
    snapshot = TurnSnapshot(
        chat_id=chat_id,
        orphans_pending=chat_id is None and orphans_possible,
        structured=answer is not None,
    )
    action = decide(snapshot)
    if isinstance(action, CheckOrphans):
        # Before the agent exists: an adopted orphan is the chat it is built on.
        try:
            found_orphan = await adopt_or_strand_orphans(
                client, store, workflow_id, marker, turn_timeout=turn_timeout, logger=logger
            )
            if found_orphan.adopted is not None:
                start = await store.turns.begin(workflow_id, marker, turn_timeout_s=turn_timeout)
        except BaseException:
            await _release_client(client, resources)
            raise
        if found_orphan.adopted is not None:
            eager.moved(checkpointed=True)
            observer.chat_id = found_orphan.adopted
        snapshot = dataclasses.replace(
            snapshot, chat_id=found_orphan.adopted, orphans_pending=False
        )

    agent = creds.get_agent(
        client=client,
        chat_id=snapshot.chat_id,
        last_seen_message_id=start.checkpoint.last_seen_message_id if start.checkpoint else None,
        tools=tools,
        # Collection, tenant, workflow and flow run: the sweeps find (only) our chats.
        # The store's identity too: a sweep of another store leaves the chat alone.
        labels=chat_labels(
            store.tenant, workflow_id, current_flow_run_id(), await store.identity()
        ),
        request_timeout=request_timeout,
        on_transport_event=hook,
        stream_options=StreamOptions(backoff_initial_ms=settings.redial_backoff_ms),
        # Every interrupt the agent sends of the checkpointed chat is journaled
        # cut-short first (a later recovery's own 409 must not pass the truncated
        # attempt off as finished), and a transient failure after a send landed
        # leaves the live run for recovery to follow (issue 11, items 1 and 6).
        hooks=AgentHooks(
            before_interrupt=journal_before_interrupt,
            before_send=still_ours,
            leave_landed_runs=True,
        ),
    )
    acts = _TurnActs(
        prompt=f"{marker} {step.prompt}",
        reask=f"{marker} {answer.nudge}" if answer is not None else "",
        agent=agent,
        store=store,
        observer=observer,
        eager=eager,
        workflow_id=workflow_id,
        step=step,
        marker=marker,
        tools=tools,
        answer=answer,
        settings=settings,
        timings=recovery_timings(settings, request_timeout, turn_timeout),
        turn_timeout=turn_timeout,
        known_failure=retry_reason is not None,
        earlier=resources.earlier_steps,
        start=start,
        gate=gate,
    )
    try:
        t_recovery = time.perf_counter()
        # Before any send: bring an earlier attempt to an end, or move off an archived
        # chat. Journals the send write-ahead; if this step already sent on this chat
        # and recorded no result, first settles the chat (ledger reconcile before any
        # interrupt), follows the crashed attempt if it is still running, and recovers
        # a finished attempt instead of resubmitting.
        while True:
            snapshot = dataclasses.replace(snapshot, fence_lost=lease is not None and lease.lost)
            action = decide(snapshot)
            if isinstance(action, StandDown):
                assert lease is not None
                lease.raise_if_lost()
                raise AssertionError("a lost lease stays lost")  # pragma: no cover
            if isinstance(action, Recover):
                snapshot = await acts.recover(snapshot, action)
            elif isinstance(action, MoveToChat):
                snapshot = await acts.move_to_chat(snapshot, action)
            elif isinstance(action, MoveToFreshChat):
                snapshot = acts.move_to_fresh_chat(snapshot, action)
            elif isinstance(action, Return):
                return action.result
            elif isinstance(action, FailStructured):
                raise StructuredAnswerError(
                    step.name, step.output_model, snapshot.chat_id, action.attempt
                )
            else:
                break
        started_at = time.time()
        # A followed attempt's time is the follow's (inside the recovery above).
        t0 = t_recovery if isinstance(action, Follow) else time.perf_counter()
        # The chat the sends go to was checkpointed before them (None: a first turn's
        # or a fresh chat, which the send creates).
        had_chat = snapshot.chat_id is not None
        failed: BaseException | None = None
        gen: GenerateResult | None = None
        try:
            # The sends: the step's prompt (or a followed attempt), then at most one
            # re-ask, until decide() says the turn settles.
            while not isinstance(action, Settle):
                if not isinstance(action, (Send, Follow, Reask)):
                    raise AssertionError(f"not a send: {action!r}")  # pragma: no cover
                snapshot = dataclasses.replace(snapshot, attempt=action.attempt)
                gen = await acts.send(action)
                reasked = snapshot.reasked or isinstance(action, Reask)
                snapshot = dataclasses.replace(
                    snapshot, reasked=reasked, answered=await acts.answered(gen, reasked=reasked)
                )
                action = decide(snapshot)
            assert gen is not None
        except BaseException as exc:
            failed = exc
            raise
        finally:
            generate_ms = (time.perf_counter() - t0) * 1000
            try:
                await eager.drain()
                crash_point("turn.before_checkpoint")  # test seam: the store faulted here
                kept: str | None = None
                try:
                    kept = await _record_after_turn(
                        store,
                        workflow_id=workflow_id,
                        agent=agent,
                        had_chat=had_chat,
                        failed=failed,
                        marker=marker,
                        started_at=started_at,
                        turn_timeout=turn_timeout,
                        logger=logger,
                        observer=observer,
                        eagerly_journaled=eager.written,
                    )
                except StoreUnavailableError as exc:
                    # Transient: the step fails retryably and its chat stays live; the
                    # failure handler names the chat without asking the store, and a
                    # finished turn whose checkpoint failed still says coder.turn.failed.
                    exc.chat_id = agent.chat_id
                    if failed is None:
                        failed = exc
                    raise
                if failed is not None:
                    # A timeout, an error or a cancellation: the SDK already fired its
                    # best-effort interrupt, so a later recovery must not trust a 409.
                    await note_failed_attempt(
                        agent.client,
                        store,
                        kept,  # also a chat the SDK discarded that this turn checkpointed
                        marker,
                        failed,
                        left_live=agent.left_run_live is not None,
                    )
            finally:
                if failed is not None:
                    observer.emit(
                        "coder.turn.failed",
                        {
                            "error": type(failed).__name__,
                            "message": str(failed)[:500],
                            "retryable": is_retryable_failure(failed),
                            "attempt": snapshot.attempt,
                            "duration_ms": round(generate_ms, 1),
                        },
                    )
        attempt = snapshot.attempt
        result = turn_result(
            gen,
            workflow_id=workflow_id,
            step=step.name,
            marker=marker,
            structured=_settled_answer(step, answer, gen, attempt),
            attempt=attempt,
            generate_ms=generate_ms,
        )
        # The chat took this step's turn: live, as far as this process knows (the next
        # step's common send then needs no read to rule out an archived chat).
        note_live(result.chat_id)
    finally:
        # The agent never owns its client: close one built for this turn only.
        try:
            await agent.aclose()
        finally:
            await _release_client(client, resources)
    observer.emit(
        "coder.turn.settled",
        {
            "finish_reason": result.finish_reason,
            "usage": result.usage,
            "attempt": attempt,
            "duration_ms": result.generate_ms,
            "redials": observer.redials,
            "segments": observer.segments,
        },
        deferred=True,  # off the turn's path, batched (parts/background.py)
    )
    # A routine turn's line is DEBUG: the coder.turn.settled event above and the
    # persisted result carry the same, and at INFO the line went through Prefect's
    # console handler (rich highlighting of the chat id) and API log handler — 9 % of
    # a fan-out worker's loop (docs/performance.md, round 8). A step that took more
    # than one send (recovered, resubmitted, re-asked) still says so at INFO.
    logger.log(
        logging.INFO if attempt > 1 else logging.DEBUG,
        "step %s settled on chat %s: finish=%s, %d tool call(s), %.0f ms, attempt %d",
        step.name,
        result.chat_id,
        result.finish_reason,
        len(result.tool_calls),
        result.generate_ms,
        attempt,
    )
    if settings.artifacts:
        try:
            publish_turn_artifact(result, acts.prompt, base_url=creds.base_url)
        except Exception:
            logger.warning("could not publish the turn artifact", exc_info=True)
    crash_point("turn.before_persist")
    return result


@task(
    name="run-turn",
    task_run_name="{workflow_id}/{step.name}",
    cache_key_fn=turn_cache_key,
    persist_result=True,
    result_serializer="json",
    retry_condition_fn=retry_if_retryable,
    retries=2,
    retry_delay_seconds=5,
)
async def run_turn(
    workflow_id: str,
    step: Step,
    settings: WorkflowSettings,
    resources: TurnResources | None = None,
    toolset: Toolset | None = None,
) -> TurnResult:
    """One durable agent turn. Re-running a finished (workflow, step) returns its
    stored result without sending anything.

    ``resources`` lets a flow share one credentials/store pair across its turns;
    without it the turn loads them from ``settings``.
    """
    ctx = TaskRunContext.get()
    retry_reason = None
    if ctx is not None and ctx.task_run.run_count > 1:
        retry_reason = f"Prefect retry {ctx.task_run.run_count - 1} of step {step.name}"
    if resources is None:
        resources = await load_resources(settings)
    return await write_step_result(
        await execute_turn(
            workflow_id, step, settings, resources, toolset=toolset, retry_reason=retry_reason
        ),
        workflow_id=workflow_id,
        step=step.name,
    )
