"""A stream dial's proxy is websockets' own choice from the environment, looked up once
per client and host (``ChatClient.ws_proxy``; docs/performance.md round 9): every dial
used to walk the whole environment twice. Like the client's REST pool, which reads the
environment when it is built, a client keeps what it found; a new client reads again."""

from __future__ import annotations

import pytest

from coder_chat.rest import ChatClient

_PROXY_VARS = ("ws_proxy", "wss_proxy", "http_proxy", "https_proxy", "all_proxy", "no_proxy")


@pytest.fixture
def clean_proxy_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in _PROXY_VARS:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    return monkeypatch


async def test_the_dial_proxy_is_read_once_per_client_and_host(
    clean_proxy_env: pytest.MonkeyPatch,
) -> None:
    env = clean_proxy_env
    url = "ws://chat.example:8080/api/experimental/chats/1/stream"
    async with ChatClient("http://chat.example:8080", "token") as client:
        assert client.ws_proxy(url) is None
        env.setenv("ws_proxy", "http://proxy-a.example:3128")
        assert client.ws_proxy(url) is None  # kept: read once
        assert client.ws_proxy("ws://other.example/x") == "http://proxy-a.example:3128"
    async with ChatClient("http://chat.example:8080", "token") as client:
        assert client.ws_proxy(url) == "http://proxy-a.example:3128"
        assert client.ws_proxy(url + "?after_id=7") == "http://proxy-a.example:3128"
    env.setenv("no_proxy", "chat.example")
    async with ChatClient("http://chat.example:8080", "token") as client:
        assert client.ws_proxy(url) is None  # no_proxy still honoured
        assert client.ws_proxy("wss://other.example/x") is None  # wss: not the ws proxy
        env.setenv("https_proxy", "http://proxy-b.example:3128")
    async with ChatClient("http://chat.example:8080", "token") as client:
        assert client.ws_proxy("wss://other.example/x") == "http://proxy-b.example:3128"
