"""The ``reconcile-workflows`` deployment: every workflow ends, without a person.

Level-triggered liveness (issue 29; docs/reconciler.md). Each tick:

1. **observe** — the store's unfinished workflow records with the lease rows they
   name and the store clock (one read), plus, in batches, their Prefect flow runs,
   the runs' recent heartbeats, and the product's Pending/Running runs that have no
   record yet (a run lost before it took its lease is adopted from Prefect);
2. **decide** — :func:`prefect_coder.flows.liveness.decide.decide`, pure, per record;
3. **act**, idempotently — ``done``; mark a dead run Crashed (which also fires the
   fast-path Crashed triggers); rerun the workflow's own deployment with ALL its
   parameters under a deterministic idempotency key per recovery attempt (two
   reconcilers, or a reconciler and a trigger, never start two: Prefect returns the
   existing run for a known key, and the attempt count is a compare-and-set in the
   store); or give up — a ``coder.workflow.gave-up`` event and a markdown artifact
   naming the workflow, its chat (left live, not archived) and why.

Every age is taken on the clock that stamped it (docs/reconciler.md, "Clocks"): state
ages, pause deadlines, heartbeat ages and the Prefect queries' windows against the
Prefect server's clock, read once per tick (``flows/liveness/server_clock.py``); lease
silences and the time since the reconciler last acted against the store's clock. The
reconciler host's own clock never enters a verdict: a host running minutes ahead would
crash healthy runs, one running behind would never notice a lost one.

Nothing to do costs the server-clock read (``/hello``, no database), three reads of
the Prefect API and one of the store, and no write, artifact or event
(docs/reconciler.md, "Cost").
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from prefect import flow
from prefect.artifacts import acreate_markdown_artifact, acreate_table_artifact
from prefect.client.orchestration import PrefectClient, get_client
from prefect.client.schemas.filters import (
    DeploymentFilter,
    DeploymentFilterName,
    FlowRunFilter,
    FlowRunFilterDeploymentId,
    FlowRunFilterId,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.events import emit_event
from prefect.events.filters import (
    EventFilter,
    EventNameFilter,
    EventOccurredFilter,
    EventOrder,
    EventRelatedFilter,
    EventResourceFilter,
)
from prefect.events.schemas.events import ReceivedEvent
from prefect.exceptions import ObjectNotFound
from prefect.states import Crashed
from pydantic import BaseModel, ConfigDict, Field

from prefect_coder.blocks.state.leases import RELEASED
from prefect_coder.blocks.state.store import StateStore
from prefect_coder.blocks.state.workflows import (
    RESUMABLE_PREFIX,
    LeaseView,
    WorkflowRecord,
    WorkflowsSnapshot,
)
from prefect_coder.flows.common.resources import load_store
from prefect_coder.flows.deployments.sweep_settings import SweepSettings
from prefect_coder.flows.liveness.decide import (
    Action,
    Decision,
    LeaseFacts,
    Observation,
    RunFacts,
    Timing,
    decide,
)
from prefect_coder.flows.liveness.server_clock import ServerClock, read_server_clock
from prefect_coder.flows.liveness.track import RESUMABLE_EVENT, batch_key, workflow_record_key
from prefect_coder.flows.observe.run_log import run_logger

__all__ = [
    "GAVE_UP_EVENT",
    "PRODUCT_DEPLOYMENTS",
    "ReconcileOptions",
    "ReconcileRow",
    "reconcile_once",
    "reconcile_workflows",
    "recovery_idempotency_key",
]

#: The event a workflow the reconciler gave up on emits (watch it: docs/reconciler.md).
GAVE_UP_EVENT = "coder.workflow.gave-up"
#: The deployments whose runs drive workflows (their Pending/Running runs without a
#: record are adopted): ``prefect.yaml``'s names.
PRODUCT_DEPLOYMENTS = (
    "agent-workflow",
    "agent-turn",
    "recover-turn",
    "agent-fanout",
    "agent-fanout-shard",
)
#: Runs per Prefect read (flow runs by id, heartbeat events).
_BATCH = 200
_DEFAULT_TTL_S = 60.0
#: Events per page (the API's maximum) and pages per chunk of runs.
_EVENTS_PER_PAGE = 50
_EVENT_PAGES = 10
#: An event's ``occurred`` is the clock of the host that emitted it (a flow run's), the
#: only time Prefect's events API filters on: the windows reach this far past the
#: server's "now" both ways so that an emitter's skewed clock does not hide its events.
#: Their ages are then taken from ``received`` (the server's clock).
_OCCURRED_SKEW = timedelta(minutes=15)

logger = logging.getLogger("prefect_coder.flows.reconcile")


class ReconcileOptions(BaseModel):
    """The reconciler's clocks (seconds) and bounds; see docs/reconciler.md."""

    model_config = ConfigDict(extra="forbid")

    pending_grace_s: float = Field(
        default=120.0, gt=0, description="A Pending run this old is lost."
    )
    lost_grace_s: float = Field(
        default=5.0,
        ge=0,
        description="Silence past the missed lease renewals before a host is lost.",
    )
    missed_renewals: float = Field(
        default=1.5,
        gt=0,
        description="Lease renewals (every ttl / 3) a holder may miss before it is silent.",
    )
    heartbeat_grace_s: float = Field(
        default=90.0, gt=0, description="No lease to ask: heartbeats silent this long mean lost."
    )
    heartbeat_fresh_s: float = Field(
        default=35.0, ge=0, description="A heartbeat this recent vetoes the lease's evidence."
    )
    crashed_grace_s: float = Field(
        default=20.0, ge=0, description="A Crashed run is left this long to the Crashed triggers."
    )
    max_attempts: int = Field(default=3, ge=0, description="Reruns per workflow before giving up.")
    backoff_s: float = Field(default=10.0, ge=0, description="Wait after the first rerun; doubles.")
    max_backoff_s: float = Field(
        default=300.0, ge=0, description="The longest wait between reruns."
    )
    adopt: bool = Field(
        default=True, description="Record product runs found Pending/Running without a record."
    )

    def timing(self) -> Timing:
        """The pure function's clocks."""
        return Timing(
            pending_grace_s=self.pending_grace_s,
            lost_grace_s=self.lost_grace_s,
            missed_renewals=self.missed_renewals,
            heartbeat_grace_s=self.heartbeat_grace_s,
            heartbeat_fresh_s=self.heartbeat_fresh_s,
            crashed_grace_s=self.crashed_grace_s,
            max_attempts=self.max_attempts,
            backoff_s=self.backoff_s,
            max_backoff_s=self.max_backoff_s,
        )


class ReconcileRow(BaseModel):
    """One workflow of a tick: what was seen, decided and done."""

    key: str
    workflow_id: str | None = None
    chat_id: str | None = None
    flow_run_id: str | None = None
    state: str | None = None
    attempts: int = 0
    action: str
    why: str
    acted: bool = False
    #: The rerun's flow run id (``recover``).
    rerun_id: str | None = None


def recovery_idempotency_key(key: str, attempt: int, dead_run: str | None) -> str:
    """The rerun's idempotency key: one per (workflow record, attempt, dead run), so
    every reconciler — and a retry of the same tick — names the same flow run."""
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return f"reconcile-{digest}-{attempt}-{dead_run or 'none'}"


# --------------------------------------------------------------------------- observe


def _settings_ttl(parameters: dict[str, Any]) -> float:
    settings = parameters.get("settings")
    if isinstance(settings, dict):
        ttl = settings.get("lease_ttl_s")
        if isinstance(ttl, int | float) and ttl > 0:
            return float(ttl)
    return _DEFAULT_TTL_S


def lease_facts(
    record: WorkflowRecord, leases: dict[str, LeaseView], now: float
) -> LeaseFacts | None:
    """The record's leases as evidence: live if any row is unexpired; silent since the
    most recent renewal of a row not released (renewed = its expiry minus the ttl the
    run renews with).

    On the store's clock: ``now`` is the snapshot's (``WorkflowsSnapshot.now``, read in
    the same transaction) and every expiry was written by the store's clock."""
    if not record.lease_keys:
        return None
    ttl = _settings_ttl(record.parameters)
    rows = [leases[k] for k in record.lease_keys if k in leases]
    held = [r for r in rows if r.expires_at != RELEASED]
    return LeaseFacts(
        live=any(r.expires_at > now for r in rows),
        silent_s=min((now - (r.expires_at - ttl)) for r in held) if held else None,
        ttl_s=ttl,
    )


def run_facts(run: FlowRun, heartbeat: datetime | None, now: datetime) -> RunFacts:
    """A flow run as the pure function sees it, every age on the Prefect server's clock.

    ``now``: the server's "now" (:func:`read_server_clock`). The state's ``timestamp``
    is minted by the server when it accepts the state. ``heartbeat``: the latest beat's
    ``received`` (stamped by the server), not its ``occurred`` (the emitting host's
    clock). A pause's ``pause_timeout`` is computed by the pausing run's host, and
    Prefect's server expires the pause against its own clock: the same comparison here.
    """
    state = run.state
    if state is None:
        return RunFacts(None)
    pause_left: float | None = None
    timeout = state.state_details.pause_timeout if state.state_details else None
    if timeout is not None:
        pause_left = (timeout - now).total_seconds()
    return RunFacts(
        state_type=state.type.value,
        state_name=state.name,
        state_age_s=max(0.0, (now - state.timestamp).total_seconds()),
        heartbeat_age_s=None if heartbeat is None else (now - heartbeat).total_seconds(),
        pause_left_s=pause_left,
        state_message=state.message,
    )


def _chunks(items: Sequence[Any]) -> Iterable[Sequence[Any]]:
    for at in range(0, len(items), _BATCH):
        yield items[at : at + _BATCH]


async def _runs_by_id(client: PrefectClient, ids: list[str]) -> dict[str, FlowRun] | None:
    """The flow runs by id (absent: the server has none); None if a read failed."""
    found: dict[str, FlowRun] = {}
    try:
        for chunk in _chunks(ids):
            for run in await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[UUID(i) for i in chunk])),
                limit=len(chunk),
            ):
                found[str(run.id)] = run
    except Exception as exc:
        logger.warning("could not read the flow runs: %s", type(exc).__name__)
        return None
    return found


async def _events(client: PrefectClient, event_filter: EventFilter) -> AsyncIterator[ReceivedEvent]:
    """The events ``event_filter`` matches, 50 a page (the API's most), at most
    ``_EVENT_PAGES`` pages; a caller that has what it needs stops iterating."""
    page = await client.read_events(event_filter, limit=_EVENTS_PER_PAGE)
    for _ in range(_EVENT_PAGES):
        for event in page.events:
            yield event
        if page.next_page is None:
            return
        page = await client.read_events_page(str(page.next_page))


def _occurred(since: datetime, now: datetime) -> EventOccurredFilter:
    """An ``occurred`` window from ``since`` to ``now`` (server clock), widened by
    :data:`_OCCURRED_SKEW` both ways (``occurred`` is on the emitter's clock; the
    default ``until`` would be this host's "now")."""
    return EventOccurredFilter.model_validate(
        {"since": since - _OCCURRED_SKEW, "until": now + _OCCURRED_SKEW}
    )


async def _heartbeats(
    client: PrefectClient, run_ids: list[str], since: datetime, now: datetime
) -> dict[str, datetime]:
    """When the server received each run's latest heartbeat since ``since`` (server
    clock; none found, or a failed read: absent).

    Newest first, paged only until every run of the chunk has its latest beat."""
    latest: dict[str, datetime] = {}
    try:
        for chunk in _chunks(run_ids):
            beats = EventFilter(
                occurred=_occurred(since, now),
                event=EventNameFilter(name=["prefect.flow-run.heartbeat"]),
                resource=EventResourceFilter(id=[f"prefect.flow-run.{i}" for i in chunk]),
                order=EventOrder.DESC,
            )
            async for event in _events(client, beats):
                run_id = event.resource.id.removeprefix("prefect.flow-run.")
                if run_id not in latest or event.received > latest[run_id]:
                    latest[run_id] = event.received
                if all(i in latest for i in chunk):
                    break
    except Exception as exc:
        logger.warning("could not read heartbeats: %s", type(exc).__name__)
    return latest


async def _resumable_runs(
    client: PrefectClient, runs: Sequence[FlowRun], now: datetime
) -> set[str] | None:
    """The ids among ``runs`` (Failed, with no resumable mark in the store) whose failure
    handler emitted ``coder.workflow.resumable``; None when the events could not be read.

    The second source of the mark: the handler emits the event to Prefect even when the
    store — often the very thing that failed — cannot take the mark. Without it, a run
    failed by a store outage counted as ended and its workflow never finished."""
    if not runs:
        return set()
    since = min(r.state.timestamp for r in runs if r.state is not None) - timedelta(minutes=5)
    found: set[str] = set()
    try:
        for chunk in _chunks([str(r.id) for r in runs]):
            wanted = {f"prefect.flow-run.{i}" for i in chunk}
            marks = EventFilter(
                occurred=_occurred(since, now),
                event=EventNameFilter(name=[RESUMABLE_EVENT]),
                related=EventRelatedFilter(id=sorted(wanted)),
            )
            async for event in _events(client, marks):
                found.update(
                    r.id.removeprefix("prefect.flow-run.") for r in event.related if r.id in wanted
                )
    except Exception as exc:
        logger.warning("could not read resumable events: %s", type(exc).__name__)
        return None
    return found


def _record_key(deployment_name: str, parameters: dict[str, Any]) -> tuple[str, str | None] | None:
    """The record key a product run would have written (see flows/liveness/track.py)."""
    workflow_id = parameters.get("workflow_id")
    if deployment_name in ("agent-workflow", "agent-turn", "recover-turn"):
        return (workflow_record_key(workflow_id), workflow_id) if workflow_id else None
    workflows = parameters.get("workflows")
    if isinstance(workflows, list) and deployment_name in ("agent-fanout", "agent-fanout-shard"):
        ids = [w.get("workflow_id", "") for w in workflows if isinstance(w, dict)]
        kind = "shard" if deployment_name == "agent-fanout-shard" else "fanout"
        return batch_key(kind, ids), None
    return None


def _same_store(parameters: dict[str, Any], store_block: str | None) -> bool:
    settings = parameters.get("settings")
    theirs = settings.get("store_block") if isinstance(settings, dict) else None
    return (theirs or None) == (store_block or None)


async def _adopt(
    client: PrefectClient,
    store: StateStore,
    snapshot: WorkflowsSnapshot,
    store_block: str | None,
    older_than: datetime,
) -> int:
    """Record the product's Pending/Running runs on this store that no running record
    names (lost before they took their lease: issue 29, case 4). Two reads."""
    deployments = await client.read_deployments(
        deployment_filter=DeploymentFilter(
            name=DeploymentFilterName(any_=list(PRODUCT_DEPLOYMENTS))
        )
    )
    if not deployments:
        return 0
    names = {d.id: d.name for d in deployments}
    runs = await client.read_flow_runs(
        flow_run_filter=FlowRunFilter(
            deployment_id=FlowRunFilterDeploymentId(any_=list(names)),
            state=FlowRunFilterState(
                type=FlowRunFilterStateType(any_=[StateType.PENDING, StateType.RUNNING])
            ),
        ),
        limit=_BATCH,
    )
    known = {r.key: r.flow_run_id for r in snapshot.records}
    adopted = 0
    for run in runs:
        if run.deployment_id is None or run.state is None or run.state.timestamp > older_than:
            continue
        parameters = dict(run.parameters or {})
        found = _record_key(names.get(run.deployment_id, ""), parameters)
        if found is None or not _same_store(parameters, store_block):
            continue
        key, workflow_id = found
        if key in known:  # a running record decides (its run is this one, or newer)
            continue
        await store.workflows.started(
            key,
            deployment=str(run.deployment_id),
            parameters=parameters,
            flow_run_id=str(run.id),
            workflow_id=workflow_id,
            lease_keys=[f"workflow:{workflow_id}"] if workflow_id else [],
        )
        adopted += 1
    return adopted


# --------------------------------------------------------------------------- act


async def _give_up(
    store: StateStore, record: WorkflowRecord, decision: Decision, run_state: str | None
) -> bool:
    reason = decision.why
    if not await store.workflows.give_up(
        record.key, expected_attempts=record.attempts, reason=reason
    ):
        return False  # another reconciler gave up first: it reported
    subject = record.workflow_id or record.key
    emit_event(
        GAVE_UP_EVENT,
        resource={
            "prefect.resource.id": f"coder.workflow.{subject}",
            "prefect.resource.name": subject,
        },
        payload={
            "key": record.key,
            "workflow_id": record.workflow_id,
            "chat_id": record.chat_id,
            "deployment_id": record.deployment,
            "flow_run_id": record.flow_run_id,
            "attempts": record.attempts,
            "why": reason,
        },
    )
    chat = (
        f"chat `{record.chat_id}` — left live, not archived: resume it, or archive it with "
        "the `archive-workflow-chat` deployment"
        if record.chat_id
        else "no chat checkpointed"
    )
    digest = hashlib.sha256(record.key.encode()).hexdigest()[:16]
    await acreate_markdown_artifact(
        key=f"coder-gave-up-{digest}",
        markdown=(
            f"# Gave up on workflow `{subject}`\n\n"
            f"* record: `{record.key}` (deployment `{record.deployment}`)\n"
            f"* last flow run: `{record.flow_run_id}` ({run_state or 'unknown'})\n"
            f"* {chat}\n"
            f"* recoveries started: {record.attempts}\n"
            f"* why: {reason}\n\n"
            "Every parameter is in the state store (`store.workflows.get(...)`); a rerun of "
            "the deployment with them recovers before it sends anything."
        ),
        description=f"reconcile-workflows gave up on {subject}",
    )
    return True


async def _recover(
    client: PrefectClient, store: StateStore, record: WorkflowRecord, decision: Decision
) -> str | None:
    attempt = record.attempts + 1
    key = recovery_idempotency_key(record.key, attempt, record.flow_run_id)
    rerun = await client.create_flow_run_from_deployment(
        UUID(record.deployment),
        parameters=record.parameters,
        idempotency_key=key,
        tags=["coder-reconciled"],
    )
    # Two reconcilers got the same run (same key); one counts the attempt.
    await store.workflows.claim_attempt(
        record.key,
        expected_attempts=record.attempts,
        flow_run_id=str(rerun.id),
        reason=decision.why,
    )
    return str(rerun.id)


async def _act(
    client: PrefectClient,
    store: StateStore,
    record: WorkflowRecord,
    decision: Decision,
    run_state: str | None,
) -> tuple[bool, str | None]:
    if decision.action == Action.DONE:
        await store.workflows.finished(
            record.key, flow_run_id=record.flow_run_id, reason=decision.why
        )
        return True, None
    if decision.action == Action.MARK_CRASHED and record.flow_run_id:
        await client.set_flow_run_state(
            UUID(record.flow_run_id),
            Crashed(message=f"reconcile-workflows: {decision.why}"),
            force=False,
        )
        await store.workflows.noted(record.key, decision.why)
        return True, None
    if decision.action == Action.RECOVER:
        return True, await _recover(client, store, record, decision)
    if decision.action == Action.GIVE_UP:
        return await _give_up(store, record, decision, run_state), None
    return False, None


# --------------------------------------------------------------------------- one tick


async def reconcile_once(
    store: StateStore,
    options: ReconcileOptions | None = None,
    *,
    store_block: str | None = None,
    dry_run: bool = False,
    client: PrefectClient | None = None,
) -> list[ReconcileRow]:
    """One tick: observe, decide, act (unless ``dry_run``); one row per workflow.
    ``client``: a Prefect client to reuse (a looping run keeps one open)."""
    if client is None:
        async with get_client() as own:
            return await reconcile_once(
                store, options, store_block=store_block, dry_run=dry_run, client=own
            )
    options = options or ReconcileOptions()
    timing = options.timing()
    snapshot = await store.workflows.snapshot()
    adopting = options.adopt and not dry_run
    if not adopting and not snapshot.records:
        return []
    # One clock for every age taken from Prefect: the server's, read once this tick.
    clock: ServerClock = await read_server_clock(client)
    now = clock.now()
    if adopting:
        try:
            older = now - timedelta(seconds=min(options.pending_grace_s, 30.0))
            if await _adopt(client, store, snapshot, store_block, older):
                snapshot = await store.workflows.snapshot()
                now = clock.now()
        except Exception as exc:
            logger.warning("could not look for runs to adopt: %s", type(exc).__name__)
    if not snapshot.records:
        return []
    ids = [r.flow_run_id for r in snapshot.records if r.flow_run_id]
    runs = await _runs_by_id(client, ids)
    live = [
        i
        for i in ids
        if runs is not None
        and i in runs
        and (s := runs[i].state) is not None
        and s.type in (StateType.RUNNING, StateType.PENDING)
    ]
    since = now - timedelta(seconds=max(timing.heartbeat_grace_s, timing.heartbeat_fresh_s) * 2)
    beats = await _heartbeats(client, live, since, now) if live else {}
    unmarked = [
        run
        for r in snapshot.records
        if r.flow_run_id
        and not (r.reason or "").startswith(RESUMABLE_PREFIX)
        and runs is not None
        and (run := runs.get(r.flow_run_id)) is not None
        and run.state is not None
        and run.state.type == StateType.FAILED
    ]
    evented = await _resumable_runs(client, unmarked, now)
    rows: list[ReconcileRow] = []
    for record in snapshot.records:
        acted_age = None if record.acted_at is None else snapshot.now - record.acted_at
        run = None if runs is None or not record.flow_run_id else runs.get(record.flow_run_id)
        found = runs is None or not record.flow_run_id or run is not None
        observation = Observation(
            key=record.key,
            attempts=record.attempts,
            acted_age_s=acted_age,
            run=None if run is None else run_facts(run, beats.get(str(run.id)), now),
            found=found and record.flow_run_id is not None,
            lease=lease_facts(record, snapshot.leases, snapshot.now),
            resumable=(record.reason or "").startswith(RESUMABLE_PREFIX)
            or (None if evented is None else record.flow_run_id in evented),
        )
        if runs is None:
            decision = Decision(Action.LEAVE, "the flow runs could not be read")
        else:
            decision = decide(observation, timing)
        state = None if run is None or run.state is None else run.state.name
        row = ReconcileRow(
            key=record.key,
            workflow_id=record.workflow_id,
            chat_id=record.chat_id,
            flow_run_id=record.flow_run_id,
            state=state,
            attempts=record.attempts,
            action=decision.action.value,
            why=decision.why,
        )
        if not dry_run and decision.action != Action.LEAVE:
            try:
                row.acted, row.rerun_id = await _act(client, store, record, decision, state)
            except ObjectNotFound:
                row.why += " (its deployment no longer exists)"
            except Exception as exc:
                row.why += f" (act failed: {type(exc).__name__}; next tick retries)"
        rows.append(row)
    return rows


@flow(name="reconcile-workflows", persist_result=False, log_prints=False)
async def reconcile_workflows(
    settings: SweepSettings | None = None,
    options: ReconcileOptions | None = None,
    dry_run: bool = False,
    run_for_s: float = 0.0,
    tick_s: float = 30.0,
) -> list[ReconcileRow]:
    """Drive every unfinished workflow on the store to an end (docs/reconciler.md).

    Args:
        settings: which state store (``store_block``); the workflows' own settings
            (the ``&settings`` anchor of prefect.yaml) are accepted.
        options: the clocks and bounds (grace periods, attempts, backoff).
        dry_run: decide and report, act on nothing.
        run_for_s: 0: one tick. Otherwise tick every ``tick_s`` for this long in this
            one flow run: a flow run on a process worker is a process start (seconds of
            CPU), an idle tick in a running process costs milliseconds
            (docs/reconciler.md, "Cost").
        tick_s: seconds between two ticks of a looping run.

    Returns the last tick's rows.
    """
    settings = settings or SweepSettings()
    log = run_logger(__name__)
    store = await load_store(settings.workflow_settings())
    end = time.monotonic() + max(0.0, run_for_s)
    async with get_client() as client:
        while True:
            started = time.monotonic()
            rows = await reconcile_once(
                store,
                options,
                store_block=settings.store_block,
                dry_run=dry_run,
                client=client,
            )
            await _report(rows, log)
            if started + tick_s >= end:
                return rows
            await asyncio.sleep(max(0.0, started + tick_s - time.monotonic()))


async def _report(rows: list[ReconcileRow], log: Any) -> None:
    """A log line and a table artifact for a tick that acted; nothing for an idle one."""
    acted = [r for r in rows if r.action != Action.LEAVE.value]
    if not acted:
        return
    log.info(
        "reconcile: %d workflow(s), acted on %d: %s",
        len(rows),
        len(acted),
        "; ".join(f"{r.key} {r.action} ({r.why})" for r in acted[:10]),
    )
    await acreate_table_artifact(
        key="reconcile-workflows",
        table=[r.model_dump(mode="json") for r in acted],
        description=f"reconcile-workflows: acted on {len(acted)} of {len(rows)}",
    )
