"""The live view shows a turn's text when its stream was dialed after the server
committed the message (then the message arrives whole, not as deltas): a loaded
machine dialed that late and the live artifact showed "Streamed text (0 characters)".
Events are the wire's own frames, parsed by the client's parser."""

from __future__ import annotations

import json
from typing import Any

from coder_chat.events import WsEvent
from coder_chat.models import parse_frame
from prefect_coder.flows.observe.live_progress import LiveProgress

CHAT = "4d31ccf2-f137-4049-aa6e-fcc272fd8c4d"


def _events(*frames: dict[str, Any]) -> list[WsEvent]:
    return [
        WsEvent(chat_id=CHAT, reader=1, attempt=1, event=ev, forwarded=True)
        for frame in frames
        for ev in parse_frame(json.dumps(frame))
    ]


def _message(text: str, call: bool) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    if call:
        content.append(
            {"type": "tool-call", "tool_call_id": "c1", "tool_name": "gate", "args": "{}"}
        )
    return {
        "type": "message",
        "chat_id": CHAT,
        "message": {
            "id": 7,
            "chat_id": CHAT,
            "role": "assistant",
            "content": content,
            "created_at": "2026-12-01T00:00:00Z",
        },
    }


def _delta(text: str, seq: int) -> dict[str, Any]:
    return {
        "type": "message_part",
        "chat_id": CHAT,
        "message_part": {"role": "assistant", "part": {"type": "text", "text": text}},
        "seq": seq,
    }


def _progress() -> LiveProgress:
    return LiveProgress(workflow_id="w", step="s", interval_s=3600.0)


def _feed(progress: LiveProgress, events: list[WsEvent]) -> None:
    for ev in events:
        # Folding only: no running loop, so nothing is scheduled for publishing.
        progress._fold(ev.event)


def test_a_message_committed_before_the_dial_shows_its_text_and_tool_call() -> None:
    progress = _progress()
    _feed(progress, _events(_message("The first half.", call=True)))
    assert progress.text == "The first half." and progress.text_chars == 15
    assert [(t.name, t.state) for t in progress.tools.values()] == [("gate", "called")]
    assert "## Streamed text (15 characters)" in progress.render()


def test_a_streamed_message_is_not_counted_twice_and_a_cut_one_is_completed() -> None:
    progress = _progress()
    _feed(progress, _events(_delta("Hello, ", 1), _delta("wor", 2)))
    # Redialed after the commit: the deltas of "ld." never came; the message has them.
    _feed(progress, _events(_message("Hello, world.", call=False)))
    assert progress.text == "Hello, world." and progress.text_chars == 13
    # The next message streams on its own; its commit adds nothing.
    _feed(progress, _events(_delta(" Again.", 1), _message(" Again.", call=False)))
    assert progress.text == "Hello, world. Again." and progress.text_chars == 20
