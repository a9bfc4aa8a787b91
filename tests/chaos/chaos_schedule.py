"""Seeded chaos schedules: a seed → a deterministic list of events (pure, no I/O).

A schedule is a workflow shape (two or three steps from a small catalog of scripted
turns, each client tool call with its own amount) and a list of phases run in
order:

* ``child`` phases run the workflow in a fresh process forked from the warm fork
  server (``tests/recovery/crash_child.py``) that SIGKILLs itself at a crash point
  (``""`` = never: the run ends by itself or fails on a fault). The first is the
  workflow's first run; later ones are recoveries that may be killed in turn.
* one final ``recover`` phase: the in-process recovery — a plain rerun, or the
  ``recover-turn`` flow then the rerun (or, for a shard schedule, the shard again).

Lifecycle dimensions (issue 29), drawn from a stream of their own so that a seed
without one keeps the events it always had (``lifecycle``):

* ``start`` — a run killed right at its start: after it took the workflow's lease
  and recorded itself, before its first turn sends (``turn.slot_held:1``);
* ``recovery-run`` — after the first run's kill, one or two child runs of the
  ``recover-turn`` flow (``finish_workflow``), each SIGKILLed at a crash point;
* ``shard`` — every child run is an ``agent-fanout-shard`` run holding the
  workflow (a crashed shard is started again, as its fan-out does);
* ``approval`` — an approval step after the first step; the runs are flow runs of
  an ``agent-workflow`` deployment, which suspend at it; kills before and right
  after the suspension, a second run started while one is suspended, then the
  decision through Prefect's API (``decide``) and the resumed run(s).

Faults of our own dependencies (issue 30), drawn from a third stream of their own
and only when the caller names the store (``store``: ``make_schedule``): timed
actions of ``chaos_infra`` in a phase — a PostgreSQL store restarted or its
connections terminated, a SQLite store's write lock held by a stopped process,
the Prefect API restarted (``prefect_restart``: only on a server the rig owns),
the result storage unwritable for a while.

Each phase may carry emulator faults armed for its duration (stream drops, REST
faults, stalls, lost responses), timed actions at an offset into it (an emulator
restart that keeps state, dropping every open stream) and concurrent sweep runs
(``sweep-stuck-turns`` with the harshest budgets, ``sweep-orphans`` with no grace)
racing it. The event list is deterministic; when a timed event lands relative to
the workflow's progress is not (it is wall-clock), which is part of the chaos.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = [
    "APPROVAL_STEP",
    "INFRA_FAULTS",
    "LIFECYCLES",
    "SHORT_STORE_WAIT",
    "TEMPLATES",
    "Fault",
    "Phase",
    "Schedule",
    "SweepRun",
    "Template",
    "Timed",
    "make_schedule",
]


@dataclass(frozen=True)
class Template:
    """One scripted step: the ``#emu`` script and the amounts it charges (one
    logical tool call per amount, unique across the catalog)."""

    name: str
    script: dict[str, Any]
    amounts: tuple[int, ...]


def _charge(cents: int, text: str, **extra: Any) -> dict[str, Any]:
    return {
        "text": text,
        "deltas": 5,
        "delay": 0.02,
        "tool_calls": [{"name": "charge_card", "args": {"amount_cents": cents}}],
        **extra,
    }


#: The catalog. ``think``: a continuation that keeps generating after the tool
#: result (a crash there leaves a live attempt to follow) and calls a second tool.
TEMPLATES: dict[str, Template] = {
    t.name: t
    for t in (
        Template("deposit", {"steps": [_charge(101, "Charging the deposit.")]}, (101,)),
        Template("rest", {"steps": [_charge(252, "Charging the rest now.")]}, (252,)),
        Template(
            "rounds",
            {
                "steps": [
                    _charge(303, "Charging the order."),
                    _charge(34, "Now the fee."),
                    {"text": "All paid.", "deltas": 3, "delay": 0.02},
                ]
            },
            (303, 34),
        ),
        Template(
            "think",
            {
                "steps": [
                    _charge(405, "Charging the extra."),
                    _charge(56, "And the tip.", sleep=1.0),
                    {"text": "Receipt checked.", "deltas": 3, "delay": 0.02},
                ]
            },
            (405, 56),
        ),
        Template("hello", {"steps": [{"text": "Hello there.", "deltas": 4, "delay": 0.02}]}, ()),
    )
}

#: Crash points of a workflow's first run (``crash_child.py``: ``<point>:<nth>``,
#: ``+<s>`` = that long after the point). ``""``: no kill, faults only.
FIRST_POINTS = [
    "",
    "turn.before_create:1",
    "turn.after_create:1",
    "turn.sending:1",
    "turn.sending:2",
    "turn.after_checkpoint:1",
    "turn.mid_stream:1",
    "turn.mid_stream:2",
    "turn.mid_stream:3",
    "turn.after_tool_results:1",
    "turn.after_tool_results:2",
    "turn.after_tool_results:1+0.3",
    "tool.before_effect:1",
    "tool.before_effect:2",
    "tool.before_effect:3",
    "tool.after_effect:1",
    "tool.after_effect:2",
    "tool.after_effect:3",
    "tool.after_done:1",
    "tool.after_done:2",
    "tool.after_done:3",
    "turn.before_persist:1",
    "turn.before_persist:2",
    "turn.before_persist:3",
]
#: A run killed right at its start: it took the workflow's lease, recorded itself
#: for the reconciler and claimed its turn slot; nothing of its first turn sent.
START_POINT = "turn.slot_held:1"
#: Extra points for a run that recovers a crashed one.
RECOVERY_POINTS = [
    "recovery.before_interrupt:1",
    "recovery.after_verdict:1",
    "recovery.after_submit:1",
    "recovery.before_resubmit:1",
    "tool.redrive.before_effect:1",
]


#: Points every first step reaches (each template streams and persists once).
FIRST_STEP_POINTS = [
    "turn.sending:1",
    "turn.after_checkpoint:1",
    "turn.mid_stream:1",
    "turn.mid_stream:2",
    "turn.before_persist:1",
]
#: Points of a ``recover-turn`` child run: its own turn of the crashed step first
#: (``turn.slot_held:1``, its recovery's points, ``turn.before_persist:1``), then
#: the rest of the workflow as a subflow (the next step's send and persist).
RECOVERY_RUN_POINTS = [
    *RECOVERY_POINTS,
    START_POINT,
    START_POINT,
    "turn.before_persist:1",
    "turn.before_persist:1",
    "turn.sending:1",
    "turn.mid_stream:1",
    "tool.after_effect:1",
    "turn.before_persist:2",
]
#: Points of an approval workflow's first deployment run: its first step's turn,
#: right before it suspends (its "waits for a decision" line) and right after the
#: suspension was recorded (the engine's "Finished in state Suspended" line), the
#: process still alive. "" = it runs to the suspension.
APPROVAL_POINTS = [
    "",
    "",
    START_POINT,
    "turn.sending:1",
    "turn.mid_stream:1",
    "tool.before_effect:1",
    "tool.after_effect:1",
    "turn.before_persist:1",
    "approval.before_suspend:1",
    "approval.before_suspend:1",
    "approval.suspended:1",
    "approval.suspended:1",
]
#: Points of a resumed run (its first turn is the step after the approval).
RESUMED_POINTS = [
    "",
    "",
    START_POINT,
    "turn.sending:1",
    "turn.mid_stream:1",
    "tool.after_effect:1",
    "tool.after_done:1",
    "turn.before_persist:1",
]
#: The lifecycle dimensions and their weights ("" = none: the schedule as before).
LIFECYCLES = {"": 8, "start": 3, "recovery-run": 3, "shard": 3, "approval": 3}
#: The approval step of an ``approval`` schedule (after its first step).
APPROVAL_STEP = "approve"
#: Faults of our own dependencies by store kind: action → (weight, durations in s —
#: a restart's downtime, how long a lock or an unwritable storage lasts). A lock held
#: 12 s outlasts the store's own 10 s wait and its retries; a 10 s storage fault
#: outlasts a task's retries.
INFRA_FAULTS: dict[str, dict[str, tuple[int, tuple[float, ...]]]] = {
    "sqlite": {
        "store-lock": (3, (0.5, 3.0, 12.0)),
        "prefect-restart": (2, (0.0, 1.0, 4.0)),
        "results-unwritable": (2, (1.0, 4.0, 10.0)),
    },
    "pg": {
        "store-restart": (2, (0.0, 0.5, 2.0, 5.0)),
        "store-drop-conns": (2, (0.0,)),
        "prefect-restart": (2, (0.0, 1.0, 4.0)),
        "results-unwritable": (2, (1.0, 4.0, 10.0)),
    },
}
#: The share of schedules with dependency faults (when a store is named).
INFRA_P = 0.6
#: With a store named, this share of the approval schedules kills the first resumed
#: run right after it read the person's answer, before it recorded the decision.
ANSWERED_P = 0.25
ANSWERED_POINT = "approval.answered:1"
#: Half the schedules with a dependency fault give their store little patience
#: (``connect_timeout`` 2 s, ``transient_retry_s`` 3 s): with the defaults the store
#: rides out every drawn fault itself; with these a lock or an outage of a few
#: seconds exhausts its retries, and the step fails transiently — the path of task
#: retries, a failed run with its chat kept live, and the rerun.
SHORT_STORE_WAIT = (2.0, 3.0)


@dataclass(frozen=True)
class Fault:
    """An emulator fault armed for one phase (``emu.faults.<method>(**args)``)."""

    method: str
    args: tuple[tuple[str, Any], ...]

    def arm(self, emu: Any) -> None:
        getattr(emu.faults, self.method)(**dict(self.args))

    def __str__(self) -> str:
        return f"{self.method}({', '.join(f'{k}={v!r}' for k, v in self.args)})"


def _fault(fn: str, **args: Any) -> Fault:
    return Fault(fn, tuple(args.items()))


def _random_fault(rng: random.Random) -> Fault:
    kind = rng.choice(
        [
            "lost-send",
            "lost-results",
            "lost-first-post",
            "send-5xx",
            "results-5xx",
            "read-5xx",
            "interrupt-5xx",
            "get-5xx",
            "stream-drop",
            "stream-close",
            "refuse-ws",
            "stall",
            "slow-results",
        ]
    )
    if kind == "lost-send":
        return _fault("drop_response", count=1, method="POST", path="/messages")
    if kind == "lost-results":
        return _fault("drop_response", count=1, method="POST", path="/tool-results")
    if kind == "lost-first-post":  # the chat's creation when the phase creates one
        return _fault("drop_response", count=1, method="POST", path="/chats")
    if kind == "send-5xx":
        status = rng.choice([502, 503])
        return _fault(
            "fail_rest", count=rng.choice([1, 2]), status=status, method="POST", path="/messages"
        )
    if kind == "results-5xx":
        return _fault("fail_rest", count=1, status=503, method="POST", path="/tool-results")
    if kind == "read-5xx":
        return _fault(
            "fail_rest", count=rng.choice([1, 2]), status=502, method="GET", path="/messages"
        )
    if kind == "interrupt-5xx":
        return _fault("fail_rest", count=1, status=503, method="POST", path="/interrupt")
    if kind == "get-5xx":
        return _fault("fail_rest", count=rng.choice([1, 3]), status=503, method="GET")
    if kind == "stream-drop":
        return _fault("drop_next_stream", after_frames=rng.randint(0, 4), count=rng.choice([1, 2]))
    if kind == "stream-close":
        return _fault("drop_next_stream", after_frames=rng.randint(1, 3), count=1, code=1011)
    if kind == "refuse-ws":
        return _fault("refuse_upgrades", status=503, count=rng.choice([1, 2, 3]))
    if kind == "stall":
        return _fault("stall_stream", seconds=rng.choice([0.3, 0.8, 1.5]))
    return _fault("delay_commit", seconds=0.5, count=1, method="POST", path="/tool-results")


@dataclass(frozen=True)
class Timed:
    """An action ``at_s`` seconds into a phase: ``restart`` (the emulator restarts,
    keeping all state, after ``downtime`` s), ``drop-streams`` (every open stream
    aborted now), or a fault of a dependency (``chaos_infra.INFRA_ACTIONS``) lasting
    ``downtime`` s."""

    at_s: float
    action: str
    downtime: float = 0.0

    @property
    def infra(self) -> bool:
        """A fault of a dependency (store, Prefect API, result storage)."""
        return self.action.startswith(("store-", "prefect-", "results-"))

    def __str__(self) -> str:
        extra = ""
        if self.action == "restart":
            extra = f" downtime={self.downtime}s"
        elif self.infra and self.action != "store-drop-conns":
            extra = f" for {self.downtime}s"
        return f"{self.action} at +{self.at_s:.2f}s{extra}"


@dataclass(frozen=True)
class SweepRun:
    """A sweep flow run started ``at_s`` seconds into a phase, racing it."""

    kind: str  # "stuck" (sweep-stuck-turns) | "orphans" (sweep-orphans)
    at_s: float
    lease_wait_s: float

    def __str__(self) -> str:
        name = "sweep-stuck-turns" if self.kind == "stuck" else "sweep-orphans"
        return f"{name} at +{self.at_s:.2f}s (lease wait {self.lease_wait_s}s)"


@dataclass(frozen=True)
class Phase:
    """One run of the workflow and what happens around it."""

    kind: str  # "child" | "recover" | "decide"
    crash_at: str = ""
    mode: str = "rerun"  # recover only: "rerun" | "recover-turn" | "shard"
    #: child only: the flow the child runs — "agent-workflow" (a direct call),
    #: "recover-turn", "shard" (agent-fanout-shard) or "deployment" (a new flow run
    #: of the agent-workflow deployment, executed as a process worker would)
    flow: str = "agent-workflow"
    faults: tuple[Fault, ...] = ()
    timed: tuple[Timed, ...] = ()
    sweeps: tuple[SweepRun, ...] = ()

    def __str__(self) -> str:
        if self.kind == "child":
            what = "" if self.flow == "agent-workflow" else f" of {self.flow}"
            head = f"child run{what}, SIGKILL at {self.crash_at or '(none)'}"
        elif self.kind == "decide":
            head = (
                "decide: approve every suspended run through the API, run the resumed "
                f"run(s), the first SIGKILLed at {self.crash_at or '(none)'}"
            )
        else:
            head = f"in-process recovery: {self.mode}"
        parts = [head]
        parts += [f"fault {f}" for f in self.faults]
        parts += [str(t) for t in self.timed]
        parts += [str(s) for s in self.sweeps]
        return "; ".join(parts)


@dataclass(frozen=True)
class Schedule:
    seed: int
    templates: tuple[str, ...]
    retries: int
    phases: tuple[Phase, ...] = field(default_factory=tuple)
    #: the lifecycle dimension ("" none, or a key of LIFECYCLES)
    lifecycle: str = ""
    #: the store's patience, ``(connect_timeout, transient_retry_s)`` of its block;
    #: None = the block's defaults (10 s, 20 s), which ride out every drawn fault
    store_wait: tuple[float, float] | None = None

    @property
    def approval(self) -> bool:
        """An approval step follows the first step."""
        return self.lifecycle == "approval"

    def describe(self) -> str:
        shape = list(self.templates)
        if self.approval:
            shape.insert(1, f"({APPROVAL_STEP})")
        head = f"seed {self.seed}: steps {shape}, task retries {self.retries}"
        if self.lifecycle:
            head += f", lifecycle {self.lifecycle}"
        if self.store_wait:
            head += f", store waits {self.store_wait[0]:g}+{self.store_wait[1]:g} s"
        lines = [head]
        lines += [f"  {i + 1}. {p}" for i, p in enumerate(self.phases)]
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps({"seed": self.seed, "schedule": self.describe().splitlines()})


def _sweeps(rng: random.Random, p: float, span_s: float) -> tuple[SweepRun, ...]:
    if rng.random() >= p:
        return ()
    n = 1 if rng.random() < 0.8 else 2
    return tuple(
        SweepRun(
            kind=rng.choice(["stuck", "orphans"]),
            at_s=round(rng.uniform(0.0, span_s), 2),
            lease_wait_s=rng.choice([0.05, 0.5, 2.0]),
        )
        for _ in range(n)
    )


def _timed(rng: random.Random, p_restart: float, p_drop: float, span_s: float) -> tuple[Timed, ...]:
    out = []
    if rng.random() < p_restart:
        out.append(
            Timed(round(rng.uniform(0.1, span_s), 2), "restart", rng.choice([0.0, 0.1, 0.3]))
        )
    if rng.random() < p_drop:
        out.append(Timed(round(rng.uniform(0.1, span_s), 2), "drop-streams"))
    return tuple(sorted(out, key=lambda t: t.at_s))


def _faults(rng: random.Random, p: float) -> tuple[Fault, ...]:
    r = rng.random()
    if r >= p:
        return ()
    n = 2 if r < p * 0.3 else 1
    return tuple(_random_fault(rng) for _ in range(n))


def make_schedule(
    seed: int,
    lifecycle: str | None = None,
    *,
    store: str | None = None,
    prefect_restart: bool = False,
) -> Schedule:
    """The schedule of ``seed`` (same seed, same events).

    ``lifecycle``: None = the seed's own draw; a key of :data:`LIFECYCLES` forces
    that dimension on the seed's base events ("" = none: the schedule the seed had
    before issue 29, which CI's regression seeds keep). ``store`` ("sqlite" or "pg",
    a key of :data:`INFRA_FAULTS`): draw faults of the dependencies too (None: none,
    the schedule as before issue 30); ``prefect_restart``: the Prefect server may be
    restarted among them."""
    rng = random.Random(seed)
    k = rng.choice([2, 2, 3])
    templates = tuple(rng.sample(sorted(TEMPLATES), k))
    retries = rng.choice([0, 0, 1])
    children = rng.choices([1, 2, 3], weights=[5, 4, 1])[0]
    phases = []
    for i in range(children):
        points = FIRST_POINTS if i == 0 else FIRST_POINTS[1:] + RECOVERY_POINTS * 2
        phases.append(
            Phase(
                "child",
                crash_at=rng.choice(points),
                faults=_faults(rng, 0.45),
                timed=_timed(rng, 0.2, 0.15, 2.5),
                # a sweep beside the first run races a live workflow; later ones race
                # the recovery of a crashed one
                sweeps=_sweeps(rng, 0.15 if i == 0 else 0.4, 2.0),
            )
        )
    phases.append(
        Phase(
            "recover",
            mode=rng.choice(["rerun", "recover-turn"]),
            faults=_faults(rng, 0.3),
            timed=_timed(rng, 0.15, 0.1, 1.5),
            sweeps=_sweeps(rng, 0.5, 1.0),
        )
    )
    # The lifecycle dimension comes from a stream of its own: the draws above (and so
    # every seed's schedule before issue 29) are unchanged by it.
    life = random.Random(f"lifecycle-{seed}")
    drawn = life.choices(list(LIFECYCLES), weights=list(LIFECYCLES.values()))[0]
    if lifecycle is None:
        lifecycle = drawn
    elif lifecycle not in LIFECYCLES:
        raise ValueError(f"unknown lifecycle {lifecycle!r}: one of {list(LIFECYCLES)}")
    if lifecycle == "start":
        phases = _start_kills(life, phases)
    elif lifecycle == "recovery-run":
        phases = _recovery_runs(life, phases)
    elif lifecycle == "shard":
        phases = _shard_runs(life, phases)
    elif lifecycle == "approval":
        phases = _approval_runs(life, phases)
    store_wait = None
    if store is not None:
        infra = random.Random(f"infra-{seed}")
        phases = _infra_faults(infra, phases, store, prefect_restart)
        if any(t.infra for p in phases for t in p.timed) and infra.random() < 0.5:
            store_wait = SHORT_STORE_WAIT
        if lifecycle == "approval" and random.Random(f"answered-{seed}").random() < ANSWERED_P:
            # the resumed run killed between reading the answer and recording it (the
            # window of seed 263: a fault there lost a person's decision)
            phases = [
                replace(p, crash_at=ANSWERED_POINT) if p.kind == "decide" else p for p in phases
            ]
    return Schedule(seed, templates, retries, tuple(phases), lifecycle, store_wait)


def _infra_faults(
    rng: random.Random, phases: list[Phase], store: str, prefect_restart: bool
) -> list[Phase]:
    """One or two dependency faults in random phases (or none, 1 - INFRA_P)."""
    if store not in INFRA_FAULTS:
        raise ValueError(f"unknown store {store!r}: one of {list(INFRA_FAULTS)}")
    kinds = {
        k: v for k, v in INFRA_FAULTS[store].items() if prefect_restart or k != "prefect-restart"
    }
    if rng.random() >= INFRA_P:
        return phases
    out = list(phases)
    for _ in range(1 if rng.random() < 0.75 else 2):
        i = rng.randrange(len(out))
        action = rng.choices(list(kinds), weights=[w for w, _ in kinds.values()])[0]
        # early: most phases end (a kill, a finish) within a second or two, and a fault
        # at +0 is one a run starts into
        fault = Timed(round(rng.uniform(0.0, 1.5), 2), action, rng.choice(kinds[action][1]))
        out[i] = replace(out[i], timed=tuple(sorted((*out[i].timed, fault), key=lambda t: t.at_s)))
    return out


def _start_kills(rng: random.Random, phases: list[Phase]) -> list[Phase]:
    """The first run killed at its start; a second child run (a rerun) too, sometimes,
    or one more rerun killed at its start before the others."""
    out = [replace(phases[0], crash_at=START_POINT)]
    rest = phases[1:]
    if rest[0].kind == "child" and rng.random() < 0.5:
        rest[0] = replace(rest[0], crash_at=START_POINT)
    elif rng.random() < 0.5:
        out.append(Phase("child", crash_at=START_POINT))
    return out + rest


def _recovery_runs(rng: random.Random, phases: list[Phase]) -> list[Phase]:
    """The first run killed in its first step, then one or two ``recover-turn``
    child runs, each SIGKILLed, then the final recovery. The base schedule's later
    workflow runs are dropped: one of them usually finishes the workflow, and a
    ``recover-turn`` run then has nothing left to be killed in."""
    first = phases[0]
    if first.crash_at not in FIRST_STEP_POINTS:
        first = replace(first, crash_at=rng.choice(FIRST_STEP_POINTS))
    n = rng.choices([1, 2], weights=[1, 1])[0]
    runs = [
        Phase(
            "child",
            flow="recover-turn",
            crash_at=rng.choice(RECOVERY_RUN_POINTS),
            faults=_faults(rng, 0.25),
            sweeps=_sweeps(rng, 0.25, 1.5),
        )
        for _ in range(n)
    ]
    return [first, *runs, phases[-1]]


def _shard_runs(rng: random.Random, phases: list[Phase]) -> list[Phase]:
    """Every child run is a shard run; the final recovery reruns the shard, or the
    workflow (or ``recover-turn``) as before."""
    out = [replace(p, flow="shard") if p.kind == "child" else p for p in phases]
    if rng.random() < 0.5:
        out[-1] = replace(out[-1], mode="shard")
    return out


def _approval_runs(rng: random.Random, phases: list[Phase]) -> list[Phase]:
    """Deployment runs of a workflow with an approval step: the first run (killed in
    its first step, around the suspension, or suspended), sometimes a second run
    started beside it (killed or suspended too), then the decision (the first resumed
    run killed or not), then the in-process recovery of the base schedule."""
    out = [
        Phase(
            "child",
            flow="deployment",
            crash_at=rng.choice(APPROVAL_POINTS),
            faults=_faults(rng, 0.3),
            sweeps=_sweeps(rng, 0.2, 2.0),
        )
    ]
    if rng.random() < 0.45:
        # a rerun (the reconciler's, after a kill) or a second run started while the
        # first is suspended: it suspends at the same step, or is killed on its way
        out.append(
            Phase(
                "child",
                flow="deployment",
                crash_at=rng.choice(["", "", START_POINT, "approval.before_suspend:1"]),
                faults=_faults(rng, 0.2),
            )
        )
    out.append(
        Phase(
            "decide",
            crash_at=rng.choice(RESUMED_POINTS),
            faults=_faults(rng, 0.25),
            # sweeps while the workflow waits on a person: its chat is idle, not stuck
            # and not an orphan — never archived before the workflow finished
            sweeps=_sweeps(rng, 0.5, 0.5),
        )
    )
    return out + phases[-1:]
