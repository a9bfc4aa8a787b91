# The per-call `timeout=` parameter is part of the module contract (docs/architecture.md).
# ruff: noqa: ASYNC109
"""What recovery takes and gives: its time constants, the store and the follower it
works with, where the settle-wait left the chat, its outcome, and its own error."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from coder_chat.core.recovery import RecoveryDecision
from coder_chat.crash_safe import ToolLedgerStore
from coder_chat.errors import CoderRecoveryError
from coder_chat.history import RecoveredTurn
from coder_chat.results import GenerateResult

#: Wall-clock time (``time.time()``) the ``+N.Ns`` of recovery's log lines counts
#: from, so one recovery's timeline reads straight off its run's logs: the
#: ``recover-turn`` flow sets its run's start. Unset: each recovery's own start.
timeline_origin: ContextVar[float | None] = ContextVar("recovery_timeline_origin", default=None)


@dataclass(frozen=True, slots=True)
class RecoveryTimings:
    """Time constants of recovery (seconds); tests shorten them.

    ``probe_bound``: the status probe + interrupt bound (15 s) — a stalled
    deployment must fail the step, not hang it. ``settle_budget``: the settle
    poll and the history reads after it (600 s): turn-scale, because a
    reconciled pause revives a full model/tool continuation.
    ``poll_interval``: 1 s — acknowledged is not settled. ``commit_horizon``:
    how long a journaled send may still land (300 s = ``request_timeout``).
    ``max_rounds``: reconcile → settle rounds before giving up (each round is
    one NEW client-tool pause of the revived run).
    """

    probe_bound: float = 15.0
    settle_budget: float = 600.0
    poll_interval: float = 1.0
    commit_horizon: float = 300.0
    max_rounds: int = 64


class JournalStore(Protocol):
    """The per-chat send journal (``blocks.StateStore().journal`` fits)."""

    async def get(self, chat_id: str) -> Any: ...
    async def set(self, chat_id: str, entry: Any) -> Any: ...


class RecoveryStore(Protocol):
    """Journal + tool ledger (``blocks.StateStore`` fits)."""

    @property
    def journal(self) -> JournalStore: ...
    @property
    def ledger(self) -> ToolLedgerStore: ...


class Follower(Protocol):
    """What recovery re-attaches with (``coder_chat.CoderAgent`` fits): an agent on
    the step's chat with the step's client tools (crash-safe ones bound to the
    ledger, so a pause whose effect already committed is answered from it)."""

    async def follow(
        self,
        *,
        timeout: float | None = None,
        user_message_id: int | None = None,
        marker: str | None = None,
    ) -> GenerateResult: ...


class ToolOutcomeLostError(CoderRecoveryError):
    """The server closed a client tool call as "Tool execution timed out" although
    the ledger shows its effect committed (``done``) or may have (``committing``).

    chatd does that when nobody answers a ``requires_action`` pause in time (five
    minutes): the model is told the tool failed and answers on that basis. The
    attempt's answer is therefore not returned, and the step is not resubmitted
    either: a resubmitted prompt lets the model call the tool again under a NEW
    call id, i.e. a new ledger key, and the effect would be applied twice. The
    step fails with this error (Prefect does not retry it); an operator decides.

    ``calls``: ``(tool_call_id, tool_name, ledger_state, recorded_output)``.
    """

    def __init__(self, chat_id: str, marker: str, calls: list[tuple[str, str, str, Any]]) -> None:
        names = ", ".join(f"{name} {call_id} (ledger {state})" for call_id, name, state, _ in calls)
        super().__init__(
            f"chat {chat_id}, step {marker}: the server recorded {names} as "
            "'Tool execution timed out' but the ledger shows the effect committed (done) or "
            "may have (committing); the attempt's answer rests on a failure that did not "
            "happen, so it is not returned, and the step is not resubmitted (the model "
            "could apply the effect again under a new call id). Decide by hand: the "
            "recorded outputs are on this error's .calls."
        )
        self.chat_id = chat_id
        self.marker = marker
        self.calls = calls


@dataclass(frozen=True, slots=True)
class SettleResult:
    """Where the settle-wait left the chat."""

    status: str
    cut_short: bool
    attempts: int
    horizon_slept_s: float
    #: Set when the live run is this step's crashed attempt: follow it for this
    #: many seconds instead of cutting it short (nothing was interrupted).
    follow_s: float | None = None
    #: The newest user message of the settle's last history read (its attempt
    #: count), which the at-rest status read after it covered; None: none. The
    #: result check takes a verdict only from a history that ends with the same
    #: turn (a newer one is a send that landed after the status read).
    covered_user_id: int | None = None


@dataclass(slots=True)
class RecoveryOutcome:
    """What recovery concluded for one step's attempt.

    ``followed``: the crashed attempt was still running and was followed to its
    settle (:attr:`followed` holds what its ``generate()`` would have returned);
    ``recovered``: it had finished, its result is rebuilt from history;
    ``resubmit``: it never finished (or was cut short): send the step again.
    """

    classification: Literal["recovered", "resubmit", "followed"]
    chat_id: str
    marker: str
    status: str
    cut_short: bool
    #: Committed attempts of the step (user messages carrying the marker).
    attempts: int
    recovered: RecoveredTurn | None
    reason: str
    decisions: list[RecoveryDecision] = field(default_factory=list)
    #: Time spent sleeping out a journaled send's commit window (deliberate).
    horizon_slept_s: float = 0.0
    #: The followed attempt's result (``classification == "followed"``).
    followed: GenerateResult | None = None
