"""Replay dedup by episode and seq; forward-progress rules (spec §4.3/§4.4)."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from coder_chat.core.dedup import ReplayFilter
from coder_chat.models import ChatStreamEvent


def delta(hv: int | None, ga: int | None, seq: int | None, text: str = "x") -> ChatStreamEvent:
    payload: dict[str, object] = {"role": "assistant", "part": {"type": "text", "text": text}}
    if hv is not None:
        payload |= {"history_version": hv, "generation_attempt": ga, "seq": seq}
    return ChatStreamEvent.model_validate({"type": "message_part", "message_part": payload})


def message(mid: int, text: str) -> ChatStreamEvent:
    return ChatStreamEvent.model_validate(
        {
            "type": "message",
            "message": {
                "id": mid,
                "role": "assistant",
                "content": [{"type": "text", "text": text}],
            },
        }
    )


def test_replayed_deltas_are_suppressed_and_not_progress() -> None:
    f = ReplayFilter()
    assert f.observe(delta(3, 1, 1)).progress
    assert f.observe(delta(3, 1, 2)).forward
    replay = f.observe(delta(3, 1, 1))
    assert not replay.forward and not replay.progress
    assert not f.observe(delta(3, 1, 2)).forward
    assert f.observe(delta(3, 1, 3)).progress
    # a new attempt restarts seq at 1 and is new content
    assert f.observe(delta(3, 2, 1)).progress
    assert f.position == (3, 2, 1)


def test_snapshots_always_forwarded_progress_only_when_changed() -> None:
    f = ReplayFilter(after_id=10)
    first = f.observe(message(11, "a"))
    assert first.forward and first.progress
    same = f.observe(message(11, "a"))
    assert same.forward and not same.progress
    revised = f.observe(message(11, "ab"))
    assert revised.forward and revised.progress
    status = f.observe(
        ChatStreamEvent.model_validate({"type": "status", "status": {"status": "running"}})
    )
    assert status.forward and not status.progress
    assert not f.observe(ChatStreamEvent.model_validate({"type": "queue_update"})).progress


def test_revision_cursor_is_the_highest_status_history_version() -> None:
    f = ReplayFilter()
    assert f.history_version is None

    def status(body: dict[str, Any]) -> ChatStreamEvent:
        return ChatStreamEvent.model_validate({"type": "status", "status": body})

    f.observe(status({"status": "running"}))  # B1: no history_version on status
    assert f.history_version is None
    f.observe(status({"status": "running", "history_version": 7}))
    f.observe(status({"status": "waiting", "history_version": 5}))  # never moves back
    assert f.history_version == 7
    f.observe(status({"status": "running", "history_version": 9}))
    assert f.history_version == 9


def test_coordinate_less_delta_flags_until_new_commit() -> None:
    f = ReplayFilter(after_id=5)
    obs = f.observe(delta(None, None, None))
    assert obs.forward and not obs.progress and f.untrackable_outstanding
    f.observe(message(4, "old"))  # not above the max seen
    assert f.untrackable_outstanding
    f.observe(message(6, "new commit"))
    assert not f.untrackable_outstanding


@settings(max_examples=200, deadline=None)  # pure logic; a loaded machine stalls examples
@given(
    episodes=st.lists(st.integers(min_value=1, max_value=12), min_size=1, max_size=4),
    drops=st.lists(st.integers(min_value=0, max_value=40), max_size=6),
)
def test_redial_replays_deliver_each_delta_exactly_once(
    episodes: list[int], drops: list[int]
) -> None:
    """Model chatd: after a drop at global position p, the in-progress episode is
    replayed from seq 1 up to what was sent, then continues. The consumer must
    see every delta exactly once, in order."""
    original = [
        (1, attempt, seq) for attempt, n in enumerate(episodes, 1) for seq in range(1, n + 1)
    ]
    f = ReplayFilter()
    forwarded: list[tuple[int, int, int]] = []
    drop_points = set(drops)
    sent = 0
    while sent < len(original):
        hv, ga, seq = original[sent]
        if f.observe(delta(hv, ga, seq)).forward:
            forwarded.append((hv, ga, seq))
        sent += 1
        if sent in drop_points:
            drop_points.discard(sent)
            # reconnect: replay the current episode of the last sent delta from seq 1
            hv, ga, last = original[sent - 1]
            for s in range(1, last + 1):
                obs = f.observe(delta(hv, ga, s))
                assert not obs.forward and not obs.progress
    assert forwarded == original
