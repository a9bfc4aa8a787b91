"""The AI Gateway client against the emulator's two surfaces, over real sockets:
structured output (valid, invalid-then-valid, invalid twice), typed errors from the
fault API, BYOK, provider names, and no token anywhere."""

from __future__ import annotations

import logging
import pickle
from typing import Literal

import pytest
from model_env import TOKEN
from pydantic import BaseModel, Field

from coder_chat.emulator import Emulator
from coder_chat.gateway import (
    GatewayAuthError,
    GatewayClient,
    GatewayError,
    GatewayOutputError,
    GatewayRateLimitError,
    GatewayServerError,
)

APIS = ["openai", "anthropic"]


class Verdict(BaseModel):
    label: Literal["bug", "feature", "question"]
    confidence: float = Field(ge=0, le=1)
    reasons: list[str]


def _gw(emu: Emulator, **kwargs: object) -> GatewayClient:
    return GatewayClient(emu.base_url, kwargs.pop("token", TOKEN), **kwargs)  # type: ignore[arg-type]


def _calls(emu: Emulator) -> list[dict]:
    return [e["details"] for e in emu.event_log(["aibridge"])]


@pytest.mark.parametrize("api", APIS)
async def test_valid_structured_output(emu: Emulator, api: Literal["openai", "anthropic"]) -> None:
    async with _gw(emu) as gw:
        reply = await gw.structured(api, "m-1", "Classify: the app crashes on start", Verdict)
    assert isinstance(reply.value, Verdict)
    assert reply.value.label == "bug"  # the emulator answers an enum's first value
    assert reply.attempts == 1
    assert reply.usage["input_tokens"] > 0
    calls = _calls(emu)
    assert [(c["api"], c["schema"], c["invalid"]) for c in calls] == [(api, True, False)]


@pytest.mark.parametrize("api", APIS)
async def test_invalid_then_valid_is_asked_again_once(
    emu: Emulator, api: Literal["openai", "anthropic"]
) -> None:
    async with _gw(emu) as gw:
        reply = await gw.structured(api, "m-1", 'Classify it #gw {"invalid": 1}', Verdict)
    assert reply.attempts == 2
    assert reply.value.label == "bug"
    assert [(c["answer"], c["invalid"]) for c in _calls(emu)] == [(1, True), (2, False)]
    assert reply.usage["input_tokens"] >= 2  # both calls counted


@pytest.mark.parametrize("api", APIS)
async def test_invalid_twice_is_a_clear_error(
    emu: Emulator, api: Literal["openai", "anthropic"]
) -> None:
    async with _gw(emu) as gw:
        with pytest.raises(GatewayOutputError) as err:
            await gw.structured(api, "m-1", 'Classify it #gw {"invalid": 5}', Verdict)
    assert "Verdict" in str(err.value) and "after one re-ask" in str(err.value)
    assert len(_calls(emu)) == 2  # one re-ask, no more
    assert pickle.loads(pickle.dumps(err.value)).errors == err.value.errors


async def test_plain_completion_and_exact_reply(emu: Emulator) -> None:
    async with _gw(emu) as gw:
        plain = await gw.complete("openai", "m", [{"role": "user", "content": "hello"}])
        exact = await gw.complete(
            "anthropic", "m", [{"role": "user", "content": 'x #gw {"reply": "fixed"}'}]
        )
    assert plain.text == "Echo: hello"
    assert exact.text == "fixed"


@pytest.mark.parametrize(
    ("status", "kind", "retryable"),
    [
        (401, GatewayAuthError, False),
        (429, GatewayRateLimitError, True),
        (503, GatewayServerError, True),
        (500, GatewayServerError, True),
    ],
)
async def test_fault_statuses_are_typed(
    emu: Emulator,
    status: int,
    kind: type[GatewayError],
    retryable: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    emu.faults.fail_rest(1, status=status, method="POST", path="/aibridge/")
    with caplog.at_level(logging.DEBUG):
        async with _gw(emu) as gw:
            with pytest.raises(kind) as err:
                await gw.structured("openai", "m", "classify", Verdict)
            assert err.value.status == status
            assert err.value.retryable is retryable
            # The fault was one-shot: the next call goes through.
            assert (await gw.structured("openai", "m", "classify", Verdict)).attempts == 1
    for text in (str(err.value), repr(err.value), caplog.text, repr(gw)):
        assert TOKEN not in text


async def test_bad_token_is_401_and_never_echoed(
    emu: Emulator, caplog: pytest.LogCaptureFixture
) -> None:
    bad = TOKEN + "-wrong"
    with caplog.at_level(logging.DEBUG):
        async with _gw(emu, token=bad) as gw:
            for api in ("openai", "anthropic"):
                with pytest.raises(GatewayAuthError) as err:
                    await gw.complete(api, "m", [{"role": "user", "content": "hi"}])
                assert "API key is invalid" in str(err.value)
                assert bad not in str(err.value) and bad not in repr(err.value)
    assert bad not in caplog.text and TOKEN not in caplog.text
    assert TOKEN not in str(emu.event_log())


async def test_byok_sends_the_token_as_governance_header(emu: Emulator) -> None:
    async with _gw(emu, upstream_key="sk-upstream-123") as gw:
        assert "byok" in repr(gw) and "sk-upstream" not in repr(gw)
        for api in ("openai", "anthropic"):
            await gw.complete(api, "m", [{"role": "user", "content": "hi"}])
    assert [c["byok"] for c in _calls(emu)] == [True, True]
    # The upstream key alone (no valid Coder token) is refused.
    async with _gw(emu, token="not-a-coder-token", upstream_key="sk-upstream-123") as gw:
        with pytest.raises(GatewayAuthError):
            await gw.complete("openai", "m", [{"role": "user", "content": "hi"}])


async def test_provider_names_are_configurable(emu: Emulator) -> None:
    async with _gw(emu, anthropic_provider="corp-claude") as gw:
        assert gw.path("anthropic") == "/api/v2/aibridge/corp-claude/v1/messages"
        reply = await gw.structured("anthropic", "m", "classify", Verdict)
    assert reply.value.label == "bug"
    assert _calls(emu)[0]["provider"] == "corp-claude"
    # A provider of the other surface kind has no such route.
    async with _gw(emu, openai_provider="corp-claude") as gw:
        with pytest.raises(GatewayError) as err:
            await gw.complete("openai", "m", [{"role": "user", "content": "hi"}])
    assert err.value.status == 404


async def test_shares_the_chat_clients_pool(emu: Emulator) -> None:
    from coder_chat.rest import ChatClient

    async with ChatClient(emu.base_url, TOKEN) as chat:
        gw = GatewayClient.from_chat_client(chat, TOKEN)
        assert gw._http is chat._http
        await gw.complete("openai", "m", [{"role": "user", "content": "hi"}])
        await gw.aclose()  # borrowed: must not close the chat client's pool
        assert not chat._http.is_closed
