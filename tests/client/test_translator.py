"""TurnTranslator: attribution window, queued gate, promotion settle, ledger, finish.

Pure state machine, fed synthetic event sequences shaped like chatd's
(chatd-wire §3.4/§3.5).
"""

from __future__ import annotations

import json
from typing import Any

from coder_chat.core.translator import (
    QueuedGate,
    ReasoningDelta,
    ServerToolResult,
    Source,
    TextDelta,
    ToolCall,
    TurnTranslator,
    canonical_json,
    pending_client_calls,
)
from coder_chat.models import ChatStreamEvent


def msg(
    mid: int, role: str, *parts: dict[str, Any], usage: dict[str, Any] | None = None, **kw: Any
) -> dict[str, Any]:
    m: dict[str, Any] = {"id": mid, "role": role, "content": list(parts)}
    if usage is not None:
        m["usage"] = usage
    m.update(kw)
    return {"type": "message", "message": m}


def text(t: str) -> dict[str, Any]:
    return {"type": "text", "text": t}


def delta(
    t: str, seq: int = 1, hv: int = 1, attempt: int = 1, kind: str = "text"
) -> dict[str, Any]:
    return {
        "type": "message_part",
        "message_part": {
            "role": "assistant",
            "part": {"type": kind, "text": t},
            "history_version": hv,
            "generation_attempt": attempt,
            "seq": seq,
        },
    }


def status(s: str) -> dict[str, Any]:
    return {"type": "status", "status": {"status": s}}


def queue(*ids: int) -> dict[str, Any]:
    ev: dict[str, Any] = {"type": "queue_update"}
    if ids:
        ev["queued_messages"] = [{"id": i, "content": []} for i in ids]
    return ev


def action(*calls: tuple[str, str, str]) -> dict[str, Any]:
    return {
        "type": "action_required",
        "action_required": {
            "tool_calls": [{"tool_call_id": c, "tool_name": n, "args": a} for c, n, a in calls]
        },
    }


def texts(parts: list[Any]) -> str:
    return "".join(p.text for p in parts if isinstance(p, TextDelta))


# ----------------------------------------------------------------------- window


def test_immediate_submission_ignores_history_and_replays() -> None:
    tr = TurnTranslator(cursor=10)
    out = tr.feed_many(
        [
            msg(5, "assistant", text("old"), usage={"output_tokens": 100}),
            msg(10, "user", text("hi")),
            status("running"),
            delta("Hel", 1),
            delta("lo", 2),
            msg(11, "assistant", text("Hello"), usage={"input_tokens": 3, "output_tokens": 2}),
            status("waiting"),
        ]
    )
    assert texts(out) == "Hello"
    assert tr.text == "Hello"
    assert tr.usage.output_tokens == 2
    assert tr.usage.input_tokens == 3
    assert tr.settled and tr.finish_reason == "stop" and tr.raw_status == "waiting"
    assert tr.max_message_id == 11
    assert tr.message_ids == [11]


def test_fresh_chat_anchors_on_first_user_snapshot_not_a_boundary() -> None:
    tr = TurnTranslator(cursor=0)
    tr.feed_many([msg(7, "user", text("p")), status("running"), delta("x", 1)])
    assert not tr.promoted
    assert tr.effective_cursor == 7
    tr.feed(msg(8, "assistant", text("xy")))
    tr.feed(status("waiting"))
    assert tr.text == "xy"


def test_snapshot_only_message_and_tail_after_reconnect() -> None:
    tr = TurnTranslator(cursor=1)
    out = tr.feed_many([delta("ab", 1), delta("c", 2)])
    # a message committed during an outage arrives as exactly its missing tail
    out += tr.feed(msg(2, "assistant", text("abcdef")))
    out += tr.feed(msg(3, "assistant", text("snap only")))
    out += tr.feed(msg(2, "assistant", text("abcdef")))  # identical replay
    assert [p.text for p in out if isinstance(p, TextDelta)] == ["ab", "c", "def", "snap only"]
    assert tr.text == "abcdefsnap only"


def test_revision_extending_earlier_message_is_deferred_while_deltas_open() -> None:
    tr = TurnTranslator(cursor=1)
    tr.feed_many([delta("one", 1), msg(2, "assistant", text("one")), delta("tw", 1, hv=2)])
    assert tr.feed(msg(2, "assistant", text("one+"))) == []  # deferred
    out = tr.feed(msg(3, "assistant", text("two")))
    assert texts(out) == "+o"  # flushed revision then the tail of message 3
    assert tr.text.count("+") == 1
    # a rewrite emits nothing
    assert tr.feed(msg(3, "assistant", text("TWO"))) == []


def test_rewrite_of_pending_and_deltas_running_ahead() -> None:
    tr = TurnTranslator(cursor=1)
    tr.feed_many([delta("abc", 1), delta("XY", 1, hv=2)])
    out = tr.feed(msg(2, "assistant", text("abc")))
    assert out == []
    assert tr.text == "abcXY"
    tr.feed(msg(3, "assistant", text("XYZ")))
    assert tr.text == "abcXYZ"
    tr2 = TurnTranslator(cursor=1)
    tr2.feed_many([delta("wrong", 1), msg(2, "assistant", text("right"))])
    assert tr2.text == "right"


def test_retry_drops_failed_attempt_preview() -> None:
    tr = TurnTranslator(cursor=1)
    tr.feed_many([delta("garb", 1, attempt=1), {"type": "retry", "retry": {"attempt": 1}}])
    tr.feed_many([delta("good", 1, attempt=2), msg(2, "assistant", text("good"))])
    assert tr.text == "good"
    tr2 = TurnTranslator(cursor=1)
    tr2.feed_many([delta("garb", 1, attempt=1), delta("good", 1, attempt=2)])
    tr2.feed(msg(2, "assistant", text("good")))
    assert tr2.text == "good"


def test_reasoning_and_sources_and_server_tools() -> None:
    tr = TurnTranslator(cursor=1, client_tool_names={"mine"})
    out = tr.feed_many(
        [
            delta("think", 1, kind="reasoning"),
            {
                "type": "message_part",
                "message_part": {
                    "role": "assistant",
                    "part": {
                        "type": "tool-call",
                        "tool_call_id": "s1",
                        "tool_name": "execute",
                        "args_delta": "{",
                    },
                },
            },
            {
                "type": "message_part",
                "message_part": {
                    "role": "assistant",
                    "part": {
                        "type": "tool-call",
                        "tool_call_id": "s1",
                        "tool_name": "execute",
                        "args": {"cmd": "ls"},
                    },
                },
            },
            {
                "type": "message_part",
                "message_part": {
                    "role": "tool",
                    "part": {
                        "type": "tool-result",
                        "tool_call_id": "s1",
                        "tool_name": "execute",
                        "result": "ok",
                    },
                },
            },
            {
                "type": "message_part",
                "message_part": {
                    "role": "assistant",
                    "part": {"type": "source", "url": "https://x", "title": "X"},
                },
            },
            msg(
                2,
                "assistant",
                {"type": "reasoning", "text": "thinking"},
                {
                    "type": "tool-call",
                    "tool_call_id": "s1",
                    "tool_name": "execute",
                    "args": {"cmd": "ls"},
                },
                {"type": "tool-call", "tool_call_id": "c1", "tool_name": "mine", "args": {}},
                {"type": "source", "url": "https://x"},
            ),
            msg(
                3,
                "tool",
                {
                    "type": "tool-result",
                    "tool_call_id": "s1",
                    "tool_name": "execute",
                    "result": "ok",
                },
            ),
            msg(
                4,
                "tool",
                {
                    "type": "tool-result",
                    "tool_call_id": "zz",
                    "tool_name": "execute",
                    "result": "?",
                },
            ),
        ]
    )
    assert [p.text for p in out if isinstance(p, ReasoningDelta)] == ["think", "ing"]
    calls = [p for p in out if isinstance(p, ToolCall)]
    assert [(c.tool_call_id, c.provider_executed) for c in calls] == [("s1", True)]
    assert [p.tool_call_id for p in out if isinstance(p, ServerToolResult)] == ["s1"]
    assert len([p for p in out if isinstance(p, Source)]) == 1
    assert tr.reasoning == "thinking"
    assert tr.client_calls == []  # client parts in snapshots never become calls


def test_usage_keyed_by_message_id_revision_replaces_tool_ignored() -> None:
    tr = TurnTranslator(cursor=1)
    tr.feed_many(
        [
            msg(
                2,
                "assistant",
                text("a"),
                usage={
                    "input_tokens": 10,
                    "output_tokens": 5,
                    "cache_read_tokens": 2,
                    "context_limit": 100,
                },
            ),
            msg(
                2,
                "assistant",
                text("a"),
                usage={
                    "input_tokens": 10,
                    "output_tokens": 7,
                    "cache_read_tokens": 2,
                    "context_limit": 100,
                },
            ),
            msg(
                3,
                "tool",
                {"type": "tool-result", "tool_call_id": "x", "result": 1},
                usage={"output_tokens": 999},
            ),
            msg(
                4,
                "assistant",
                text("b"),
                usage={
                    "input_tokens": 1,
                    "output_tokens": 1,
                    "context_limit": 200,
                    "total_cost_micros": 5,
                },
            ),
        ]
    )
    u = tr.usage
    assert u.output_tokens == 8
    assert u.no_cache_input_tokens == 11
    assert u.input_tokens == 13
    assert u.context_limit == 200
    assert u.total_cost_micros == 5


# ----------------------------------------------------------------------- status / finish


def test_requires_action_then_client_call_settles_tool_calls() -> None:
    tr = TurnTranslator(cursor=1, client_tool_names={"add"})
    tr.feed_many(
        [
            msg(
                2,
                "assistant",
                {"type": "tool-call", "tool_call_id": "c1", "tool_name": "add", "args": {"a": 1}},
            ),
            status("requires_action"),
        ]
    )
    assert not tr.settled and tr.awaiting_action
    out = tr.feed(action(("c1", "add", '{"a":1}')))
    assert out == [ToolCall("c1", "add", '{"a":1}', False)]
    assert tr.settled and tr.finish_reason == "tool-calls" and tr.raw_status == "requires_action"
    # replays of the same pause are ignored
    assert tr.feed(action(("c1", "add", '{"a":1}'))) == []


def test_submitted_ids_ignored_and_stale_requires_action_cleared() -> None:
    submitted = {"c1"}
    tr = TurnTranslator(cursor=1, client_tool_names={"add"}, submitted_tool_call_ids=submitted)
    tr.feed_many([status("requires_action"), action(("c1", "add", "{}"))])
    assert tr.client_calls == [] and not tr.settled
    tr.feed(status("running"))
    assert tr.terminal_status is None and not tr.awaiting_action
    tr.feed(status("waiting"))
    assert tr.settled and tr.finish_reason == "stop"


def test_requires_action_safety_valve() -> None:
    tr = TurnTranslator(cursor=1, safety_valve=3)
    tr.feed(status("requires_action"))
    for i in range(3):
        tr.feed({"type": "preview_reset"})
        assert not tr.settled, i
    tr.feed({"type": "preview_reset"})
    assert tr.settled


def test_error_event_and_status_error() -> None:
    tr = TurnTranslator(cursor=1)
    out = tr.feed(
        {"type": "error", "error": {"message": "boom", "kind": "overloaded", "retryable": True}}
    )
    assert out[-1].type == "error" and tr.settled and tr.finish_reason == "error"
    tr2 = TurnTranslator(cursor=1)
    tr2.feed(status("error"))
    assert tr2.settled and tr2.finish_reason == "error" and tr2.error is None


def test_models_are_accepted_as_events() -> None:
    tr = TurnTranslator(cursor=1, client_tool_names={"add"})
    evs = [
        ChatStreamEvent.model_validate(delta("hi", 1)),
        ChatStreamEvent.model_validate(
            msg(2, "assistant", text("hi!"), usage={"output_tokens": 4})
        ),
        ChatStreamEvent.model_validate(status("requires_action")),
        ChatStreamEvent.model_validate(action(("c", "add", '{"a": 2}'))),
    ]
    tr.feed_many(evs)
    assert tr.text == "hi!" and tr.usage.output_tokens == 4
    assert tr.client_calls[0].input == '{"a": 2}'


# ----------------------------------------------------------------------- promotion


def test_promotion_boundary_settles_and_freezes() -> None:
    tr = TurnTranslator(cursor=10)
    tr.feed_many(
        [
            delta("mine", 1),
            msg(11, "assistant", text("mine"), usage={"output_tokens": 1}),
            status("requires_action"),
        ]
    )
    out = tr.feed(msg(12, "user", text("next prompt")))
    assert out == []
    assert tr.promoted and tr.settled
    assert tr.finish_reason == "stop" and tr.raw_status is None
    # nothing of the successor leaks in
    tr.feed_many(
        [
            delta("theirs", 1, hv=3),
            msg(13, "assistant", text("theirs"), usage={"output_tokens": 50}),
            status("waiting"),
        ]
    )
    assert tr.text == "mine" and tr.usage.output_tokens == 1
    assert tr.max_message_id == 12


# ----------------------------------------------------------------------- queued gate


QC = [{"type": "text", "text": "second job"}]


def predecessor(tr: TurnTranslator) -> None:
    assert (
        tr.feed_many(
            [
                msg(20, "user", text("first job")),
                status("running"),
                queue(5),
                delta("pred", 1),
                msg(21, "assistant", text("pred"), usage={"output_tokens": 9}),
                status("requires_action"),
                action(("p1", "add", "{}")),
                {"type": "error", "error": {"message": "x"}} if False else status("running"),
            ]
        )
        == []
    )


def test_exact_gate_anchors_on_stamp_and_ignores_same_content_other_stamp() -> None:
    tr = TurnTranslator(cursor=19, queued=QueuedGate(5, QC), client_tool_names={"add"})
    predecessor(tr)
    assert tr.gated and tr.queued_id == 5
    # someone else's identical prompt, stamped differently
    assert tr.feed(msg(22, "user", *QC, queued_message_id=4)) == []
    assert tr.gated
    assert tr.feed(msg(23, "user", *QC, queued_message_id=5)) == []
    assert not tr.gated and tr.effective_cursor == 23
    tr.feed_many(
        [
            queue(),
            delta("ours", 1, hv=9),
            msg(24, "assistant", text("ours"), usage={"output_tokens": 2}),
            status("waiting"),
        ]
    )
    assert tr.text == "ours" and tr.usage.output_tokens == 2 and tr.client_calls == []
    assert tr.max_message_id == 24


def test_heuristic_gate_candidate_confirmed_by_queue_update() -> None:
    tr = TurnTranslator(cursor=19, queued=QueuedGate(5, QC))
    predecessor(tr)
    tr.feed(msg(22, "user", *QC))  # candidate
    assert tr.gated
    tr.feed_many([delta("ou", 1, hv=9)])
    out = tr.feed(queue())  # our entry left the queue → anchor and replay buffer
    assert not tr.gated and tr.effective_cursor == 22
    assert texts(out) == "ou"
    tr.feed_many([msg(23, "assistant", text("ours")), status("waiting")])
    assert tr.text == "ours"


def test_heuristic_gate_candidate_dropped_when_entry_still_listed() -> None:
    tr = TurnTranslator(cursor=19, queued=QueuedGate(5, QC))
    predecessor(tr)
    tr.feed_many([msg(22, "user", *QC), delta("theirs", 1, hv=9), queue(5)])
    assert tr.gated and tr.text == ""
    tr.feed_many(
        [msg(23, "assistant", text("theirs")), status("running"), msg(24, "user", *QC), queue()]
    )
    assert not tr.gated and tr.effective_cursor == 24
    assert tr.text == ""


def test_heuristic_gate_without_entry_id_first_match_anchors() -> None:
    tr = TurnTranslator(cursor=19, queued=QueuedGate(None, QC))
    tr.feed_many([msg(20, "user", text("other")), queue(), msg(21, "user", *QC)])
    assert not tr.gated and tr.effective_cursor == 21


def test_gate_dead_ends() -> None:
    tr = TurnTranslator(cursor=19, queued=QueuedGate(5, QC))
    tr.feed_many([status("running"), queue()])
    assert tr.failure is not None and tr.failure.kind == "queued_submission_lost"
    assert tr.settled
    tr2 = TurnTranslator(cursor=19, queued=QueuedGate(5, QC))
    tr2.feed({"type": "error", "error": {"message": "provider down"}})
    assert tr2.failure is not None and "provider down" in tr2.failure.message
    assert tr2.error is None  # the predecessor's error is not ours


def test_canonical_json_ignores_key_order_and_nulls() -> None:
    assert canonical_json([{"b": 1, "a": {"y": None, "x": 2}}]) == canonical_json(
        [{"a": {"x": 2}, "b": 1}]
    )


# ----------------------------------------------------------------------- lost action recovery


def test_pending_client_calls_derivation() -> None:
    messages = [
        {
            "id": 30,
            "role": "assistant",
            "content": [
                {"type": "tool-call", "tool_call_id": "old", "tool_name": "add", "args": {}}
            ],
        },
        {
            "id": 31,
            "role": "tool",
            "content": [{"type": "tool-result", "tool_call_id": "old", "result": 1}],
        },
        {
            "id": 33,
            "role": "assistant",
            "content": [
                {"type": "tool-call", "tool_call_id": "a", "tool_name": "add", "args": {"a": 1}},
                {"type": "tool-call", "tool_call_id": "b", "tool_name": "add"},
                {"type": "tool-call", "tool_call_id": "n", "tool_name": "add", "args": None},
                {"type": "tool-call", "tool_call_id": "s", "tool_name": "execute", "args": {}},
                {
                    "type": "tool-call",
                    "tool_call_id": "p",
                    "tool_name": "add",
                    "args": {},
                    "provider_executed": True,
                },
                {"type": "tool-call", "tool_call_id": "done", "tool_name": "add", "args": {}},
                {"type": "tool-call", "tool_call_id": "sub", "tool_name": "add", "args": {}},
                {"type": "tool-call", "tool_name": "add", "args": {}},
            ],
        },
        {
            "id": 34,
            "role": "tool",
            "content": [{"type": "tool-result", "tool_call_id": "done", "result": 1}],
        },
    ]
    turn, calls = pending_client_calls(
        reversed(messages), after_id=30, client_tool_names={"add"}, submitted_tool_call_ids={"sub"}
    )
    assert [m["id"] for m in turn] == [31, 33, 34]
    assert calls == [
        {"tool_call_id": "a", "tool_name": "add", "args": '{"a": 1}'},
        {"tool_call_id": "b", "tool_name": "add", "args": "{}"},
        {"tool_call_id": "n", "tool_name": "add", "args": "null"},
    ]
    tr = TurnTranslator(cursor=30, client_tool_names={"add"})
    tr.feed(status("requires_action"))
    assert tr.awaiting_action
    tr.ingest_recovered(turn, calls)
    assert [c.tool_call_id for c in tr.client_calls] == ["a", "b", "n"]
    assert json.loads(tr.client_calls[0].input) == {"a": 1}
    assert tr.settled


def test_pending_client_calls_none_without_assistant() -> None:
    assert pending_client_calls(
        [{"id": 5, "role": "user", "content": []}], after_id=0, client_tool_names={"x"}
    ) == ([{"id": 5, "role": "user", "content": []}], [])


def test_late_replay_of_a_committed_episode_is_ignored() -> None:
    # seq 1-2 seen, drop; the reconnect shows the commit first and then (late) the
    # rest of the closed episode's preview: it must not become new pending text.
    tr = TurnTranslator(cursor=1)
    tr.feed_many([delta("ab", 1), delta("cd", 2), msg(2, "assistant", text("abcdef"))])
    assert tr.feed_many([delta("ef", 3), delta("more", 4)]) == []
    tr.feed_many([delta("next", 1, hv=2), msg(3, "assistant", text("next"))])
    assert tr.text == "abcdefnext"


def test_closed_episodes_are_shared_across_segments() -> None:
    closed: set[tuple[Any, Any]] = set()
    seg1 = TurnTranslator(cursor=1, closed_episodes=closed)
    seg1.feed_many([delta("ab", 1), msg(2, "assistant", text("abcd"))])
    seg2 = TurnTranslator(cursor=2, closed_episodes=closed)
    assert seg2.feed(delta("cd", 2)) == []  # a late tail of segment 1's step
    seg2.feed_many([delta("new", 1, hv=5), msg(3, "assistant", text("new"))])
    assert seg2.text == "new"
