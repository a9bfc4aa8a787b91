"""TextLedger on its own: deltas vs snapshots (agent-semantics §3.6). Pure, no sockets."""

from __future__ import annotations

from typing import Any

from coder_chat.core.parts import ReasoningDelta, TextDelta
from coder_chat.core.text_ledger import Episode, TextLedger

E1: Episode = (1, 1)


def content(text: str = "", reasoning: str = "") -> list[dict[str, Any]]:
    out = []
    if reasoning:
        out.append({"type": "reasoning", "text": reasoning})
    if text:
        out.append({"type": "text", "text": text})
    return out


def test_snapshot_claims_pending_deltas_and_emits_only_the_tail() -> None:
    led = TextLedger()
    assert led.delta("text", "Hel", E1) == [TextDelta("Hel")]
    assert led.delta("text", "lo", E1) == [TextDelta("lo")]
    assert led.commit(5, content("Hello world")) == [TextDelta(" world", 5)]
    assert led.text == "Hello world"
    assert led.commit(5, content("Hello world")) == []  # identical replay


def test_snapshot_only_message_emits_everything_and_empty_deltas_nothing() -> None:
    led = TextLedger()
    assert led.delta("text", "", E1) == []
    assert led.commit(5, content("all", "why")) == [ReasoningDelta("why", 5), TextDelta("all", 5)]
    assert (led.text, led.reasoning) == ("all", "why")


def test_revision_extends_rewrite_does_not() -> None:
    led = TextLedger()
    led.commit(5, content("abc"))
    assert led.commit(5, content("abcdef")) == [TextDelta("def", 5)]
    assert led.commit(5, content("xyz")) == []
    assert led.text == "abcdef"


def test_revision_racing_next_steps_deltas_is_deferred_until_flush() -> None:
    led = TextLedger()
    led.commit(5, content("one"))
    led.delta("text", "two", (1, 2))
    assert led.commit(5, content("one+")) == []  # next step's deltas are open
    assert led.flush() == [TextDelta("+", 5)]
    assert led.text == "one+two"  # committed tail placed before the pending deltas


def test_retry_and_new_generation_attempt_void_the_pending_preview() -> None:
    led = TextLedger()
    led.delta("text", "bad", (1, 1))
    led.drop_pending()
    assert led.text == ""
    led.delta("text", "also bad", (2, 1))
    led.delta("text", "good", (2, 2))  # same history, new attempt
    assert led.text == "good"


def test_closed_episode_replay_is_ignored_across_ledgers_sharing_the_set() -> None:
    closed: set[Episode] = set()
    first = TextLedger(closed)
    first.delta("text", "step one", E1)
    first.commit(5, content("step one"))
    assert E1 in closed
    second = TextLedger(closed)  # the resume segment of the same turn
    assert second.delta("text", "step one", E1) == []
    assert second.text == ""


def test_deltas_ahead_of_the_snapshot_stay_pending_for_the_next_message() -> None:
    led = TextLedger()
    led.delta("text", "first", E1)
    led.delta("text", "second", E1)
    assert led.commit(5, content("first")) == []
    assert led.commit(6, content("second")) == []
    assert led.text == "firstsecond"


def test_old_server_deltas_without_episode_still_reconcile() -> None:
    led = TextLedger()
    led.delta("text", "ab", (None, None))
    assert led.commit(3, content("abc")) == [TextDelta("c", 3)]
