"""Wire models parse raw JSON samples shaped as chatd-wire §3/§4 states (tolerantly)."""

from __future__ import annotations

import json

import pytest

from coder_chat.models import (
    Chat,
    ChatInputPart,
    ChatMessagesResponse,
    CreateChatMessageResponse,
    CreateChatRequest,
    DynamicToolDefinition,
    ToolResult,
    UpdateChatRequest,
    parse_frame,
)

FRAME = json.dumps(
    [
        {
            "type": "message",
            "chat_id": "c1",
            "message": {
                "id": 41,
                "chat_id": "c1",
                "role": "assistant",
                "created_at": "2026-01-01T00:00:00Z",
                "content": [
                    {"type": "text", "text": "hi"},
                    {"type": "tool-call", "tool_call_id": "t1", "tool_name": "ls", "args": None},
                    {"type": "skill", "skill_name": "x"},
                ],
                "usage": {"input_tokens": 3, "output_tokens": 2, "brand_new_counter": 9},
                "queued_message_id": 7,
            },
        },
        {
            "type": "message_part",
            "chat_id": "c1",
            "message_part": {
                "role": "assistant",
                "part": {"type": "text", "text": "he"},
                "history_version": 4,
                "generation_attempt": 1,
                "seq": 3,
            },
        },
        {
            "type": "message_part",
            "chat_id": "c1",
            "message_part": {"part": {"type": "text", "text": "x"}},
        },
        {"type": "queue_update", "chat_id": "c1"},
        {"type": "status", "chat_id": "c1", "status": {"status": "pending"}},
        {
            "type": "error",
            "chat_id": "c1",
            "error": {"message": "boom", "retryable": True, "kind": "overloaded"},
        },
        {
            "type": "action_required",
            "chat_id": "c1",
            "action_required": {
                "tool_calls": [{"tool_call_id": "t1", "tool_name": "ls", "args": '{"p":1}'}]
            },
        },
        {
            "type": "retry",
            "chat_id": "c1",
            "retry": {"attempt": 1, "delay_ms": 500, "error": "e", "retrying_at": "t"},
        },
        {"type": "preview_reset", "chat_id": "c1"},
        {"type": "history_reset", "chat_id": "c1", "from_message_id": 3},
        {"type": "some_future_event", "chat_id": "c1", "payload": {"a": 1}},
    ]
)


def test_parse_full_frame() -> None:
    events = parse_frame(FRAME)
    assert [e.type for e in events][:4] == [
        "message",
        "message_part",
        "message_part",
        "queue_update",
    ]
    msg = events[0].message
    assert msg is not None and msg.id == 41 and msg.queued_message_id == 7
    call = msg.content[1]
    assert (
        "args" in call.model_fields_set and call.args is None
    )  # JSON null kept distinct from absent
    assert "args" not in msg.content[0].model_fields_set
    assert msg.content[2].type == "skill" and msg.content[2].model_dump()["skill_name"] == "x"
    assert msg.usage is not None and msg.usage.model_dump()["brand_new_counter"] == 9
    mp = events[1].message_part
    assert (
        mp is not None
        and mp.has_coordinates
        and (mp.history_version, mp.generation_attempt, mp.seq) == (4, 1, 3)
    )
    assert events[2].message_part is not None and not events[2].message_part.has_coordinates
    assert events[3].queued_messages == []  # absent key = empty queue
    assert events[4].status is not None and events[4].status.status == "pending"
    assert events[5].error is not None and events[5].error.retryable is True
    ar = events[6].action_required
    assert ar is not None and ar.tool_calls[0].args == '{"p":1}'
    assert events[7].retry is not None and events[7].retry.delay_ms == 500
    assert events[9].model_dump()["from_message_id"] == 3
    assert events[10].type == "some_future_event" and events[10].model_dump()["payload"] == {"a": 1}
    # non-queue events keep queued_messages unset
    assert events[0].queued_messages is None


def test_single_object_frame_tolerated() -> None:
    events = parse_frame('{"type":"status","chat_id":"c","status":{"status":"waiting"}}\n')
    assert (
        len(events) == 1 and events[0].status is not None and events[0].status.status == "waiting"
    )


@pytest.mark.parametrize(
    "raw",
    ["not json", "[1, 2]", '[{"chat_id": "no type"}]', '[{"type":"message","message":{"id":"x"}}]'],
)
def test_malformed_frames_raise_value_error(raw: str) -> None:
    with pytest.raises(ValueError):
        parse_frame(raw)


def test_action_required_object_args_tolerated() -> None:
    (ev,) = parse_frame(
        '[{"type":"action_required","action_required":{"tool_calls":[{"tool_call_id":"a","tool_name":"b","args":{"k":[1]}}]}}]'
    )
    assert ev.action_required is not None and json.loads(ev.action_required.tool_calls[0].args) == {
        "k": [1]
    }


def test_chat_and_history_shapes() -> None:
    chat = Chat.model_validate(
        {
            "id": "c",
            "status": "completed",
            "labels": None,
            "mcp_server_ids": None,
            "children": [{"id": "k", "status": "waiting", "children": []}],
            "title_source": "auto",
            "last_error": {"message": "m", "retryable": False},
        }
    )
    assert chat.labels == {} and chat.mcp_server_ids == [] and chat.children[0].id == "k"
    assert chat.model_dump()["title_source"] == "auto"
    page = ChatMessagesResponse.model_validate(
        {
            "messages": [{"id": 1, "role": "user", "content": None}],
            "has_more": True,
            "history_version": 5,
        }
    )
    assert page.messages[0].content == [] and page.queued_messages == [] and page.has_more
    resp = CreateChatMessageResponse.model_validate(
        {
            "queued": True,
            "queued_message": {
                "id": 3,
                "content": [{"type": "text", "text": "q"}],
                "created_at": "t",
            },
        }
    )
    assert (
        resp.queued
        and resp.message is None
        and resp.queued_message is not None
        and resp.queued_message.id == 3
    )


def test_request_bodies() -> None:
    body = CreateChatRequest(
        organization_id="o",
        content=[ChatInputPart.text_part("hello")],
        unsafe_dynamic_tools=[
            DynamicToolDefinition(name="t", description="d", input_schema={"type": "object"})
        ],
    ).wire()
    assert body == {
        "organization_id": "o",
        "content": [{"type": "text", "text": "hello"}],
        "client_type": "api",
        "unsafe_dynamic_tools": [
            {"name": "t", "description": "d", "input_schema": {"type": "object"}}
        ],
    }
    assert UpdateChatRequest(archived=True).wire() == {"archived": True}
    assert ToolResult(tool_call_id="t", output=None).wire() == {
        "tool_call_id": "t",
        "output": None,
        "is_error": False,
    }
