"""coder_chat.core.segment: how a segment ends, decided without sockets.

Every combination of submission state, read state, ending and failure kind is
enumerated and checked against the rules written out independently below.
"""

from __future__ import annotations

import itertools
from typing import Final, Literal

import pytest

from coder_chat.core.segment import (
    ReadEnd,
    ReadState,
    SegmentState,
    Stop,
    Submit,
    read_end,
    teardown,
)

ENDINGS: Final[tuple[Literal["clean", "failure", "teardown"], ...]] = (
    "clean",
    "failure",
    "teardown",
)
READS: list[ReadState | None] = [
    None,
    *(
        ReadState(reached_terminal=t, gated=g, queued_id=q, paused_for_tools=p)
        for t, g, q, p in itertools.product((False, True), (False, True), (None, 9), (False, True))
    ),
]
STATES = [
    SegmentState(chat_id=c, created_chat=cc, submit=s)
    for c, cc, s in itertools.product((None, "chat-1"), (False, True), list(Submit))
]


def expected_stop(state: SegmentState, read: ReadState | None) -> Stop:
    if state.chat_id is None:
        return Stop.NONE
    if read is not None and read.reached_terminal:
        return Stop.NONE
    if read is not None and read.gated:
        return Stop.WITHDRAW if read.queued_id is not None else Stop.NONE
    ours = {Submit.SENDING, Submit.LANDED, Submit.ADOPTED}
    return Stop.INTERRUPT if state.submit in ours else Stop.NONE


@pytest.mark.parametrize("state", STATES, ids=str)
def test_teardown_every_combination(state: SegmentState) -> None:
    for read, ending, failed, created in itertools.product(
        READS, ENDINGS, (False, True), (False, True)
    ):
        d = teardown(state, read, ending=ending, stream_failed=failed, created_turn=created)
        assert d.stop is expected_stop(state, read), (read, ending)
        assert d.keep_stream == (ending == "clean" and read is not None and read.paused_for_tools)
        assert d.strand == (failed and created and state.chat_id is not None)
        assert (d.withdraw_id is not None) == (d.stop is Stop.WITHDRAW)
        assert d.why


def test_key_cases_read_as_the_spec_says() -> None:
    landed = SegmentState("c", submit=Submit.LANDED)
    unsettled = ReadState(reached_terminal=False)
    # §5.3: a segment ending unsettled after its submission landed interrupts its run ...
    assert teardown(landed, unsettled, ending="failure").stop is Stop.INTERRUPT
    # ... and so does one whose POST was in flight (it may have landed) ...
    assert teardown(landed.sending(), None, ending="failure").stop is Stop.INTERRUPT
    # ... but never after a rejected POST: nothing of ours runs.
    assert teardown(landed.sending().rejected(), None, ending="failure").stop is Stop.NONE
    # A queued prompt is withdrawn; someone else's running job is never interrupted.
    gated = ReadState(reached_terminal=False, gated=True, queued_id=4)
    d = teardown(landed, gated, ending="failure")
    assert d.stop is Stop.WITHDRAW and d.withdraw_id == 4
    # A promotion settle (reached_terminal without a status) interrupts nothing.
    assert teardown(landed, ReadState(reached_terminal=True), ending="clean").stop is Stop.NONE
    # A follower adopts the run: an unsettled follow stops it like a landed turn would.
    adopted = SegmentState().adopted("c")
    assert teardown(adopted, unsettled, ending="failure").stop is Stop.INTERRUPT
    # The healthy pause keeps the stream for the resume segment.
    pause = ReadState(reached_terminal=True, paused_for_tools=True)
    assert teardown(landed, pause, ending="clean").keep_stream
    assert not teardown(landed, pause, ending="teardown").keep_stream


def test_state_transitions() -> None:
    s = SegmentState(chat_id=None)
    assert s.submit is Submit.NOTHING and s.rejected() == s
    sending = s.sending()
    assert sending.submit is Submit.SENDING
    assert sending.rejected().submit is Submit.REJECTED
    created = sending.landed("c", created=True)
    assert (created.chat_id, created.created_chat, created.submit) == ("c", True, Submit.LANDED)
    # a refused stream upgrade after the POST landed: still our run
    assert created.rejected() == created
    # a later resume never clears "this segment created the chat"
    assert created.landed("c").created_chat


def test_read_end_every_combination() -> None:
    for settled, dead, err, closed in itertools.product((False, True), repeat=4):
        got = read_end(settled=settled, dead_end=dead, server_error=err, reader_closed=closed)
        if dead:
            want = ReadEnd.DEAD_END  # the queued prompt is lost, whatever else happened
        elif err:
            want = ReadEnd.SERVER_ERROR
        elif settled:
            want = ReadEnd.SETTLED  # a settle wins over a reader we closed afterwards
        elif closed:
            want = ReadEnd.TORN_DOWN
        else:
            want = ReadEnd.STREAM_CLOSED
        assert got is want, (settled, dead, err, closed)
