"""The reconciler's pure decision, as a table (like ``coder_chat/core``'s tests): one row
per situation a workflow can be found in, and the one action each must get. The rows
name issue 29's cases: an approval waiting on a person, a host lost after its lease
stopped renewing, a run lost while Pending, a crashed recovery, a read that failed."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefect_coder.flows.liveness.decide import (
    Action,
    LeaseFacts,
    Observation,
    RunFacts,
    Timing,
    decide,
)

T = Timing(
    pending_grace_s=120,
    lost_grace_s=5,
    missed_renewals=2,
    heartbeat_grace_s=90,
    heartbeat_fresh_s=45,
    crashed_grace_s=20,
    max_attempts=3,
    backoff_s=10,
    max_backoff_s=300,
)
TTL = 60.0
ALLOW = TTL / 3 * 2 + 5  # missed renewals + grace: 45 s

LIVE = LeaseFacts(live=True, silent_s=3, ttl_s=TTL)
SILENT = LeaseFacts(live=True, silent_s=ALLOW + 1, ttl_s=TTL)  # not expired yet, renewals stopped
LAPSED = LeaseFacts(live=False, silent_s=TTL + 30, ttl_s=TTL)
RELEASED = LeaseFacts(live=False, silent_s=None, ttl_s=TTL)


def obs(run: RunFacts | None, lease: LeaseFacts | None = None, **kw: object) -> Observation:
    return Observation(key="workflow:wf", run=run, lease=lease, **kw)  # type: ignore[arg-type]


ROWS: list[tuple[str, Observation, Action]] = [
    # --- unknown: nothing is done on a read that failed
    ("run unreadable", obs(None, SILENT), Action.LEAVE),
    ("run without a state", obs(RunFacts(None), SILENT), Action.LEAVE),
    # --- waiting on a person: never crashed, whatever else is silent
    (
        "Suspended approval, lease released, no heartbeat for an hour",
        obs(
            RunFacts("PAUSED", "Suspended", 3600, heartbeat_age_s=3600, pause_left_s=80000),
            RELEASED,
        ),
        Action.LEAVE,
    ),
    (
        "Suspended past its deadline (the server's expiry decides)",
        obs(RunFacts("PAUSED", "Suspended", 90000, pause_left_s=-10), LAPSED, attempts=3),
        Action.LEAVE,
    ),
    ("Paused in process", obs(RunFacts("PAUSED", "Paused", 500), SILENT), Action.LEAVE),
    # --- ended: recorded
    ("Completed", obs(RunFacts("COMPLETED", "Completed", 1), RELEASED), Action.DONE),
    (
        "Completed while its lease still looks silent",
        obs(RunFacts("COMPLETED"), SILENT),
        Action.DONE,
    ),
    # --- failed: rerun only on the failure handler's positive mark (chat kept live)
    (
        "Failed just now: its failure handler has the grace to mark it",
        obs(RunFacts("FAILED", "Failed", 5)),
        Action.LEAVE,
    ),
    (
        "Failed, marked resumable (transient: the chat kept live)",
        obs(RunFacts("FAILED", "Failed", 5), RELEASED, resumable=True),
        Action.RECOVER,
    ),
    (
        "Failed with no mark after the grace (final, or a flow without the handler)",
        obs(RunFacts("FAILED", "Failed", 60), RELEASED),
        Action.DONE,
    ),
    (
        "Failed, whether it is resumable unreadable (its events could not be read)",
        obs(RunFacts("FAILED", "Failed", 60), RELEASED, resumable=None),
        Action.LEAVE,
    ),
    (
        "Failed and resumable, recoveries exhausted",
        obs(RunFacts("FAILED", "Failed", 60), RELEASED, attempts=3, resumable=True),
        Action.GIVE_UP,
    ),
    (
        "Failed: its approval expired (a person's non-decision, never rerun)",
        obs(
            RunFacts(
                "FAILED", "Failed", 600, state_message="The flow was paused and never resumed."
            )
        ),
        Action.DONE,
    ),
    ("Cancelled by a person", obs(RunFacts("CANCELLED", "Cancelled", 5)), Action.DONE),
    # --- alive
    ("Running, lease renewed", obs(RunFacts("RUNNING", "Running", 600), LIVE), Action.LEAVE),
    (
        "Running, lease silent but a fresh heartbeat (a stalled loop, not a lost host)",
        obs(RunFacts("RUNNING", "Running", 600, heartbeat_age_s=10), SILENT),
        Action.LEAVE,
    ),
    (
        "Running, lease silent, but the run only just started",
        obs(RunFacts("RUNNING", "Running", 10), SILENT),
        Action.LEAVE,
    ),
    (
        "Running, lease released (steps over, flow finishing)",
        obs(RunFacts("RUNNING", "Running", 600), RELEASED),
        Action.LEAVE,
    ),
    (
        "Running, nothing to ask (no lease, no heartbeat)",
        obs(RunFacts("RUNNING", "Running", 9999)),
        Action.LEAVE,
    ),
    (
        "Scheduled (waiting for a worker)",
        obs(RunFacts("SCHEDULED", "Scheduled", 9999)),
        Action.LEAVE,
    ),
    ("Cancelling", obs(RunFacts("CANCELLING", "Cancelling", 9999), LAPSED), Action.LEAVE),
    # --- dead: two sources agree
    (
        "Running, lease renewals stopped before it expired (lost host, fast)",
        obs(RunFacts("RUNNING", "Running", 600, heartbeat_age_s=60), SILENT),
        Action.MARK_CRASHED,
    ),
    (
        "Running, lease lapsed",
        obs(RunFacts("RUNNING", "Running", 600), LAPSED),
        Action.MARK_CRASHED,
    ),
    (
        "Running, no lease (a fan-out), heartbeats stopped",
        obs(RunFacts("RUNNING", "Running", 600, heartbeat_age_s=200)),
        Action.MARK_CRASHED,
    ),
    (
        "Running, no lease, heartbeats stopped, but only just Running",
        obs(RunFacts("RUNNING", "Running", 30, heartbeat_age_s=200)),
        Action.LEAVE,
    ),
    (
        "Pending for long, nobody holds the lease (lost before its first heartbeat)",
        obs(RunFacts("PENDING", "Pending", 300), RELEASED),
        Action.MARK_CRASHED,
    ),
    (
        "Pending for long, no lease row at all",
        obs(RunFacts("PENDING", "Pending", 300)),
        Action.MARK_CRASHED,
    ),
    ("Pending briefly", obs(RunFacts("PENDING", "Pending", 30), RELEASED), Action.LEAVE),
    (
        "Pending, another run holds the workflow",
        obs(RunFacts("PENDING", "Pending", 300), LIVE),
        Action.LEAVE,
    ),
    # --- crashed: the fast path first, then reruns with backoff, then give up
    (
        "Crashed just now (recover-turn's trigger has it)",
        obs(RunFacts("CRASHED", "Crashed", 5)),
        Action.LEAVE,
    ),
    ("Crashed past the grace", obs(RunFacts("CRASHED", "Crashed", 25)), Action.RECOVER),
    (
        "Crashed recovery, 1 attempt, backoff not over",
        obs(RunFacts("CRASHED", "Crashed", 25), attempts=1, acted_age_s=5),
        Action.LEAVE,
    ),
    (
        "Crashed recovery, 1 attempt, backoff over",
        obs(RunFacts("CRASHED", "Crashed", 25), attempts=1, acted_age_s=11),
        Action.RECOVER,
    ),
    (
        "Crashed, 2 attempts, backoff 20 s not over",
        obs(RunFacts("CRASHED", "Crashed", 25), attempts=2, acted_age_s=15),
        Action.LEAVE,
    ),
    (
        "Crashed, attempts exhausted",
        obs(RunFacts("CRASHED", "Crashed", 25), attempts=3, acted_age_s=999),
        Action.GIVE_UP,
    ),
    ("Flow run deleted", obs(None, found=False), Action.RECOVER),
    ("Flow run deleted, attempts exhausted", obs(None, found=False, attempts=3), Action.GIVE_UP),
]


@pytest.mark.parametrize(("case", "o", "action"), ROWS, ids=[r[0] for r in ROWS])
def test_decision_table(case: str, o: Observation, action: Action) -> None:
    got = decide(o, T)
    assert got.action == action, f"{case}: {got}"
    assert got.why  # an operator reads why in the tick's table


def test_backoff_doubles_and_is_capped() -> None:
    assert [T.backoff(n) for n in range(6)] == [0, 10, 20, 40, 80, 160]
    assert Timing(backoff_s=100, max_backoff_s=300).backoff(5) == 300


_types = st.sampled_from(
    [
        "SCHEDULED",
        "PENDING",
        "RUNNING",
        "PAUSED",
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "CRASHED",
        "CANCELLING",
        None,
    ]
)
_ages = st.floats(min_value=0, max_value=1e6)
_opt_ages = st.none() | _ages


@given(
    kind=_types,
    name=st.sampled_from(["Suspended", "Paused", "Running", None]),
    age=_ages,
    beat=_opt_ages,
    lease=st.none()
    | st.builds(LeaseFacts, live=st.booleans(), silent_s=_opt_ages, ttl_s=st.floats(1, 600)),
    attempts=st.integers(0, 10),
    acted=_opt_ages,
)
def test_never_acts_on_a_paused_run_and_never_exceeds_the_attempts(
    kind: str | None,
    name: str | None,
    age: float,
    beat: float | None,
    lease: LeaseFacts | None,
    attempts: int,
    acted: float | None,
) -> None:
    o = obs(
        RunFacts(kind, name, age, heartbeat_age_s=beat), lease, attempts=attempts, acted_age_s=acted
    )
    got = decide(o, T)
    if kind == "PAUSED" or kind is None:
        assert got.action == Action.LEAVE
    if got.action == Action.RECOVER:
        assert attempts < T.max_attempts and kind in ("CRASHED", "FAILED")
    if got.action == Action.MARK_CRASHED:
        assert kind in ("RUNNING", "PENDING")
        assert beat is None or beat >= T.heartbeat_fresh_s  # a fresh heartbeat vetoes
    if got.action == Action.GIVE_UP:
        assert attempts >= T.max_attempts
