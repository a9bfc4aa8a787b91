"""Kill → recovered result through the deployed path (``bench/recovery.py --deployed``).

Set up as a user does (``bench/deployed_env.py``): PostgreSQL-backed ``prefect server
start``, the chatd emulator in its own process, ``prefect deploy --all`` of
``prefect.yaml`` (its ``recover-turn`` Crashed triggers), ``prefect-coder automations
apply`` (zombie runs → Crashed), ``--workers`` ``prefect worker start`` process
workers. Settings are the deployments' defaults (``prefect.yaml``); the only worker
environment added is the test payments tool (``PREFECT_CODER_TOOL_MODULES``) and
``--worker-query-s`` when given (Prefect's default poll is 10 s).

Each kill is one ``agent-workflow`` run (``run_deployment``, as ``prefect deployment
run`` does) of a three-step workflow: ``plan`` (text, a crash-safe ``charge_card``
call, text), ``pay`` (``charge_card``, then a long model continuation of
``--continuation`` seconds), ``report`` (text). Its flow-run process is SIGKILLed at
a point spread over the workflow's fault-free duration (``--kills``), or — host loss
(``--host-losses``) — its worker is SIGKILLed together with its children, so only
the zombie automation (heartbeats) can mark the run Crashed.

Per kill, from Prefect's API, the result storage and the emulator's event log:

* detection   kill → the killed run's Crashed state
* fired       Crashed → the recover-turn trigger fired (``prefect.automation.triggered``
              event whose triggering event is that Crashed event)
* created     fired → the ``recover-turn`` run created (the RunDeployment action)
* pickup      created → Pending (a worker's poll, ``PREFECT_WORKER_QUERY_SECONDS``)
* spawn       Pending → the workspace supervisor's first line (Prefect 3.9's first
              process of a flow run: interpreter start, Prefect imports)
* pull        → pull steps done (it reads the deployment, runs the pull steps)
* load        → Running (the engine: ``exec`` of ``python -m prefect.engine``, imports,
              flow load)
* begin       Running → recover-turn's first line ("flow code begins": parameters,
              the flow's own imports already done)
* lease       → "lease taken" (blocks, store, the workflow lease: a crashed holder's
              lease is taken over at once)
* recover     lease taken → the crashed step's result stored (file in the result
              storage): orphan check, settle, follow/history/resubmit
* total       kill → recovered result stored;  done: kill → workflow finished
* first decision  lease taken → recovery's first settle decision (its log line)

and how the crashed step was finished (from the emulator): ``kept`` (its attempt was
live at the kill and finished without a second user turn: the model's work was kept),
``resubmitted`` (a second user turn with the step's marker), ``recovered`` (at rest at
the kill, rebuilt from history), ``not sent`` (the step had sent nothing yet), ``none``
(no step in flight); and recovery's own verdict from its log: ``followed`` (it
re-attached to the still-running attempt), ``recovered`` (the attempt had finished by
the time recovery looked: read from history), ``resubmit``. ``overhead``: the
recovered result minus the later of the kill and the end of the crashed attempt's
turn on the server (what recovery added on top of the model's own remaining work).
Effects of ``charge_card`` are counted by the payments service per ledger key: each
workflow must have exactly 2 (one per charging step); more are duplicate effects.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import resource
import signal
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TESTS = ROOT / "tests" / "recovery"
for p in (str(HERE), str(ROOT), str(TESTS)):
    if p not in sys.path:
        sys.path.insert(0, p)

from deployed_env import DeployedEnv, deployed_env, snapshot_head  # noqa: E402

STEP_NAMES = ("plan", "pay", "report")
CHARGING_STEPS = 2
_MARKER = re.compile(r"\[(b[kfh]-[^\]/\s]+)/([^\]\s]+)\]")
COLUMNS = (
    "detect", "fired", "create", "pickup", "spawn", "pull", "load", "begin", "lease", "recover",
    "TOTAL", "overhd", "done",
)  # fmt: skip
#: The per-kill breakdown, in timeline order (the keys of ``Kill.phases``).
PHASES = (
    "detection", "fired", "created", "pickup", "spawn", "pull", "load", "begin", "lease",
    "recover", "total", "overhead", "done",
)  # fmt: skip
_VERDICT = re.compile(r"recovery of (\S+) on chat \S+: (\w+)")
#: recover_turn's timeline lines (flows/deployments/recover_turn.py ``_Timeline``).
_MARK = re.compile(r"recover-turn (\S+): (.+?) \+([0-9.]+)s \(")
LIVE = {"running", "pending", "requires_action", "interrupting", "paused"}


def _directive(script: Any) -> str:
    return " #emu " + json.dumps(script)


def workflow_steps(continuation: float) -> list[dict[str, Any]]:
    """The three steps (JSON, as a user passes them to ``prefect deployment run``)."""
    chunks = max(4, int(continuation * 2))
    return [
        {
            "name": "plan",
            "prompt": "Look at the account and charge the deposit."
            + _directive(
                {
                    "steps": [
                        {
                            "text": "Looking at the account, then charging the deposit.",
                            "deltas": 8,
                            "delay": 0.25,
                            "tool_calls": [{"name": "charge_card", "args": {"amount_cents": 100}}],
                        },
                        {"text": "Deposit charged; the plan is ready.", "deltas": 8, "delay": 0.25},
                    ]
                }
            ),
            "tools": ["charge_card"],
        },
        {
            "name": "pay",
            "prompt": "Charge the rest and explain the invoice."
            + _directive(
                {
                    "steps": [
                        {
                            "text": "Charging the rest now.",
                            "deltas": 4,
                            "delay": 0.25,
                            "tool_calls": [{"name": "charge_card", "args": {"amount_cents": 250}}],
                        },
                        {
                            "text": "All paid. Here is the invoice, line by line. " * 4,
                            "deltas": chunks,
                            "delay": continuation / chunks,
                        },
                    ]
                }
            ),
            "tools": ["charge_card"],
        },
        {
            "name": "report",
            "prompt": "Write the report."
            + _directive(
                {"text": "Report: deposit and rest charged.", "deltas": 12, "delay": 0.25}
            ),
        },
    ]


@dataclass
class Kill:
    """One kill and what followed it (times are wall-clock seconds)."""

    mode: str  # "process" | "host"
    workflow_id: str
    offset_s: float
    run_id: str = ""
    t_running: float = 0.0
    t_kill: float = 0.0
    crashed_step: str | None = None
    chat_status_at_kill: dict[str, str] = field(default_factory=dict)
    killed_final: str = ""
    t_crashed: float | None = None
    recover_run: str = ""
    t_recover_created: float | None = None
    t_recover_pending: float | None = None
    t_recover_running: float | None = None
    t_result: float | None = None
    t_done: float | None = None
    recover_state: str = ""
    how: str = ""
    extra_user_turns: int = 0
    effects: int = 0
    unarchived: int = 0
    skipped: str = ""
    recover_log: list[tuple[float, str]] = field(default_factory=list)
    t_pulled: float | None = None  # the recover run's pull steps done (a log line)
    t_supervisor: float | None = None  # the supervisor's first line (its pull steps start)
    verdict: str = ""  # recovery's own verdict, from its log: followed/recovered/resubmit
    t_model_end: float | None = None  # the crashed attempt's turn end in the emulator
    t_fired: float | None = None  # the recover-turn trigger fired (automation.triggered event)
    t_begins: float | None = None  # recover_turn's first line ("flow code begins")
    t_lease: float | None = None  # recover_turn took the workflow's lease
    first_decision_s: float | None = None  # lease taken → recovery's first settle decision

    def phases(self) -> dict[str, float | None]:
        def d(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else b - a

        result = self.t_result if self.t_result is not None else self.t_done
        return {
            "detection": d(self.t_kill, self.t_crashed),
            "fired": d(self.t_crashed, self.t_fired),
            "created": d(self.t_fired or self.t_crashed, self.t_recover_created),
            "pickup": d(self.t_recover_created, self.t_recover_pending),
            "spawn": d(self.t_recover_pending, self.t_supervisor or self.t_pulled),
            "pull": d(self.t_supervisor, self.t_pulled),
            "load": d(self.t_pulled, self.t_recover_running),
            "begin": d(self.t_recover_running, self.t_begins),
            "lease": d(self.t_begins, self.t_lease),
            "recover": d(self.t_lease or self.t_recover_running, result),
            "total": d(self.t_kill, result),
            # what recovery added on top of the model's own remaining work
            "overhead": d(max(self.t_kill, self.t_model_end or 0.0), result),
            "done": d(self.t_kill, self.t_done),
        }


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def _ts(dt: Any) -> float | None:
    return None if dt is None else float(dt.timestamp())


class Bench:
    def __init__(self, env: DeployedEnv, args: argparse.Namespace, payments: Any) -> None:
        self.env = env
        self.payments = payments  # tests/recovery/payments.py: effects per ledger key
        self.args = args
        self.steps = workflow_steps(args.continuation)
        self.spare = 0

    def result_file(self, workflow_id: str, step: str) -> Path:
        from prefect_coder.flows.common.results import result_key

        return self.env.results_dir / result_key(workflow_id, step)

    async def start_run(self, client: Any, workflow_id: str) -> Any:
        from prefect.deployments import run_deployment

        return await run_deployment(  # type: ignore[misc]
            "agent-workflow/agent-workflow",
            parameters={"workflow_id": workflow_id, "steps": self.steps},
            timeout=0,
            client=client,
        )

    async def wait_running(self, client: Any, run_id: Any, limit: float = 300) -> tuple[int, float]:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            run = await client.read_flow_run(run_id)
            if run.state and run.state.is_running() and run.infrastructure_pid:
                return int(str(run.infrastructure_pid).split(":")[-1]), time.time()
            if run.state and run.state.is_final():
                raise RuntimeError(f"run {run_id} ended {run.state.name} before running")
            await asyncio.sleep(0.2)
        raise TimeoutError(f"run {run_id} never ran")

    async def fault_free(self, client: Any) -> float:
        """One run without a kill: seconds from Running to Completed (and a warm-up)."""
        wf = f"bf-{uuid.uuid4().hex[:8]}"
        run = await self.start_run(client, wf)
        _, t0 = await self.wait_running(client, run.id)
        while True:
            r = await client.read_flow_run(run.id)
            if r.state and r.state.is_final():
                assert r.state.is_completed(), r.state
                return time.time() - t0
            await asyncio.sleep(0.2)

    async def recover_runs(self, client: Any, workflow_id: str) -> list[Any]:
        from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
        from prefect.client.schemas.sorting import FlowRunSort

        runs = await client.read_flow_runs(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["recover-turn"])),
            sort=FlowRunSort.EXPECTED_START_TIME_DESC,
            limit=50,
        )
        return [r for r in runs if (r.parameters or {}).get("workflow_id") == workflow_id]

    async def run_log(self, client: Any, run_id: Any) -> list[tuple[float, str]]:
        """The first log lines of a flow run (worker and engine), timestamped."""
        from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
        from prefect.client.schemas.sorting import LogSort

        logs = await client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])),
            sort=LogSort.TIMESTAMP_ASC,
            limit=200,
        )
        return [(float(lg.timestamp.timestamp()), lg.message[:200]) for lg in logs]

    async def trigger_fired(self, client: Any, run_id: str, t_crashed: float) -> float | None:
        """When a recover-turn trigger fired on ``run_id``'s Crashed event: the
        ``prefect.automation.triggered`` event whose triggering event is that one."""
        from datetime import UTC, datetime, timedelta

        since = datetime.fromtimestamp(t_crashed, UTC) - timedelta(seconds=5)
        body = {
            "filter": {
                "occurred": {"since": since.isoformat(), "until": datetime.now(UTC).isoformat()},
                "event": {"name": ["prefect.automation.triggered"]},
                "order": "ASC",
            },
            "limit": 50,
        }
        try:
            resp = await client._client.post("/events/filter", json=body)
            resp.raise_for_status()
            events = resp.json().get("events", [])
        except Exception:
            return None
        for ev in events:
            trig = (ev.get("payload") or {}).get("triggering_event") or {}
            res = (trig.get("resource") or {}).get("prefect.resource.id", "")
            if trig.get("event") == "prefect.flow-run.Crashed" and res.endswith(run_id):
                return datetime.fromisoformat(ev["occurred"]).timestamp()
        return None

    async def episode(self, client: Any, k: Kill) -> Kill:
        run = await self.start_run(client, k.workflow_id)
        k.run_id = str(run.id)
        pid, k.t_running = await self.wait_running(client, run.id)
        await asyncio.sleep(max(0.0, k.t_running + k.offset_s - time.time()))
        current = await client.read_flow_run(run.id)
        if current.state and current.state.is_final():
            k.skipped = f"run ended {current.state.name} before the kill"
            return k
        # State at the kill: which step has no stored result yet, every chat's status.
        chats = await self.env.emulator.chats()
        k.chat_status_at_kill = {c["id"]: c["status"] for c in chats if not c.get("archived")}
        k.crashed_step = next(
            (s for s in STEP_NAMES if not self.result_file(k.workflow_id, s).exists()), None
        )
        victim = None
        if k.mode == "host":
            victim = self.env.worker_of(pid)
            if victim is None:
                k.skipped = "no worker found as the run's parent"
                return k
            k.t_kill = time.time()
            victim.kill_host()
        else:
            k.t_kill = time.time()
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                k.skipped = "process already gone"
                return k
        if victim is not None:
            await victim.proc.wait()
        deadline = time.monotonic() + self.args.episode_timeout
        recover: Any = None
        while time.monotonic() < deadline:
            r = await client.read_flow_run(run.id)
            if r.state and r.state.is_final():
                k.killed_final = r.state.name
                if r.state.is_crashed() and k.t_crashed is None:
                    k.t_crashed = _ts(r.state.timestamp)
                if r.state.is_completed():
                    k.skipped = "the killed run completed (kill too late)"
                    break
            if k.t_result is None and k.crashed_step:
                f = self.result_file(k.workflow_id, k.crashed_step)
                if f.exists():
                    k.t_result = f.stat().st_mtime
            found = await self.recover_runs(client, k.workflow_id)
            if found:
                recover = found[-1]  # the first one created
                if recover.state and recover.state.is_final():
                    break
            await asyncio.sleep(0.5)
        if recover is not None:
            recover = await client.read_flow_run(recover.id)
            k.recover_run = str(recover.id)
            k.recover_state = recover.state.name if recover.state else ""
            k.t_recover_created = _ts(recover.created)
            for st in await client.read_flow_run_states(recover.id):
                t = _ts(st.timestamp)
                if st.type.value == "PENDING" and k.t_recover_pending is None:
                    k.t_recover_pending = t
                if st.type.value == "RUNNING" and k.t_recover_running is None:
                    k.t_recover_running = t
                if st.is_final():
                    k.t_done = t
            if k.t_result is None and k.crashed_step:
                f = self.result_file(k.workflow_id, k.crashed_step)
                if f.exists():
                    k.t_result = f.stat().st_mtime
            k.recover_log = await self.run_log(client, recover.id)
            read_marks(k)
            if k.t_crashed is not None:
                k.t_fired = await self.trigger_fired(client, k.run_id, k.t_crashed)
        elif not k.skipped:
            k.skipped = "no recover-turn run within the episode timeout"
        if victim is not None:  # the lost host's replacement (the survivor did the work)
            self.spare += 1
            await self.env.start_worker(f"spare-{self.spare}")
        return k

    async def account(self, kills: list[Kill]) -> None:
        """From the emulator (user turns, chat states) and the payments service."""
        chats = await self.env.emulator.chats()
        events = await self.env.emulator.events()
        sent_at = {
            (e["chat_id"], e["details"]["id"]): e["time"]
            for e in events
            if e["kind"] == "message" and e["details"].get("role") == "user"
        }
        by_wf: dict[str, list[tuple[str, str, float, str]]] = {}
        archived = {c["id"]: bool(c.get("archived")) for c in chats}
        for c in chats:
            for m in await self.env.emulator.messages(c["id"]):
                if m.get("role") != "user":
                    continue
                text = "".join(p.get("text", "") for p in m.get("content") or [])
                found = _MARKER.search(text)
                if found:
                    wf, step = found.group(1), found.group(2)
                    at = sent_at.get((c["id"], m["id"]), 0.0)
                    by_wf.setdefault(wf, []).append((c["id"], step, at, text))
        for k in kills:
            rows = by_wf.get(k.workflow_id, [])
            wf_chats = {r[0] for r in rows}
            k.unarchived = sum(1 for c in wf_chats if not archived.get(c, True))
            keys = self.payments.effects_with_prefix("/")
            k.effects = sum(v for key, v in keys.items() if any(f"/{c}/" in key for c in wf_chats))
            if k.crashed_step is None:
                k.how = "none"
                continue
            mine = [r for r in rows if r[1] == k.crashed_step]
            k.extra_user_turns = max(0, len(mine) - 1)
            before = [r for r in mine if r[2] and r[2] <= k.t_kill]
            if before:  # the crashed attempt ran on: when did the model finish it?
                k.t_model_end = next(
                    (
                        e["time"]
                        for e in events
                        if e["kind"] == "turn_end"
                        and e["chat_id"] == before[0][0]
                        and e["time"] > k.t_kill
                    ),
                    None,
                )
            if not before:
                k.how = "not sent"
            elif k.extra_user_turns:
                k.how = "resubmitted"
            elif k.chat_status_at_kill.get(before[0][0]) in LIVE:
                k.how = "kept"
            else:
                k.how = "recovered"


def read_marks(k: Kill) -> None:
    """The phase times found in the recover run's log lines (``k.recover_log``)."""
    for t, msg in k.recover_log:
        if k.t_pulled is None and "deployment steps completed" in msg:
            k.t_pulled = t
        if k.t_supervisor is None and "deployment pull step(s)" in msg:
            k.t_supervisor = t
        mark = _MARK.search(msg)
        if mark and mark.group(1) == k.workflow_id:
            if mark.group(2) == "flow code begins" and k.t_begins is None:
                k.t_begins = t
            elif mark.group(2) == "lease taken" and k.t_lease is None:
                k.t_lease = t
        if (
            k.first_decision_s is None
            and k.t_lease is not None
            and msg.startswith("recovery [")
            and "] settle: saw" in msg
        ):
            k.first_decision_s = t - k.t_lease
        found_v = _VERDICT.search(msg)
        if found_v and found_v.group(1) == f"{k.workflow_id}/{k.crashed_step}":
            k.verdict = found_v.group(2)


_TAKEOVER = re.compile(
    r"lease 'workflow:(b[kh]-[^']+)' taken over from .*whose run is over \(([0-9.]+)s before"
)


def print_takeovers(tmp: Path) -> list[float]:
    """The kills' workflow leases recover-turn took over from their crashed holder (the
    lines go to the workers' output, not to the run's API logs), and how many seconds
    before the lease's expiry: the wait a bare lease would have added."""
    saved = [
        float(m.group(2))
        for log in sorted(tmp.glob("worker-*.log"))
        for m in _TAKEOVER.finditer(log.read_text(errors="replace"))
    ]
    print(
        f"\nworkflow leases taken over from a crashed holder: {len(saved)}, "
        f"seconds before their expiry: {' '.join(f'{v:.1f}' for v in sorted(saved)) or '-'}"
    )
    return saved


def report_again(path: Path) -> None:
    """Print the report of a finished run again from its ``kills.json`` (phases
    re-read from the stored log lines: a later version of this file may split them
    finer)."""
    data = json.loads(path.read_text())
    kills = []
    for raw in data["kills"]:
        raw["recover_log"] = [tuple(x) for x in raw["recover_log"]]
        k = Kill(**{f: v for f, v in raw.items() if f in Kill.__dataclass_fields__})
        read_marks(k)
        kills.append(k)
    summary = data["summary"]
    args = argparse.Namespace(**summary.get("args", {}))
    report(kills, args, summary.get("fault_free_s", 0.0))
    print_takeovers(path.parent)
    loads = summary.get("load_during") or []
    if loads:
        print(
            f"\nload average (1 min) during the run: min {min(loads):.1f}, median "
            f"{statistics.median(loads):.1f}, max {max(loads):.1f} ({len(loads)} samples)"
        )


def _fmt(v: float | None) -> str:
    return "    -" if v is None else f"{v:5.1f}"


def report(kills: list[Kill], args: argparse.Namespace, fault_free_s: float) -> dict[str, Any]:
    done = [k for k in kills if not k.skipped]
    print(
        f"\n{'mode':7s} {'offset':>6s} {'step':7s} {'how':12s} "
        + " ".join(f"{p:>7s}" for p in COLUMNS)
        + "  effects extra verdict"
    )
    for k in kills:
        if k.skipped:
            print(f"{k.mode:7s} {k.offset_s:6.1f} skipped: {k.skipped}")
            continue
        ph = k.phases()
        print(
            f"{k.mode:7s} {k.offset_s:6.1f} {k.crashed_step or '-':7s} {k.how:12s} "
            + " ".join(f"{_fmt(ph[p]):>7s}" for p in ph)
            + f"  {k.effects:7d} {k.extra_user_turns:5d} {k.verdict or '-'}"
            + (f"  recover-turn {k.recover_state}" if k.recover_state != "Completed" else "")
        )
    summary: dict[str, Any] = {"fault_free_s": fault_free_s, "modes": {}}
    for mode in ("process", "host"):
        rows = [k for k in done if k.mode == mode]
        if not rows:
            continue
        skipped = sum(1 for k in kills if k.mode == mode and k.skipped)
        print(f"\n{mode} kills: {len(rows)} (skipped {skipped})")
        stats: dict[str, Any] = {"n": len(rows)}
        for phase in (*PHASES, "first decision"):
            if phase == "first decision":  # lease taken → recovery's first settle decision
                vals = [k.first_decision_s for k in rows if k.first_decision_s is not None]
            else:
                vals = [v for k in rows if (v := k.phases()[phase]) is not None]
            if not vals:
                continue
            stats[phase] = {
                "p50": pct(vals, 0.5), "p95": pct(vals, 0.95), "max": max(vals),
                "mean": statistics.mean(vals), "n": len(vals),
            }  # fmt: skip
            print(
                f"  {phase:10s} p50 {pct(vals, 0.5):6.1f} s   p95 {pct(vals, 0.95):6.1f} s   "
                f"max {max(vals):6.1f} s   (n={len(vals)})"
            )
        hows: dict[str, int] = {}
        verdicts: dict[str, int] = {}
        for k in rows:
            hows[k.how] = hows.get(k.how, 0) + 1
            if k.how in ("kept", "resubmitted"):
                verdicts[k.verdict or "?"] = verdicts.get(k.verdict or "?", 0) + 1
        live = hows.get("kept", 0) + hows.get("resubmitted", 0)
        share = hows.get("kept", 0) / live if live else float("nan")
        dup = sum(max(0, k.effects - CHARGING_STEPS) for k in rows)
        missing = sum(max(0, CHARGING_STEPS - k.effects) for k in rows)
        bad = [k.workflow_id for k in rows if k.recover_state != "Completed"]
        print(
            "  crashed turns: "
            + ", ".join(f"{h} {n}" for h, n in sorted(hows.items()))
            + f"; live at the kill and finished without resubmitting: {hows.get('kept', 0)}/{live}"
            + (f" ({share:.0%})" if live else "")
            + "; recovery's verdict on those live turns: "
            + ", ".join(f"{v} {n}" for v, n in sorted(verdicts.items()))
        )
        print(
            f"  duplicate effects: {dup}; missing effects: {missing}; extra user turns: "
            f"{sum(k.extra_user_turns for k in rows)}; chats left unarchived: "
            f"{sum(k.unarchived for k in rows)}; recover-turn not Completed: {len(bad)}"
        )
        stats.update(hows=hows, verdicts=verdicts, kept_share=share, duplicates=dup, missing=missing,
                     not_completed=bad)  # fmt: skip
        summary["modes"][mode] = stats
    return summary


async def import_seconds(source: Path) -> tuple[float, float]:
    """Wall and CPU time of a fresh ``import`` of the recover-turn flow here and now:
    how slow a flow-run process start is on this machine at this load (wall ≈ CPU on
    an idle machine)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import prefect.engine, prefect_coder.flows.deployments.recover_turn",
        cwd=str(source), env={**os.environ, "PYTHONPATH": str(source)},
    )  # fmt: skip
    await proc.wait()
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


async def run(args: argparse.Namespace) -> None:
    from payments import running_payments

    if args.report_only:
        report_again(Path(args.report_only) / "kills.json")
        return

    tmp = Path(args.tmp or tempfile.mkdtemp(prefix="bench-recovery-deployed-"))
    load0 = os.getloadavg()
    print(f"load average at start: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} "
          f"({os.cpu_count()} cores); work dir {tmp}", flush=True)  # fmt: skip
    if args.source == "head":
        source = tmp / "src"
        commit = snapshot_head(source)
        print(f"flow runs run HEAD {commit[:10]} (snapshot in {source})", flush=True)
    else:
        source = ROOT
        print("flow runs run the shared work tree as it is (--source worktree)", flush=True)
    with running_payments() as payments:
        worker_env = {
            "PYTHONPATH": str(source / "tests" / "recovery"),
            "PREFECT_CODER_TOOL_MODULES": "payment_tools",
            "PAYMENTS_URL": payments.url,
        }
        if args.worker_query_s is not None:
            worker_env["PREFECT_WORKER_QUERY_SECONDS"] = str(args.worker_query_s)
        t0 = time.perf_counter()
        async with deployed_env(
            tmp, worker_env=worker_env, emulator_args=("--delta-delay", "0"), source=source
        ) as env:
            print(f"server, emulator, deploy: {time.perf_counter() - t0:.0f} s", flush=True)
            if args.engine_command:
                await env.set_pool_command(f"{sys.executable} -m prefect.engine")
                print("pool command: python -m prefect.engine (one process per run)", flush=True)
            imp0 = await import_seconds(source)
            print(
                f"fresh import of recover-turn + prefect.engine: {imp0[0]:.1f} s "
                f"({imp0[1]:.1f} s CPU)",
                flush=True,
            )
            for i in range(args.workers):
                await env.start_worker(f"w{i + 1}")
            bench = Bench(env, args, payments)
            loads: list[float] = []

            async def sample_load() -> None:
                while True:
                    loads.append(os.getloadavg()[0])
                    await asyncio.sleep(15)

            sampler = asyncio.create_task(sample_load())
            rng = random.Random(args.seed)
            kills: list[Kill] = []
            with env.prefect():
                from prefect.client.orchestration import get_client

                async with get_client() as client:
                    ff = await bench.fault_free(client)
                    ff = min(ff, await bench.fault_free(client))
                    print(f"fault-free workflow, Running → Completed: {ff:.1f} s", flush=True)

                    def offsets(n: int) -> list[float]:
                        # stratified over the run (flow start to the last step's end)
                        out = [ff * (0.03 + 0.92 * (i + rng.random()) / n) for i in range(n)]
                        rng.shuffle(out)
                        return out

                    sem = asyncio.Semaphore(args.parallel)

                    async def one(k: Kill) -> Kill:
                        async with sem:
                            try:
                                k = await bench.episode(client, k)
                            except Exception as exc:  # report it, go on with the next
                                k.skipped = f"error: {exc!r}"[:300]
                            ph = k.phases()
                            print(
                                f"  {k.mode} kill at {k.offset_s:5.1f} s ({k.crashed_step}): "
                                f"total {_fmt(ph['total'])} s, detection {_fmt(ph['detection'])} s"
                                + (f" [{k.skipped}]" if k.skipped else ""),
                                flush=True,
                            )
                            return k

                    proc = [
                        Kill("process", f"bk-{i}-{uuid.uuid4().hex[:6]}", o)
                        for i, o in enumerate(offsets(args.kills))
                    ]
                    kills += await asyncio.gather(*(one(k) for k in proc))
                    for i, o in enumerate(offsets(args.host_losses)):
                        # one at a time: a host loss kills every run on that worker
                        kills.append(await one(Kill("host", f"bh-{i}-{uuid.uuid4().hex[:6]}", o)))
                    await bench.account(kills)
                    (tmp / "emulator-events.json").write_text(
                        json.dumps(await env.emulator.events())
                    )
            sampler.cancel()
            load1 = os.getloadavg()
            print(
                f"\nload average (1 min) during the run: min {min(loads):.1f}, median "
                f"{statistics.median(loads):.1f}, max {max(loads):.1f} ({len(loads)} samples)"
            )
            imp1 = await import_seconds(source)
            print(
                f"\nfresh import of recover-turn + prefect.engine at the end: {imp1[0]:.1f} s "
                f"({imp1[1]:.1f} s CPU)"
            )
            summary = report(kills, args, ff)
            summary["lease_takeovers_s"] = print_takeovers(tmp)
            summary["load_start"], summary["load_end"] = load0, load1
            summary["load_during"] = loads
            summary["import_s"] = (imp0, imp1)
            summary["args"] = vars(args)
            (tmp / "kills.json").write_text(
                json.dumps({"summary": summary, "kills": [asdict(k) for k in kills]}, indent=1)
            )
            print(
                f"\nload average at end: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}; "
                f"details: {tmp / 'kills.json'}",
                flush=True,
            )


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of the deployed mode (``bench/recovery.py --deployed``)."""
    g = p.add_argument_group("--deployed")
    g.add_argument("--kills", type=int, default=6, help="SIGKILLs of a flow-run process")
    g.add_argument("--host-losses", type=int, default=1, help="SIGKILLs of a worker + children")
    g.add_argument("--workers", type=int, default=2)
    g.add_argument("--parallel", type=int, default=2, help="process-kill episodes at once")
    g.add_argument("--seed", type=int, default=11)
    g.add_argument("--episode-timeout", type=float, default=600)
    g.add_argument(
        "--worker-query-s",
        type=float,
        default=None,
        help="PREFECT_WORKER_QUERY_SECONDS of the workers (default: Prefect's, 10 s)",
    )
    g.add_argument("--tmp", default=None, help="work dir (default: a new temp dir)")
    g.add_argument(
        "--engine-command",
        action="store_true",
        help="set the pool's command to 'python -m prefect.engine' (one process per run)",
    )
    g.add_argument(
        "--report-only",
        default=None,
        metavar="DIR",
        help="print the report of an earlier run again from DIR/kills.json (no run)",
    )
    g.add_argument(
        "--source",
        choices=("head", "worktree"),
        default="head",
        help="run the flows from a snapshot of HEAD (default) or the shared work tree",
    )
