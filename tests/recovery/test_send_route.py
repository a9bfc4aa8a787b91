"""How a step's send on a checkpointed chat starts (``flows/recovery/before_send.py``'s
:func:`send_route`), as a table: one row per journal entry the step can find before its
write-ahead, with the step order known or not and the chat archived or not."""

from __future__ import annotations

import pytest

from prefect_coder.blocks.state import JournalEntry
from prefect_coder.flows.recovery.before_send import SendRoute, send_route

A, B, C = "[wf/a]", "[wf/b]", "[wf/c]"
#: The step under test is B; A runs before it, C after it.
EARLIER = frozenset({A})


def sent(marker: str, attempt: int = 0) -> JournalEntry:
    return JournalEntry.submitting(marker, attempt, turn_timeout=60.0)


ROWS: list[tuple[str, JournalEntry | None, frozenset[str] | None, bool | None, SendRoute]] = [
    # --- the journal names this step: an attempt of it sent
    ("this step's write-ahead: recover it", sent(B), EARLIER, None, SendRoute.RECOVER),
    ("this step's, order unknown: recover it", sent(B), None, None, SendRoute.RECOVER),
    (
        "this step's attempt cut short: recover",
        JournalEntry.cut_short(B, 1),
        EARLIER,
        None,
        SendRoute.RECOVER,
    ),
    (
        "this step's on an archived chat: recover (finds it archived)",
        sent(B),
        EARLIER,
        True,
        SendRoute.RECOVER,
    ),
    # --- an earlier step's: this step never sent
    ("an earlier step's, chat not asked yet: ask", sent(A), EARLIER, None, SendRoute.ASK_ARCHIVED),
    (
        "an earlier step's, the chat takes messages: the common send",
        sent(A),
        EARLIER,
        False,
        SendRoute.COMMON_SEND,
    ),
    (
        "an earlier step's, the chat archived: look (never a 400)",
        sent(A),
        EARLIER,
        True,
        SendRoute.LOOK_FIRST,
    ),
    # --- anything else: the step's marker may be in history
    (
        "no entry (an archived chat's records dropped): look",
        None,
        EARLIER,
        None,
        SendRoute.LOOK_FIRST,
    ),
    ("no entry, order unknown: look", None, None, None, SendRoute.LOOK_FIRST),
    (
        "a later step's (this step's result lost): look",
        sent(C),
        EARLIER,
        None,
        SendRoute.LOOK_FIRST,
    ),
    ("a later step's, the chat live: still look", sent(C), EARLIER, False, SendRoute.LOOK_FIRST),
    ("another step's, order unknown (agent-turn): look", sent(A), None, None, SendRoute.LOOK_FIRST),
    (
        "another step's, no step before this one: look",
        sent(A),
        frozenset(),
        False,
        SendRoute.LOOK_FIRST,
    ),
]


@pytest.mark.parametrize(
    ("situation", "before", "earlier", "archived", "expected"), ROWS, ids=[r[0] for r in ROWS]
)
def test_send_route(
    situation: str,
    before: JournalEntry | None,
    earlier: frozenset[str] | None,
    archived: bool | None,
    expected: SendRoute,
) -> None:
    assert send_route(before, B, earlier, archived=archived) is expected, situation


@pytest.mark.parametrize("before", [None, sent(A), sent(B), sent(C)])
@pytest.mark.parametrize("earlier", [None, frozenset(), EARLIER, frozenset({A, C})])
@pytest.mark.parametrize("archived", [None, False, True])
def test_the_common_send_needs_an_earlier_step_and_a_live_chat(
    before: JournalEntry | None, earlier: frozenset[str] | None, archived: bool | None
) -> None:
    # The only way to send without looking is proof the step never sent (an entry
    # naming a step before it) on a chat known to take messages.
    way = send_route(before, B, earlier, archived=archived)
    if way is SendRoute.COMMON_SEND:
        assert before is not None and earlier is not None and before.marker in earlier
        assert before.marker != B and archived is False
    if way is SendRoute.ASK_ARCHIVED:
        assert archived is None
