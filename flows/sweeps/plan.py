"""What the sweeps do with each chat, and why — pure decisions, no I/O.

The shell (:mod:`prefect_coder.flows.sweeps.run`) lists the chats this collection
labelled, reads the state store once, and asks these functions what to do with every chat; each
answer carries its reason, which ends up in the run's table artifact.

**Orphan sweep** (durable design, "Recover after a crash": *sweep every chat no
checkpoint accounts for — regardless of status — and retire every orphan*):

1. checkpointed → **keep**: the workflow owns its end of life; never archived here;
2. recorded stranded → **retire** (known dead: its session was discarded), or
   **forget** the record when the chat is already archived;
3. not labelled by this collection/tenant → **ignore**, never touched;
4. already archived → **keep** (nothing left to retire);
5. younger than the grace period → **wait**: it may be a live first turn whose
   ``finally`` checkpoint has not been written yet;
6. otherwise → **retire**: bounded interrupt, then archive (retrying 409).

A chat to retire or interrupt that is paused in ``requires_action`` with an
entry on the tool ledger is **reconciled** instead (:func:`paused_refinement`):
the pause may be the only record of a committed effect.

A checkpointed chat whose live run is its step's **crashed attempt** (the
journal's send landed, or a recovery pass revived it) and that is still within
the step's turn deadline is never cut short by the stuck-turn sweep
(:func:`crashed_attempt_left`, :func:`crashed_attempt_refinement`): a running
attempt is **left** to its workflow's own recovery, which follows it; a paused
one is **reconciled** with the calls that never ran run through the ledger —
what the dead process (and that recovery) would have done. Cutting it short
makes the workflow resubmit the step, and the model repeats the attempt's
committed tool calls under new call ids.

**Stuck-turn sweep** (agent semantics §8, "Preventing stuck turns"): a chat of
this collection in ``running``/``interrupting`` with no change for longer than
the turn budget, or in ``requires_action`` longer than the action budget with
nobody answering → **interrupt** (or reconcile). Everything else → keep.

Ages come from the listing: ``created_at`` for the grace period (how long the
chat exists), ``updated_at`` for the budgets (how long since the server last
changed it: a status change or a committed step). Both are the Coder server's
clock, compared with the sweeping worker's; the defaults are minutes, so
ordinary clock skew does not matter.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from coder_chat.core.journal import JournalView, classify_entry
from prefect_coder.flows.common.labels import of_another_store, owned_by, workflow_of

__all__ = [
    "BUSY_STATUSES",
    "CRASHED_ATTEMPT_STATUSES",
    "Accounting",
    "Action",
    "ChatFacts",
    "SweepDecision",
    "busy_refinement",
    "crashed_attempt_left",
    "crashed_attempt_refinement",
    "parse_time",
    "paused_refinement",
    "plan_orphan",
    "plan_stuck",
]

#: Statuses with a run in flight or a pause waiting for an answer.
BUSY_STATUSES = frozenset({"running", "interrupting", "requires_action"})

#: Statuses in which a crashed attempt within its turn deadline is not cut short:
#: generating (left to its workflow's recovery) or paused on client tools
#: (answered). ``interrupting`` is already being cut short by somebody.
CRASHED_ATTEMPT_STATUSES = frozenset({"running", "pending", "paused", "requires_action"})


class Action(StrEnum):
    """What a sweep does with one chat."""

    KEEP = "keep"  # accounted for, settled, or within budget: nothing to do
    WAIT = "wait"  # inside the grace period: look again next sweep
    IGNORE = "ignore"  # not this collection's chat: never touched
    RETIRE = "retire"  # bounded interrupt, then archive (retrying 409)
    INTERRUPT = "interrupt"  # stuck turn: stop it, keep the chat
    RECONCILE = "reconcile"  # paused with a committed effect: answer it from the ledger
    FORGET = "forget"  # stranded record of a chat already archived or gone
    BUSY = "busy"  # a live run of its workflow holds the lease: not now
    LEAVE = "leave"  # its step's crashed attempt within its deadline: its recovery's job


@dataclass(frozen=True, slots=True)
class ChatFacts:
    """What the listing says about one chat (times as epoch seconds)."""

    chat_id: str
    status: str
    archived: bool
    created_at: float | None
    updated_at: float | None
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def workflow_id(self) -> str | None:
        """The workflow the chat's labels name."""
        return workflow_of(self.labels)

    @classmethod
    def of(cls, chat: Any) -> ChatFacts:
        """From a ``coder_chat.models.Chat`` (or anything with its attributes)."""
        return cls(
            chat_id=str(chat.id),
            status=str(chat.status),
            archived=bool(chat.archived),
            created_at=parse_time(chat.created_at),
            updated_at=parse_time(chat.updated_at),
            labels=dict(chat.labels or {}),
        )


@dataclass(frozen=True, slots=True)
class Accounting:
    """What the state store accounts for (read once per sweep)."""

    tenant: str
    #: The store's identity (``StateStore.identity``); None: unknown (no fence).
    store_id: str | None = None
    #: chat id → workflow id, from every checkpoint of the tenant
    checkpointed: Mapping[str, str] = field(default_factory=dict)
    #: chat id → (workflow id or None, reason), from the stranded-chat records
    stranded: Mapping[str, tuple[str | None, str]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SweepDecision:
    """One chat, what to do with it, and why."""

    chat_id: str
    action: Action
    reason: str
    status: str
    archived: bool = False
    workflow_id: str | None = None
    age_s: float | None = None
    idle_s: float | None = None

    def but(self, action: Action, reason: str) -> SweepDecision:
        """The same chat with another action."""
        return SweepDecision(
            self.chat_id,
            action,
            reason,
            self.status,
            self.archived,
            self.workflow_id,
            self.age_s,
            self.idle_s,
        )


def parse_time(value: str | None) -> float | None:
    """RFC 3339 (Go prints up to nanoseconds, ``Z`` or an offset) → epoch seconds."""
    if not value:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    if parsed.tzinfo is None:
        return None  # a naive time cannot be compared with ours safely
    return parsed.timestamp()


def _ago(then: float | None, now: float) -> float | None:
    return None if then is None else max(0.0, now - then)


def _base(chat: ChatFacts, acct: Accounting, now: float) -> SweepDecision:
    workflow = acct.checkpointed.get(chat.chat_id)
    if workflow is None and chat.chat_id in acct.stranded:
        workflow = acct.stranded[chat.chat_id][0]
    return SweepDecision(
        chat.chat_id,
        Action.KEEP,
        "",
        chat.status,
        chat.archived,
        workflow or chat.workflow_id,
        _ago(chat.created_at, now),
        _ago(chat.updated_at, now),
    )


def plan_orphan(chat: ChatFacts, acct: Accounting, *, now: float, grace_s: float) -> SweepDecision:
    """The orphan sweep's decision for one listed chat."""
    d = _base(chat, acct, now)
    if chat.chat_id in acct.checkpointed:
        return d.but(Action.KEEP, f"checkpointed by workflow {d.workflow_id}")
    if chat.chat_id in acct.stranded:
        why = acct.stranded[chat.chat_id][1]
        if chat.archived:
            return d.but(Action.FORGET, f"stranded ({why}) and already archived")
        # Known dead: the SDK discarded its session; no turn will ever resume it,
        # so no grace period applies.
        return d.but(Action.RETIRE, f"stranded ({why}): its session was discarded")
    if not owned_by(chat.labels, acct.tenant):
        return d.but(Action.IGNORE, "not labelled by this collection and tenant")
    other = of_another_store(chat.labels, acct.store_id)
    if other is not None:
        return d.but(
            Action.IGNORE,
            f"checkpointed by another state store ({other}): this sweep's store cannot "
            "account for it; left alone (run the sweeps with the workflows' store: "
            "CoderCredentials.store_block)",
        )
    if chat.archived:
        return d.but(Action.KEEP, "no checkpoint, already archived")
    if d.age_s is None:
        return d.but(Action.WAIT, "no created_at in the listing: cannot prove it is past the grace")
    if d.age_s < grace_s:
        return d.but(
            Action.WAIT,
            f"no checkpoint yet, created {d.age_s:.1f}s ago: inside the {grace_s:g}s grace "
            "period (may be a live first turn)",
        )
    return d.but(
        Action.RETIRE,
        f"no checkpoint accounts for it ({chat.status}, created {d.age_s:.1f}s ago, "
        f"grace {grace_s:g}s)",
    )


def plan_stuck(
    chat: ChatFacts,
    acct: Accounting,
    *,
    now: float,
    turn_budget_s: float,
    action_budget_s: float,
) -> SweepDecision:
    """The stuck-turn sweep's decision for one listed (unarchived) chat."""
    d = _base(chat, acct, now)
    ours = (
        owned_by(chat.labels, acct.tenant)
        or chat.chat_id in acct.checkpointed
        or chat.chat_id in acct.stranded
    )
    if not ours:
        return d.but(Action.IGNORE, "not labelled by this collection and tenant")
    other = of_another_store(chat.labels, acct.store_id)
    if other is not None and chat.chat_id not in acct.checkpointed:
        # Its own store's workflow (and its recovery) drives it: a stuck-turn verdict
        # here could interrupt a turn that store's recovery is following.
        return d.but(Action.IGNORE, f"checkpointed by another state store ({other}): left alone")
    if chat.archived or chat.status not in BUSY_STATUSES:
        return d.but(Action.KEEP, f"{chat.status}: no run in flight")
    if d.idle_s is None:
        return d.but(Action.KEEP, "no updated_at in the listing: cannot measure the status age")
    if chat.status == "requires_action":
        if d.idle_s <= action_budget_s:
            return d.but(Action.KEEP, f"paused {d.idle_s:.1f}s, within {action_budget_s:g}s")
        return d.but(
            Action.INTERRUPT,
            f"paused in requires_action for {d.idle_s:.1f}s (> {action_budget_s:g}s) with "
            "nobody answering",
        )
    if d.idle_s <= turn_budget_s:
        return d.but(Action.KEEP, f"{chat.status} {d.idle_s:.1f}s, within {turn_budget_s:g}s")
    return d.but(
        Action.INTERRUPT,
        f"{chat.status} with no change for {d.idle_s:.1f}s (> turn budget {turn_budget_s:g}s)",
    )


def paused_refinement(d: SweepDecision, *, status: str, has_ledger_entries: bool) -> SweepDecision:
    """Turn an interrupt/retire of a paused chat into a reconcile when the ledger
    holds an entry for it: the ``requires_action`` pause may be the only pending
    record of a committed effect, and interrupting it away would let a resubmitted
    prompt repeat the effect (design: "Make client tools crash-safe")."""
    if d.action not in (Action.RETIRE, Action.INTERRUPT) or status != "requires_action":
        return d
    if not has_ledger_entries:
        return d
    return d.but(
        Action.RECONCILE,
        d.reason + "; paused with entries on the tool ledger: reconcile, never interrupt",
    )


def busy_refinement(d: SweepDecision, *, lease_holder: str | None) -> SweepDecision:
    """A chat whose workflow's lease is held by a live run is left alone: that run
    may be the turn that created it (before its checkpoint) or the one answering
    its pause. The next sweep looks again."""
    if d.action not in (Action.RETIRE, Action.INTERRUPT, Action.RECONCILE) or not lease_holder:
        return d
    return d.but(
        Action.BUSY,
        d.reason + f"; a live run of workflow {d.workflow_id} holds its lease: left for later",
    )


def crashed_attempt_left(
    entry: JournalView, attempts: int, *, now: float, turn_timeout_s: float
) -> float | None:
    """Seconds left of the step's turn deadline when the chat's live run is that
    step's crashed attempt; ``None`` when it is not (or the deadline has passed).

    The workflow's own recovery reads the journal the same way
    (:func:`coder_chat.core.journal.classify_entry`): the journal's ``submitting``
    entry sits below the step's attempt count (``attempts``: user messages carrying
    the entry's marker) — the send landed, the run is that attempt's — or a
    recovery pass journaled ``resumed`` for this very attempt (it revived the run).

    The deadline is the one the entry recorded (the journal's ``at`` plus the STEP's
    turn timeout, written with the send or the revival): for a ``submitting`` entry
    the send's write-ahead is where the crashed ``generate()``'s own turn bound
    started (recovery follows it for the same time); for ``resumed``, the answer
    that revived the run — so each answered pause gives the revived run one more
    turn timeout, never more, and a chat whose workflow is gone for good is swept at
    most one turn timeout after the last sign of its attempt. An entry without a
    deadline (written before the field existed) falls back to ``at`` plus
    ``turn_timeout_s``, the sweep's own setting (the workflows' settings by default).
    """
    reading = classify_entry(entry, entry.marker, attempts, turn_timeout=turn_timeout_s)
    return reading.crashed_attempt_left(now)


def crashed_attempt_refinement(
    d: SweepDecision, *, status: str, left_s: float | None
) -> SweepDecision:
    """Never cut short a checkpointed step's crashed attempt within its turn deadline
    (``left_s`` from :func:`crashed_attempt_left`; ``None``: act as planned).

    * running → **leave**: the workflow's recovery follows it (re-attaches and
      answers its pauses); interrupting it makes the step resubmit, and the model
      charges its committed tool calls again under new call ids;
    * paused on client tools → **reconcile**, with calls that never ran *run*
      through the ledger (their key is the call id's, stable across crashes), not
      cut short: the dead process's own next tool call, as its recovery would run it.
    """
    if left_s is None or d.action not in (Action.INTERRUPT, Action.RECONCILE):
        return d
    if status not in CRASHED_ATTEMPT_STATUSES:
        return d
    why = f"its step's crashed attempt, {left_s:.1f}s left of its turn deadline"
    if status == "requires_action":
        return d.but(
            Action.RECONCILE,
            d.reason + f"; {why}: answer its pause through the ledger (calls that never ran "
            "are run), never cut it short",
        )
    return d.but(
        Action.LEAVE, d.reason + f"; {why}: left to its workflow's recovery, which follows it"
    )
