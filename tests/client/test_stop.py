"""stop_chat against the chatd emulator: every way a chat is brought to rest."""

from __future__ import annotations

import time
from typing import Any

import pytest

from coder_chat.emulator import Emulator
from coder_chat.errors import CoderApiError
from coder_chat.models import (
    Chat,
    ChatInputPart,
    CreateChatMessageRequest,
    CreateChatRequest,
    DynamicToolDefinition,
)
from coder_chat.rest import ChatClient
from coder_chat.stop import stop_chat

POLL = 0.02
LONG_RUN = '#emu {"sleep": 30, "text": "never finished"}'
# The model calls the client tool, then (after the results) would run for 30 s.
PAUSE_THEN_LONG_RUN = (
    '#emu {"steps": [{"tool_calls": [{"name": "lookup", "args": {"q": "x"}}]},'
    ' {"sleep": 30, "text": "resumed"}]}'
)


def client_for(emu: Emulator) -> ChatClient:
    return ChatClient(emu.base_url, emu.token, organization_id=emu.organization_id)


async def create(client: ChatClient, emu: Emulator, text: str, **kw: Any) -> Chat:
    return await client.create_chat(
        CreateChatRequest(
            organization_id=emu.organization_id, content=[ChatInputPart.text_part(text)], **kw
        )
    )


def transitions(emu: Emulator, chat_id: str) -> list[tuple[str | None, str]]:
    return [
        (e["details"]["old"], e["details"]["new"])
        for e in emu.event_log(["status"])
        if e["chat_id"] == chat_id
    ]


def requests(emu: Emulator, chat_id: str, method: str, suffix: str = "") -> list[int]:
    return [
        e["details"]["status"]
        for e in emu.event_log(["request"])
        if e["chat_id"] == chat_id
        and e["details"]["method"] == method
        and e["details"]["path"].split("?")[0].endswith(suffix)
    ]


class Journal:
    """A before_interrupt hook that records the status it was shown."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def __call__(self, chat: Chat) -> None:
        self.seen.append(chat.status)


async def test_running_chat_is_interrupted_once_and_settles(chatd_emulator: Emulator) -> None:
    emu = chatd_emulator
    journal = Journal()
    async with client_for(emu) as client:
        chat = await create(client, emu, f"work {LONG_RUN}")
        result = await stop_chat(
            client, chat.id, timeout=5, before_interrupt=journal, poll_interval=POLL
        )
    assert result.settled and result.status == "waiting"
    assert result.interrupts == 1 and journal.seen == ["running"]
    assert not result.archived and not result.was_archived
    assert emu.chat(chat.id)["status"] == "waiting"
    assert ("running", "interrupting") in transitions(emu, chat.id)
    assert requests(emu, chat.id, "POST", "/interrupt") == [200]


async def test_requires_action_chat_needs_two_interrupts(chatd_emulator: Emulator) -> None:
    emu = chatd_emulator
    journal = Journal()
    async with client_for(emu) as client:
        chat = await create(
            client,
            emu,
            f"look it up {PAUSE_THEN_LONG_RUN}",
            unsafe_dynamic_tools=[DynamicToolDefinition(name="lookup")],
        )
        await emu.await_status(chat.id, "requires_action")
        result = await stop_chat(
            client, chat.id, timeout=5, before_interrupt=journal, poll_interval=POLL
        )
    assert result.settled and result.status == "waiting"
    assert result.interrupts == 2
    # The journal hook ran before each interrupt: once on the pause, once on the
    # run the server resumed after closing the pending call.
    assert journal.seen == ["requires_action", "running"]
    assert requests(emu, chat.id, "POST", "/interrupt") == [200, 200]
    steps = transitions(emu, chat.id)
    # First interrupt: the pause became a live run again (the second step's 30 s
    # sleep); only the second interrupt stopped it.
    paused_at = steps.index(("running", "requires_action"))
    assert steps[paused_at + 1 :] == [
        ("requires_action", "running"),
        ("running", "interrupting"),
        ("interrupting", "waiting"),
    ]
    results = [
        p
        for m in emu.messages(chat.id, include_system=False)
        for p in m.get("content") or []
        if p.get("type") == "tool-result"
    ]
    assert len(results) == 1 and results[0]["is_error"] is True
    assert "interrupted by user" in str(results[0]["result"])


async def test_promoted_queued_message_is_stopped_too(chatd_emulator: Emulator) -> None:
    emu = chatd_emulator
    journal = Journal()
    async with client_for(emu) as client:
        chat = await create(client, emu, f"first {LONG_RUN}")
        queued = await client.create_message(
            chat.id, CreateChatMessageRequest(content=[ChatInputPart.text_part(f"next {LONG_RUN}")])
        )
        assert queued.queued
        result = await stop_chat(
            client, chat.id, timeout=5, before_interrupt=journal, poll_interval=POLL
        )
    # The first interrupt ended the first run; the server then promoted the queued
    # message and ran it (interrupting → running), so it took a second interrupt.
    assert result.settled and result.status == "waiting" and result.interrupts == 2
    assert journal.seen == ["running", "running"]
    assert ("interrupting", "running") in transitions(emu, chat.id)
    assert emu.chat(chat.id)["queue"] == []


@pytest.mark.chatd_emulator(max_concurrent_root_chats=1)
async def test_chat_waiting_for_capacity_is_stopped(
    chatd_era: str, chatd_emulator: Emulator
) -> None:
    # No worker holds the waiting chat: B3 answers the interrupt with `waiting` at once,
    # B1/B2 pass through `interrupting`; one interrupt settles it either way.
    emu = chatd_emulator
    async with client_for(emu) as client:
        busy = await create(client, emu, f"first {LONG_RUN}")
        waiting = await create(client, emu, f"second {LONG_RUN}")
        # no worker owns it yet
        assert (await client.get_chat(waiting.id)).queued_for_capacity is True
        result = await stop_chat(client, waiting.id, timeout=5, poll_interval=POLL)
        assert result.settled and result.status == "waiting" and result.interrupts == 1
        other = await stop_chat(client, busy.id, timeout=5, poll_interval=POLL)
    assert other.settled and other.interrupts == 1


async def test_idle_chat_is_left_alone(chatd_emulator: Emulator) -> None:
    emu = chatd_emulator
    journal = Journal()
    async with client_for(emu) as client:
        chat = await create(client, emu, "hi")
        await emu.await_status(chat.id, "waiting")
        result = await stop_chat(client, chat.id, before_interrupt=journal, poll_interval=POLL)
    assert result.settled and result.status == "waiting" and result.interrupts == 0
    assert journal.seen == []  # nothing cut short: nothing journaled
    assert requests(emu, chat.id, "POST", "/interrupt") == []


async def test_stop_and_archive(chatd_emulator: Emulator) -> None:
    emu = chatd_emulator
    async with client_for(emu) as client:
        chat = await create(client, emu, f"work {LONG_RUN}")
        result = await stop_chat(client, chat.id, timeout=5, archive=True, poll_interval=POLL)
        assert result.settled and result.archived and not result.was_archived
        assert result.interrupts == 1
        assert emu.chat(chat.id)["archived"] is True
        # Again: already archived, nothing sent but the read.
        again = await stop_chat(client, chat.id, archive=True, poll_interval=POLL)
    assert again.archived and again.was_archived and again.interrupts == 0
    assert requests(emu, chat.id, "PATCH") == [204]


async def test_archive_retries_409(chatd_emulator: Emulator) -> None:
    emu = chatd_emulator
    async with client_for(emu) as client:
        chat = await create(client, emu, "hi")
        await emu.await_status(chat.id, "waiting")
        emu.faults.fail_rest(
            2, status=409, method="PATCH", message="Cannot archive an active chat."
        )
        result = await stop_chat(client, chat.id, timeout=5, archive=True, poll_interval=POLL)
    assert result.archived and result.settled
    refused = [
        e
        for e in emu.event_log(["fault"])
        if e["details"] == {"fault": "fail", "method": "PATCH", "path": f"/api/v2/chats/{chat.id}"}
    ]
    assert len(refused) == 2 and requests(emu, chat.id, "PATCH") == [204]


@pytest.mark.chatd_emulator(interrupt_wind_down=3.0)
async def test_bound_exceeded_reports_unsettled(chatd_emulator: Emulator) -> None:
    emu = chatd_emulator
    journal = Journal()
    async with client_for(emu) as client:
        chat = await create(client, emu, f"work {LONG_RUN}")
        started = time.monotonic()
        result = await stop_chat(
            client,
            chat.id,
            timeout=0.4,
            archive=True,
            before_interrupt=journal,
            poll_interval=POLL,
        )
        elapsed = time.monotonic() - started
    # It waited out its timeout, then gave up (the fields below say so; no upper
    # bound on the wall clock, which a loaded machine stretches).
    assert elapsed >= 0.4
    assert not result.settled and not result.archived
    assert result.status == "interrupting" and result.interrupts == 1
    assert journal.seen == ["running"]  # polls during the wind-down, no re-interrupt
    assert requests(emu, chat.id, "PATCH") == []  # an unsettled chat is not archived


async def test_hook_failure_sends_no_interrupt(chatd_emulator: Emulator) -> None:
    emu = chatd_emulator

    async def broken_journal(chat: Chat) -> None:
        raise RuntimeError("journal unavailable")

    async with client_for(emu) as client:
        chat = await create(client, emu, f"work {LONG_RUN}")
        with pytest.raises(RuntimeError, match="journal unavailable"):
            await stop_chat(client, chat.id, before_interrupt=broken_journal, poll_interval=POLL)
        assert requests(emu, chat.id, "POST", "/interrupt") == []
        await stop_chat(client, chat.id, poll_interval=POLL)  # leave nothing running


async def test_network_failures_are_retried_within_the_bound(chatd_emulator: Emulator) -> None:
    emu = chatd_emulator
    journal = Journal()
    async with client_for(emu) as client:
        chat = await create(client, emu, f"work {LONG_RUN}")
        # The interrupt lands but its response is lost; the next GET fails outright.
        emu.faults.drop_response(1, method="POST", path="/interrupt")
        emu.faults.drop_response(1, method="GET", path=chat.id)
        result = await stop_chat(
            client, chat.id, timeout=5, archive=True, before_interrupt=journal, poll_interval=POLL
        )
    assert result.settled and result.status == "waiting" and result.archived
    # The lost interrupt had landed: the chat was re-read, not interrupted again.
    assert journal.seen == ["running"] and result.interrupts == 0
    assert result.last_error is not None and "RemoteProtocolError" in result.last_error
    assert emu.token not in result.last_error
    assert ("running", "interrupting") in transitions(emu, chat.id)
    assert requests(emu, chat.id, "POST", "/interrupt") == []  # the one sent was the dropped one


async def test_unreachable_server_is_reported_not_raised() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    async with ChatClient(f"http://127.0.0.1:{port}", "tok-secret") as client:
        result = await stop_chat(client, "c1", timeout=0.2, poll_interval=POLL)
    assert not result.settled and result.status is None and result.interrupts == 0
    assert result.last_error is not None and "CODER_URL" in result.last_error


async def test_unknown_chat_is_a_404(chatd_emulator: Emulator) -> None:
    async with client_for(chatd_emulator) as client:
        with pytest.raises(CoderApiError) as err:
            await stop_chat(client, "00000000-0000-4000-8000-000000000001", poll_interval=POLL)
    assert err.value.status == 404
