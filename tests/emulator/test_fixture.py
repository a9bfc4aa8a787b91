"""The pytest fixture / thread-hosted emulator reached from synchronous code."""

from __future__ import annotations

import time

import httpx
import pytest

from coder_chat.emulator import Emulator, Script
from coder_chat.emulator.eras import default_era


def test_fixture_sync_round_trip(chatd_emulator: Emulator) -> None:
    emu = chatd_emulator
    h = {"Coder-Session-Token": emu.token}
    with httpx.Client(base_url=emu.base_url, headers=h) as c:
        r = c.post(
            "/api/v2/chats",
            json={
                "organization_id": emu.organization_id,
                "content": [{"type": "text", "text": "hi"}],
            },
        )
        assert r.status_code == 201
        cid = r.json()["id"]
        emu.wait_for_status(cid, "waiting")
        emu.script_next_turn(cid, Script.text("scripted", deltas=2))
        assert (
            c.post(
                f"/api/v2/chats/{cid}/messages",
                json={"content": [{"type": "text", "text": "more"}]},
            ).status_code
            == 200
        )
        emu.wait_for_status(cid, "waiting")
        texts = [m["content"][0]["text"] for m in emu.messages(cid, include_system=False)]
        assert texts == ["hi", "Echo: hi", "more", "scripted"]
        assert any(m["role"] == "system" for m in emu.messages(cid))
        kinds = {e["kind"] for e in emu.event_log()}
        assert {"turn_start", "turn_end", "status", "message", "request"} <= kinds


@pytest.mark.chatd_emulator(requires_action_timeout=0.05)
def test_fixture_marker_config(chatd_emulator: Emulator) -> None:
    assert chatd_emulator.config.requires_action_timeout == 0.05


def test_thread_startup_is_fast() -> None:
    t = time.perf_counter()
    with Emulator.running_in_thread() as emu:
        started = time.perf_counter() - t
        assert emu.base_url.startswith("http://127.0.0.1:")
    assert started < 0.5


def test_fixture_runs_per_era(chatd_era: str, chatd_emulator: Emulator) -> None:
    assert chatd_emulator.era == chatd_era
    with httpx.Client(
        base_url=chatd_emulator.base_url, headers={"Coder-Session-Token": chatd_emulator.token}
    ) as c:
        status = c.get("/api/experimental/chats").status_code
    assert status == (404 if chatd_era == "b3" else 200)


@pytest.mark.parametrize("chatd_era", ["b1"])
def test_fixture_era_narrowed(chatd_era: str, chatd_emulator: Emulator) -> None:
    assert chatd_emulator.era == "b1"


@pytest.mark.chatd_emulator(era="b2")
def test_fixture_marker_era(chatd_emulator: Emulator) -> None:
    assert chatd_emulator.era == "b2"
    assert chatd_emulator.config.stamps_queued_message_id is True


def test_fixture_default_era(chatd_emulator: Emulator) -> None:
    assert chatd_emulator.era == default_era()
