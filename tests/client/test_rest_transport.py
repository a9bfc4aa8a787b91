"""Network failures of ChatClient: one CoderTransportError, with method, URL, whether a
retry is safe and the setting to check; never the token. Real sockets, faults from the
emulator's fault API."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from coder_chat.emulator import Emulator
from coder_chat.errors import CoderError, CoderTimeoutError, CoderTransportError
from coder_chat.models import ChatInputPart, CreateChatMessageRequest, CreateChatRequest
from coder_chat.rest import ChatClient

TOKEN = "tok-3f9a1c77-secret-value"


def closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def assert_no_token(err: BaseException, token: str) -> None:
    texts = [str(err), repr(err), *map(str, err.args), *map(str, vars(err).values())]
    assert not [t for t in texts if token in t]
    assert err.__cause__ is None and err.__context__ is None  # no httpx object chained


async def test_refused_connection_names_the_url_and_the_setting(events: Any) -> None:
    base = f"http://127.0.0.1:{closed_port()}"
    async with ChatClient(base, TOKEN, organization_id="o", on_transport_event=events) as client:
        with pytest.raises(CoderTransportError) as got:
            await client.get_chat("c1")
        err = got.value
        assert isinstance(err, CoderError) and not isinstance(err, CoderTimeoutError)
        assert err.method == "GET" and err.url == f"{base}/api/v2/chats/c1"
        assert err.reason == "ConnectError" and err.retry_safe
        assert "CODER_URL" in str(err) and "base_url" in str(err)
        assert_no_token(err, TOKEN)
        # Nothing was sent, so even a POST is safe to retry.
        with pytest.raises(CoderTransportError) as post:
            await client.create_chat(
                CreateChatRequest(organization_id="o", content=[ChatInputPart.text_part("x")])
            )
        assert post.value.method == "POST" and post.value.retry_safe
        assert_no_token(post.value, TOKEN)
    assert [e.message for e in events.of("http:error")] == [str(err), str(post.value)]


async def test_read_timeout_of_a_post_is_not_retry_safe(chatd_emulator: Emulator) -> None:
    emu = chatd_emulator
    async with ChatClient(emu.base_url, emu.token, organization_id=emu.organization_id) as c:
        chat = await c.create_chat(
            CreateChatRequest(
                organization_id=emu.organization_id, content=[ChatInputPart.text_part("hi")]
            )
        )
        await emu.await_status(chat.id, "waiting")
    # The server stalls the next POST /messages past the client's 0.2 s read timeout; the
    # message still lands afterwards, which is exactly why a blind re-send is unsafe.
    emu.faults.delay_commit(0.6, method="POST", path="/messages")
    async with ChatClient(emu.base_url, emu.token, timeout=0.2) as quick:
        with pytest.raises(CoderTimeoutError) as got:
            await quick.create_message(
                chat.id, CreateChatMessageRequest(content=[ChatInputPart.text_part("again")])
            )
        err = got.value
        assert isinstance(err, TimeoutError) and isinstance(err, CoderTransportError)
        assert err.reason == "ReadTimeout" and err.method == "POST" and not err.retry_safe
        assert err.url == f"{emu.base_url}/api/v2/chats/{chat.id}/messages"
        assert "may have reached the server" in str(err)
        assert_no_token(err, emu.token)
        # The same stall on a GET: safe to retry.
        emu.faults.delay_commit(0.6, method="GET", path=chat.id)
        with pytest.raises(CoderTimeoutError) as read:
            await quick.get_chat(chat.id)
        assert read.value.retry_safe and read.value.method == "GET"

    def user_messages() -> int:
        return sum(1 for m in emu.messages(chat.id, include_system=False) if m["role"] == "user")

    for _ in range(100):  # the stalled POST runs once its 0.6 s delay is over
        if user_messages() == 2:
            break
        await asyncio.sleep(0.05)
    assert user_messages() == 2  # the timed-out POST landed


async def test_lost_response_of_a_post_is_not_retry_safe(chatd_emulator: Emulator) -> None:
    emu = chatd_emulator
    emu.faults.drop_response(1, method="POST", path="/api/v2/chats")
    async with ChatClient(emu.base_url, emu.token, organization_id=emu.organization_id) as c:
        with pytest.raises(CoderTransportError) as got:
            await c.create_chat(
                CreateChatRequest(
                    organization_id=emu.organization_id, content=[ChatInputPart.text_part("x")]
                )
            )
    err = got.value
    assert err.reason == "RemoteProtocolError" and not err.retry_safe
    assert_no_token(err, emu.token)
    assert len(emu.chats()) == 1  # it landed: a re-send would create a second chat
