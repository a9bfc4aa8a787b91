"""Runs chaos schedules against real parts: the chatd emulator (thread), the test
payments service, a warm fork server whose children are really SIGKILLed
(``tests/recovery/crash_child.py``), the Prefect server of the caller, SQLite
stores. Shared by ``tests/chaos`` (a short fixed seed set) and ``bench/chaos.py``
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
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chaos_invariants import LIVE, Evidence, Violation, check
from chaos_schedule import TEMPLATES, Phase, Schedule, SweepRun, Timed
from crash_matrix import ForkServer, crash_settings, directive, env_for_children, run_workflow
from payments import Payments
from pydantic import SecretStr

from coder_chat.emulator import Emulator
from prefect_coder.blocks import ChatStateStore, CoderCredentials
from prefect_coder.flows.common.labels import LABEL_WORKFLOW, label_value
from prefect_coder.flows.common.params import Step, WorkflowSettings, step_marker
from prefect_coder.flows.sweeps.options import SweepOptions

if TYPE_CHECKING:
    from warm_python import WarmPython

__all__ = ["Outcome", "Rig", "open_rig", "process_env", "run_schedule"]

#: Short recovery constants (production: 1 s poll, horizon = request timeout).
FAST_ENV = {"PREFECT_CODER_SETTLE_POLL_S": "0.05", "PREFECT_CODER_COMMIT_HORIZON_S": "1.0"}
#: Bound of one phase: a run that neither ends nor fails within it is a liveness bug.
PHASE_LIMIT_S = 90.0
#: Clean reruns after the schedule before recovery counts as not finishing.
CLEAN_RERUNS = 2


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
    expected_text: dict[str, str] = field(default_factory=dict)

    async def settings_for(self, tag: str, retries: int) -> WorkflowSettings:
        """Workflow settings on a store tenant of its own: a sweep of the schedule
        sees only the schedule's chats."""
        tenant = f"chaos-{tag}-{uuid.uuid4().hex[:8]}"
        await ChatStateStore(url=self.state_url, tenant=tenant).save(tenant, overwrite=True)
        return crash_settings(self.credentials_block, tenant, retries=retries)


def steps_of(templates: tuple[str, ...] | list[str]) -> list[Step]:
    return [
        Step(
            name=f"s{i}-{name}",
            prompt=f"Do the {name} step." + directive(TEMPLATES[name].script),
            tools=["charge_card"] if TEMPLATES[name].amounts else [],
        )
        for i, name in enumerate(templates)
    ]


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
    env: dict[str, str], workdir: Path, warm: WarmPython | None
) -> ForkServer:
    """The fork server: on ``warm`` (the test session's warm process) when its
    ``PREFECT_*`` environment is ``env``'s — the children fork from it and no second
    interpreter imports Prefect (~4.5 CPU-s and, on a loaded machine, tens of seconds
    of wall) — else on a warm process of its own. On a heavily loaded machine an own
    process's import can outlast the 60 s ready bound, so a slow start is retried (the
    slow one is stopped first)."""
    if warm is not None and warm.would_fork(env):
        fork = ForkServer(env, workdir / "chaos-children.log", warm)
        await fork.start(ready_s=300)
        return fork
    for attempt in range(1, 4):
        fork = ForkServer(env, workdir / f"chaos-children-{attempt}.log")
        try:
            await fork.start()
            return fork
        except TimeoutError:
            await fork.stop()
            if attempt == 3:
                raise
    raise AssertionError("unreachable")


@contextlib.asynccontextmanager
async def open_rig(
    child_env: dict[str, str], workdir: Path, payments: Payments, warm: WarmPython | None = None
) -> AsyncIterator[Rig]:
    """Start an emulator and a fork server of their own (its children forked from
    ``warm`` when given and compatible); learn the fault-free text of every catalog
    step. Call inside :func:`process_env` of ``payments``; ``workdir`` must exist."""
    token = f"tok-chaos-{uuid.uuid4().hex}"
    with Emulator.running_in_thread(tokens=[token], delta_delay=0.0, log_requests=False) as emu:
        fork = await _start_fork_server(
            env_for_children({**child_env, **FAST_ENV}, payments.url), workdir, warm
        )
        try:
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
            rig = Rig(emu, payments, fork, block, f"sqlite+aiosqlite:///{workdir / 'chaos.db'}")
            names = sorted(TEMPLATES)
            settings = await rig.settings_for("calibrate", 0)
            calibrate = f"chaos-calibrate-{uuid.uuid4().hex[:6]}"
            results = await run_workflow(calibrate, steps_of(names), settings)
            rig.expected_text = {n: r.text for n, r in zip(names, results, strict=True)}
            yield rig
        finally:
            await fork.stop()


def _workflow_chats(emu: Emulator, workflow_id: str) -> list[dict[str, Any]]:
    want = label_value(workflow_id)
    return [c for c in emu.chats() if (c.get("labels") or {}).get(LABEL_WORKFLOW) == want]


def _any_live(emu: Emulator, workflow_id: str) -> bool:
    return any(c["status"] in LIVE for c in _workflow_chats(emu, workflow_id))


async def _timed(rig: Rig, t: Timed, stop: asyncio.Event) -> str | None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), t.at_s)
        return None  # the phase ended first
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
    mode: str, workflow_id: str, steps: list[Step], settings: WorkflowSettings
) -> list[Any]:
    from prefect_coder.flows.deployments.recover_turn import recover_turn

    if mode == "recover-turn":
        await recover_turn(workflow_id, steps=steps, settings=settings, finish_workflow=True)
    return await run_workflow(workflow_id, steps, settings)


async def _run_phase(
    rig: Rig,
    phase: Phase,
    workflow_id: str,
    steps: list[Step],
    settings: WorkflowSettings,
    spec: str,
) -> tuple[bool, list[Any] | None, str]:
    """One phase; (ended abnormally, results of an in-process run, what happened)."""
    for f in phase.faults:
        f.arm(rig.emu)
    stop = asyncio.Event()
    actors = [asyncio.create_task(_timed(rig, t, stop)) for t in phase.timed]
    actors += [asyncio.create_task(_sweep(s, settings)) for s in phase.sweeps]
    results = None
    t0 = time.monotonic()
    try:
        if phase.kind == "child":
            try:
                rc = await rig.fork.run(phase.crash_at, spec, limit_s=PHASE_LIMIT_S)
            except TimeoutError:
                rc = None
            abnormal = rc != 0
            what = {-9: "killed", 0: "finished", 3: "failed", None: "HUNG"}.get(rc, f"rc {rc}")
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
    t0 = time.monotonic()
    since = time.monotonic()  # the emulator's event clock (same process)
    workflow_id = f"chaos-{schedule.seed}-{uuid.uuid4().hex[:6]}"
    steps = steps_of(schedule.templates)
    settings = await rig.settings_for(str(schedule.seed), schedule.retries)
    spec = json.dumps(
        {
            "workflow_id": workflow_id,
            "steps": [s.model_dump(mode="json") for s in steps],
            "settings": settings.model_dump(mode="json"),
        }
    )
    cuts = 0
    log: list[str] = []
    results: list[Any] | None = None
    hung = False
    for phase in schedule.phases:
        abnormal, got, what = await _run_phase(rig, phase, workflow_id, steps, settings, spec)
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
            results = await asyncio.wait_for(
                run_workflow(workflow_id, steps, settings), PHASE_LIMIT_S
            )
            log.append("clean rerun finished")
            break
        except Exception as exc:
            error = f"clean rerun failed: {type(exc).__name__}: {str(exc)[:300]}"
            log.append(error)
    stored = None
    if results is not None:
        error = None
        try:  # every step from storage now
            stored = await asyncio.wait_for(
                run_workflow(workflow_id, steps, settings), PHASE_LIMIT_S
            )
        except Exception as exc:
            error = f"the rerun after recovery failed: {type(exc).__name__}: {str(exc)[:300]}"
    for _ in range(100):  # a sweep's or archive's interrupt winds down in milliseconds
        if not _any_live(rig.emu, workflow_id):
            break
        await asyncio.sleep(0.05)
    ev = _evidence(rig, workflow_id, steps, schedule, results, stored, cuts, error)
    # Every fault of this rig's emulator since the start is this schedule's.
    ev.fired = sum(
        1
        for e in rig.emu.event_log(["fault", "restart"])
        if e["mono"] >= since and e["details"].get("fault") != "delay_commit"
    )
    violations = check(ev)
    if hung:
        violations.append(Violation("phase-bounded", f"a run outlived {PHASE_LIMIT_S:g} s"))
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
    steps: list[Step],
    schedule: Schedule,
    results: list[Any] | None,
    stored: list[Any] | None,
    cuts: int,
    error: str | None,
) -> Evidence:
    chats = _workflow_chats(rig.emu, workflow_id)
    ids = {c["id"] for c in chats}
    events = [
        e for e in rig.emu.event_log(["message", "status", "turn_end"]) if e["chat_id"] in ids
    ]
    with rig.payments.lock:
        effects = {
            k: (n, int(rig.payments.answers[k]["charged_cents"]))
            for k, n in rig.payments.effects.items()
            if any(f"/{c}/" in k for c in ids)
        }
    return Evidence(
        workflow_id=workflow_id,
        steps={
            s.name: (step_marker(workflow_id, s.name), t)
            for s, t in zip(steps, schedule.templates, strict=True)
        },
        amounts=[a for t in schedule.templates for a in TEMPLATES[t].amounts],
        expected_text=rig.expected_text,
        chats=chats,
        messages={c: rig.emu.messages(c, include_system=False) for c in ids},
        events=events,
        effects=effects,
        results=results,
        stored=stored,
        cuts=cuts,
        recovery_error=error,
    )
