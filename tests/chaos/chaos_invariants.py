"""The invariants a chaos schedule must keep, checked from what the outside world
recorded: the emulator's stored rows and event log, and the payments service.

* ``exactly-once`` — each logical tool call's effect happened exactly once (the
  payments service's effects of the workflow's chats, grouped by the call's
  amount, which is unique per logical call in the catalog; a repeated call under
  a new tool-call id is a second key with the same amount).
* ``finished-attempt`` — each stored step result is the answer of a finished
  attempt, not a cut-short one: its text is the fault-free run's, and in the event
  log the attempt its user message started ended ``completed`` with no interrupt,
  no abandoned/errored turn and no synthetic "interrupted"/"timed out" tool result,
  its last assistant message being the result's.
* ``chats-at-rest`` — no chat of the workflow is left running, paused or
  unarchived at the end.
* ``extra-turns`` — extra user turns of the steps on the workflow's chat ≤ the
  crashes that cut a live attempt: SIGKILLs (or failed runs) that left a live
  attempt behind, plus attempts a stuck sweep interrupted (journaled cut-short:
  the step is resubmitted), plus every fault that fired (a lost response, a 5xx, a dropped
  stream, a restart: each can fail the turn's task attempt, whose retry or rerun
  then finds the attempt live and unowned — the matrix's documented window). Any
  other chat of the workflow may carry only the first step's prompt, and counts
  as one extra turn of it: a chat orphaned before its checkpoint (lost create
  response, kill after create) is adopted by the next attempt, so one is left
  beside the workflow's chat only when the SDK discarded it (its stream failed
  on create: a fault) or when several crashes each left one — or when a
  ``sweep-orphans`` run with a grace below the turn timeout retired it first (the
  product warns that such a grace protects a first turn's chat only by its
  workflow's lease; each chat it retired allows one extra turn).
* ``recovery-finished`` — recovery reached the end of the workflow (a clean rerun
  after the schedule succeeds) and returns the stored results unchanged.
* ``one-key`` — each logical tool call reached the payments service under one
  ledger idempotency key, however often it was asked (a repeat under a new
  tool-call id re-drives or replays the first call's key, never a key of its own).
* ``archived-early`` — the workflow's chat was not archived before its last step's
  attempt finished (the emulator's ``archived`` events against that attempt's
  completed turn end); the runner adds the same violation when a chat is archived
  while the workflow waits for an approval.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LIVE", "Evidence", "Violation", "check"]

LIVE = {"running", "pending", "requires_action", "interrupting", "paused"}
_SYNTHETIC = ("interrupted by user", "timed out", "interrupted before it produced")
_CUT_OUTCOMES = {"interrupted", "abandoned", "error"}


@dataclass(frozen=True)
class Violation:
    invariant: str
    detail: str

    def __str__(self) -> str:
        return f"[{self.invariant}] {self.detail}"


@dataclass
class Evidence:
    """Everything the checks read, gathered once after the schedule."""

    workflow_id: str
    #: step name → (marker, template name)
    steps: dict[str, tuple[str, str]]
    #: the amounts of every logical client tool call of the workflow
    amounts: list[int]
    #: template name → the fault-free run's step text
    expected_text: dict[str, str]
    chats: list[dict[str, Any]]
    messages: dict[str, list[dict[str, Any]]]
    #: ``message``/``status``/``turn_end`` events of the workflow's chats, in log order
    events: list[dict[str, Any]]
    #: idempotency key → (effects, amount)
    effects: dict[str, tuple[int, int]]
    results: list[Any] | None
    stored: list[Any] | None
    #: kills (or failed runs) that left a live attempt behind
    cuts: int
    #: faults that fired (emulator ``fault`` events but delayed commits, restarts)
    fired: int = 0
    recovery_error: str | None = None
    notes: list[str] = field(default_factory=list)
    #: every idempotency key the payments service was asked with → its amount
    keys: dict[str, int] = field(default_factory=dict)
    #: orphan chats retired by the schedule's sweep-orphans runs (grace 0, below the
    #: turn timeout: a first turn's chat is protected only by its workflow's lease
    #: until its checkpoint is written — the product warns so; a crashed first turn's
    #: chat retired before the rerun adopts it makes the rerun send that step again)
    retired: int = 0
    #: attempts the schedule's sweep-stuck-turns runs interrupted (0.01 s budgets:
    #: every running or paused turn is "stuck"); each is journaled cut-short, and the
    #: workflow's recovery resubmits that step — a journaled cut, like a crash's
    interrupted: int = 0


def _text(m: dict[str, Any]) -> str:
    return "".join(p.get("text", "") for p in m.get("content") or [] if p.get("type") == "text")


def _exactly_once(ev: Evidence, finished: bool) -> list[Violation]:
    out = []
    by_amount: Counter[int] = Counter()
    for key, (n, amount) in ev.effects.items():
        by_amount[amount] += n
        if n != 1:
            out.append(Violation("exactly-once", f"key {key} applied {n} times"))
    for amount, n in sorted(by_amount.items()):
        if amount not in ev.amounts:
            out.append(Violation("exactly-once", f"unexpected charge of {amount} ({n}x)"))
        elif n > 1:
            keys = [k for k, (_, a) in ev.effects.items() if a == amount]
            out.append(
                Violation("exactly-once", f"charge {amount} applied {n} times under keys {keys}")
            )
    if finished:
        missing = [a for a in ev.amounts if by_amount[a] == 0]
        if missing:
            out.append(Violation("exactly-once", f"charges {missing} never applied"))
    return out


def _one_key(ev: Evidence) -> list[Violation]:
    by_amount: dict[int, list[str]] = {}
    for key, amount in sorted(ev.keys.items()):
        by_amount.setdefault(amount, []).append(key)
    return [
        Violation("one-key", f"call of {amount} reached the service under {len(ks)} keys {ks}")
        for amount, ks in sorted(by_amount.items())
        if len(ks) > 1
    ]


def _archived_early(ev: Evidence) -> list[Violation]:
    """The workflow's chat archived before its last step's attempt completed."""
    if not ev.results or ev.results[-1].user_message_id is None:
        return []
    last = ev.results[-1]
    mine = [e for e in ev.events if e["chat_id"] == last.chat_id]
    start = next(
        (
            i
            for i, e in enumerate(mine)
            if e["kind"] == "message" and e["details"]["id"] == last.user_message_id
        ),
        None,
    )
    if start is None:
        return []
    ends = [
        i
        for i, e in enumerate(mine)
        if i > start and e["kind"] == "turn_end" and e["details"].get("outcome") == "completed"
    ]
    done = ends[0] if ends else len(mine)
    early = [
        i
        for i, e in enumerate(mine[:done])
        if e["kind"] == "archived" and e["details"].get("archived")
    ]
    if not early:
        return []
    where = "before its last step was sent" if early[0] < start else "during its last step"
    return [
        Violation(
            "archived-early",
            f"chat {last.chat_id} archived {where} ({last.step}, user message "
            f"{last.user_message_id})",
        )
    ]


def _attempt_span(events: list[dict[str, Any]], chat_id: str, user_id: int) -> list[dict[str, Any]]:
    mine = [e for e in events if e["chat_id"] == chat_id]
    start = next(
        (i for i, e in enumerate(mine) if e["kind"] == "message" and e["details"]["id"] == user_id),
        None,
    )
    if start is None:
        return []
    span = []
    for e in mine[start + 1 :]:
        if e["kind"] == "message" and e["details"]["role"] == "user":
            break
        span.append(e)
    return span


def _finished_attempts(ev: Evidence) -> list[Violation]:
    out: list[Violation] = []
    if ev.results is None:
        return out
    names = list(ev.steps)
    if [r.step for r in ev.results] != names:
        return [Violation("finished-attempt", f"results for {[r.step for r in ev.results]}")]
    for r in ev.results:
        _, template = ev.steps[r.step]
        want = ev.expected_text[template]
        if r.text != want:
            out.append(
                Violation("finished-attempt", f"{r.step}: text {r.text!r}, fault-free {want!r}")
            )
        if r.user_message_id is None:
            out.append(
                Violation(
                    "finished-attempt",
                    f"{r.step}: result names no user message: cannot be tied to an attempt",
                )
            )
            continue
        span = _attempt_span(ev.events, r.chat_id, r.user_message_id)
        ends = [e["details"]["outcome"] for e in span if e["kind"] == "turn_end"]
        statuses = [e["details"]["new"] for e in span if e["kind"] == "status"]
        assistant = [
            e["details"]["id"]
            for e in span
            if e["kind"] == "message" and e["details"]["role"] == "assistant"
        ]
        why = []
        if not ends or ends[-1] != "completed":
            why.append(f"turn ends {ends}")
        if _CUT_OUTCOMES & set(ends):
            why.append(f"a turn of it ended {sorted(_CUT_OUTCOMES & set(ends))}")
        if "interrupting" in statuses:
            why.append("it was interrupted")
        if not assistant:
            why.append("it has no assistant message")
        elif not r.message_ids:
            # a result rebuilt from history names no messages (a fidelity gap, not
            # a wrong answer): the attempt is tied through its user message alone
            ev.notes.append(f"{r.step}: result has no message_ids (rebuilt from history)")
        elif assistant[-1] not in r.message_ids:
            why.append(f"its last assistant message {assistant[-1]} is not the result's")
        rows = {e["details"]["id"] for e in span if e["kind"] == "message"}
        for m in ev.messages.get(r.chat_id, []):
            if m["id"] not in rows:
                continue
            for p in m.get("content") or []:
                res = str(p.get("result", "")) if p.get("type") == "tool-result" else ""
                if any(s in res for s in _SYNTHETIC):
                    why.append(f"synthetic tool result {res[:60]!r}")
        if why:
            out.append(
                Violation(
                    "finished-attempt",
                    f"{r.step} (chat {r.chat_id}, user message {r.user_message_id}): "
                    + "; ".join(why),
                )
            )
    return out


def _at_rest(ev: Evidence) -> list[Violation]:
    out = []
    for c in ev.chats:
        if c["status"] in LIVE or not c.get("archived"):
            out.append(
                Violation(
                    "chats-at-rest",
                    f"chat {c['id']} left {c['status']}, archived={c.get('archived', False)}",
                )
            )
    return out


def _extra_turns(ev: Evidence) -> list[Violation]:
    out: list[Violation] = []
    main = ev.results[-1].chat_id if ev.results else None
    first_marker = next(iter(ev.steps.values()))[0]
    extra = 0
    for chat_id, msgs in ev.messages.items():
        users = [_text(m) for m in msgs if m.get("role") == "user"]
        if chat_id != main:
            if len(users) != 1 or first_marker not in users[0]:
                out.append(
                    Violation(
                        "extra-turns",
                        f"chat {chat_id} is not the workflow's chat ({main}) but carries "
                        f"{len(users)} user turns: {[u[:50] for u in users]}",
                    )
                )
            extra += 1  # the first step sent again, in another chat
            continue
        for marker, _ in ev.steps.values():
            n = sum(marker in u for u in users)
            extra += max(0, n - 1)
    if extra > ev.cuts + ev.fired + ev.retired + ev.interrupted:
        out.append(
            Violation(
                "extra-turns",
                f"{extra} extra user turns (on chat {main} and as other chats of the "
                f"workflow), but only {ev.cuts} crashes left a live attempt, {ev.fired} "
                f"faults fired, {ev.interrupted} attempts were interrupted by a stuck "
                f"sweep and {ev.retired} orphans were retired by a sweep",
            )
        )
    return out


def check(ev: Evidence) -> list[Violation]:
    """Every violated invariant of the schedule, with the evidence in its detail."""
    finished = ev.recovery_error is None and ev.results is not None
    out: list[Violation] = []
    if not finished:
        out.append(Violation("recovery-finished", ev.recovery_error or "no results"))
    elif ev.stored is not None and [r.model_dump() for r in ev.stored] != [
        r.model_dump() for r in ev.results or []
    ]:
        out.append(Violation("recovery-finished", "a rerun returned other results than stored"))
    out += _exactly_once(ev, finished)
    out += _one_key(ev)
    out += _finished_attempts(ev)
    out += _archived_early(ev)
    out += _at_rest(ev)
    if finished:
        out += _extra_turns(ev)
    return out
