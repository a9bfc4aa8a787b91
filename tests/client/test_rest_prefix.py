"""REST prefix fallback/lock rules, deadlines, error envelopes and transport events,
against a small real HTTP server that can answer 404 on one prefix only."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from coder_chat.errors import CoderApiError, CoderTimeoutError, CoderTransportError
from coder_chat.rest import ChatClient

TOKEN = "tok-3f9a1c77-secret-value"
CHAT = "5b0d8c0e-1a52-4c8e-9a0e-3e7d7f6b1a01"
CHAT_JSON = {"id": CHAT, "status": "waiting", "title": "t"}


def router(live_prefix: str | None, **overrides: Any) -> Any:
    """chatd with only ``live_prefix`` mounted; ``overrides[path] -> (status, body)``."""

    def route(method: str, target: str, body: bytes) -> tuple[int, Any]:
        path = target.split("?", 1)[0]
        if path in overrides:
            return overrides[path]
        if live_prefix is None or not path.startswith(live_prefix):
            return 404, {"message": "Route not found."}
        rest = path[len(live_prefix) :]
        if rest == "" and method == "GET":
            return 200, []
        if rest == f"/{CHAT}" and method == "GET":
            return 200, CHAT_JSON
        return 404, {"message": "Resource not found or you do not have access to this resource"}

    return route


async def test_v2_404_falls_back_once_and_locks_experimental(mini_http: Any, events: Any) -> None:
    async with mini_http(router("/api/experimental/chats")) as server:
        async with ChatClient(server.base_url, TOKEN, on_transport_event=events) as client:
            assert not client.prefix_locked
            chat = await client.get_chat(CHAT)
            assert chat.id == CHAT and client.prefix == "/api/experimental/chats"
            assert client.prefix_locked
            await client.get_chat(CHAT)
            assert client.stream_url(CHAT, 4).endswith(
                f"/api/experimental/chats/{CHAT}/stream?after_id=4"
            )
    assert [t for _, t, _ in server.requests] == [
        f"/api/v2/chats/{CHAT}",
        f"/api/experimental/chats/{CHAT}",
        f"/api/experimental/chats/{CHAT}",  # locked: no more v2 probes
    ]
    reqs, resps = events.of("http:request"), events.of("http:response")
    assert [r.id for r in reqs] == [1, 2, 3] and [r.id for r in resps] == [1, 2, 3]
    assert {r.op for r in reqs} == {"getChat"}
    assert [(r.status, r.ok) for r in resps] == [(404, False), (200, True), (200, True)]
    assert all(r.duration_ms >= 0 for r in resps)


async def test_first_non_404_error_locks_v2(mini_http: Any) -> None:
    route = router(
        "/api/v2/chats", **{f"/api/v2/chats/{CHAT}": (401, {"message": "Unauthorized."})}
    )
    async with mini_http(route) as server:
        async with ChatClient(server.base_url, TOKEN) as client:
            with pytest.raises(CoderApiError) as info:
                await client.get_chat(CHAT)
            assert info.value.status == 401 and client.prefix_locked
            assert client.prefix == "/api/v2/chats"
    assert len(server.requests) == 1


async def test_two_404s_keep_v2_error_and_do_not_lock(mini_http: Any) -> None:
    async with mini_http(router("/api/v2/chats")) as server:
        async with ChatClient(server.base_url, TOKEN) as client:
            with pytest.raises(CoderApiError) as info:
                await client.get_chat("9e1f0000-0000-4000-8000-000000000000")
            err = info.value
            assert err.status == 404 and err.path.startswith("/api/v2/chats/")
            assert err.method == "GET"
            assert err.message == "Resource not found or you do not have access to this resource"
            assert not client.prefix_locked
            # the next call probes v2 first again, and a 200 there locks it
            assert (await client.get_chat(CHAT)).id == CHAT
            assert client.prefix_locked and client.prefix == "/api/v2/chats"
    assert [t.split("/")[2] for _, t, _ in server.requests] == ["v2", "experimental", "v2"]


async def test_network_error_never_locks(mini_http: Any, events: Any) -> None:
    calls = {"n": 0}

    def route(method: str, target: str, body: bytes) -> tuple[int, Any]:
        calls["n"] += 1
        if calls["n"] == 1:
            return 0, None  # connection closed without a response
        return router("/api/experimental/chats")(method, target, body)

    async with mini_http(route) as server:
        async with ChatClient(server.base_url, TOKEN, on_transport_event=events) as client:
            with pytest.raises(CoderTransportError) as info:
                await client.get_chat(CHAT)
            assert not client.prefix_locked
            err = info.value
            assert err.__context__ is None and err.__cause__ is None
            assert not hasattr(err, "request")  # the httpx request (and its headers) is not kept
            assert err.method == "GET" and err.retry_safe  # a GET may always be re-sent
            assert TOKEN not in repr(err) and TOKEN not in str(err)
            assert (await client.get_chat(CHAT)).id == CHAT
            assert client.prefix == "/api/experimental/chats"
    (http_error,) = events.of("http:error")
    assert http_error.id == 1 and http_error.op == "getChat" and http_error.message


async def test_per_call_deadline_covers_the_call(mini_http: Any, events: Any) -> None:
    async def slow(method: str, target: str, body: bytes) -> tuple[int, Any]:
        await asyncio.sleep(2)
        return 200, CHAT_JSON

    async with mini_http(slow) as server:
        async with ChatClient(server.base_url, TOKEN, on_transport_event=events) as client:
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(TimeoutError, match="deadline"):
                await client.get_chat(CHAT, timeout=0.1)
            assert loop.time() - started < 1.0
            # a caller's own asyncio.timeout propagates as the caller's TimeoutError
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.1):
                    await client.get_chat(CHAT)
            # the client's default httpx timeout is a transport timeout (a TimeoutError too)
        async with ChatClient(server.base_url, TOKEN, timeout=0.1) as quick:
            with pytest.raises(CoderTimeoutError) as info:
                await quick.get_chat(CHAT)
            assert isinstance(info.value, TimeoutError) and info.value.reason == "ReadTimeout"
    assert len(events.of("http:error")) == 2 and not events.of("http:response")


async def test_error_envelope_and_non_json_bodies(mini_http: Any) -> None:
    route = router(
        "/api/v2/chats",
        **{
            f"/api/v2/chats/{CHAT}/messages": (
                429,
                {
                    "message": "Message queue is full.",
                    "detail": "Maximum 20 messages can be queued.",
                },
            ),
            f"/api/v2/chats/{CHAT}": (
                400,
                {
                    "message": "Invalid labels.",
                    "validations": [{"field": "labels", "detail": "bad key"}],
                },
            ),
        },
    )
    async with mini_http(route) as server:
        async with ChatClient(server.base_url, TOKEN) as client:
            from coder_chat.models import ChatInputPart, CreateChatMessageRequest, UpdateChatRequest

            with pytest.raises(CoderApiError) as info:
                await client.create_message(
                    CHAT, CreateChatMessageRequest(content=[ChatInputPart.text_part("x")])
                )
            assert str(info.value) == (
                f"Coder API POST /api/v2/chats/{CHAT}/messages failed (429): "
                "Message queue is full. — Maximum 20 messages can be queued."
            )
            with pytest.raises(CoderApiError) as info2:
                await client.update_chat(CHAT, UpdateChatRequest(labels={"-": "x"}))
            assert info2.value.detail == "labels: bad key"
            with pytest.raises(CoderApiError) as info3:
                await client.list_models(organization_id="org")  # both model routes 404
            assert info3.value.path == "/api/v2/organizations/org/chats/models"
    paths = [t.split("?")[0] for _, t, _ in server.requests]
    assert paths[-2:] == [
        "/api/v2/organizations/org/chats/models",
        "/api/experimental/chats/model-configs",
    ]


async def test_token_only_in_header_never_in_url_logs_or_events(
    mini_http: Any, events: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with mini_http(router("/api/experimental/chats")) as server:
        async with ChatClient(
            server.base_url, TOKEN, organization_id="org", on_transport_event=events
        ) as client:
            await client.get_chat(CHAT)
            with pytest.raises(CoderApiError) as info:
                await client.get_chat("0e1f0000-0000-4000-8000-000000000000")
            scan = [repr(client), str(client), repr(info.value), str(info.value)]
    assert all(h.get("coder-session-token") == TOKEN for _, _, h in server.requests)
    assert all(TOKEN not in t for _, t, _ in server.requests)
    scan += [repr(e) for e in events.events]
    scan += [r.getMessage() for r in caplog.records] + [str(r.args) for r in caplog.records]
    assert caplog.records
    assert not any(TOKEN in s for s in scan)


async def test_from_settings_reads_env_and_hides_the_token(
    mini_http: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from coder_chat.settings import CoderSettings

    async with mini_http(router("/api/v2/chats")) as server:
        monkeypatch.setenv("CODER_URL", server.base_url)
        monkeypatch.setenv("CODER_SESSION_TOKEN", TOKEN)
        monkeypatch.setenv("CODER_ORG_ID", "org-1")
        monkeypatch.setenv("CODER_HTTP_TIMEOUT", "5")
        settings = CoderSettings()
        assert TOKEN not in repr(settings) and TOKEN not in str(settings.model_dump())
        assert settings.organization_id == "org-1" and settings.http_timeout == 5.0
        async with ChatClient.from_settings(settings) as client:
            assert client.organization_id == "org-1"
            assert (await client.get_chat(CHAT)).id == CHAT
    assert server.requests[0][2]["coder-session-token"] == TOKEN
