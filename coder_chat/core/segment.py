"""How a segment ends, as pure decisions over a small state value.

A *segment* (agent-semantics §3.2) submits something — a new chat, a message,
client tool results, or nothing when it follows a run started elsewhere — then
reads the stream until the run settles. How it ends decides what must happen
to the chat and to the stream, and each rule closes a failure window:

* a segment that ends without the run settling fires ONE best-effort interrupt
  of its own chat (§5.3) — a run nobody reads would otherwise keep spending
  until the server's own limits stop it;
* except when nothing of ours can be running: the submission was **rejected**
  (non-2xx: nothing was queued or started) or never sent;
* a prompt still **queued** behind someone else's run is withdrawn instead; the
  running job is not ours and must not be interrupted;
* a healthy ``requires_action`` pause keeps the stream open (paused) for the
  resume segment; every other ending closes it;
* a ``CoderStreamError`` on a chat this turn created strands that chat and
  discards the session (§7).

The I/O shell in :mod:`coder_chat.agent` records what happened in a
:class:`SegmentState`, asks :func:`read_end` and :func:`teardown`, and does
what they say. No I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Literal

__all__ = [
    "Ending",
    "ReadEnd",
    "ReadState",
    "SegmentKind",
    "SegmentState",
    "Stop",
    "Submit",
    "Teardown",
    "read_end",
    "teardown",
]

#: ``clean``: the run settled (a pause counts); ``failure``: an error ended it;
#: ``teardown``: the agent was closed while the segment was reading.
Ending = Literal["clean", "failure", "teardown"]


class SegmentKind(StrEnum):
    """What the segment submits before reading."""

    #: The turn's prompt: creates the chat, or posts a message to it.
    PROMPT = "prompt"
    #: Client tool results answering the previous segment's pause.
    RESULTS = "results"
    #: Nothing: re-attach to a run already going on (``CoderAgent.follow``).
    FOLLOW = "follow"


class Submit(StrEnum):
    """Where the segment's submission stands."""

    #: Nothing sent yet (the cursor probe may have run).
    NOTHING = "nothing"
    #: A POST is in flight: it may land even if we never see the answer.
    SENDING = "sending"
    #: The server accepted it: a run of ours is (or was) going on.
    LANDED = "landed"
    #: The server answered non-2xx: nothing was queued or started.
    REJECTED = "rejected"
    #: Nothing was sent: the segment follows a run this session started earlier
    #: (possibly in a process that died). The run is ours as if just submitted.
    ADOPTED = "adopted"


@dataclass(frozen=True, slots=True)
class SegmentState:
    """What the segment has done so far, as far as its ending is concerned."""

    chat_id: str | None = None
    created_chat: bool = False
    submit: Submit = Submit.NOTHING

    def sending(self) -> SegmentState:
        return replace(self, submit=Submit.SENDING)

    def landed(self, chat_id: str, *, created: bool = False) -> SegmentState:
        return replace(
            self, chat_id=chat_id, created_chat=self.created_chat or created, submit=Submit.LANDED
        )

    def adopted(self, chat_id: str) -> SegmentState:
        return replace(self, chat_id=chat_id, submit=Submit.ADOPTED)

    def rejected(self) -> SegmentState:
        """A non-2xx answer: the POST in flight (if any) landed nothing.

        A rejection after the submission landed (e.g. a refused stream upgrade)
        leaves it landed: our run is still going on.
        """
        if self.submit is Submit.SENDING:
            return replace(self, submit=Submit.REJECTED)
        return self


@dataclass(frozen=True, slots=True)
class ReadState:
    """What the translator knows at the segment's end (``None``: reading never started)."""

    #: The run settled (terminal status) or a promotion ended it.
    reached_terminal: bool
    #: The prompt is still queued behind someone else's run.
    gated: bool = False
    #: The queue entry to withdraw while gated (``None``: the server sent no id).
    queued_id: int | None = None
    #: Terminal ``requires_action`` with client calls (not a promotion).
    paused_for_tools: bool = False


class ReadEnd(StrEnum):
    """Why the read loop stopped; each maps to one outcome of the segment."""

    SETTLED = "settled"  # clean: finish the segment
    DEAD_END = "dead-end"  # the queued prompt was lost → CoderChatError(kind)
    SERVER_ERROR = "server-error"  # an ``error`` event → CoderChatError.from_payload
    TORN_DOWN = "torn-down"  # the agent closed the reader mid-turn
    STREAM_CLOSED = "stream-closed"  # the stream ended first → CoderChatError(stream_closed)


def read_end(*, settled: bool, dead_end: bool, server_error: bool, reader_closed: bool) -> ReadEnd:
    """Classify the end of the read loop (a dead end and a server error win over the rest)."""
    if dead_end:
        return ReadEnd.DEAD_END
    if server_error:
        return ReadEnd.SERVER_ERROR
    if settled:
        return ReadEnd.SETTLED
    if reader_closed:
        return ReadEnd.TORN_DOWN
    return ReadEnd.STREAM_CLOSED


class Stop(StrEnum):
    """What to send the chat at teardown (fire-and-forget, bounded)."""

    NONE = "none"
    INTERRUPT = "interrupt"
    WITHDRAW = "withdraw"  # DELETE the queue entry


@dataclass(frozen=True, slots=True)
class Teardown:
    """What the shell does when the segment ends, and why (for logs and tests)."""

    keep_stream: bool
    stop: Stop
    why: str
    withdraw_id: int | None = None
    #: Strand the chat (``stranded_chat_ids``) and discard the session.
    strand: bool = False


def teardown(
    state: SegmentState,
    read: ReadState | None,
    *,
    ending: Ending,
    stream_failed: bool = False,
    created_turn: bool = False,
) -> Teardown:
    """Decide the segment's teardown.

    Args:
        state: what was submitted, and to which chat.
        read: the translator's view, ``None`` if reading never started.
        ending: how the segment ended.
        stream_failed: it failed with ``CoderStreamError`` (redials exhausted).
        created_turn: the turn this segment belongs to created the chat.
    """
    keep = ending == "clean" and read is not None and read.paused_for_tools
    strand = stream_failed and created_turn and state.chat_id is not None
    if state.chat_id is None:
        return Teardown(keep, Stop.NONE, "no chat yet: nothing to stop", strand=strand)
    if read is not None and read.reached_terminal:
        return Teardown(keep, Stop.NONE, "the run settled", strand=strand)
    if read is not None and read.gated:
        if read.queued_id is None:
            return Teardown(
                keep,
                Stop.NONE,
                "still queued, no entry id: never stop another job's run",
                strand=strand,
            )
        return Teardown(
            keep,
            Stop.WITHDRAW,
            "still queued: withdraw the entry, never stop another job's run",
            withdraw_id=read.queued_id,
            strand=strand,
        )
    if state.submit in (Submit.SENDING, Submit.LANDED, Submit.ADOPTED):
        return Teardown(
            keep,
            Stop.INTERRUPT,
            f"unsettled, submission {state.submit}: stop our run",
            strand=strand,
        )
    return Teardown(
        keep, Stop.NONE, f"submission {state.submit}: nothing of ours runs", strand=strand
    )
