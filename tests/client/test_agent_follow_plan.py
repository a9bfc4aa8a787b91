"""coder_chat.core.follow: which turn a follower re-attaches to, and which steps are done.

Pure: history shaped like chatd's (dicts), no sockets.
"""

from __future__ import annotations

import json
from typing import Any

from coder_chat.core.follow import history_covers, pick_queued, pick_turn, plan_follow

TOOLS = frozenset({"add"})


def user(mid: int, text: str = "go") -> dict[str, Any]:
    return {"id": mid, "role": "user", "content": [{"type": "text", "text": text}]}


def assistant(mid: int, *parts: dict[str, Any]) -> dict[str, Any]:
    return {"id": mid, "role": "assistant", "content": list(parts)}


def text(t: str) -> dict[str, Any]:
    return {"type": "text", "text": t}


def call(cid: str, name: str = "add", args: Any = None, **kw: Any) -> dict[str, Any]:
    part = {"type": "tool-call", "tool_call_id": cid, "tool_name": name, **kw}
    if args is not None:
        part["args"] = args
    return part


def result(mid: int, cid: str, value: Any, is_error: bool = False) -> dict[str, Any]:
    part = {"type": "tool-result", "tool_call_id": cid, "result": value, "is_error": is_error}
    return {"id": mid, "role": "tool", "content": [part]}


HISTORY = [
    user(1, "warm up"),
    assistant(2, text("Echo")),
    user(3, "step [wf/1]"),
    assistant(4, text("one")),
    user(5, "step [wf/2]"),
    assistant(6, text("two")),
]


def test_pick_turn_precedence() -> None:
    assert pick_turn(HISTORY, after_id=2) == 3  # first prompt after the checkpoint
    assert pick_turn(HISTORY, after_id=4) == 5
    assert pick_turn(HISTORY, after_id=6) is None  # nothing after the cursor
    assert pick_turn(HISTORY, after_id=None) == 5  # no cursor: the last prompt
    assert pick_turn(HISTORY, after_id=6, marker="[wf/1]") == 3  # marker beats the cursor
    assert pick_turn([*HISTORY, user(7, "again [wf/1]")], after_id=None, marker="[wf/1]") == 7
    assert pick_turn(HISTORY, after_id=6, marker="[wf/9]") is None
    assert pick_turn(HISTORY, after_id=6, user_message_id=1) == 1  # explicit id beats all
    assert pick_turn(HISTORY, after_id=None, user_message_id=4) is None  # not a user message
    assert pick_turn([], after_id=None) is None


def test_history_covers_says_when_a_newest_first_read_can_stop() -> None:
    newest_two = HISTORY[-2:]  # ids 5, 6
    assert not history_covers(newest_two, after_id=2)
    assert history_covers(newest_two, after_id=5)
    assert history_covers(newest_two, after_id=None)
    assert not history_covers(newest_two, after_id=None, marker="[wf/1]")
    assert history_covers(newest_two, after_id=None, marker="[wf/2]")
    assert not history_covers(newest_two, after_id=None, user_message_id=3)
    assert history_covers(HISTORY, after_id=None, user_message_id=3)


def test_plan_splits_done_tool_rounds_from_the_live_step() -> None:
    msgs = [
        user(10),
        assistant(11, text("let me add"), call("c1", args={"a": 1, "b": 2})),
        result(12, "c1", 3),
        assistant(13, call("c2"), call("s1", name="web", provider_executed=True)),
        result(14, "c2", "bad", is_error=True),
        assistant(15, text("partial")),  # the live step (may still be generating)
    ]
    plan = plan_follow(msgs, user_message_id=10, client_tool_names=TOOLS)
    assert plan.user_message_id == 10
    assert [s.after_id for s in plan.done_steps] == [10, 12]
    assert [s.last_id for s in plan.done_steps] == [12, 14]
    first, second = plan.done_steps
    assert [m["id"] for m in first.messages] == [11, 12]
    assert first.calls == (
        {"tool_call_id": "c1", "tool_name": "add", "args": json.dumps({"a": 1, "b": 2})},
    )
    assert first.outputs == {"c1": (3, False)}
    assert second.calls[0]["args"] == "{}"  # absent args → {}
    assert second.outputs == {"c2": ("bad", True)}  # provider-executed s1 is not a client call
    assert plan.cursor == 14 and plan.answered_call_ids == {"c1", "c2"}


def test_plan_keeps_a_pending_round_live_and_stops_at_the_next_turn() -> None:
    msgs = [
        user(10),
        assistant(11, call("a1"), call("a2")),
        result(12, "a1", 1),  # a2 unanswered: the round is the live pause
        user(13),
        result(14, "a2", 2),  # after the next prompt: not this turn's
    ]
    plan = plan_follow(msgs, user_message_id=10, client_tool_names=TOOLS)
    assert plan.done_steps == () and plan.cursor == 10 and plan.answered_call_ids == frozenset()


def test_plan_ignores_unknown_tool_names_and_earlier_messages() -> None:
    msgs = [
        assistant(5, call("old")),
        result(6, "old", 0),
        user(10),
        assistant(11, call("x", name="not-mine")),
        result(12, "x", 0),
    ]
    plan = plan_follow(msgs, user_message_id=10, client_tool_names=TOOLS)
    assert plan.done_steps == () and plan.cursor == 10


def test_pick_queued_takes_the_newest_entry_carrying_the_marker() -> None:
    queue = [
        {"id": 3, "content": [text("other [wf/1]")]},
        {"id": 4, "content": [text("mine [wf/2]")]},
        {"id": 6, "content": [text("mine again [wf/2]")]},
    ]
    entry = pick_queued(queue, "[wf/2]")
    assert entry is not None and entry.queued_id == 6
    assert entry.content == [text("mine again [wf/2]")]
    assert pick_queued(queue, "[wf/9]") is None and pick_queued([], "[wf/2]") is None
