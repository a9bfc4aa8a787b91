"""Crash recovery decisions, as pure functions (durable design: "Recover after a crash",
"Make client tools crash-safe", "Recover the result before resubmitting").

No I/O here: the shell in :mod:`coder_chat.recovery` reads the chat status, the
journal, the ledger and history, asks these functions what to do, and does it.
Every function returns a value the shell can log and publish ("what was seen,
what was decided, why"), so each branch is testable without sockets.

Vocabulary:

* **attempt count** (``attempts``): user messages in history carrying the step's
  marker, i.e. how many times this step's prompt landed on the chat.
* **journal entry** (:mod:`coder_chat.core.journal`): ``(state, marker, attempt,
  at, deadline)`` written ahead of every send (``"submitting"``, ``attempt`` = the
  count *before* the send) and ahead of the ledger reconcile's network calls
  (``"resumed"`` / ``"cut-short"``); read through
  :func:`coder_chat.core.journal.classify_entry`.
* **cut short**: the attempt was (or may have been) stopped before it finished;
  a cut-short attempt must be resubmitted, never returned as a result.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

from coder_chat.core.fields import field
from coder_chat.core.journal import EntryReading, JournalView, Standing, classify_entry
from coder_chat.models import AT_REST_STATUSES

__all__ = [
    "LIVE_RUN_STATUSES",
    "POLL_DONE_STATUSES",
    "TIMEOUT_REASON",
    "Classification",
    "JournalView",
    "LedgerAction",
    "PollVerdict",
    "RecoveryDecision",
    "SettleAction",
    "batch_verdict",
    "classify_attempt",
    "crashed_pause_budget",
    "cut_short_after_interrupt",
    "follows_crashed_attempt",
    "horizon_remaining",
    "is_answered",
    "is_timeout_result",
    "ledger_action",
    "lost_outcomes",
    "pin_after_horizon",
    "poll_verdict",
    "scope_journal",
    "settle_action",
    "split_marker",
]

#: Statuses that end the settle poll (the run is over; a new message starts afresh).
POLL_DONE_STATUSES = AT_REST_STATUSES


@dataclass(frozen=True, slots=True)
class RecoveryDecision:
    """One recovery decision, for logs and the table artifact."""

    stage: str
    seen: str
    decided: str
    why: str

    def row(self) -> dict[str, str]:
        return {"stage": self.stage, "seen": self.seen, "decided": self.decided, "why": self.why}


# --------------------------------------------------------------------------- journal scoping


def scope_journal(entry: JournalView | None, marker: str, attempts: int) -> JournalView | None:
    """The entry only if it classifies THIS attempt of THIS step.

    Entries are per attempt, so the chat id alone cannot scope them: a verdict
    from attempt N must not classify attempt N+1 (a double crash), and a later
    step's recovery on the same chat must not inherit this one's. Applying an
    entry only while both marker and attempt count still match means every
    resubmission retires every earlier verdict by itself — there is no clear
    step to forget.
    """
    return entry if classify_entry(entry, marker, attempts).this_attempt else None


# --------------------------------------------------------------------------- settle-wait


class SettleAction(StrEnum):
    """The settle-wait's first move, chosen from the probed status and the journal."""

    #: ``requires_action``: a client tool crashed mid-execution. The pause is the
    #: only pending record of its committed effects: reconcile, never interrupt.
    RECONCILE = "reconcile"
    #: A previous recovery pass revived the run by submitting recorded results,
    #: then died. Interrupting now would cut down a run doing the step's work, and
    #: a resubmitted prompt would mint NEW tool-call ids, sidestepping the
    #: idempotency keys. Let it finish; nothing was cut short.
    LET_FINISH = "let-finish"
    #: A previous pass journaled "cut-short" (an unstarted sibling in its batch),
    #: then may have died before its interrupt landed. The journal records intent,
    #: not a landed interrupt: re-drive it. A 409 means the chat already settled;
    #: the verdict stands.
    REDRIVE_INTERRUPT = "redrive-interrupt"
    #: Anything else: interrupt, and learn from the answer whether a run was live.
    INTERRUPT = "interrupt"


def settle_action(status: str, journaled: JournalView | None) -> SettleAction:
    """Branch of the settle-wait (``journaled`` already passed :func:`scope_journal`)."""
    if status == "requires_action":
        return SettleAction.RECONCILE
    if journaled is not None and journaled.state != "submitting":
        if journaled.state == "resumed":
            return SettleAction.LET_FINISH
        return SettleAction.REDRIVE_INTERRUPT
    return SettleAction.INTERRUPT


def cut_short_after_interrupt(accepted: bool, probed_status: str | None) -> bool:
    """``cut_short`` from a fresh interrupt's answer.

    An accepted interrupt stopped a live run: cut short. A 409 proves only that
    nothing is stoppable *now*; that means "never cut short" only if the probe
    saw no interrupt already in flight — a probed ``interrupting`` is an earlier
    interrupt (a timeout's best-effort one, a sweeper) already truncating the
    attempt, and the 409 just says it landed.
    """
    return True if accepted else probed_status == "interrupting"


def horizon_remaining(journaled: JournalView | None, now: float, horizon_s: float) -> float:
    """Seconds left of a matching ``"submitting"`` entry's commit window (0 if none).

    A matching "submitting" entry — its attempt count has not grown — means the
    process died with its send possibly en route, and the server can commit it
    AFTER every read so far (the interrupt's 409 only said nothing was running
    then). Sleeping out what remains of the window (``requestTimeoutMs`` past the
    write is the conservative horizon; a restart has usually consumed most of
    it) lets a late-landing turn start before the settle poll, so the negative
    history read that follows is past the window.
    """
    if journaled is None or journaled.state != "submitting":
        return 0.0
    # Clamped to the horizon: a writer whose clock ran ahead must not stretch it.
    return min(horizon_s, max(0.0, journaled.at + horizon_s - now))


def pin_after_horizon(journaled: JournalView | None, attempts_now: int) -> bool:
    """True when an unlanded send over an existing attempt must pin ``cut_short``.

    The step only ever plans a resubmission over a cut-short, errored or
    unsubmitted attempt, so a write-ahead that superseded a "cut-short" verdict
    still carries its consequence: the result scan must not mistake the old
    attempt's truncated tail for a finished result.
    """
    return (
        journaled is not None
        and journaled.attempt > 0
        and classify_entry(journaled, journaled.marker, attempts_now).standing is Standing.UNSENT
    )


PollVerdict = Literal["settled", "paused", "wait"]


def poll_verdict(status: str, cut_short: bool) -> PollVerdict:
    """One settle-poll observation → stop (``settled`` / ``paused``) or keep waiting.

    ``requires_action`` with no accepted interrupt racing to clear it is a
    *stable* pause: a run resumed by submitted tool results called a NEW client
    tool — exit and reconcile again instead of polling out the deadline. While an
    interrupt is in flight (``cut_short``) the pause is about to clear: wait.
    """
    if status in POLL_DONE_STATUSES:
        return "settled"
    if status == "requires_action" and not cut_short:
        return "paused"
    return "wait"


# --------------------------------------------------------------------------- ledger reconcile


class LedgerAction(StrEnum):
    """What reconciliation does with one pending client-tool call."""

    #: ``done``: the effect committed and its result was stranded; submit the
    #: recorded output, nothing re-executes.
    SUBMIT_RECORDED = "submit-recorded"
    #: ``committing``: ambiguous (crashed between the write-ahead and "done").
    #: Re-drive with the SAME idempotency key — a committed effect replays as a
    #: no-op — with arguments from history, validated as the live loop would.
    REDRIVE = "redrive"
    #: No entry, but the tool is pure (``structured_output``'s ack, a tool declared
    #: with ``crash_safe.pure``): running it again has no effect, so answer the
    #: pause instead of cutting the attempt short and resubmitting the step.
    REPLAY = "replay"
    #: No entry: the tool never ran. Interrupting loses nothing.
    UNSTARTED = "unstarted"


def ledger_action(ledger_state: str | None, *, replayable: bool = False) -> LedgerAction:
    """Per-call reconcile action from the ledger entry's state (None = no entry)."""
    if ledger_state == "done":
        return LedgerAction.SUBMIT_RECORDED
    if ledger_state == "committing":
        return LedgerAction.REDRIVE
    if ledger_state is not None:
        raise ValueError(f"unknown ledger state {ledger_state!r}")
    return LedgerAction.REPLAY if replayable else LedgerAction.UNSTARTED


def batch_verdict(actions: Iterable[LedgerAction]) -> Literal["resumed", "cut-short"] | None:
    """The ONE verdict of a reconcile batch, journaled before any network call.

    A mixed batch (one call done, a sibling never started) journals "cut-short"
    before even its submission, so no crash point can leave a stale "resumed"
    masking the pending interrupt. ``None`` for an empty batch (nothing to do).
    Submitted results are committed to history, so a batch that ends in an
    interrupt still keeps the effect's recorded outcome for the resubmitted turn.
    """
    acts = list(actions)
    if not acts:
        return None
    return "cut-short" if LedgerAction.UNSTARTED in acts else "resumed"


# --------------------------------------------------------------------------- following

#: Statuses of a run that is still generating (legacy ``pending``/``paused`` included).
#: ``interrupting`` is not one: somebody is already stopping it.
LIVE_RUN_STATUSES = frozenset({"running", "pending", "paused"})


def follows_crashed_attempt(
    status: str, entry: JournalView | None, marker: str, attempts: int
) -> bool:
    """True when the live run IS this step's crashed attempt: re-attach, never cut it short.

    Beyond the seed design (which interrupts every live run): the crashed
    process's send landed — the journal's ``submitting`` entry for this marker
    holds the count *before* that send and history now has more — and the chat
    is still generating, so the run is that attempt's own continuation (steps
    are sequential per chat and only this workflow sends on it; the count is
    taken from the newest user messages, so a later foreign prompt would reset
    it to 0). Interrupting it throws away paid model work, and resubmitting the
    step lets the model call its tools again under NEW call ids, which sidestep
    the ledger's idempotency keys: an effect that committed runs twice.

    A ``requires_action`` pause is not followed here: the ledger reconcile
    answers it (it predates this rule and also handles calls that never ran).
    """
    return (
        status in LIVE_RUN_STATUSES
        and classify_entry(entry, marker, attempts).standing is Standing.LANDED
    )


def crashed_pause_budget(reading: EntryReading, now: float, *, revived_s: float) -> float | None:
    """Seconds recovery may spend answering a ``requires_action`` pause itself, or None.

    Beyond the seed design (which interrupts a pause whose call never ran): when
    the pause is THIS step's crashed attempt, a call with no ledger entry is the
    crashed process's own next tool call — run it through the ledger (its key is
    the call id's, stable across crashes), submit, and follow the revived run.
    Interrupting it instead restarts the model, which calls a tool anew under a
    NEW id, and the resubmitted step redoes the attempt's earlier rounds.

    The pause is the step's attempt when its send landed (:attr:`Standing.LANDED`;
    the budget is what is left of that attempt's turn deadline, ``<= 0`` → None:
    stop it), or when an earlier recovery pass revived this very attempt
    (:attr:`Standing.REVIVED`; ``revived_s``, a turn of its own: the answer about
    to be submitted revives it again). Anything else — no attempt of the step in
    history, a ``cut-short`` verdict, another step's entry — returns None:
    unstarted calls are cut short, as before.
    """
    if reading.standing is Standing.REVIVED and reading.attempts > 0:
        return revived_s
    if reading.standing is Standing.LANDED:
        return reading.crashed_attempt_left(now)
    return None


# --------------------------------------------------------------------------- lost outcomes

#: The synthetic result chatd writes when nobody answered a client-tool pause in
#: time (the requires_action deadline, 5 minutes): the model is told the tool failed.
TIMEOUT_REASON = "Tool execution timed out"


def is_timeout_result(output: Any, is_error: bool) -> bool:
    """A client tool result that is chatd's synthetic "timed out" cancellation.

    The server stores it as the JSON string of the reason with ``is_error``; a
    client that decoded it sees the plain string.
    """
    if not is_error:
        return False
    if isinstance(output, dict) and set(output) <= {"error", "message"}:
        output = output.get("error", output.get("message"))
    if not isinstance(output, str):
        return False
    return output.strip().strip('"') == TIMEOUT_REASON


def lost_outcomes(
    results: Iterable[tuple[str, str, Any, bool]], ledger_states: Mapping[str, str | None]
) -> list[tuple[str, str, str]]:
    """Calls whose history says "timed out" while the ledger shows the effect ran.

    ``results``: ``(tool_call_id, tool_name, output, is_error)`` of the attempt's
    client tool results; ``ledger_states``: the ledger state per call id (None:
    no entry). Returns ``(tool_call_id, tool_name, ledger_state)`` for every
    call the server closed as timed out although its ledger entry is ``done``
    (the effect committed) or ``committing`` (it may have): the model's answer
    rests on a failure that did not happen (or may not have).
    """
    out = []
    for call_id, name, output, is_error in results:
        state = ledger_states.get(call_id)
        if state in ("done", "committing") and is_timeout_result(output, is_error):
            out.append((call_id, name, state))
    return out


# --------------------------------------------------------------------------- result check

Classification = Literal["recovered", "resubmit", "reconcile"]


def classify_attempt(
    *, submitted: bool, cut_short: bool, status: str, known_failure: bool = False
) -> tuple[Classification, str]:
    """The result check after the settle-wait: ``(classification, why)``.

    * settled ``requires_action`` → back to ledger reconciliation, never recovery
      or resubmission (the pause is the pending record of committed effects);
    * ``submitted and not cut_short`` and ``waiting``/``completed`` → the attempt
      finished and only its recording was lost: return the recovered result;
    * otherwise resubmit. ``not submitted`` is sound only behind the send
      write-ahead; ``error`` gets normal retry judgment; after ``cut_short`` the
      model continues from its aborted attempt in history.

    ``known_failure`` pins ``cut_short``: recovery that follows a known timeout or
    abort cannot trust its own 409 — the expiry already fired the SDK's
    best-effort interrupt, which may have stopped the run before recovery looked.
    """
    if status == "requires_action":
        return "reconcile", "the chat is paused on client tools: reconcile the ledger again"
    cut = cut_short or known_failure
    if not submitted:
        return "resubmit", "no user message carries the step marker: the prompt never landed"
    if status == "error":
        return "resubmit", "the attempt ended in error"
    if cut:
        why = (
            "recovery follows a known timeout/abort (cut_short pinned)"
            if known_failure and not cut_short
            else "the attempt was cut short"
        )
        return "resubmit", why
    if status in ("waiting", "completed"):
        return "recovered", f"the attempt finished ({status}) and only its recording was lost"
    return "resubmit", f"unexpected settled status {status!r}"


def is_answered(messages: Iterable[Any], user_message_id: int) -> bool:
    """True when an assistant message follows the user message ``user_message_id``
    (before the chat's next user message): the turn it started produced something.
    Pure; ``messages`` in any order."""
    ordered = sorted(messages, key=lambda m: int(field(m, "id", 0)))
    for m in ordered:
        if int(field(m, "id", 0)) <= user_message_id:
            continue
        role = field(m, "role")
        if role == "user":
            return False
        if role == "assistant":
            return True
    return False


# --------------------------------------------------------------------------- helpers


def split_marker(text: str, marker: str) -> str | None:
    """The prompt a user message carried after ``marker`` (``"<marker> <prompt>"``)."""
    idx = text.find(marker)
    if idx < 0:
        return None
    return text[idx + len(marker) :].lstrip(" ")


def describe_statuses(statuses: Sequence[Any]) -> str:
    """Compact ``a → b → c`` of a status sequence (consecutive repeats folded)."""
    out: list[str] = []
    for s in statuses:
        if not out or out[-1] != str(s):
            out.append(str(s))
    return " → ".join(out)
