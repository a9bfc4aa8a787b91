"""Stream reader against the chatd emulator: drops mid-text, mid tool-call args and
across a committed-message gap (exactly-once deltas), paused redial during tool
execution, upgrade refusals, budget exhaustion, and a token scan."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest

from coder_chat.emulator.script import Script
from coder_chat.errors import CoderAgentError, CoderApiError, CoderStreamError
from coder_chat.models import (
    ChatInputPart,
    ChatMessage,
    ChatStreamEvent,
    CreateChatMessageRequest,
    CreateChatRequest,
    DynamicToolDefinition,
    ToolResult,
)
from coder_chat.rest import ChatClient
from coder_chat.stream import ChatStreamReader, ChatWatcher, StreamOptions

FAST = StreamOptions(backoff_initial_ms=5, backoff_cap_ms=40, open_timeout=2.0, close_timeout=0.5)
LONG_TEXT = "The quick brown fox jumps over the lazy dog, again and again, until the end."


def client_for(emu: Any, events: Any = None, token: str | None = None) -> ChatClient:
    return ChatClient(
        emu.base_url,
        token or emu.token,
        organization_id=emu.organization_id,
        on_transport_event=events,
    )


async def idle_chat(client: ChatClient, emu: Any, tools: list[str] | None = None) -> str:
    """A chat whose first (echo) turn is done, so the next turn can be scripted."""
    chat = await client.create_chat(
        CreateChatRequest(
            organization_id=emu.organization_id,
            content=[ChatInputPart.text_part("setup")],
            unsafe_dynamic_tools=[DynamicToolDefinition(name=t) for t in tools or []] or None,
        )
    )
    await emu.await_status(chat.id, "waiting")
    return chat.id


async def send(client: ChatClient, chat_id: str, text: str) -> int:
    resp = await client.create_message(
        chat_id, CreateChatMessageRequest(content=[ChatInputPart.text_part(text)])
    )
    assert resp.message is not None
    return resp.message.id


async def read_until(
    reader: ChatStreamReader, stop: Any, out: list[ChatStreamEvent], limit: float = 30.0
) -> ChatStreamEvent:
    # ``limit`` bounds the wait for each next event, it is not a pause: at load 20 the
    # first event of a turn took more than 5 s (b1 pass, test_drop_mid_tool_call_args).
    while True:
        ev = await reader.next_event(timeout=limit)
        assert ev is not None
        out.append(ev)
        if stop(ev):
            return ev


def is_status(s: str) -> Any:
    return lambda ev: ev.type == "status" and ev.status is not None and ev.status.status == s


def deltas(evs: list[ChatStreamEvent]) -> list[ChatStreamEvent]:
    return [e for e in evs if e.type == "message_part"]


def coords(evs: list[ChatStreamEvent]) -> list[tuple[int, int, int]]:
    out = []
    for e in deltas(evs):
        mp = e.message_part
        assert mp is not None
        hv, ga, seq = mp.history_version, mp.generation_attempt, mp.seq
        assert hv is not None and ga is not None and seq is not None
        out.append((hv, ga, seq))
    return out


def assistant_messages(evs: list[ChatStreamEvent]) -> list[ChatMessage]:
    return [e.message for e in evs if e.message is not None and e.message.role == "assistant"]


def assert_each_delta_once(evs: list[ChatStreamEvent]) -> None:
    c = coords(evs)
    assert len(c) == len(set(c)), "a delta was delivered twice"
    assert c == sorted(c)


@pytest.mark.chatd_emulator(delta_delay=0.02)
async def test_drop_mid_text_delivers_every_delta_exactly_once(
    chatd_era: str, chatd_emulator: Any, events: Any
) -> None:
    emu = chatd_emulator
    async with client_for(emu, events) as client:
        chat_id = await idle_chat(client, emu)
        emu.script_next_turn(chat_id, Script.text(LONG_TEXT, deltas=15))
        after_id = await send(client, chat_id, "talk")
        reader = ChatStreamReader(client, chat_id, after_id=after_id, options=FAST)
        got: list[ChatStreamEvent] = []
        await read_until(reader, lambda e: len(deltas(got)) >= 4, got)
        assert emu.faults.drop_stream(chat_id) == 1  # TCP abort, no close frame
        await read_until(reader, is_status("waiting"), got)
        await reader.aclose()
    text = "".join(e.message_part.part.text or "" for e in deltas(got))  # type: ignore[union-attr]
    assert text == LONG_TEXT
    assert_each_delta_once(got)
    (final,) = assistant_messages(got)
    assert final.content[0].text == LONG_TEXT
    dials = events.of("ws:dial")
    assert len(dials) >= 2 and dials[0].url.endswith(f"?after_id={after_id}")
    # Every redial keeps the original after_id; B2/B3 report a revision cursor on their
    # status events and get it back under both build names, B1 reports none.
    (status,) = [e.event.status for e in events.of("ws:event") if e.event.type == "status"][:1]
    cursor = status.history_version
    assert (cursor is None) == (chatd_era == "b1")
    tail = f"&after_revision={cursor}&history_version={cursor}" if cursor else ""
    assert all(d.url.endswith(f"?after_id={after_id}{tail}") for d in dials[1:])
    assert [c.attempt for c in events.of("ws:close")] == [d.attempt for d in dials]
    assert events.of("ws:close")[0].code == 1006
    suppressed = [e for e in events.of("ws:event") if not e.forwarded]
    assert suppressed and all(e.event.type == "message_part" for e in suppressed)


@pytest.mark.chatd_emulator(delta_delay=0.03)
async def test_drop_mid_tool_call_args(chatd_emulator: Any, events: Any) -> None:
    emu = chatd_emulator
    args = {"query": "weather in Lisbon", "days": [1, 2, 3]}
    async with client_for(emu, events) as client:
        chat_id = await idle_chat(client, emu, tools=["lookup"])
        emu.script_next_turn(chat_id, Script.client_tool("lookup", args))
        after_id = await send(client, chat_id, "call it")
        reader = ChatStreamReader(client, chat_id, after_id=after_id, options=FAST)
        got: list[ChatStreamEvent] = []

        def first_args_delta(ev: ChatStreamEvent) -> bool:
            return ev.type == "message_part" and ev.message_part.part.args_delta is not None  # type: ignore[union-attr]

        await read_until(reader, first_args_delta, got)
        emu.faults.drop_stream(chat_id)
        await read_until(reader, lambda e: e.type == "action_required", got)
        await reader.aclose()
    assert_each_delta_once(got)
    parts = [e.message_part.part for e in deltas(got)]  # type: ignore[union-attr]
    streamed = "".join(p.args_delta for p in parts if p.args_delta is not None)
    # Each args delta once and in order. A loaded machine's redial can come after the
    # server committed the message: the episode is closed then, the deltas streamed
    # during the outage are not replayed, and the committed message (asserted below)
    # carries the whole call — the deltas are a prefix of the args (seen at load 15, B2).
    whole = json.dumps(args)
    assert whole.startswith(streamed) and streamed, streamed
    # The whole call: at most once as the preview's last part, and once in the committed
    # assistant message (the redial after the commit sends it instead of the preview's
    # last part).
    full = [p for p in parts if p.type == "tool-call" and "args" in p.model_fields_set]
    assert len(full) <= 1 and all(p.args == args for p in full)
    committed = [p for m in assistant_messages(got) for p in m.content if p.type == "tool-call"]
    assert len(committed) == 1 and committed[0].args == args
    (action,) = [e for e in got if e.type == "action_required"]
    assert action.action_required is not None
    assert json.loads(action.action_required.tool_calls[0].args) == args
    assert len(events.of("ws:dial")) >= 2


@pytest.mark.chatd_emulator(delta_delay=0.02)
async def test_message_committed_during_outage_arrives_after_redial(
    chatd_era: str, chatd_emulator: Any, events: Any
) -> None:
    emu = chatd_emulator
    async with client_for(emu, events) as client:
        chat_id = await idle_chat(client, emu)
        emu.script_next_turn(chat_id, Script.text(LONG_TEXT, deltas=10))
        after_id = await send(client, chat_id, "talk")
        reader = ChatStreamReader(
            client,
            chat_id,
            after_id=after_id,
            options=StreamOptions(backoff_initial_ms=60, backoff_cap_ms=200, close_timeout=0.5),
        )
        got: list[ChatStreamEvent] = []
        await read_until(reader, lambda e: len(deltas(got)) >= 3, got)
        # the outage: drop now and refuse the next two dials while the turn commits
        emu.faults.refuse_upgrades(503, count=2)
        emu.faults.drop_stream(chat_id)
        await emu.await_status(chat_id, "waiting")
        await read_until(reader, is_status("waiting"), got)
        await reader.aclose()
    assert_each_delta_once(got)
    streamed = "".join(e.message_part.part.text or "" for e in deltas(got))  # type: ignore[union-attr]
    assert (
        LONG_TEXT.startswith(streamed) and streamed != LONG_TEXT
    )  # the tail arrives only as a snapshot
    assistant = assistant_messages(got)
    assert len(assistant) == 1 and assistant[0].content[0].text == LONG_TEXT
    redials = events.of("ws:redial")
    assert [r.consecutive_failures for r in redials] == [1, 2, 3]  # the drop counts
    assert [r.backoff_ms for r in redials] == [60, 120, 200]
    assert len(events.of("ws:error")) >= 2


@pytest.mark.chatd_emulator(delta_delay=0.02)
async def test_paused_reader_redials_while_tools_run(
    chatd_era: str, chatd_emulator: Any, events: Any
) -> None:
    emu = chatd_emulator
    async with client_for(emu, events) as client:
        chat_id = await idle_chat(client, emu, tools=["lookup"])
        emu.script_next_turn(chat_id, Script.client_tool("lookup", {"q": 1}))
        after_id = await send(client, chat_id, "call it")
        reader = ChatStreamReader(client, chat_id, after_id=after_id, options=FAST)
        got: list[ChatStreamEvent] = []
        action = await read_until(reader, lambda e: e.type == "action_required", got)
        reader.pause()  # segment 1 ends healthy; the tool runs now
        emu.faults.drop_stream(chat_id)
        assert action.action_required is not None
        call = action.action_required.tool_calls[0]
        await client.submit_tool_results(
            chat_id, [ToolResult(tool_call_id=call.tool_call_id, output="ok")]
        )
        assert reader.reusable_for(chat_id)
        reader.resume()  # segment 2 attaches
        await read_until(reader, is_status("waiting"), got)
        await reader.aclose()
    assert_each_delta_once(got)
    roles = [e.message.role for e in got if e.type == "message"]  # type: ignore[union-attr]
    assert "tool" in roles and roles[-1] == "assistant"
    assert len(events.of("ws:dial")) == 2 and len({d.reader for d in events.of("ws:dial")}) == 1
    # The redial (B2/B3: from the requires_action status's revision cursor) re-sent
    # nothing already read: each committed message arrives once per revision.
    ids = [e.message.id for e in got if e.type == "message"]  # type: ignore[union-attr]
    if chatd_era != "b1":
        assert "after_revision=" in events.of("ws:dial")[1].url
        assert len(ids) == len(set(ids))


@pytest.mark.chatd_emulator(delta_delay=0)
async def test_redial_without_after_id_reads_history_once(
    chatd_era: str, chatd_emulator: Any, events: Any
) -> None:
    """A reader with no after_id (a resumed chat): every redial of B1 re-sends the whole
    history, which the client drops by message id (no progress, nothing new); B2/B3
    resume from the revision cursor their status event reported and re-send nothing."""
    emu = chatd_emulator
    async with client_for(emu, events) as client:
        chat_id = await idle_chat(client, emu)
        await send(client, chat_id, "two")
        await emu.await_status(chat_id, "waiting")
        async with ChatStreamReader(client, chat_id, options=FAST) as reader:
            first: list[ChatStreamEvent] = []
            await read_until(reader, is_status("waiting"), first)
            emu.faults.drop_stream(chat_id)
            again: list[ChatStreamEvent] = []
            await read_until(reader, is_status("waiting"), again)
    history = [e.message.id for e in first if e.message is not None]
    assert len(history) == 4 and history == sorted(history)
    resent = [e.message.id for e in again if e.message is not None]
    assert resent == (history if chatd_era == "b1" else [])
    redial_events = [e for e in events.of("ws:event") if e.attempt == 2]
    assert redial_events and all(e.event.type != "message_part" for e in redial_events)
    # Re-sent snapshots are forwarded: dropping them by id is the translator's job.
    assert all(e.forwarded for e in redial_events)
    assert len(events.of("ws:redial")) == 1


async def test_transient_upgrade_refusals_then_recovery(chatd_emulator: Any, events: Any) -> None:
    emu = chatd_emulator
    async with client_for(emu, events) as client:
        chat_id = await idle_chat(client, emu)
        emu.faults.refuse_upgrades(429, count=2)
        async with ChatClient(emu.base_url, emu.token, on_transport_event=events) as c2:
            async with ChatStreamReader(c2, chat_id, options=FAST) as reader:
                got: list[ChatStreamEvent] = []
                await read_until(reader, is_status("waiting"), got)
    assert [r.consecutive_failures for r in events.of("ws:redial")] == [1, 2]
    assert len(events.of("ws:dial")) == 3


async def test_budget_exhaustion_and_terminal_refusals(chatd_emulator: Any, events: Any) -> None:
    emu = chatd_emulator
    async with client_for(emu, events) as client:
        chat_id = await idle_chat(client, emu)
        emu.faults.refuse_upgrades(503)
        reader = ChatStreamReader(client, chat_id, after_id=1, options=FAST)
        with pytest.raises(CoderStreamError) as exhausted:
            await reader.next_event(timeout=5)
        await reader.aclose()
        emu.faults.clear()
        assert exhausted.value.chat_id == chat_id and exhausted.value.is_retryable is False
        assert (
            isinstance(exhausted.value.cause, CoderApiError) and exhausted.value.cause.status == 503
        )
        assert len(events.of("ws:dial")) == 5

        # unknown chat: terminal 404 with no redial
        unknown = ChatStreamReader(client, "00000000-0000-4000-8000-000000000009", options=FAST)
        with pytest.raises(CoderApiError) as missing:
            await unknown.next_event(timeout=5)
        await unknown.aclose()
        assert missing.value.status == 404 and missing.value.method == "GET"
        assert missing.value.path == "/api/v2/chats/00000000-0000-4000-8000-000000000009/stream"


async def test_bad_token_upgrade_is_terminal_and_token_never_leaks(
    chatd_emulator: Any, events: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    emu = chatd_emulator
    bad_token = "bad-token-" + "x" * 24
    async with client_for(emu, events) as client:
        chat_id = await idle_chat(client, emu)
        emu.script_next_turn(chat_id, Script.text("short answer"))
        after_id = await send(client, chat_id, "hi")
        async with ChatStreamReader(client, chat_id, after_id=after_id, options=FAST) as reader:
            got: list[ChatStreamEvent] = []
            await read_until(reader, lambda e: len(deltas(got)) >= 1, got)
            emu.faults.drop_stream(chat_id)
            await read_until(reader, is_status("waiting"), got)
            scan = [repr(reader), repr(client)]
    async with client_for(emu, events, token=bad_token) as bad:
        reader = ChatStreamReader(bad, chat_id, options=FAST)
        with pytest.raises(CoderApiError) as denied:
            await reader.next_event(timeout=5)
        await reader.aclose()
    err = denied.value
    assert isinstance(err, CoderAgentError) and err.status == 401 and err.method == "GET"
    scan += [str(err), repr(err)]
    scan += [repr(e) for e in events.events]
    # Server-side records (the emulator and its websockets ServerProtocol, which logs
    # received headers at DEBUG) are not the client's; every other record is scanned.
    client_logs = [
        r
        for r in caplog.records
        if not r.name.startswith(("coder_chat.emulator", "websockets.server"))
    ]
    assert any(r.name.startswith("httpcore") for r in client_logs)
    scan += [r.getMessage() for r in client_logs] + [str(r.args) for r in client_logs]
    for text in scan:
        assert emu.token not in text and bad_token not in text


async def _watch_connected(emu: Any, n: int) -> None:
    for _ in range(500):
        if len(emu.event_log(["watch_connect"])) >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("watcher never connected")


async def _next_status(watcher: Any, chat_id: str, status: str) -> Any:
    while True:
        ev = await watcher.next_event(timeout=5)
        assert ev is not None
        if ev.chat is not None and ev.chat.id == chat_id and ev.chat.status == status:
            return ev


def _pending_queue_reads() -> int:
    """Tasks of the running (emulator's) loop still waiting in ``Queue.get``."""
    return sum(1 for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "Queue.get")


async def test_watch_chats_redials_after_a_restart(chatd_emulator: Any) -> None:
    emu = chatd_emulator
    async with client_for(emu) as client:
        async with ChatWatcher(client, options=FAST) as watcher:
            await _watch_connected(emu, 1)
            first = await idle_chat(client, emu)
            ev = await _next_status(watcher, first, "waiting")
            assert ev.kind == "status_change"
            await asyncio.to_thread(emu.faults.restart, 0.05)
            await _watch_connected(emu, 2)
            second = await idle_chat(client, emu)
            await _next_status(watcher, second, "waiting")
        assert await watcher.next_event() is None  # closed by us
    # Both server sessions ended (the first by the restart) and left no queue read
    # pending on the emulator's loop: a leftover one was collected after that loop
    # closed, as an unraisable "Event loop is closed" in some later test.
    for _ in range(500):
        if len(emu.event_log(["watch_disconnect"])) >= 2:
            break
        await asyncio.sleep(0.01)
    assert len(emu.event_log(["watch_disconnect"])) == 2
    assert emu._call(_pending_queue_reads) == 0

    async with client_for(emu, token="bad-token-" + "y" * 20) as bad:
        with pytest.raises(CoderApiError) as denied:
            async with ChatWatcher(bad, options=FAST) as w:
                await w.next_event(timeout=5)
        assert denied.value.status == 401 and denied.value.path == "/api/v2/chats/watch"
