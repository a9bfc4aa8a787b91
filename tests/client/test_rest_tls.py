"""TLS verification is on by default, for REST and for the stream upgrade."""

from __future__ import annotations

from typing import Any

import pytest

from coder_chat.errors import CoderStreamError, CoderTransportError
from coder_chat.rest import ChatClient, shared_ssl_context
from coder_chat.stream import ChatStreamReader, StreamOptions

TOKEN = "tok-3f9a1c77-secret-value"  # = conftest.TOKEN
CHAT = "5b0d8c0e-1a52-4c8e-9a0e-3e7d7f6b1a01"
FAST = StreamOptions(backoff_initial_ms=2, backoff_cap_ms=4, open_timeout=2.0)


def ok(method: str, target: str, body: bytes) -> tuple[int, Any]:
    return 200, []


async def test_rest_verifies_certificates(mini_http: Any, self_signed_tls: Any) -> None:
    async with mini_http(ok, ssl=self_signed_tls) as server:
        assert server.base_url.startswith("https://")
        async with ChatClient(server.base_url, TOKEN) as client:
            with pytest.raises(CoderTransportError, match="CERTIFICATE_VERIFY_FAILED") as info:
                await client.list_chats()
            assert info.value.reason == "ConnectError" and info.value.retry_safe
            assert "CODER_VERIFY_TLS" in str(info.value)
            assert not client.prefix_locked
        async with ChatClient(server.base_url, TOKEN, verify=False) as insecure:
            assert await insecure.list_chats() == []


async def test_stream_verifies_certificates(scripted_server: Any, self_signed_tls: Any) -> None:
    async with scripted_server(ssl=self_signed_tls) as server:
        server.add(server.conn(frames=[[{"type": "status", "status": {"status": "waiting"}}]]))
        async with ChatClient(server.base_url, TOKEN) as client:
            assert client.stream_url(CHAT).startswith("wss://")
            reader = ChatStreamReader(client, CHAT, options=FAST)
            with pytest.raises(CoderStreamError) as info:
                await reader.next_event(timeout=5)
            await reader.aclose()
            assert "CERTIFICATE_VERIFY_FAILED" in str(info.value.cause)
        assert server.dials == []  # no handshake ever completed
        async with ChatClient(server.base_url, TOKEN, verify=False) as insecure:
            async with ChatStreamReader(insecure, CHAT, options=FAST) as reader:
                ev = await reader.next_event(timeout=5)
                assert ev is not None and ev.status is not None and ev.status.status == "waiting"
        assert len(server.dials) == 1


async def test_clients_share_one_tls_context_per_verify_setting(
    mini_http: Any, self_signed_tls: Any
) -> None:
    """Building a TLS context loads the CA bundle (tens of ms): one per process and
    setting, used by REST and by wss dials alike."""
    import ssl

    async with mini_http(ok, ssl=self_signed_tls) as server:
        a = ChatClient(server.base_url, TOKEN)
        b = ChatClient(server.base_url, TOKEN, timeout=5)
        insecure_a = ChatClient(server.base_url, TOKEN, verify=False)
        insecure_b = ChatClient(server.base_url, TOKEN, verify=False)
        assert a.ssl_context is b.ssl_context is shared_ssl_context(True)
        assert insecure_a.ssl_context is insecure_b.ssl_context is shared_ssl_context(False)
        assert a.ssl_context.verify_mode == ssl.CERT_REQUIRED and a.ssl_context.check_hostname
        assert insecure_a.ssl_context.verify_mode == ssl.CERT_NONE
        # the shared contexts are the ones in use: both clients of each kind behave alike
        for client in (a, b):
            with pytest.raises(CoderTransportError, match="CERTIFICATE_VERIFY_FAILED"):
                await client.list_chats()
        for client in (insecure_a, insecure_b):
            assert await client.list_chats() == []
        for client in (a, b, insecure_a, insecure_b):
            await client.aclose()
