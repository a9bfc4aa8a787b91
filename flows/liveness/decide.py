"""What the reconciler does with one unfinished workflow: a pure function of a snapshot.

Level-triggered (issue 29): every tick reads what IS — the workflow's durable record,
its latest Prefect flow run, the leases it renews, its chat — and :func:`decide`
says what to do, whatever event was missed. No I/O here; ``reconcile_workflows``
observes and acts, ``tests/reconcile/test_decide.py`` tables every branch.

The rules, in the order they apply:

* **Unknown ⇒ leave alone.** A read that failed says nothing: no act on it.
* **Waiting on a person ⇒ leave alone.** A Suspended or Paused run (type PAUSED) is
  never crashed, never rerun: it sends no heartbeats and holds no lease by design.
  Its approval deadline is its only clock (Prefect fails it then; ``expire-approvals``
  archives its chat).
* **Ended ⇒ record it.** Completed, Cancelled: ``done``. Failed: rerun only on positive
  evidence — its failure handler marked it resumable (the failure was transient or
  unknown and the chat was kept live: a mark in the store, or — when the store was
  what failed and the mark could not be written — the run's ``coder.workflow.resumable``
  event in Prefect); its evidence unreadable ⇒ leave alone; otherwise, after a
  grace that leaves the handler its turn, ``done`` (a final failure, or a flow without
  the handler: a rerun could repeat a final failure's turn). An expired approval (a
  person's non-decision) is ``done``.
* **Alive ⇒ leave alone.** Some holder's lease on the workflow is live and renewed,
  or a heartbeat is recent.
* **Dead ⇒ mark it Crashed.** Only on positive evidence from two sources: the run
  shows Running (or Pending: never got going) in Prefect AND its own lease stopped
  renewing (or, with no lease to ask, its heartbeats stopped) for longer than the
  grace. The Crashed state fires the fast-path triggers (``recover-turn``) at once.
* **Crashed ⇒ recover.** After a grace that leaves the fast path its turn, rerun
  the workflow's own deployment with all its parameters (every turn recovers before
  it sends, so a rerun is recovery), with a backoff between attempts.
* **Recoveries exhausted ⇒ give up**, loudly (an event and an artifact), chat left live.

The chat's status on the Coder server is not an input: a rerun brings its chat to
an end itself (follow, history, ledger) before it sends anything, so no verdict here
needs it — and the reconciler then needs no Coder credentials.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = [
    "APPROVAL_EXPIRED_MESSAGE",
    "Action",
    "Decision",
    "LeaseFacts",
    "Observation",
    "RunFacts",
    "Timing",
    "decide",
]

#: Prefect state types (``StateType`` values) by what they mean here.
_ENDED = frozenset({"COMPLETED", "CANCELLED"})
#: The message Prefect's server gives a suspended run whose timeout passed (one home:
#: the failure handler and ``expire-approvals`` read it from here).
APPROVAL_EXPIRED_MESSAGE = "The flow was paused and never resumed."
_NOT_STARTED = frozenset({"PENDING"})


class Action(StrEnum):
    """What to do with one workflow."""

    LEAVE = "leave"
    DONE = "done"
    MARK_CRASHED = "mark-crashed"
    RECOVER = "recover"
    GIVE_UP = "give-up"


@dataclass(frozen=True, slots=True)
class Timing:
    """The reconciler's clocks (seconds). Production defaults; tests pass short ones."""

    #: A Pending run (a worker took it, it never got going) this old is lost.
    pending_grace_s: float = 120.0
    #: Extra silence past the missed renewals before a lease counts as stopped.
    lost_grace_s: float = 5.0
    #: Renewals a holder may miss (it renews every ttl / 3) before it counts as silent.
    missed_renewals: float = 1.5
    #: With no lease to ask: heartbeats silent this long (3 beats of 30 s) ⇒ stopped.
    heartbeat_grace_s: float = 90.0
    #: A heartbeat this recent vetoes a lease's evidence (a stalled event loop stops
    #: renewing while the heartbeat thread still beats): a beat of 30 s plus jitter.
    heartbeat_fresh_s: float = 35.0
    #: A Crashed run is left this long to the fast path (the Crashed trigger's
    #: ``recover-turn``) before the reconciler reruns it itself.
    crashed_grace_s: float = 20.0
    #: Recoveries the reconciler starts per workflow before it gives up.
    max_attempts: int = 3
    #: Wait after a recovery before the next: ``backoff_s * 2**(attempts - 1)``, capped.
    backoff_s: float = 10.0
    max_backoff_s: float = 300.0

    def backoff(self, attempts: int) -> float:
        """The wait after the ``attempts``-th recovery before the next may start."""
        if attempts < 1:
            return 0.0
        return float(min(self.max_backoff_s, self.backoff_s * 2 ** (attempts - 1)))


@dataclass(frozen=True, slots=True)
class RunFacts:
    """The record's current Prefect flow run, as read this tick."""

    #: ``StateType`` value (``RUNNING``, ``PAUSED``, ``CRASHED`` …); None: no state.
    state_type: str | None
    state_name: str | None = None
    #: Seconds since the state was entered (Prefect's timestamp, the reconciler's clock).
    state_age_s: float = 0.0
    #: Seconds since its last heartbeat event; None: none seen (or not readable).
    heartbeat_age_s: float | None = None
    #: A paused run's deadline, seconds from now (negative: past); None: none.
    pause_left_s: float | None = None
    state_message: str | None = None


@dataclass(frozen=True, slots=True)
class LeaseFacts:
    """The workflow's leases (store rows, store clock)."""

    #: Some holder's lease on the workflow is unexpired: someone drives it.
    live: bool = False
    #: Seconds since the workflow's lease row was last renewed (by whichever holder:
    #: a run waiting for the lease takes an expired one over at once, so a row left
    #: silent means nobody drives the workflow); None: released or never taken.
    silent_s: float | None = None
    #: The ttl the run renews its lease with (its settings).
    ttl_s: float = 60.0


@dataclass(frozen=True, slots=True)
class Observation:
    """One unfinished workflow as seen this tick."""

    key: str
    attempts: int = 0
    #: Seconds since the reconciler last acted on it; None: never.
    acted_age_s: float | None = None
    #: The run: None when it could not be read (unknown); ``found=False`` below when
    #: the server answered and has no such run.
    run: RunFacts | None = None
    found: bool = True
    #: None: the workflow has no lease to ask (a fan-out), or the read failed.
    lease: LeaseFacts | None = None
    #: Its failure handler marked the failed run resumable (the chat kept live) in the
    #: store or by the run's ``coder.workflow.resumable`` event; None: the events could
    #: not be read (unknown).
    resumable: bool | None = False


@dataclass(frozen=True, slots=True)
class Decision:
    """The action and why, in words an operator reads in the tick's table."""

    action: Action
    why: str


def _leave(why: str) -> Decision:
    return Decision(Action.LEAVE, why)


def _lease_silent(lease: LeaseFacts | None, t: Timing) -> float | None:
    """Seconds nobody renewed the workflow's lease, when past the allowance (the
    renewals a holder may miss, plus the grace); else None."""
    if lease is None or lease.silent_s is None:
        return None
    return lease.silent_s if lease.silent_s > _allowance(lease, t) else None


def _allowance(lease: LeaseFacts, t: Timing) -> float:
    return lease.ttl_s / 3 * t.missed_renewals + t.lost_grace_s


def _recover_or_give_up(o: Observation, t: Timing, what: str) -> Decision:
    if o.attempts >= t.max_attempts:
        return Decision(
            Action.GIVE_UP,
            f"{what}; {o.attempts} recoveries already started (max {t.max_attempts})",
        )
    wait = t.backoff(o.attempts)
    if o.acted_age_s is not None and o.acted_age_s < wait:
        return _leave(f"{what}; backing off ({o.acted_age_s:.0f}s of {wait:.0f}s)")
    return Decision(Action.RECOVER, f"{what}: rerun {o.attempts + 1}/{t.max_attempts}")


def decide(o: Observation, t: Timing) -> Decision:
    """The one thing to do with ``o`` now (see the module docstring for the rules)."""
    if not o.found:
        return _recover_or_give_up(o, t, "its flow run no longer exists")
    run = o.run
    if run is None or run.state_type is None:
        return _leave("its flow run could not be read: unknown, nothing done")
    kind = run.state_type
    if kind == "PAUSED":
        left = (
            "no deadline"
            if run.pause_left_s is None
            else f"deadline in {run.pause_left_s:.0f}s"
            if run.pause_left_s >= 0
            else f"deadline passed {-run.pause_left_s:.0f}s ago: Prefect fails it, "
            "expire-approvals archives its chat"
        )
        return _leave(f"{run.state_name or 'Paused'}: waiting on a person ({left})")
    if kind in _ENDED:
        return Decision(Action.DONE, f"its run ended {run.state_name or kind.title()}")
    if kind == "FAILED":
        if run.state_message == APPROVAL_EXPIRED_MESSAGE:
            return Decision(Action.DONE, "its approval expired: a person's (non-)decision")
        if o.resumable is None:
            return _leave(
                "Failed: whether its failure handler kept the chat live could not be "
                "read: unknown, nothing done"
            )
        if o.resumable:
            return _recover_or_give_up(
                o,
                t,
                f"its run Failed {run.state_age_s:.0f}s ago and its failure handler kept "
                "the chat live (transient or unknown failure)",
            )
        if run.state_age_s < t.crashed_grace_s:
            return _leave(
                f"Failed {run.state_age_s:.0f}s ago: its failure handler has "
                f"{t.crashed_grace_s:.0f}s to say whether a rerun can continue it"
            )
        # No positive mark: a failure that is final, or a flow without the handler
        # (agent-turn, recover-turn, the fan-out): a rerun could repeat a final
        # failure's turn, so it is an end.
        return Decision(Action.DONE, f"its run ended {run.state_name or 'Failed'}")
    if kind == "CRASHED":
        if run.state_age_s < t.crashed_grace_s:
            return _leave(
                f"Crashed {run.state_age_s:.0f}s ago: the fast path (Crashed trigger) "
                f"has {t.crashed_grace_s:.0f}s"
            )
        return _recover_or_give_up(o, t, f"its run Crashed {run.state_age_s:.0f}s ago")
    if kind not in ("RUNNING", *_NOT_STARTED):
        # SCHEDULED (waiting for a worker: a rerun would wait too), CANCELLING, ...
        return _leave(f"{run.state_name or kind.title()}: nothing to do")
    lease = o.lease
    if run.heartbeat_age_s is not None and run.heartbeat_age_s < t.heartbeat_fresh_s:
        return _leave(f"alive: heartbeat {run.heartbeat_age_s:.0f}s ago")
    silent = _lease_silent(lease, t)
    if kind in _NOT_STARTED:
        # Never got going: a process lost between the worker's pick-up and the
        # flow's start (issue 29, case 4) stays Pending for ever otherwise.
        if lease is not None and lease.live and silent is None:
            return _leave("Pending, and its workflow's lease is live: another run drives it")
        if run.state_age_s > t.pending_grace_s:
            return Decision(
                Action.MARK_CRASHED,
                f"Pending for {run.state_age_s:.0f}s (> {t.pending_grace_s:.0f}s) with no "
                "recent heartbeat and no live lease: its process was lost before it started",
            )
        return _leave(f"Pending for {run.state_age_s:.0f}s: starting")
    # RUNNING
    if silent is not None and lease is not None and run.state_age_s > _allowance(lease, t):
        return Decision(
            Action.MARK_CRASHED,
            f"Running in Prefect, but nobody renewed its workflow's lease for {silent:.0f}s "
            f"(ttl {lease.ttl_s:g}s) and no recent heartbeat: its host was lost",
        )
    if lease is not None and lease.live:
        return _leave("alive: its workflow's lease is held and renewed")
    if (
        run.heartbeat_age_s is not None
        and run.heartbeat_age_s > t.heartbeat_grace_s
        and run.state_age_s > t.heartbeat_grace_s
    ):
        return Decision(
            Action.MARK_CRASHED,
            f"Running with no heartbeat for {run.heartbeat_age_s:.0f}s "
            f"(> {t.heartbeat_grace_s:.0f}s) and no live lease: its host was lost",
        )
    return _leave("Running; no evidence it is lost")
