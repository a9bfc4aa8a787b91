"""QueuedPromptGate on its own: when a queued prompt becomes ours (agent-semantics §3.3).

Pure: synthetic events, no sockets.
"""

from __future__ import annotations

from typing import Any

from coder_chat.core.queued_gate import Anchored, Lost, QueuedGate, QueuedPromptGate

PROMPT = [{"type": "text", "text": "do it"}]


def user(mid: int, content: Any = PROMPT, stamp: int | None = None) -> dict[str, Any]:
    m: dict[str, Any] = {"id": mid, "role": "user", "content": content}
    if stamp is not None:
        m["queued_message_id"] = stamp
    return {"type": "message", "message": m}


def assistant(mid: int) -> dict[str, Any]:
    return {"type": "message", "message": {"id": mid, "role": "assistant", "content": []}}


def queue(*ids: int) -> dict[str, Any]:
    if not ids:
        return {"type": "queue_update"}  # an empty queue has no queued_messages key
    return {"type": "queue_update", "queued_messages": [{"id": i} for i in ids]}


def gate(queued_id: int | None = 7, cursor: int = 10) -> QueuedPromptGate:
    return QueuedPromptGate(QueuedGate(queued_id, PROMPT), cursor)


def test_stamp_match_anchors_at_once_and_other_stamps_never_do() -> None:
    g = gate()
    assert g.feed(user(11, stamp=6)) is None  # identical content, someone else's entry
    assert g.candidate is None
    assert g.feed(user(12, stamp=7)) == Anchored(12, [])


def test_messages_at_or_below_the_cursor_are_never_candidates() -> None:
    g = gate()
    assert g.feed(user(10)) is None and g.feed(user(3)) is None
    assert g.candidate is None
    assert isinstance(g.feed(queue()), Lost)


def test_heuristic_candidate_anchors_when_the_entry_leaves_and_replays_the_buffer() -> None:
    g = gate()
    assert g.feed(user(11)) is None and g.candidate == 11
    buffered = [assistant(12), {"type": "status", "status": {"status": "running"}}]
    for ev in buffered:
        assert g.feed(ev) is None
    step = g.feed(queue())
    assert step == Anchored(11, buffered)


def test_candidate_dropped_while_our_entry_is_still_listed() -> None:
    g = gate()
    g.feed(user(11))
    g.feed(assistant(12))
    assert g.feed(queue(7, 8)) is None and g.candidate is None
    # the real one comes later; the earlier buffer is gone
    g.feed(user(20))
    assert g.feed(queue(8)) == Anchored(20, [])


def test_content_mismatch_is_not_a_candidate_and_canonical_json_ignores_key_order() -> None:
    g = gate()
    assert g.feed(user(11, [{"type": "text", "text": "other"}])) is None
    assert g.candidate is None
    assert g.feed(user(12, [{"text": "do it", "type": "text"}])) is None
    assert g.candidate == 12


def test_no_entry_id_anchors_on_first_content_match_and_ignores_queue_updates() -> None:
    g = gate(queued_id=None)
    assert g.feed(queue()) is None
    assert g.feed(user(11, [{"type": "text", "text": "x"}])) is None
    assert g.feed(user(12)) == Anchored(12, [])


def test_dead_ends() -> None:
    g = gate()
    assert g.feed(queue()) == Lost(
        "queued message left the queue without materialising in the chat"
    )
    lost = gate().feed({"type": "error", "error": {"message": "boom"}})
    assert isinstance(lost, Lost) and lost.message.endswith("boom")


def test_second_content_match_is_buffered_behind_the_first_candidate() -> None:
    g = gate()
    g.feed(user(11))
    second = user(13)
    g.feed(second)
    assert g.candidate == 11
    assert g.feed(queue()) == Anchored(11, [second])
