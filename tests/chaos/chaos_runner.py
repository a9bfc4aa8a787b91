"""Runs chaos schedules against real parts: the chatd emulator (thread), the test
payments service, a warm fork server whose children are really SIGKILLed
(``tests/recovery/crash_child.py``: the workflow, ``recover-turn``, a fan-out shard,
or a flow run of an ``agent-workflow`` deployment that suspends at an approval and
is resumed through Prefect's API), the Prefect server of the caller, the stores
(SQLite files or a PostgreSQL cluster) and a result storage of each rig's own; the
dependency faults of ``chaos_infra`` when the schedule has them. Shared by ``tests/chaos`` (a short fixed seed set) and ``bench/chaos.py``
(hundreds of seeds).

The caller provides the Prefect API (``PREFECT_API_URL`` current in this process
and in ``child_env``) and puts ``tests/recovery`` on ``sys.path`` (the crash
machinery and the ``charge_card`` tool live there and are imported, not copied).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import httpx
from chaos_infra import Infra, results_dir
from chaos_invariants import LIVE, Evidence, Violation, check
from chaos_schedule import APPROVAL_STEP, TEMPLATES, Phase, Schedule, SweepRun, Timed
from crash_matrix import ForkServer, crash_settings, directive, env_for_children
from payments import Payments
from pydantic import SecretStr, TypeAdapter

from coder_chat.emulator import Emulator
from prefect_coder.blocks import ChatStateStore, CoderCredentials
from prefect_coder.flows.common import params
from prefect_coder.flows.common.labels import LABEL_WORKFLOW, label_value
from prefect_coder.flows.common.params import Step, WorkflowSettings, step_marker
from prefect_coder.flows.common.results import TurnResult
from prefect_coder.flows.sweeps.options import SweepOptions

if TYPE_CHECKING:
    from warm_python import WarmPython

__all__ = ["Outcome", "Rig", "open_rig", "process_env", "run_schedule"]

T = TypeVar("T")

#: Short recovery constants (production: 1 s poll, horizon = request timeout).
FAST_ENV = {"PREFECT_CODER_SETTLE_POLL_S": "0.05", "PREFECT_CODER_COMMIT_HORIZON_S": "1.0"}
#: Bound of one phase: a run that neither ends nor fails within it is a liveness bug.
PHASE_LIMIT_S = 90.0
#: Clean reruns after the schedule before recovery counts as not finishing.
CLEAN_RERUNS = 2
#: The approval schedules' deployment of ``agent-workflow`` (one per Prefect server).
DEPLOYMENT_NAME = "chaos-approvals"
#: The rows of a sweep-orphans run in a phase's line (``orphans sweep: [retire/ok, …]``).
_ORPHAN_ROWS = re.compile(r"orphans sweep: \[([^\]]*)\]")
#: The rows of a sweep-stuck-turns run (``stuck sweep: [interrupt/ok, …]``).
_STUCK_ROWS = re.compile(r"stuck sweep: \[([^\]]*)\]")
#: New runs started at a decision while none waits (the reconciler's max_attempts).
RERUNS_TO_SUSPEND = 3
#: Exit codes of a crash child (crash_child.py).
RC_WHAT = {-9: "killed", 0: "finished", 3: "failed", 4: "suspended", None: "HUNG"}


@dataclass
class Outcome:
    """What one schedule did and which invariants it broke."""

    schedule: Schedule
    workflow_id: str
    violations: list[Violation]
    seconds: float
    phases: list[str] = field(default_factory=list)
    cuts: int = 0
    fired: int = 0
    notes: list[str] = field(default_factory=list)
    #: the workflow's chats as the emulator stored them (violations only)
    transcript: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def report(self) -> str:
        lines = [self.schedule.describe(), f"  workflow {self.workflow_id}, {self.seconds:.1f} s"]
        lines += [f"  -> {p}" for p in self.phases]
        lines.append(f"  kills that left a live attempt: {self.cuts}; faults fired: {self.fired}")
        lines += [f"  note: {n}" for n in self.notes]
        lines += [f"  VIOLATION {v}" for v in self.violations]
        lines += [f"    {t}" for t in self.transcript]
        return "\n".join(lines)


@dataclass
class Rig:
    """The running parts and the fault-free answers of each catalog step."""

    emu: Emulator
    payments: Payments
    fork: ForkServer
    credentials_block: str
    state_url: str
    #: the dependencies a schedule may fault (the store kind among them)
    infra: Infra
    #: this rig's directory: its SQLite store, its result storage (``results``)
    workdir: Path
    name: str = "rig"
    expected_text: dict[str, str] = field(default_factory=dict)
    #: the ``agent-workflow`` deployment the approval schedules' runs come from
    deployment_id: uuid.UUID | None = None

    def context(self) -> contextlib.AbstractContextManager[Any]:
        """This rig's settings for the in-process runs of the current task: its result
        storage, and the restartable Prefect server's API when the infra has one
        (settings of the context, not of the process: rigs of one bench run side by
        side, and a test's rig must leave the session's server to the others)."""
        return _rig_settings(self.workdir, self.infra)

    async def settings_for(
        self, tag: str, retries: int, store_wait: tuple[float, float] | None = None
    ) -> WorkflowSettings:
        """Workflow settings on a store tenant of its own: a sweep of the schedule
        sees only the schedule's chats. ``store_wait``: the store block's
        ``(connect_timeout, transient_retry_s)`` (None: its defaults)."""
        tenant = f"chaos-{tag}-{uuid.uuid4().hex[:8]}"
        store = ChatStateStore(url=self.state_url, tenant=tenant)
        if store_wait is not None:
            store.connect_timeout, store.transient_retry_s = store_wait
        await store.save(tenant, overwrite=True)
        return crash_settings(self.credentials_block, tenant, retries=retries)


# The union of step kinds where there is one (AnyStep), else Step is every kind.
_STEP_TYPE: Any = getattr(params, "AnyStep", Step)
_STEPS: TypeAdapter[list[Any]] = TypeAdapter(list[_STEP_TYPE])


def steps_of(templates: tuple[str, ...] | list[str], *, approval: bool = False) -> list[Any]:
    """The workflow's steps: one agent step per template (``s<i>-<name>``), and with
    ``approval`` an approval step after the first (built from plain data: ``Step``
    may be a model or a union of step kinds)."""
    raw: list[dict[str, Any]] = [
        {
            "name": f"s{i}-{name}",
            "prompt": f"Do the {name} step." + directive(TEMPLATES[name].script),
            "tools": ["charge_card"] if TEMPLATES[name].amounts else [],
        }
        for i, name in enumerate(templates)
    ]
    if approval:
        raw.insert(
            1,
            {
                "name": APPROVAL_STEP,
                "kind": "approval",
                "prompt": "Go on with the next step?",
                "timeout_s": 3600,
            },
        )
    return _STEPS.validate_python(raw)


async def run_workflow(workflow_id: str, steps: list[Any], settings: WorkflowSettings) -> list[Any]:
    """``agent_workflow`` called directly: every step's result (an approval's too)."""
    from prefect_coder.flows.deployments.agent_workflow import agent_workflow

    return list(await agent_workflow(workflow_id, steps, settings))


def turn_results(results: list[Any] | None) -> list[TurnResult] | None:
    """The agent turns' results (an approval step's decision left out)."""
    if results is None:
        return None
    return [r for r in results if isinstance(r, TurnResult)]


@contextlib.contextmanager
def process_env(payments: Payments) -> Iterator[None]:
    """The fast recovery constants and ``PAYMENTS_URL`` in this process (the
    in-process recoveries run ``charge_card`` here), restored afterwards. One
    payments service per process: the tool reads its URL from the environment."""
    saved = {k: os.environ.get(k) for k in [*FAST_ENV, "PAYMENTS_URL"]}
    os.environ.update(FAST_ENV, PAYMENTS_URL=payments.url)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


async def _start_fork_server(
    env: dict[str, str], workdir: Path, warm: WarmPython | None, results: Path
) -> ForkServer:
    """The fork server: on ``warm`` (the test session's warm process) when its
    ``PREFECT_*`` environment is ``env``'s — the children fork from it and no second
    interpreter imports Prefect (~4.5 CPU-s and, on a loaded machine, tens of seconds
    of wall) — else on a warm process of its own. On a heavily loaded machine an own
    process's import can outlast the 60 s ready bound, so a slow start is retried (the
    slow one is stopped first)."""
    if warm is not None and warm.would_fork(env):
        fork = ForkServer(env, workdir / "chaos-children.log", warm, results_dir=results)
        await fork.start(ready_s=300)
        return fork
    for attempt in range(1, 4):
        fork = ForkServer(env, workdir / f"chaos-children-{attempt}.log", results_dir=results)
        try:
            await fork.start()
            return fork
        except TimeoutError:
            await fork.stop()
            if attempt == 3:
                raise
    raise AssertionError("unreachable")


def _rig_settings(workdir: Path, infra: Infra) -> contextlib.AbstractContextManager[Any]:
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_RESULTS_LOCAL_STORAGE_PATH,
        temporary_settings,
    )

    updates: dict[Any, Any] = {PREFECT_RESULTS_LOCAL_STORAGE_PATH: results_dir(workdir)}
    if infra.prefect is not None:
        updates[PREFECT_API_URL] = infra.prefect.api_url
    return temporary_settings(updates=updates)


@contextlib.asynccontextmanager
async def open_rig(
    child_env: dict[str, str],
    workdir: Path,
    payments: Payments,
    warm: WarmPython | None = None,
    *,
    infra: Infra | None = None,
    name: str = "rig",
) -> AsyncIterator[Rig]:
    """Start an emulator and a fork server of their own (its children forked from
    ``warm`` when given and compatible); learn the fault-free text of every catalog
    step. Call inside :func:`process_env` of ``payments``; ``workdir`` must exist.
    ``infra``: the dependencies (default: SQLite stores, the caller's Prefect server,
    which is never restarted)."""
    infra = infra or Infra()
    results = results_dir(workdir)
    results.mkdir(exist_ok=True)
    if infra.prefect is not None:
        child_env = {**child_env, "PREFECT_API_URL": infra.prefect.api_url}
    token = f"tok-chaos-{uuid.uuid4().hex}"
    with Emulator.running_in_thread(tokens=[token], delta_delay=0.0, log_requests=False) as emu:
        fork = await _start_fork_server(
            env_for_children({**child_env, **FAST_ENV}, payments.url), workdir, warm, results
        )
        try:
            with _rig_settings(workdir, infra):  # left before the yield: one task's context
                rig = await _set_up(emu, payments, fork, infra, workdir, name, token)
            yield rig
        finally:
            await fork.stop()


async def _set_up(
    emu: Emulator,
    payments: Payments,
    fork: ForkServer,
    infra: Infra,
    workdir: Path,
    name: str,
    token: str,
) -> Rig:
    """The rig's blocks and deployment, and the fault-free text of every catalog step."""
    block = f"chaos-coder-{uuid.uuid4().hex[:8]}"
    await CoderCredentials(
        base_url=emu.base_url,
        organization_id=uuid.UUID(emu.organization_id),
        token=SecretStr(token),
        request_timeout=5.0,
        # A crashed attempt is followed (not cut short and resubmitted)
        # only within its turn deadline; a loaded 2-core machine took
        # 24-28 s for a first child run, past 20 s, and the resubmission
        # then repeated a charge. Still well inside PHASE_LIMIT_S.
        turn_timeout=40.0,
    ).save(block, overwrite=True)
    rig = Rig(emu, payments, fork, block, infra.store_url(workdir), infra, workdir, name)
    rig.deployment_id = await _deployment()
    names = sorted(TEMPLATES)
    settings = await rig.settings_for("calibrate", 0)
    calibrate = f"chaos-calibrate-{uuid.uuid4().hex[:6]}"
    answers = await run_workflow(calibrate, steps_of(names), settings)
    rig.expected_text = {n: r.text for n, r in zip(names, answers, strict=True)}
    return rig


async def _deployment() -> uuid.UUID:
    """The ``agent-workflow`` deployment of the approval schedules (Prefect suspends
    only a flow run of a deployment); applying it again returns the same one. The
    test tool is registered first: a deployment's step form offers (and its server
    validates against) the tool names registered when it is made (docs/deploy.md)."""
    import payment_tools  # noqa: F401  (registers charge_card)

    from prefect_coder.flows.deployments.agent_workflow import agent_workflow

    deployment = await cast(Any, agent_workflow.to_deployment(name=DEPLOYMENT_NAME))
    return uuid.UUID(str(await deployment.apply()))


@dataclass
class RunBook:
    """The deployment flow runs of one approval schedule, oldest first."""

    parameters: dict[str, Any]
    runs: list[uuid.UUID] = field(default_factory=list)

    async def start(self, rig: Rig) -> uuid.UUID:
        """A new flow run of the deployment with the workflow's parameters: what the
        reconciler starts after a crash, or a second run started while one waits."""
        from prefect.client.orchestration import get_client

        assert rig.deployment_id is not None
        async with get_client() as client:
            run = await client.create_flow_run_from_deployment(
                rig.deployment_id, parameters=self.parameters, tags=["coder-chaos"]
            )
        self.runs.append(run.id)
        return run.id

    async def states(self) -> dict[uuid.UUID, str]:
        from prefect.client.orchestration import get_client

        out = {}
        async with get_client() as client:
            for run_id in self.runs:
                run = await client.read_flow_run(run_id)
                out[run_id] = str(run.state.name) if run.state is not None else "?"
        return out

    async def mark_crashed(self, run_id: uuid.UUID) -> None:
        """A killed run is left Running by Prefect: mark it Crashed, as the zombie
        automation or the reconciler does (its lease is then taken over at once). A
        run killed after its suspension was recorded stays Suspended: both leave a
        Suspended run alone."""
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.objects import StateType
        from prefect.states import Crashed

        async with get_client() as client:
            run = await client.read_flow_run(run_id)
            if run.state is not None and run.state.type in (StateType.RUNNING, StateType.PENDING):
                await client.set_flow_run_state(run_id, Crashed(message="chaos: SIGKILLed"))


async def _api(rig: Rig, call: Callable[[], Awaitable[T]]) -> T:
    """A request of the harness to the Prefect API — what the reconciler or a person
    does around the workflow's runs (start a run, mark a killed one Crashed, approve),
    and they try again: retried while a fault of a schedule (this rig's or another's)
    has the server down. Prefect's client does not retry a refused connection on a
    client that never connected."""
    for attempt in range(1, 61):
        try:
            # at once: the request meets the faults of the moment, as the workflow's do
            return await call()
        except (httpx.TransportError, httpx.HTTPStatusError) as exc:
            if isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code < 500:
                raise
            if attempt == 60:
                raise
            await rig.infra.quiet()
            await asyncio.sleep(0.5)
    raise AssertionError("unreachable")


def _workflow_chats(emu: Emulator, workflow_id: str) -> list[dict[str, Any]]:
    want = label_value(workflow_id)
    return [c for c in emu.chats() if (c.get("labels") or {}).get(LABEL_WORKFLOW) == want]


def _any_live(emu: Emulator, workflow_id: str) -> bool:
    return any(c["status"] in LIVE for c in _workflow_chats(emu, workflow_id))


async def _timed(rig: Rig, t: Timed, stop: asyncio.Event) -> str | None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), t.at_s)
        return None  # the phase ended first
    if t.infra:  # lasts its own time, whenever the phase ends: the fault clears
        return await rig.infra.act(t.action, t.downtime, rig=rig.name, workdir=rig.workdir)
    if t.action == "restart":
        await asyncio.to_thread(rig.emu.faults.restart, t.downtime)
    else:
        await asyncio.to_thread(rig.emu.faults.drop_stream, None)
    return f"{t.action} done"


async def _sweep(s: SweepRun, settings: WorkflowSettings) -> str:
    from prefect_coder.flows.deployments.sweep_orphans import sweep_orphans
    from prefect_coder.flows.deployments.sweep_settings import SweepSettings
    from prefect_coder.flows.deployments.sweep_stuck_turns import sweep_stuck_turns

    await asyncio.sleep(s.at_s)
    opts = SweepOptions(
        concurrency=2,
        page_size=50,
        lease_wait_s=s.lease_wait_s,
        lease_ttl_s=5,
        interrupt_bound_s=5,
        archive_settle_s=5,
        archive_retry_s=0.05,
        request_timeout_s=5,
        emit_events=False,
    )
    sweep_settings = SweepSettings.model_validate(settings)
    try:
        if s.kind == "stuck":
            report = await sweep_stuck_turns(
                sweep_settings, turn_budget_s=0.01, action_budget_s=0.01, options=opts
            )
        else:
            report = await sweep_orphans(sweep_settings, grace_s=0, options=opts)
    except Exception as exc:  # a sweep beside faults may fail; the next one sweeps anyway
        return f"{s.kind} sweep raised {type(exc).__name__}: {str(exc)[:120]}"
    rows = ", ".join(f"{r.decision}/{'ok' if r.ok else 'failed'}" for r in report.rows)
    return f"{s.kind} sweep: [{rows}]"


async def _recover(
    mode: str, workflow_id: str, steps: list[Any], settings: WorkflowSettings
) -> list[Any]:
    from prefect_coder.flows.deployments.recover_turn import recover_turn

    if mode == "recover-turn":
        await recover_turn(workflow_id, steps=steps, settings=settings, finish_workflow=True)
    if mode == "shard":
        from prefect_coder.flows.deployments.fanout_shard import FanoutItem, agent_fanout_shard

        item = FanoutItem(workflow_id=workflow_id, steps=steps)
        [outcome] = await agent_fanout_shard([item], settings, shard_name=workflow_id)
        if not outcome.ok:
            raise RuntimeError(f"the shard's workflow failed: {outcome.error}")
        return list(outcome.results)
    return await run_workflow(workflow_id, steps, settings)


async def _child(
    rig: Rig, phase: Phase, crash_at: str, spec: dict[str, Any], book: RunBook | None
) -> int | None:
    """One child run of ``phase.flow``; its exit code (None: it outlived the bound).
    A deployment run is a new flow run of the deployment; killed, it is marked
    Crashed."""
    spec = {**spec, "flow": phase.flow}
    run_id = None
    if phase.flow == "deployment":
        assert book is not None
        run_id = await _api(rig, lambda: book.start(rig))
        spec["flow_run_id"] = str(run_id)
    try:
        rc: int | None = await rig.fork.run(crash_at, json.dumps(spec), limit_s=PHASE_LIMIT_S)
    except TimeoutError:
        rc = None
    if run_id is not None and book is not None and rc in (-9, None):
        await _api(rig, lambda: book.mark_crashed(run_id))
    return rc


async def _decide(
    rig: Rig,
    phase: Phase,
    workflow_id: str,
    spec: dict[str, Any],
    book: RunBook,
    settings: WorkflowSettings,
) -> tuple[int | None, str, list[Violation], int]:
    """The person's decision: while the workflow waits (its sweeps run to the end
    here), its chat must not be archived; then every suspended run is approved
    through Prefect's API and executed again (a process worker's pickup), the first
    one killed at ``phase.crash_at``. With no suspended run (every run was killed),
    one more run is started first: it suspends. Returns (the last child's exit code,
    what happened, violations seen, kills before the last run that left a live
    attempt)."""
    from prefect.flow_runs import aresume_flow_run

    notes = []
    found: list[Violation] = []
    states = await _api(rig, book.states)
    waiting = [r for r, name in states.items() if name in ("Suspended", "Paused")]
    for _ in range(RERUNS_TO_SUSPEND):
        if waiting:
            break
        # Every run was killed or failed (a fault of this phase): a new run, as the
        # reconciler starts after a crash or a resumable failure, up to its bound.
        new = await _child(rig, Phase("child", flow="deployment"), "", spec, book)
        notes.append(f"no run waited: a new run {RC_WHAT.get(new, new)}")
        states = await _api(rig, book.states)
        waiting = [r for r, name in states.items() if name in ("Suspended", "Paused")]
    for s in phase.sweeps:
        notes.append(await _sweep(s, settings))
    archived = [c["id"] for c in _workflow_chats(rig.emu, workflow_id) if c.get("archived")]
    if waiting and archived:
        found.append(
            Violation(
                "archived-early",
                f"chat(s) {archived} archived while the workflow waits for an approval",
            )
        )
    if not waiting:
        return 3, "; ".join([*notes, "no run suspended at the approval"]), found, 0
    rc: int | None = 0
    cuts = 0
    for i, run_id in enumerate(waiting):
        await _api(rig, partial(aresume_flow_run, run_id, run_input={"decision": "approve"}))
        crash_at = phase.crash_at if i == 0 else ""
        spec_run = {**spec, "flow": "deployment", "flow_run_id": str(run_id)}
        try:
            rc = await rig.fork.run(crash_at, json.dumps(spec_run), limit_s=PHASE_LIMIT_S)
        except TimeoutError:
            rc = None
        if rc in (-9, None):
            await _api(rig, partial(book.mark_crashed, run_id))
        notes.append(f"resumed run {i + 1} of {len(waiting)} {RC_WHAT.get(rc, f'rc {rc}')}")
        if i < len(waiting) - 1 and rc not in (0, 4) and _any_live(rig.emu, workflow_id):
            cuts += 1  # counted here: the phase counts only its last run's
    return rc, "; ".join(notes), found, cuts


async def _run_phase(
    rig: Rig,
    phase: Phase,
    workflow_id: str,
    steps: list[Any],
    settings: WorkflowSettings,
    spec: dict[str, Any],
    book: RunBook | None,
    found: list[Violation],
    cut_count: list[int],
) -> tuple[bool, list[Any] | None, str]:
    """One phase; (ended abnormally, results of an in-process run, what happened)."""
    for f in phase.faults:
        f.arm(rig.emu)
    stop = asyncio.Event()
    actors = [asyncio.create_task(_timed(rig, t, stop)) for t in phase.timed]
    if phase.kind != "decide":  # a decision's sweeps run while the workflow waits
        actors += [asyncio.create_task(_sweep(s, settings)) for s in phase.sweeps]
    results = None
    t0 = time.monotonic()
    try:
        if phase.kind == "child":
            rc = await _child(rig, phase, phase.crash_at, spec, book)
            # a run that suspended at the approval waits on a person: not a crash
            abnormal = rc not in (0, 4)
            what = RC_WHAT.get(rc, f"rc {rc}")
        elif phase.kind == "decide":
            assert book is not None
            rc, decided, seen, inner_cuts = await _decide(
                rig, phase, workflow_id, spec, book, settings
            )
            found += seen
            cut_count[0] += inner_cuts
            abnormal = rc not in (0, 4)
            what = f"{RC_WHAT.get(rc, f'rc {rc}')} ({decided})"
        else:
            try:
                results = await asyncio.wait_for(
                    _recover(phase.mode, workflow_id, steps, settings), PHASE_LIMIT_S
                )
                abnormal, what = False, "finished"
            except Exception as exc:
                abnormal, what = True, f"failed: {type(exc).__name__}: {str(exc)[:160]}"
    finally:
        stop.set()
        rig.emu.faults.clear()
        done = await asyncio.gather(*actors, return_exceptions=True)
    notes = [str(d) for d in done if d is not None]
    took = time.monotonic() - t0
    return abnormal, results, f"{what} after {took:.1f} s" + "".join(f"; {n}" for n in notes)


async def run_schedule(rig: Rig, schedule: Schedule) -> Outcome:
    """Run ``schedule``, recover to the end, check every invariant."""
    with rig.context():
        return await _run_schedule(rig, schedule)


async def _workflow_after_faults(
    rig: Rig, workflow_id: str, steps: list[Any], settings: WorkflowSettings
) -> list[Any]:
    """The workflow run to the end once every dependency fault is over. A run that
    fails while a fault of another rig's schedule hits the shared store or Prefect
    server is not this schedule's failure to finish: it runs again when that fault
    has cleared (bounded)."""
    for attempt in range(1, 6):
        await rig.infra.quiet()
        began = time.monotonic()
        try:
            return await asyncio.wait_for(run_workflow(workflow_id, steps, settings), PHASE_LIMIT_S)
        except Exception:
            if attempt == 5 or not rig.infra.faulted_since(began):
                raise
    raise AssertionError("unreachable")


async def _run_schedule(rig: Rig, schedule: Schedule) -> Outcome:
    t0 = time.monotonic()
    since = time.monotonic()  # the emulator's event clock (same process)
    workflow_id = f"chaos-{schedule.seed}-{uuid.uuid4().hex[:6]}"
    steps = steps_of(schedule.templates, approval=schedule.approval)
    settings = await _api(
        rig, lambda: rig.settings_for(str(schedule.seed), schedule.retries, schedule.store_wait)
    )
    spec: dict[str, Any] = {
        "workflow_id": workflow_id,
        "steps": _STEPS.dump_python(steps, mode="json"),
        "settings": settings.model_dump(mode="json"),
    }
    book = RunBook(parameters=dict(spec)) if schedule.approval else None
    found: list[Violation] = []
    cuts = 0
    log: list[str] = []
    results: list[Any] | None = None
    hung = False
    for phase in schedule.phases:
        inner = [0]
        abnormal, got, what = await _run_phase(
            rig, phase, workflow_id, steps, settings, spec, book, found, inner
        )
        cuts += inner[0]
        hung = hung or "HUNG" in what
        live = _any_live(rig.emu, workflow_id)
        if abnormal and live:
            cuts += 1  # this crash (or failed run) left a live attempt behind
        log.append(what + (" (live attempt left)" if abnormal and live else ""))
        if got is not None:
            results = got
    error = None
    for _ in range(CLEAN_RERUNS if results is None else 0):
        try:
            results = await _workflow_after_faults(rig, workflow_id, steps, settings)
            log.append("clean rerun finished")
            break
        except Exception as exc:
            error = f"clean rerun failed: {type(exc).__name__}: {str(exc)[:300]}"
            log.append(error)
    stored = None
    if results is not None:
        error = None
        try:  # every step from storage now
            stored = await _workflow_after_faults(rig, workflow_id, steps, settings)
        except Exception as exc:
            error = f"the rerun after recovery failed: {type(exc).__name__}: {str(exc)[:300]}"
    for _ in range(100):  # a sweep's or archive's interrupt winds down in milliseconds
        if not _any_live(rig.emu, workflow_id):
            break
        await asyncio.sleep(0.05)
    ev = _evidence(rig, workflow_id, steps, schedule, results, stored, cuts, error)
    # Every fault of this rig's emulator since the start is this schedule's.
    # Orphans the schedule's sweep-orphans runs retired (the phases' sweep rows).
    ev.retired = sum(rows.count("retire/ok") for line in log for rows in _ORPHAN_ROWS.findall(line))
    ev.interrupted = sum(
        rows.count("interrupt/ok") for line in log for rows in _STUCK_ROWS.findall(line)
    )
    ev.fired = sum(
        1
        for e in rig.emu.event_log(["fault", "restart"])
        if e["mono"] >= since and e["details"].get("fault") != "delay_commit"
    )
    violations = found + check(ev)
    if hung:
        violations.append(Violation("phase-bounded", f"a run outlived {PHASE_LIMIT_S:g} s"))
    foreign = rig.infra.overlapping(rig.name, t0, time.monotonic())
    if foreign:
        log.append("faults of other rigs meanwhile: " + ", ".join(foreign))
    return Outcome(
        schedule,
        workflow_id,
        violations,
        time.monotonic() - t0,
        phases=log,
        cuts=cuts,
        fired=ev.fired,
        notes=ev.notes,
        transcript=_transcript(ev) if violations else [],
    )


def _transcript(ev: Evidence) -> list[str]:
    """Each chat's rows and its status/turn-end sequence: the evidence of a violation."""
    out = []
    for c in ev.chats:
        out.append(f"chat {c['id']} ({c['status']}, archived={c.get('archived', False)})")
        for m in ev.messages.get(c["id"], []):
            for p in m.get("content") or []:
                kind = p.get("type")
                if kind == "text":
                    out.append(f"  {m['id']} {m['role']}: {p.get('text', '')[:70]!r}")
                elif kind == "tool-call":
                    out.append(f"  {m['id']} call {p.get('tool_call_id')} {p.get('args')}")
                elif kind == "tool-result":
                    out.append(
                        f"  {m['id']} result {p.get('tool_call_id')} {str(p.get('result'))[:60]}"
                    )
        seq = [
            e["details"].get("new") or f"<{e['details'].get('outcome')}>"
            for e in ev.events
            if e["chat_id"] == c["id"] and e["kind"] in ("status", "turn_end")
        ]
        out.append("  status/turn-end: " + " ".join(str(x) for x in seq))
    for key, (n, amount) in sorted(ev.effects.items()):
        out.append(f"effect {amount} x{n} key {key}")
    return out


def _evidence(
    rig: Rig,
    workflow_id: str,
    steps: list[Any],
    schedule: Schedule,
    results: list[Any] | None,
    stored: list[Any] | None,
    cuts: int,
    error: str | None,
) -> Evidence:
    chats = _workflow_chats(rig.emu, workflow_id)
    ids = {c["id"] for c in chats}
    events = [
        e
        for e in rig.emu.event_log(["message", "status", "turn_end", "archived"])
        if e["chat_id"] in ids
    ]
    with rig.payments.lock:
        effects = {
            k: (n, int(rig.payments.answers[k]["charged_cents"]))
            for k, n in rig.payments.effects.items()
            if any(f"/{c}/" in k for c in ids)
        }
        # every key the service was asked with (a replayed key too): one per call
        keys = {
            k: int(rig.payments.answers[k]["charged_cents"])
            for k in rig.payments.requests
            if k in rig.payments.answers and any(f"/{c}/" in k for c in ids)
        }
    agent_steps = [s for s in steps if s.kind == "agent"]
    return Evidence(
        workflow_id=workflow_id,
        steps={
            s.name: (step_marker(workflow_id, s.name), t)
            for s, t in zip(agent_steps, schedule.templates, strict=True)
        },
        amounts=[a for t in schedule.templates for a in TEMPLATES[t].amounts],
        expected_text=rig.expected_text,
        chats=chats,
        messages={c: rig.emu.messages(c, include_system=False) for c in ids},
        events=events,
        effects=effects,
        keys=keys,
        results=turn_results(results),
        stored=turn_results(stored),
        cuts=cuts,
        recovery_error=error,
    )
