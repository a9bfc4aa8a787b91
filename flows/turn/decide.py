"""What a durable turn does next: a pure function of what it has observed.

The turn (:func:`prefect_coder.flows.turn.durable_turn.execute_turn`) is a small
controller. It observes (a frozen :class:`TurnSnapshot`), asks :func:`decide`, acts
(one function per action kind), observes what the act returned, and repeats — until
a recovered result is returned, the step fails, or a send (or a followed attempt)
settles. No I/O here; ``tests/flows/test_turn_decide.py`` tables every branch.

What recovering an earlier attempt found is one of four findings
(:mod:`prefect_coder.flows.recovery.recovered`, made by ``recover_before_send`` and
``from_history``) — :class:`Unsent`, :class:`Finished`, :class:`Running`,
:class:`Archived` — each with only the fields it needs, so no rule reads a
combination of optional fields.

The rules, in the order they apply (each closes a failure window):

* **A send settled ⇒ re-ask once, else settle.** A structured step whose answer did
  not validate on an idle chat is asked once more (journaled like every send); never
  a busy or paused chat (``finish_reason`` other than ``stop``), never twice (the
  turn's prompt already was the re-ask). Everything else settles: the ``finally``
  checkpoint, then the result (a structured step without a valid answer fails there,
  checkpointed — never "Completed" with ``structured=None``).
* **The workflow's lease is lost ⇒ stand down** (before any send). Another run took
  the workflow over (this one stalled past the lease's ttl): recovering would
  interrupt or journal the chat that run drives now, and a send would run the step
  twice. The agent's own check (``still_ours``) fires only as a prompt leaves; this
  one fires before every act that leads there.
* **No checkpoint, an earlier hold of the lease ⇒ look for orphans first.** A
  crash between a first turn's chat creation and its checkpoint left a chat nobody
  can find: one holding only this step is adopted and recovered, never sent again.
* **A checkpointed chat not recovered yet ⇒ recover before any send.** An earlier
  attempt may have sent (the journal names the step) or its result may be lost: it
  is followed, read back or resubmitted, never sent a second time beside itself.
* **Archived, an earlier fresh chat holds the step ⇒ move there (once).** A crash
  after a fresh chat was created but before it was checkpointed: the step is
  recovered on that chat instead of creating yet another one.
* **Archived ⇒ a fresh chat.** Nothing can be sent to an archived chat ever again
  (a 400 on every rerun): the step is sent in a fresh chat, checkpointed as a first
  turn's is.
* **Finished ⇒ return it.** The earlier attempt finished and its result was lost
  (a crash before Prefect persisted it): resending would repeat its turn and tools.
* **Finished without a valid answer ⇒ the re-ask, unless it was the re-ask.**
* **Running ⇒ follow it.** The earlier attempt still runs on the server: its
  settle is this step's outcome; a resend would run the step twice at once.
* **Otherwise ⇒ send** the step's prompt as the attempt recovery numbered.

Every exit of the sends — settled, failed, cancelled — then goes through one more
decision, :func:`after_sends`: what the ``finally`` writes (a checkpoint, with or
without the first send's journal entry, or the stranded chats for the sweep).
"""

from __future__ import annotations

from dataclasses import dataclass

from coder_chat.results import GenerateResult
from prefect_coder.flows.common.results import TurnResult
from prefect_coder.flows.recovery.recovered import Archived, Finished, Found, Running, Unsent

__all__ = [
    "Action",
    "AfterSends",
    "Answered",
    "Archived",
    "CheckOrphans",
    "CheckpointChat",
    "CheckpointFirstSend",
    "FailStructured",
    "Finished",
    "Follow",
    "Found",
    "MoveToChat",
    "MoveToFreshChat",
    "Reask",
    "Recover",
    "Return",
    "Running",
    "Send",
    "Settle",
    "StandDown",
    "StrandChats",
    "TurnSnapshot",
    "Unsent",
    "after_sends",
    "decide",
]


# --- what a send (or a followed attempt) returned --------------------------------------


@dataclass(frozen=True, slots=True)
class Answered:
    """A send's (or followed attempt's) outcome, as far as the rules read it."""

    #: The step's structured answer validated (always True for a step without one).
    valid: bool = True
    #: The chat is idle (``finish_reason == "stop"``): a busy or paused chat is never
    #: re-prompted.
    idle: bool = True
    #: The turn's user message was the re-ask; None: not read (only a structured
    #: step's invalid answer on an idle chat needs it: one history read).
    was_reask: bool | None = None


# --- the snapshot ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TurnSnapshot:
    """What the turn knows before its next act."""

    #: The checkpointed chat the turn is on; None: a first turn's (or a fresh) chat,
    #: created by the send and checkpointed as a first turn's is.
    chat_id: str | None = None
    #: No checkpoint and an earlier hold of the lease may have left a chat: the orphan
    #: check has not run yet.
    orphans_pending: bool = False
    #: What recovering ``chat_id`` found; None: not recovered yet.
    found: Found | None = None
    #: The turn already left an archived checkpoint for an adopted chat.
    moved: bool = False
    #: The step asks for a structured answer.
    structured: bool = False
    #: A :class:`Finished` attempt without a valid answer: its prompt was the re-ask
    #: (one history read); None: not read.
    finished_was_reask: bool | None = None
    #: The attempt being sent (or recovered): 1-based.
    attempt: int = 1
    #: What the last send or follow returned; None: nothing sent yet.
    answered: Answered | None = None
    #: This turn sent the re-ask already.
    reasked: bool = False
    #: The workflow's lease (the fence of every act on its chat) is known lost.
    fence_lost: bool = False


# --- actions ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StandDown:
    """Another run holds the workflow now: fail (``LeaseLostError``), acting no more."""


@dataclass(frozen=True, slots=True)
class CheckOrphans:
    """Adopt the orphan chat a crashed first attempt left, strand any other."""


@dataclass(frozen=True, slots=True)
class Recover:
    """Bring an earlier attempt of the step on ``chat_id`` to an end before sending."""

    chat_id: str


@dataclass(frozen=True, slots=True)
class MoveToChat:
    """Continue on ``chat_id`` (adopted: the checkpoint now) and recover the step there."""

    chat_id: str


@dataclass(frozen=True, slots=True)
class MoveToFreshChat:
    """Forget the archived chat: the send creates a fresh one (the new checkpoint)."""

    attempt: int


@dataclass(frozen=True, slots=True)
class Return:
    """The step finished earlier: return its result, send nothing."""

    result: TurnResult


@dataclass(frozen=True, slots=True)
class FailStructured:
    """The step's re-ask already finished without a valid answer: the step fails."""

    attempt: int


@dataclass(frozen=True, slots=True)
class Send:
    """Send the step's prompt as attempt ``attempt``."""

    attempt: int


@dataclass(frozen=True, slots=True)
class Follow:
    """The earlier attempt's settle is this send's outcome: nothing is sent."""

    attempt: int
    gen: GenerateResult


@dataclass(frozen=True, slots=True)
class Reask:
    """Journal and send the structured answer's re-ask as attempt ``attempt``."""

    attempt: int


@dataclass(frozen=True, slots=True)
class Settle:
    """The sends are over: checkpoint, then the result."""

    attempt: int


Action = (
    StandDown
    | CheckOrphans
    | Recover
    | MoveToChat
    | MoveToFreshChat
    | Return
    | FailStructured
    | Send
    | Follow
    | Reask
    | Settle
)


def decide(s: TurnSnapshot) -> Action:
    """The turn's next act for snapshot ``s`` (the rules: this module's docstring)."""
    if s.answered is not None:
        return _after_send(s, s.answered)
    if s.fence_lost:
        return StandDown()
    if s.orphans_pending and s.chat_id is None:
        return CheckOrphans()
    if s.chat_id is None:
        # A first turn (no orphan to adopt) or a fresh chat after an archived one: the
        # send creates the chat; its checkpoint is written with the send's write-ahead.
        return Send(s.attempt)
    found = s.found
    if found is None:
        return Recover(s.chat_id)
    if isinstance(found, Archived):
        if found.adopted is not None and not s.moved:
            return MoveToChat(found.adopted)
        # Moved once already: a second adoption would chase chats; a fresh one ends it.
        return MoveToFreshChat(1)
    if isinstance(found, Finished):
        if not s.structured or found.result.structured is not None:
            return Return(found.result)
        # No valid answer in the finished attempt. Unknown whether it was the re-ask
        # (None) counts as the re-ask: a third prompt is never sent on a guess.
        if s.finished_was_reask is False:
            return Reask(found.attempt + 1)
        return FailStructured(found.attempt)
    if isinstance(found, Running):
        return Follow(found.attempt, found.gen)
    return Send(found.attempt)


def _after_send(s: TurnSnapshot, a: Answered) -> Action:
    if (
        s.structured
        and not s.reasked
        and not a.valid
        and a.idle
        # Unknown (not read) ⇒ no re-ask: the step settles and fails without an answer.
        and a.was_reask is False
    ):
        return Reask(s.attempt + 1)
    return Settle(s.attempt)


# --- the finally: what the sends leave in the store ------------------------------------


@dataclass(frozen=True, slots=True)
class AfterSends:
    """What the turn's ``finally`` knows of its sends, however they ended."""

    #: The turn has a chat to checkpoint: the agent's, or — on a first turn — the one
    #: the SDK discarded after its stream was lost (the turn may have run there).
    on_chat: bool
    #: That chat was the checkpoint before the sends (not a first turn's, not a fresh one).
    had_chat: bool = False
    #: The sends failed (an error, a timeout, a cancellation).
    failed: bool = False
    #: A transient failure after a send landed left the live run alone (no interrupt).
    left_live: bool = False
    #: The eager checkpoint already committed this chat with the step's write-ahead.
    eagerly_journaled: bool = False


@dataclass(frozen=True, slots=True)
class StrandChats:
    """Record the chats the SDK discarded as stranded, for the sweep."""


@dataclass(frozen=True, slots=True)
class CheckpointChat:
    """Checkpoint the chat (and cursor) in one trip; ``journal``: with the step's
    ``submitting`` entry of that attempt count (None: no journal write)."""

    journal: int | None = None


@dataclass(frozen=True, slots=True)
class CheckpointFirstSend:
    """A first send's chat, not journaled yet: checkpoint it and journal the send in
    one transaction — attempt ``attempt``; ``unless_named``: only when the chat's entry
    does not name the step already (one read in the transaction)."""

    attempt: int
    unless_named: bool


def after_sends(a: AfterSends) -> StrandChats | CheckpointChat | CheckpointFirstSend:
    """What the ``finally`` of a turn's sends writes (every exit goes through here).

    * No chat at all (nothing was created): only chats the SDK discarded before the
      last one it created, if any, go to the sweep (``StrandChats``). The last chat a
      first turn created is checkpointed even when the SDK discarded it: a tool's
      effect may have committed there, and only a retry on that chat finds it in the
      ledger (chaos seed 540).
    * The chat was the checkpoint: its sends were journaled before they left (the
      turn's begin, recovery's resubmission, the re-ask's write-ahead); even a
      failed turn checkpoints its cursor (``CheckpointChat()``).
    * A first send (no chat to journal under before it) records its entry with its
      checkpoint, whatever the outcome: otherwise a crash between this write and
      Prefect persisting the result leaves a checkpoint without an entry, and "no
      entry ⇒ never sent" would resend a finished step. A failed send journals
      attempt 1, so the retry pins it cut short and resubmits; a finished one
      attempt 0 (the count before it) — and so does a transient failure that left
      the live run alone, which the retry follows instead of cutting it.
    * The eager checkpoint committed that entry already (attempt 0) and, under the
      lease, only this turn writes it (a later cut-short keeps the marker): the read
      would add nothing for a finished send, so one trip, no read (the fan-out's
      every turn is a first turn: docs/performance.md, round 7); only a failure
      writes attempt 1 with the checkpoint.
    """
    if not a.on_chat:
        return StrandChats()
    if a.had_chat:
        return CheckpointChat()
    cut_short = a.failed and not a.left_live
    if a.eagerly_journaled:
        return CheckpointChat(journal=1 if cut_short else None)
    if cut_short:
        return CheckpointFirstSend(attempt=1, unless_named=False)
    return CheckpointFirstSend(attempt=0, unless_named=True)
