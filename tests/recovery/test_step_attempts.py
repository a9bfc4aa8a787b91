"""coder_chat.core.attempts.StepAttempts: one index of a step's attempts in history,
table-driven and pure (no sockets)."""

from __future__ import annotations

from typing import Any

import pytest

from coder_chat.core.attempts import StepAttempts, carries_marker
from coder_chat.history import count_marker_attempts


def _user(mid: int, *texts: str) -> dict[str, Any]:
    return {"id": mid, "role": "user", "content": [{"type": "text", "text": t} for t in texts]}


def _assistant(mid: int) -> dict[str, Any]:
    return {"id": mid, "role": "assistant", "content": [{"type": "text", "text": "ok"}]}


HISTORY = [
    _user(1, "[w/a] first"),
    _assistant(2),
    _user(3, "[w/b] second"),
    _assistant(4),
    _user(5, "[w/b] second again"),
    _assistant(6),
    _user(7, "[w/c] third"),
]


@pytest.mark.parametrize(
    ("messages", "marker", "row"),
    [
        # (attempts, last id, tail, answered, tail_attempts, tail_complete)
        (HISTORY, "[w/a]", (1, 1, False, True, 0, True)),
        (HISTORY, "[w/b]", (2, 5, False, True, 0, True)),
        (HISTORY, "[w/c]", (1, 7, True, False, 1, True)),  # closed by b's prompt
        (HISTORY, "[w/d]", (0, None, False, False, 0, True)),  # absent
        (HISTORY[:6], "[w/b]", (2, 5, True, True, 2, True)),
        (HISTORY[2:5], "[w/b]", (2, 5, True, False, 2, False)),  # the page ran out
        ([], "[w/a]", (0, None, False, False, 0, False)),  # nothing read yet
        ([_assistant(9)], "[w/a]", (0, None, False, False, 0, False)),
        # the marker in the second text part of a user message still counts
        ([_user(1, "see: ", "[w/a] go")], "[w/a]", (1, 1, True, False, 1, False)),
        # an assistant quoting the marker is no attempt
        ([_user(1, "x"), {**_assistant(2), "content": [{"type": "text", "text": "[w/a]"}]}],
         "[w/a]", (0, None, False, False, 0, True)),
    ],
)  # fmt: skip
def test_index(messages: list[Any], marker: str, row: tuple[Any, ...]) -> None:
    for order in (messages, list(reversed(messages))):  # any page order
        got = StepAttempts.of(order, marker)
        assert (
            got.attempts,
            got.last_user_message_id,
            got.tail,
            got.answered,
            got.tail_attempts,
            got.tail_complete,
        ) == row
        assert got.found == (row[1] is not None)
        assert count_marker_attempts(order, marker) == (row[4], row[5])


def test_marker_is_matched_in_text_parts_only() -> None:
    assert carries_marker(_user(1, "[w/a] hi"), "[w/a]")
    assert not carries_marker(
        {"id": 1, "role": "user", "content": [{"type": "file", "text": "[w/a]"}]}, "[w/a]"
    )
    assert not carries_marker({"id": 1, "role": "user", "content": None}, "[w/a]")
