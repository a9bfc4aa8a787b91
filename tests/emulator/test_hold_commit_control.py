"""The ``hold-commit`` fault over the control API: a send held until the second history
read commits right before that read is served, so the first read misses it and the
second sees it (the read-skew interleaving recovery's verdict must survive)."""

from __future__ import annotations

import asyncio

import httpx

from coder_chat.emulator import Emulator

from .helpers import P, client, create_chat, send, wait_status


def _user_texts(body: object) -> list[str]:
    messages = body if isinstance(body, list) else body.get("messages", [])  # type: ignore[union-attr]
    return [
        part.get("text", "")
        for m in messages
        if m.get("role") == "user"
        for part in m.get("content", [])
        if part.get("type") == "text"
    ]


async def test_a_held_send_commits_right_before_the_releasing_read(emu: Emulator) -> None:
    async with client(emu) as c:
        chat = await create_chat(c, emu, "first")
        await wait_status(emu, chat["id"], "waiting")
        history = f"{P}/{chat['id']}/messages"
        async with httpx.AsyncClient(base_url=emu.base_url) as raw:
            admin = {"X-Emulator-Admin-Token": emu.admin_token}
            r = await raw.post(
                "/__emulator__/faults/hold-commit",
                headers=admin,
                json={"path": history, "until_path": history, "until_count": 2},
            )
            assert r.status_code == 200, r.text
            late = asyncio.create_task(send(c, chat["id"], "late"))
            for _ in range(500):
                holds = (await raw.get("/__emulator__/faults", headers=admin)).json()["holds"]
                if holds:
                    break
                await asyncio.sleep(0.01)
            assert holds and holds[0]["remaining"] == 2, holds
            before = await c.get(history)
            assert "late" not in _user_texts(before.json())
            assert not late.done()
            after = await c.get(history)
            assert "late" in _user_texts(after.json())
            assert (await asyncio.wait_for(late, 10)).status_code in (200, 201)
        released = [
            e
            for e in emu.event_log(["fault"])
            if e["details"].get("fault") == "hold_commit_released"
        ]
        assert len(released) == 1
