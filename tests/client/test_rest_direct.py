"""The REST client sends through its pool's transport (docs/performance.md, round 10b).

A ``ChatClient`` that owns its pool, with no proxy in the environment, hands each
request to the httpx transport itself instead of ``AsyncClient.send``: the auth and
redirect flows it never used, the cookie jar it never read and the URL/header merges
cost about a fifth of a request's CPU. What goes on the wire stays what the httpx
client sent (the same headers, once each); what a server learns differs in one
point: a cookie it set is not sent back (the token header is the only credential).
With a proxy in the environment the client keeps httpx's routing.

Real sockets: a raw HTTP/1.1 server (``MiniHttp``, keep-alive) that records each
request's head as sent.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import pytest

from coder_chat.rest import ChatClient

if TYPE_CHECKING:
    from conftest import MiniHttp

TOKEN = "tok-direct-7c1e-secret"
CHAT = {
    "id": "c0ffee00-0000-4000-8000-000000000001",
    "owner_id": "u1",
    "title": "t",
    "status": "waiting",
    "created_at": "2026-01-01T00:00:00Z",
    "updated_at": "2026-01-01T00:00:00Z",
}


@pytest.fixture
async def raw_server(
    monkeypatch: pytest.MonkeyPatch, mini_http: type[MiniHttp]
) -> AsyncIterator[MiniHttp]:
    """Keep-alive: answers every request with ``CHAT`` and a cookie."""
    for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("ALL_PROXY", raising=False)
    cookie = [("Set-Cookie", "session=server-set; Path=/")]
    async with mini_http(lambda *_: (200, CHAT), keep_alive=True, extra_headers=cookie) as server:
        yield server


def _names(headers: list[tuple[str, str]]) -> list[str]:
    return sorted(k.lower() for k, _ in headers)


async def test_headers_on_the_wire_are_the_httpx_clients_once_each(raw_server: MiniHttp) -> None:
    async with ChatClient(raw_server.base_url, TOKEN, organization_id="o1") as client:
        await client.get_chat(CHAT["id"])
        await client.archive_chat(CHAT["id"])
        await client.get_chat(CHAT["id"])
    assert len(raw_server.heads) == 3
    get_line, get_headers = raw_server.heads[0]
    assert get_line == f"GET /api/v2/chats/{CHAT['id']} HTTP/1.1"
    assert _names(get_headers) == [
        "accept",
        "accept-encoding",
        "coder-session-token",
        "connection",
        "host",
        "user-agent",
    ]
    values = {k.lower(): v for k, v in get_headers}
    assert values["accept"] == "application/json"
    assert values["user-agent"] == "prefect-coder/coder_chat"
    assert values["connection"] == "keep-alive"
    assert values["coder-session-token"] == TOKEN
    assert values["host"] == raw_server.base_url.split("://", 1)[1]
    patch_line, patch_headers = raw_server.heads[1]
    assert patch_line.startswith("PATCH ")
    assert _names(patch_headers) == sorted([*_names(get_headers), "content-length", "content-type"])
    assert {k.lower(): v for k, v in patch_headers}["content-type"] == "application/json"
    # One pooled keep-alive connection for all three requests.
    assert raw_server.connections == 1


async def test_a_cookie_the_server_sets_is_not_sent_back(raw_server: MiniHttp) -> None:
    """The httpx client's jar sent ``Cookie: session=server-set`` on the second
    request; the transport path has no jar (the token header is the credential)."""
    async with ChatClient(raw_server.base_url, TOKEN, organization_id="o1") as client:
        await client.get_chat(CHAT["id"])
        await client.get_chat(CHAT["id"])
    assert [k.lower() for k, _ in raw_server.heads[1][1] if k.lower() == "cookie"] == []


async def test_no_httpx_request_log_record(
    raw_server: MiniHttp, caplog: pytest.LogCaptureFixture
) -> None:
    """``AsyncClient.send`` logged ``HTTP Request: ...`` per request at INFO (built
    whenever the httpx logger is enabled); the client's own http:request/http:response
    transport events carry the same."""
    caplog.set_level(logging.INFO, logger="httpx")
    seen: list[Any] = []
    async with ChatClient(
        raw_server.base_url, TOKEN, organization_id="o1", on_transport_event=seen.append
    ) as client:
        await client.get_chat(CHAT["id"])
    assert [r for r in caplog.records if r.name == "httpx"] == []
    assert [e.type for e in seen] == ["http:request", "http:response"]
    assert seen[1].status == 200


async def test_a_proxy_in_the_environment_keeps_httpxs_routing(
    raw_server: MiniHttp, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``HTTP_PROXY`` set the request goes through the httpx client, which routes
    it to the proxy (absolute-form request line)."""
    monkeypatch.setenv("HTTP_PROXY", raw_server.base_url)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    async with ChatClient("http://chatd.example.invalid:8080", TOKEN) as client:
        chat = await client.get_chat(CHAT["id"])
    assert chat.id == CHAT["id"]
    line, headers = raw_server.heads[0]
    assert line == f"GET http://chatd.example.invalid:8080/api/v2/chats/{CHAT['id']} HTTP/1.1"
    assert {k.lower(): v for k, v in headers}["coder-session-token"] == TOKEN


async def test_a_repeated_url_is_parsed_once(raw_server: MiniHttp) -> None:
    async with ChatClient(raw_server.base_url, TOKEN, organization_id="o1") as client:
        await client.get_chat(CHAT["id"])
        first = client._urls[f"{raw_server.base_url}/api/v2/chats/{CHAT['id']}"]
        await client.get_chat(CHAT["id"])
        assert client._urls[f"{raw_server.base_url}/api/v2/chats/{CHAT['id']}"] is first
        for i in range(300):  # bounded: cleared when full
            await client.get_chat(f"c{i}")
        assert len(client._urls) <= 256
