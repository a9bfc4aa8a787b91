"""Every REST route of ChatClient against the chatd emulator over real sockets."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest

from coder_chat.emulator.script import Script
from coder_chat.errors import CoderApiError
from coder_chat.models import (
    ChatInputPart,
    CreateChatMessageRequest,
    CreateChatRequest,
    DynamicToolDefinition,
    ToolResult,
    UpdateChatRequest,
)
from coder_chat.rest import ChatClient


def client_for(emu: Any, **kw: Any) -> ChatClient:
    return ChatClient(emu.base_url, emu.token, organization_id=emu.organization_id, **kw)


def create_req(emu: Any, text: str, **kw: Any) -> CreateChatRequest:
    return CreateChatRequest(
        organization_id=emu.organization_id, content=[ChatInputPart.text_part(text)], **kw
    )


def msg_req(text: str, **kw: Any) -> CreateChatMessageRequest:
    return CreateChatMessageRequest(content=[ChatInputPart.text_part(text)], **kw)


async def test_chat_lifecycle_routes(chatd_era: str, chatd_emulator: Any, events: Any) -> None:
    emu = chatd_emulator
    async with client_for(emu, on_transport_event=events) as client:
        chat = await client.create_chat(
            create_req(
                emu,
                "hello",
                labels={"suite": "rest"},
                system_prompt="be terse",
                unsafe_dynamic_tools=[
                    DynamicToolDefinition(
                        name="lookup",
                        description="look a thing up",
                        input_schema={"type": "object", "properties": {"q": {"type": "string"}}},
                    )
                ],
            )
        )
        assert chat.status == "running" and chat.labels == {"suite": "rest"}
        assert client.prefix_locked and client.prefix == "/api/v2/chats"
        await emu.await_status(chat.id, "waiting")

        got = await client.get_chat(chat.id)
        assert got.id == chat.id and got.status == "waiting"

        page = await client.get_messages(chat.id)
        assert [m.role for m in page.messages] == ["assistant", "user"]  # newest first
        user_id = page.messages[1].id
        if chatd_era == "b3":  # B3 adds the turn's start and the stream cursor
            assert page.turn_start_id == user_id and page.history_version is not None
        else:
            assert page.turn_start_id is None and page.history_version is None
        asc = await client.get_messages(chat.id, after_id=user_id)
        assert [m.id for m in asc.messages] == [page.messages[0].id]
        one = await client.get_messages(chat.id, limit=1)
        assert len(one.messages) == 1 and one.has_more

        # immediate send on an idle chat → committed message; its turn runs until it is
        # interrupted, so the next sends meet a running chat however slow this machine is
        emu.script_next_turn(chat.id, Script.long_running(30.0))
        sent = await client.create_message(chat.id, msg_req("second"))
        assert not sent.queued and sent.message is not None and sent.message.role == "user"
        await emu.await_status(chat.id, "running")
        # a send while running → queued; then withdraw it
        queued = await client.create_message(chat.id, msg_req("third"))
        assert queued.queued and queued.queued_message is not None
        await client.delete_queued_message(chat.id, queued.queued_message.id)
        # queue + promote (from running: promoted after an interrupt)
        queued2 = await client.create_message(chat.id, msg_req("fourth"))
        assert queued2.queued_message is not None
        await client.promote_queued_message(chat.id, queued2.queued_message.id)
        await emu.await_status(chat.id, "waiting")
        # interrupt of an idle chat → 409
        with pytest.raises(CoderApiError) as idle:
            await client.interrupt_chat(chat.id)
        assert idle.value.status == 409
        assert idle.value.message == "Chat is not in an interruptible state."

        await client.update_chat(chat.id, UpdateChatRequest(title="renamed"))
        assert (await client.get_chat(chat.id)).title == "renamed"
        await client.archive_chat(chat.id)
        assert (await client.get_chat(chat.id)).archived
        with pytest.raises(CoderApiError) as archived:
            await client.create_message(chat.id, msg_req("too late"))
        err = archived.value
        assert (err.status, err.method) == (400, "POST")
        assert err.message == "Cannot send messages to an archived chat."
        assert err.path == f"/api/v2/chats/{chat.id}/messages"
    ops = [e.op for e in events.of("http:request")]
    assert ops[:3] == ["createChat", "getChat", "getMessages"]
    assert {
        "createChatMessage",
        "deleteQueuedMessage",
        "interruptChat",
        "updateChat",
        "archiveChat",
    } <= set(ops)


async def test_interrupt_running_chat(chatd_emulator: Any) -> None:
    emu = chatd_emulator
    async with client_for(emu) as client:
        chat = await client.create_chat(create_req(emu, "slow"))
        emu.script_next_turn(chat.id, Script.long_running(5.0))
        await emu.await_status(chat.id, "waiting")
        await client.create_message(chat.id, msg_req("go slow"))
        interrupted = await client.interrupt_chat(chat.id)
        assert interrupted.id == chat.id and interrupted.status in ("interrupting", "waiting")
        await emu.await_status(chat.id, "waiting")


async def test_tool_results_route(chatd_emulator: Any) -> None:
    emu = chatd_emulator
    async with client_for(emu) as client:
        chat = await client.create_chat(
            create_req(
                emu,
                "use the tool",
                unsafe_dynamic_tools=[
                    DynamicToolDefinition(name="lookup", input_schema={"type": "object"})
                ],
            )
        )
        emu.script_next_turn(chat.id, Script.client_tool("lookup", {"q": "x"}))
        # the first turn was already started by create; script the next one and send
        await emu.await_status(chat.id, "waiting")
        await client.create_message(chat.id, msg_req("now call it"))
        await emu.await_status(chat.id, "requires_action")
        page = await client.get_messages(chat.id, limit=1)
        (call,) = [p for p in page.messages[0].content if p.type == "tool-call"]
        assert call.tool_name == "lookup" and call.args == {"q": "x"}
        assert call.tool_call_id is not None
        with pytest.raises(CoderApiError) as bad:
            await client.submit_tool_results(chat.id, [ToolResult(tool_call_id="nope", output=1)])
        assert bad.value.status == 400
        await client.submit_tool_results(
            chat.id, [ToolResult(tool_call_id=call.tool_call_id, output={"answer": 42})]
        )
        await emu.await_status(chat.id, "waiting")
        with pytest.raises(CoderApiError) as again:
            await client.submit_tool_results(
                chat.id, [ToolResult(tool_call_id=call.tool_call_id, output=None)]
            )
        assert again.value.status == 409


async def test_listing_by_label_archived_or_not(chatd_emulator: Any) -> None:
    emu = chatd_emulator
    async with client_for(emu) as client:
        ids = []
        for i in range(5):
            c = await client.create_chat(create_req(emu, f"chat {i}", labels={"sweep": "me"}))
            ids.append(c.id)
        await client.create_chat(create_req(emu, "other", labels={"sweep": "not-me"}))
        for cid in ids:
            await emu.await_status(cid, "waiting")
        await client.archive_chat(ids[0])
        await client.archive_chat(ids[1])
        live = [c.id async for c in client.iter_chats(labels={"sweep": "me"}, page_size=2)]
        archived = [
            c.id
            async for c in client.iter_chats(labels={"sweep": "me"}, archived=True, page_size=2)
        ]
        both = [
            c.id
            async for c in client.iter_chats(labels={"sweep": "me"}, archived=None, page_size=2)
        ]
        assert sorted(live) == sorted(ids[2:]) and len(live) == 3
        assert sorted(archived) == sorted(ids[:2])
        assert sorted(both) == sorted(ids)
        first_page = await client.list_chats(labels={"sweep": "me"}, limit=2)
        assert len(first_page) == 2
        with pytest.raises(CoderApiError) as bad_q:
            await client.list_chats(q="bare words")
        assert bad_q.value.status == 400


async def test_files_and_models(chatd_emulator: Any) -> None:
    emu = chatd_emulator
    async with client_for(emu) as client:
        data = json.dumps({"k": [1, 2]}).encode()
        file_id = await client.upload_file(data, "application/json", "data.json")
        body, media_type = await client.get_file(file_id)
        assert body == data and media_type == "application/json"
        with pytest.raises(CoderApiError) as bad:
            await client.upload_file(b"\x00\x01binary", "image/png", "x.png")
        assert bad.value.status == 400
        models = await client.list_models()
        assert isinstance(models.get("models"), list) and models["models"]


async def test_error_mapping_unknown_chat_and_bad_token(
    chatd_emulator: Any, caplog: pytest.LogCaptureFixture, events: Any
) -> None:
    caplog.set_level(logging.DEBUG)
    emu = chatd_emulator
    async with client_for(emu, on_transport_event=events) as client:
        with pytest.raises(CoderApiError) as unknown:
            await client.get_chat("00000000-0000-4000-8000-000000000001")
        assert unknown.value.status == 404
        assert (
            unknown.value.message == "Resource not found or you do not have access to this resource"
        )
        # both prefixes answered 404: v2's error is kept and nothing is locked
        assert unknown.value.path.startswith("/api/v2/chats/") and not client.prefix_locked
    bad_token = "definitely-not-valid-" + emu.token[-6:]
    async with ChatClient(emu.base_url, bad_token, on_transport_event=events) as bad:
        with pytest.raises(CoderApiError) as denied:
            await bad.list_chats()
        assert denied.value.status == 401 and bad.prefix_locked
        scan = [repr(bad), str(denied.value), repr(denied.value)]
    scan += [repr(e) for e in events.events]
    # Server-side records (the emulator and its websockets ServerProtocol, which logs
    # received headers at DEBUG) are not the client's; every other record is scanned.
    client_logs = [
        r
        for r in caplog.records
        if not r.name.startswith(("coder_chat.emulator", "websockets.server"))
    ]
    scan += [r.getMessage() for r in client_logs] + [str(r.args) for r in client_logs]
    for text in scan:
        assert emu.token not in text and bad_token not in text


@pytest.mark.chatd_emulator(era="b2")  # a build that serves both prefixes
async def test_fault_injected_v2_404_falls_back_to_experimental(chatd_emulator: Any) -> None:
    emu = chatd_emulator
    emu.faults.fail_rest(1, status=404, path="/api/v2/chats", message="Route not found.")
    async with client_for(emu) as client:
        chats = await client.list_chats()
        assert chats == [] and client.prefix == "/api/experimental/chats"
        chat = await client.create_chat(create_req(emu, "on the old prefix"))
        assert client.stream_url(chat.id).endswith(f"/api/experimental/chats/{chat.id}/stream")


@pytest.mark.chatd_emulator(era="b3")
async def test_v2_only_build_never_locks_the_experimental_prefix(chatd_emulator: Any) -> None:
    """B3 serves the chat routes on /api/v2 only. A 404 there (here: injected) tries
    the experimental prefix once, which is a 404 on B3 too, so the client keeps the v2
    error and stays unlocked; the next answer from v2 locks v2."""
    emu = chatd_emulator
    emu.faults.fail_rest(1, status=404, path="/api/v2/chats", message="Route not found.")
    async with client_for(emu) as client:
        with pytest.raises(CoderApiError) as missing:
            await client.list_chats()
        assert (missing.value.status, missing.value.path) == (404, "/api/v2/chats")
        assert not client.prefix_locked
        assert await client.list_chats() == []
        assert client.prefix_locked and client.prefix == "/api/v2/chats"
        chat = await client.create_chat(create_req(emu, "on v2"))
        assert client.stream_url(chat.id).endswith(f"/api/v2/chats/{chat.id}/stream")
        # an unknown chat is a plain 404 from v2 and never moves the lock
        with pytest.raises(CoderApiError) as unknown:
            await client.get_chat("00000000-0000-4000-8000-000000000009")
        assert unknown.value.status == 404 and client.prefix == "/api/v2/chats"


async def test_status_search_per_build(chatd_era: str, chatd_emulator: Any) -> None:
    """iter_chats filters by archived state only, which every build accepts; a
    ``status:`` query is B2/B3 only (B1 answers 400), so callers that need statuses
    list and filter client-side."""
    emu = chatd_emulator
    async with client_for(emu) as client:
        chat = await client.create_chat(create_req(emu, "listed", labels={"era": "x"}))
        await emu.await_status(chat.id, "waiting")
        found = [c async for c in client.iter_chats(labels={"era": "x"}, archived=None)]
        assert [c.id for c in found] == [chat.id] and found[0].status == "waiting"
        if chatd_era == "b1":
            with pytest.raises(CoderApiError) as refused:
                await client.list_chats(q="status:waiting")
            assert refused.value.status == 400
        else:
            waiting = await client.list_chats(q="status:waiting", labels={"era": "x"})
            assert [c.id for c in waiting] == [chat.id]


@pytest.mark.chatd_emulator(max_concurrent_root_chats=1)
async def test_interrupting_send_to_a_chat_no_worker_holds(
    chatd_era: str, chatd_emulator: Any
) -> None:
    """A chat waiting for a capacity slot has no worker. B3 finishes an interrupting
    send at once (``queued: false`` with ``message``); B1/B2 queue it. The client's
    response model carries both shapes."""
    emu = chatd_emulator
    async with client_for(emu) as client:
        busy = await client.create_chat(create_req(emu, "busy"))
        emu.script_next_turn(busy.id, Script.long_running(30.0))
        await emu.await_status(busy.id, "waiting")
        await client.create_message(busy.id, msg_req("hold the slot"))
        waiting = await client.create_chat(create_req(emu, "second"))
        assert (await client.get_chat(waiting.id)).queued_for_capacity is True
        sent = await client.create_message(waiting.id, msg_req("now", busy_behavior="interrupt"))
        if chatd_era == "b3":
            assert not sent.queued and sent.message is not None and sent.message.role == "user"
        else:
            assert sent.queued and sent.queued_message is not None and sent.message is None


async def test_per_call_deadline_against_a_delayed_commit(chatd_emulator: Any) -> None:
    emu = chatd_emulator
    async with client_for(emu) as client:
        chat = await client.create_chat(create_req(emu, "x"))
        await emu.await_status(chat.id, "waiting")
        emu.faults.delay_commit(1.0, path="/messages")
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(TimeoutError):
            await client.create_message(chat.id, msg_req("slow"), timeout=0.1)
        assert loop.time() - start < 0.8
