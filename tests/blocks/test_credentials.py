"""CoderCredentials: validation at the edge, secret hygiene, env fallback, real wiring."""

from __future__ import annotations

import json
import logging
import socket
import uuid

import pytest
from pydantic import SecretStr, ValidationError

from coder_chat.emulator import Emulator
from coder_chat.errors import CoderApiError, CoderTransportError
from prefect_coder.blocks import CoderCredentials

ORG = "0a1b2c3d-0000-4000-8000-123456789abc"
TOKEN = "tok-SUPER-SECRET-0123456789"
ENV = ("CODER_URL", "CODER_SESSION_TOKEN", "CODER_ORG_ID", "CODER_HTTP_TIMEOUT",
       "CODER_REQUEST_TIMEOUT", "CODER_TURN_TIMEOUT", "CODER_VERIFY_TLS")  # fmt: skip


def make(**kw: object) -> CoderCredentials:
    values: dict[str, object] = {"base_url": "https://coder.example.com", "organization_id": ORG}
    values["token"] = TOKEN
    values.update(kw)
    return CoderCredentials(**values)  # type: ignore[arg-type]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_defaults_and_normalisation() -> None:
    c = make(base_url="  https://coder.example.com/  ")
    assert c.base_url == "https://coder.example.com"
    assert make(base_url="http://127.0.0.1:3000/coder/").base_url == "http://127.0.0.1:3000/coder"
    assert c.organization_id == uuid.UUID(ORG)
    assert (c.request_timeout, c.turn_timeout, c.http_timeout, c.verify_tls) == (
        300.0,
        600.0,
        30.0,
        True,
    )
    assert make(organization_id=uuid.UUID(ORG)).organization_id == uuid.UUID(ORG)


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("base_url", "ftp://coder.example.com", "base_url: must be an http(s) URL"),
        ("base_url", "coder.example.com", "base_url: must be an http(s) URL"),
        ("base_url", "", "base_url: required"),
        ("base_url", f"https://user:{TOKEN}@coder.example.com", "base_url: must not contain user"),
        (
            "base_url",
            f"https://coder.example.com/?token={TOKEN}",
            "base_url: must not have a query",
        ),
        ("base_url", "https://coder.example.com:99999", "base_url: the port"),
        ("organization_id", "acme", "organization_id: must be the organization's UUID"),
        ("token", "", "token: empty"),
        ("token", f"{TOKEN}\n", "token: contains whitespace"),
        ("request_timeout", 0, "greater than 0"),
        ("turn_timeout", -1, "greater than 0"),
        ("http_timeout", 0, "greater than 0"),
    ],
)
def test_bad_input_names_field_and_fix_without_echoing(
    field: str, value: object, needle: str
) -> None:
    with pytest.raises(ValidationError) as info:
        make(**{field: value})
    text = str(info.value)
    assert needle in text and field in text
    assert TOKEN not in text and repr(TOKEN) not in repr(info.value)


def test_token_never_shown(caplog: pytest.LogCaptureFixture) -> None:
    c = make()
    logger = logging.getLogger("test.creds")
    with caplog.at_level(logging.INFO):
        logger.info("creds %s %r", c, c)
    dumps = [
        repr(c),
        str(c),
        str(c.model_dump()),
        json.dumps(c.model_dump(mode="json")),
        c.model_dump_json(),
        caplog.text,
    ]
    for text in dumps:
        assert TOKEN not in text
    assert c.model_dump(mode="json")["token"] == "**********"
    assert c.token.get_secret_value() == TOKEN


def test_from_env(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("CODER_URL", "https://env.example.com/")
    clean_env.setenv("CODER_SESSION_TOKEN", TOKEN)
    clean_env.setenv("CODER_ORG_ID", ORG)
    clean_env.setenv("CODER_HTTP_TIMEOUT", "12")
    clean_env.setenv("CODER_TURN_TIMEOUT", "900")
    c = CoderCredentials.from_env()
    assert (c.base_url, str(c.organization_id), c.token.get_secret_value()) == (
        "https://env.example.com",
        ORG,
        TOKEN,
    )
    assert (c.http_timeout, c.turn_timeout, c.request_timeout) == (12.0, 900.0, 300.0)
    assert CoderCredentials.from_env(request_timeout=5).request_timeout == 5


def test_from_env_missing_and_bad(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("CODER_URL", "https://env.example.com")
    with pytest.raises(ValueError, match="CODER_SESSION_TOKEN, CODER_ORG_ID"):
        CoderCredentials.from_env()
    clean_env.setenv("CODER_SESSION_TOKEN", TOKEN)
    clean_env.setenv("CODER_ORG_ID", "not-a-uuid")
    with pytest.raises(ValueError, match="organization_id: must be") as info:
        CoderCredentials.from_env()
    assert TOKEN not in str(info.value)


async def test_get_client_talks_to_the_emulator(chatd_emulator_session: Emulator) -> None:
    emu = chatd_emulator_session
    creds = make(
        base_url=emu.base_url, organization_id=emu.organization_id, token=SecretStr(emu.token),
        http_timeout=7,
    )  # fmt: skip
    async with creds.get_client() as client:
        assert client.base_url.rstrip("/") == emu.base_url.rstrip("/")
        assert client.organization_id == emu.organization_id
        assert isinstance(await client.list_chats(limit=1), list)
        assert emu.token not in repr(client)


async def test_wrong_token_is_rejected_and_not_echoed(chatd_emulator_session: Emulator) -> None:
    emu = chatd_emulator_session
    creds = make(base_url=emu.base_url, organization_id=emu.organization_id, token=TOKEN)
    async with creds.get_client() as client:
        with pytest.raises(CoderApiError) as info:
            await client.list_chats(limit=1)
    assert info.value.status == 401
    assert TOKEN not in f"{info.value!r} {info.value}"


async def test_unreachable_base_url_names_the_url_and_the_setting() -> None:
    # A port nobody listens on: connect is refused before any byte is sent.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    creds = make(base_url=f"http://127.0.0.1:{port}/coder", http_timeout=5)
    async with creds.get_client() as client:
        with pytest.raises(CoderTransportError) as info:
            await client.list_chats(limit=1)
    text = str(info.value)
    assert f"http://127.0.0.1:{port}/coder" in text
    assert "base_url" in text and "CODER_URL" in text
    assert info.value.retry_safe
    assert TOKEN not in f"{info.value!r} {text}"


async def test_open_agent_runs_a_turn(chatd_emulator_session: Emulator) -> None:
    emu = chatd_emulator_session
    creds = make(
        base_url=emu.base_url, organization_id=emu.organization_id, token=emu.token,
        request_timeout=20, turn_timeout=30,
    )  # fmt: skip
    async with creds.open_agent() as agent:
        result = await agent.generate("hello from the blocks tests", timeout=creds.turn_timeout)
        assert result.chat_id and agent.chat_id == result.chat_id
        client = agent.client
    # Both the agent and the client the block built for it are closed.
    with pytest.raises(Exception):  # noqa: B017 - any use of a closed client fails
        await client.list_chats(limit=1)
    # Resuming through get_agent with a caller-owned client.
    async with creds.get_client() as own:
        resumed = creds.get_agent(client=own, chat_id=result.chat_id)
        assert resumed.client is own and resumed.chat_id == result.chat_id
        await resumed.aclose()
        assert isinstance(await own.list_chats(limit=1), list)  # ours stays open
