"""Per-era conformance: what differs between builds B1, B2 and B3 (spec "Builds").

Each test runs the same requests against every era and asserts that era's answer, so a
behaviour pinned to one build cannot leak into another.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
import websockets

from coder_chat.emulator import DEFAULT_ERA, ERA_NAMES, Emulator, Script
from coder_chat.emulator.eras import ERA_ENV

from .helpers import V2, P, Tap, client, create_chat, send, wait_status

ERAS = pytest.mark.parametrize("era", ERA_NAMES)


async def _done_chat(c: httpx.AsyncClient, emu: Emulator) -> dict[str, Any]:
    chat = await create_chat(c, emu, "hello", prefix=V2)
    await wait_status(emu, chat["id"], "waiting")
    return chat


async def _until_queued_for_capacity(emu: Emulator, chat_id: str) -> None:
    for _ in range(1000):
        if emu.chat(chat_id)["queued_for_capacity"]:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the chat never waited for capacity")


def test_default_era(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ERA_ENV, raising=False)
    assert Emulator().era == DEFAULT_ERA == "b3"  # the newest build
    monkeypatch.setenv(ERA_ENV, "b3")  # a whole suite against another build, no edits
    assert Emulator().era == "b3"
    assert Emulator(era="b1").era == "b1"  # an explicit era wins
    assert Emulator(era="B1").era == "b1"
    with pytest.raises(ValueError, match="unknown era"):
        Emulator(era="b9")


@ERAS
async def test_prefixes(emu: Emulator, era: str) -> None:
    async with client(emu) as c:
        body = {"organization_id": emu.organization_id, "content": [{"type": "text", "text": "x"}]}
        assert (await c.post(V2, json=body)).status_code == 201
        r = await c.post(P, json=body)
        if era == "b3":  # core routes on /api/v2 only
            assert r.status_code == 404 and r.json() == {"message": "Route not found."}
            assert (await c.get(P)).status_code == 404
        else:
            assert r.status_code == 201
            assert len((await c.get(P)).json()) == 2


@ERAS
async def test_models_word_under_v2(emu: Emulator, era: str) -> None:
    async with client(emu) as c:
        r = await c.get(f"{V2}/models")
        if era == "b1":  # reserved on the experimental mount only: a malformed chat id
            assert r.status_code == 400 and r.json()["message"] == 'Invalid UUID "models".'
            assert (await c.get(f"{P}/models")).status_code == 404
        else:
            assert r.status_code == 404


@ERAS
async def test_stream_cursor_and_status_history_version(emu: Emulator, era: str) -> None:
    async with client(emu) as c:
        chat = await _done_chat(c, emu)
        cid = chat["id"]
        hv = emu.chat(cid)["history_version"]
        url = f"{emu.ws_url}{V2}/{cid}/stream"
        hdr = {"Coder-Session-Token": emu.token}

        async def refused(query: str) -> int | None:
            try:
                async with websockets.connect(f"{url}?{query}", additional_headers=hdr):
                    return None
            except websockets.InvalidStatus as e:
                assert e.response.status_code == 400
                return e.response.status_code

        # Each build validates only its own cursor name and ignores the others.
        assert (await refused("after_revision=-1") is not None) == (era == "b2")
        assert (await refused("history_version=-1") is not None) == (era == "b3")
        assert (await refused(f"history_version={hv + 1}") is not None) == (era == "b3")
        async with Tap(emu, cid, prefix=V2) as plain:
            await plain.wait_status("waiting")
        status = plain.of("status")[0]["status"]
        if era == "b1":
            assert status == {"status": "waiting"}
        else:
            assert status == {"status": "waiting", "history_version": hv}
        assert [e["message"]["role"] for e in plain.of("message")] == ["user", "assistant"]
        assert "preview_reset" in plain.types()
        # A cursor at the chat's history version: nothing re-sent, no preview_reset
        # (B3 also ignores after_id when its cursor is non-zero).
        name = {"b1": None, "b2": "after_revision", "b3": "history_version"}[era]
        if name is not None:
            async with Tap(emu, cid, after_id=1, prefix=V2, query=f"{name}={hv}") as tap:
                await tap.wait_status("waiting")
                await asyncio.sleep(0.02)
            assert tap.types() == ["status"]


@ERAS
async def test_search_keys(emu: Emulator, era: str) -> None:
    async with client(emu) as c:
        await _done_chat(c, emu)
        for q in ("status:waiting", "archived:any", "pr_status:none", "status:running,waiting"):
            r = await c.get(V2, params={"q": q})
            if era == "b1":
                assert r.status_code == 400, q
                assert r.json()["message"] == "Invalid chat search query."
            else:
                assert r.status_code == 200, q
        r = await c.get(V2, params={"q": "status:waiting"})
        if era != "b1":
            assert len(r.json()) == 1
        r = await c.get(V2, params={"q": "search:hello"})
        assert r.status_code == (400 if era == "b1" else 200)


@ERAS
async def test_create_with_empty_content_and_title(emu: Emulator, era: str) -> None:
    async with client(emu) as c:
        base = {"organization_id": emu.organization_id}
        r = await c.post(V2, json={**base, "content": []})
        if era != "b3":
            assert r.status_code == 400 and r.json()["message"] == "Content is required."
        else:
            assert r.status_code == 201
            chat = r.json()
            assert chat["status"] == "waiting" and chat["title"] == "New Chat"
            page = (await c.get(f"{V2}/{chat['id']}/messages")).json()
            assert page["messages"] == []
            await asyncio.sleep(0.02)
            assert emu.chat(chat["id"])["status"] == "waiting"  # no worker runs
            assert (await send(c, chat["id"], "now go", prefix=V2)).status_code == 200
            await wait_status(emu, chat["id"], "waiting")
            texts = [m["content"][0]["text"] for m in emu.messages(chat["id"], False)]
            assert texts == ["now go", "Echo: now go"]
        r = await c.post(
            V2, json={**base, "content": [{"type": "text", "text": "hi"}], "title": "Mine"}
        )
        assert r.json()["title"] == ("Mine" if era == "b3" else "hi")  # B1/B2: unknown field


@ERAS
@pytest.mark.emu(max_concurrent_root_chats=1)
async def test_interrupt_of_a_chat_no_worker_holds(emu: Emulator, era: str) -> None:
    async with client(emu) as c:
        emu.set_default_script(Script.long_running(5.0, "slow"))
        holder = await create_chat(c, emu, "holds the only slot", prefix=V2)
        waiting = await create_chat(c, emu, "waits for capacity", prefix=V2)
        await _until_queued_for_capacity(emu, waiting["id"])
        async with Tap(emu, waiting["id"], prefix=V2) as tap:
            await tap.wait_status("running")
            r = await c.post(f"{V2}/{waiting['id']}/interrupt")
            assert r.status_code == 200
            if era == "b3":  # finished in the same transaction: no interrupting
                assert r.json()["status"] == "waiting"
            else:
                assert r.json()["status"] == "interrupting"
            await tap.wait_status("waiting")
        assert ("interrupting" in tap.statuses()) == (era != "b3")
        # An owned chat is interrupted the usual way in every era.
        r = await c.post(f"{V2}/{holder['id']}/interrupt")
        assert r.json()["status"] == "interrupting"
        await wait_status(emu, holder["id"], "waiting")


@ERAS
@pytest.mark.emu(max_concurrent_root_chats=1)
async def test_interrupting_send_to_a_chat_no_worker_holds(emu: Emulator, era: str) -> None:
    async with client(emu) as c:
        emu.set_default_script(Script.long_running(5.0, "slow"))
        holder = await create_chat(c, emu, "holds the only slot", prefix=V2)
        waiting = await create_chat(c, emu, "waits", prefix=V2)
        await _until_queued_for_capacity(emu, waiting["id"])
        r = await send(c, waiting["id"], "instead", busy="interrupt", prefix=V2)
        assert r.status_code == 200
        body = r.json()
        info = emu.chat(waiting["id"])
        if era == "b3":  # the new message is the promoted head: not queued
            assert body["queued"] is False and body["message"]["role"] == "user"
            assert body["message"]["content"][0]["text"] == "instead"
            assert info["status"] == "running" and info["queue"] == []
        else:
            assert body["queued"] is True and body["queued_message"]["id"] > 0
            assert info["status"] == "interrupting"
        await c.post(f"{V2}/{holder['id']}/interrupt")


@ERAS
async def test_patch_validation_before_writes(emu: Emulator, era: str) -> None:
    async with client(emu) as c:
        chat = await _done_chat(c, emu)
        r = await c.patch(f"{V2}/{chat['id']}", json={"title": "Renamed", "archived": False})
        assert r.status_code == 400 and r.json()["message"] == "Chat is already not archived."
        title = (await c.get(f"{V2}/{chat['id']}")).json()["title"]
        assert title == ("hello" if era == "b3" else "Renamed")  # B3 wrote nothing


@ERAS
async def test_messages_page_versions(emu: Emulator, era: str) -> None:
    async with client(emu) as c:
        chat = await _done_chat(c, emu)
        cid = chat["id"]
        newest = (await c.get(f"{V2}/{cid}/messages")).json()
        polled = (await c.get(f"{V2}/{cid}/messages", params={"after_id": 1})).json()
        if era == "b3":
            user_id = next(m["id"] for m in newest["messages"] if m["role"] == "user")
            assert newest["history_version"] == emu.chat(cid)["history_version"]
            assert newest["turn_start_id"] == user_id
            assert "history_version" not in polled and "turn_start_id" not in polled
        else:
            assert set(newest) == set(polled) == {"messages", "queued_messages", "has_more"}


@ERAS
async def test_promoted_queue_head_stamp(emu: Emulator, era: str) -> None:
    async with client(emu) as c:
        chat = await _done_chat(c, emu)
        emu.script_next_turn(chat["id"], Script.long_running(0.1, "busy", chunks=2))
        await send(c, chat["id"], "first", prefix=V2)
        queued = (await send(c, chat["id"], "second", prefix=V2)).json()
        assert queued["queued"] is True
        await wait_status(emu, chat["id"], "waiting")
        promoted = next(
            m
            for m in emu.messages(chat["id"], False)
            if m["role"] == "user" and m["content"][0]["text"] == "second"
        )
        if era == "b1":  # B1's ChatMessage has no queued_message_id
            assert "queued_message_id" not in promoted
        else:
            assert promoted["queued_message_id"] == queued["queued_message"]["id"]
