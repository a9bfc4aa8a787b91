"""The emulator keeps session tokens out of its logs, like the real server: a
stream upgrade and REST calls at DEBUG log level leave no token in any record."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from websockets.asyncio.client import connect

from coder_chat.emulator.server import Emulator


async def test_no_token_in_any_log_record_at_debug(
    chatd_emulator: Emulator, caplog: pytest.LogCaptureFixture
) -> None:
    emu = chatd_emulator
    caplog.set_level(logging.DEBUG)  # root: every logger, the websockets ones included
    headers = {"Coder-Session-Token": emu.token}
    async with httpx.AsyncClient(base_url=emu.base_url, headers=headers) as http:
        r = await http.post(
            "/api/v2/chats",
            json={
                "organization_id": emu.organization_id,
                "content": [{"type": "text", "text": "hello"}],
            },
        )
        assert r.status_code == 201
        chat_id = r.json()["id"]
    url = emu.base_url.replace("http", "ws", 1) + f"/api/v2/chats/{chat_id}/stream"
    async with connect(url, additional_headers=headers) as ws:
        frame = json.loads(await ws.recv())
        assert isinstance(frame, list) and frame
    # The raw test client's own websockets/httpx loggers are not the emulator's.
    client_side = ("websockets.client", "httpx", "httpcore")
    records = [
        r.name + " " + r.getMessage() + repr(r.args)
        for r in caplog.records
        if not r.name.startswith(client_side)
    ]
    # Capture works (the raw test client's own DEBUG lines are there), so an emulator
    # record carrying the token would have been seen.
    assert any(r.name.startswith(client_side) for r in caplog.records)
    assert not [r for r in records if emu.token in r]
