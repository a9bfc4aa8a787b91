"""Fault injection over real sockets: in-process handle and control API."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import websockets

from coder_chat.emulator import Emulator, Script, Sleep, Text

from .helpers import V2, P, Tap, client, create_chat, send, wait_status


async def test_drop_stream_after_frames_and_reconnect_replays(emu: Emulator) -> None:
    async with client(emu) as c:
        emu.set_default_script(Script.long_running(0.3, "abcdefghij", chunks=10))
        chat = await create_chat(c, emu, "go")
        tap = Tap(emu, chat["id"])
        async with tap:
            await tap.wait_for(lambda ev: any(e["type"] == "message_part" for e in ev))
            assert emu.faults.drop_stream(chat["id"], after_frames=2) == 1
            await asyncio.wait_for(tap.closed.wait(), 5)
        assert tap.close_code == 1006  # TCP abort, no close frame
        last = max(e["message"]["id"] for e in tap.of("message"))
        async with Tap(emu, chat["id"], after_id=last) as tap2:
            await tap2.wait_status("waiting")
        # reconnect mid-episode: snapshot, then the episode replayed from seq 1
        types = tap2.types()
        assert types[0] == "status" and types[1] == "preview_reset"
        parts = [e["message_part"] for e in tap2.of("message_part")]
        first_ep = (parts[0]["history_version"], parts[0]["generation_attempt"])
        seqs = [
            p["seq"] for p in parts if (p["history_version"], p["generation_attempt"]) == first_ep
        ]
        assert seqs == list(range(1, len(seqs) + 1))
        assert [e["message"]["role"] for e in tap2.of("message")] == ["assistant"]


async def test_drop_now_with_close_code(emu: Emulator) -> None:
    async with client(emu) as c:
        chat = await create_chat(c, emu, "go")
        await wait_status(emu, chat["id"], "waiting")
        async with Tap(emu, chat["id"]) as tap:
            await tap.wait_status("waiting")
            emu.faults.drop_stream(code=1001)
            await asyncio.wait_for(tap.closed.wait(), 5)
        assert tap.close_code == 1001


async def test_drop_next_stream(emu: Emulator) -> None:
    async with client(emu) as c:
        chat = await create_chat(c, emu, "go")
        await wait_status(emu, chat["id"], "waiting")
        emu.faults.drop_next_stream(chat["id"], after_frames=1)
        async with Tap(emu, chat["id"]) as tap:
            await asyncio.wait_for(tap.closed.wait(), 5)
        assert len(tap.frames) == 1
        async with Tap(emu, chat["id"]) as tap2:  # only the next one
            await tap2.wait_status("waiting")
            await asyncio.sleep(0.05)
            assert not tap2.closed.is_set()


async def test_refuse_upgrades_count_and_period(emu: Emulator) -> None:
    async with client(emu) as c:
        chat = await create_chat(c, emu, "go")
        emu.faults.refuse_upgrades(503, count=2)
        for _ in range(2):
            with pytest.raises(websockets.InvalidStatus) as ei:
                async with Tap(emu, chat["id"]):
                    pass
            assert ei.value.response.status_code == 503
        async with Tap(emu, chat["id"]) as tap:
            await tap.wait_status("waiting")
        emu.faults.refuse_upgrades(502, seconds=0.15)
        with pytest.raises(websockets.InvalidStatus):
            async with Tap(emu, chat["id"]):
                pass
        await asyncio.sleep(0.2)
        async with Tap(emu, chat["id"]) as tap:
            await tap.wait_status("waiting")


async def test_fail_next_rest_calls(emu: Emulator) -> None:
    async with client(emu) as c:
        emu.faults.fail_rest(2, status=502, method="POST", path="/chats")
        for _ in range(2):
            r = await c.post(
                P,
                json={
                    "organization_id": emu.organization_id,
                    "content": [{"type": "text", "text": "x"}],
                },
            )
            assert r.status_code == 502 and "message" in r.json()
        assert emu.chats() == []  # nothing committed
        chat = await create_chat(c, emu, "ok")
        assert (await c.get(f"{P}/{chat['id']}")).status_code == 200


@pytest.mark.parametrize(
    ("status", "message"),
    [(401, "Unauthorized"), (429, "Too Many Requests"), (502, "Bad Gateway"), (599, "HTTP 599")],
)
async def test_fault_messages_default_to_the_status_phrase(
    emu: Emulator, status: int, message: str
) -> None:
    async with client(emu) as c:
        emu.faults.fail_rest(1, status=status, method="GET")
        r = await c.get(P)
        assert r.status_code == status and r.json() == {"message": message}
        emu.faults.fail_rest(1, status=status, message="custom")
        assert (await c.get(P)).json() == {"message": "custom"}
        chat = await create_chat(c, emu, "go")
        emu.faults.refuse_upgrades(status, count=1)
        with pytest.raises(websockets.InvalidStatus) as ei:
            async with Tap(emu, chat["id"]):
                pass
        assert ei.value.response.status_code == status
        assert json.loads(ei.value.response.body) == {"message": message}
    # Over the control API too.
    async with httpx.AsyncClient(base_url=emu.base_url) as raw:
        admin = {"X-Emulator-Admin-Token": emu.admin_token}
        r = await raw.post("/__emulator__/faults/fail-rest", headers=admin, json={"status": status})
        assert r.status_code == 200
        r = await raw.get(P, headers={"Coder-Session-Token": emu.token})
        assert r.status_code == status and r.json() == {"message": message}


async def test_drop_response_commits(emu: Emulator) -> None:
    async with client(emu) as c:
        chat = await create_chat(c, emu, "first")
        await wait_status(emu, chat["id"], "waiting")
        emu.faults.drop_response(1, method="POST", path="/messages")
        with pytest.raises(httpx.RemoteProtocolError):
            await send(c, chat["id"], "landed")
        await wait_status(emu, chat["id"], "waiting")
        texts = [
            m["content"][0]["text"]
            for m in emu.messages(chat["id"], include_system=False)
            if m["role"] == "user"
        ]
        assert texts == ["first", "landed"]
        # create chat: the chat exists although the client saw no response
        emu.faults.drop_response(1, path=P)
        with pytest.raises(httpx.RemoteProtocolError):
            await c.post(
                P,
                json={
                    "organization_id": emu.organization_id,
                    "content": [{"type": "text", "text": "lost"}],
                },
            )
        assert len(emu.chats()) == 2


async def test_delay_commit(emu: Emulator) -> None:
    async with client(emu) as c:
        chat = await create_chat(c, emu, "first")
        await wait_status(emu, chat["id"], "waiting")
        emu.faults.delay_commit(0.2, path="/messages")
        task = asyncio.create_task(send(c, chat["id"], "late"))
        await asyncio.sleep(0.1)
        assert len(emu.messages(chat["id"], include_system=False)) == 2
        r = await task
        assert r.status_code == 200


async def test_stall_stream(emu: Emulator) -> None:
    async with client(emu) as c:
        emu.set_default_script(Script.long_running(0.2, "abcdef", chunks=6))
        chat = await create_chat(c, emu, "go")
        async with Tap(emu, chat["id"]) as tap:
            await tap.wait_for(lambda ev: any(e["type"] == "message_part" for e in ev))
            emu.faults.stall_stream(chat["id"], seconds=0.4)
            n = len(tap.frames)
            await wait_status(emu, chat["id"], "waiting")
            assert len(tap.frames) <= n + 1
            await tap.wait_status("waiting", within=3)
        assert not tap.closed.is_set() or tap.close_code is not None


async def test_restart_keeps_state(emu: Emulator) -> None:
    async with client(emu) as c:
        chat = await create_chat(c, emu, "before")
        await wait_status(emu, chat["id"], "waiting")
        async with Tap(emu, chat["id"]) as tap:
            await tap.wait_status("waiting")
            port = emu.port
            await emu.arestart(downtime=0.05)
            await asyncio.wait_for(tap.closed.wait(), 5)
        assert emu.port == port
        r = await c.get(f"{P}/{chat['id']}")
        assert r.status_code == 200 and r.json()["status"] == "waiting"
        r = await send(c, chat["id"], "after")
        assert r.status_code == 200
        assert r.json()["message"]["id"] > 2
        await wait_status(emu, chat["id"], "waiting")


def test_control_api_from_another_process_view(chatd_emulator: Emulator) -> None:
    emu = chatd_emulator
    admin = {"X-Emulator-Admin-Token": emu.admin_token}
    h = {"Coder-Session-Token": emu.token}
    with httpx.Client(base_url=emu.base_url) as c:
        assert c.get("/__emulator__/chats").status_code == 401
        assert c.get("/__emulator__/chats", headers=admin).json() == []
        r = c.post(
            V2,
            headers=h,
            json={
                "organization_id": emu.organization_id,
                "content": [{"type": "text", "text": "a"}],
                "unsafe_dynamic_tools": [{"name": "structured_output"}],
            },
        )
        cid = r.json()["id"]
        emu.wait_for_status(cid, "waiting")
        r = c.post(
            f"/__emulator__/chats/{cid}/script",
            headers=admin,
            json={"script": {"structured_output": {"v": 1}}},
        )
        assert r.status_code == 200, r.text
        c.post(f"{V2}/{cid}/messages", headers=h, json={"content": [{"type": "text", "text": "b"}]})
        emu.wait_for_status(cid, "requires_action")
        info = c.get(f"/__emulator__/chats/{cid}", headers=admin).json()
        assert info["execution_state"] == "A0"
        assert info["pending_tool_calls"][0]["tool_name"] == "structured_output"
        r = c.post(f"/__emulator__/chats/{cid}/expire-requires-action", headers=admin)
        assert r.json() == {"expired": True}
        emu.wait_for_status(cid, "waiting")
        msgs = c.get(f"/__emulator__/chats/{cid}/messages", headers=admin).json()
        tool = [m for m in msgs if m["role"] == "tool"][-1]
        assert tool["content"][0]["result"] == "Tool execution timed out"
        assert tool["content"][0]["is_error"] is True
        assert (
            c.post(
                "/__emulator__/faults/fail-rest", headers=admin, json={"count": 1, "status": 503}
            ).status_code
            == 200
        )
        assert c.get(f"{V2}/{cid}", headers=h).status_code == 503
        assert c.get(f"{V2}/{cid}", headers=h).status_code == 200
        r = c.post("/__emulator__/restart", headers=admin, json={"downtime": 0.05})
        assert r.status_code == 202
        time.sleep(0.15)
        assert c.get(f"{V2}/{cid}", headers=h).status_code == 200
        ev = c.get("/__emulator__/events?kind=restart", headers=admin).json()
        assert len(ev) == 1


@pytest.mark.chatd_emulator(requires_action_timeout=0.1)
def test_requires_action_deadline(chatd_emulator: Emulator) -> None:
    emu = chatd_emulator
    emu.set_default_script(Script.client_tool("t", {"a": 1}))
    h = {"Coder-Session-Token": emu.token}
    with httpx.Client(base_url=emu.base_url, headers=h) as c:
        r = c.post(
            V2,
            json={
                "organization_id": emu.organization_id,
                "content": [{"type": "text", "text": "a"}],
                "unsafe_dynamic_tools": [{"name": "t"}],
            },
        )
        cid = r.json()["id"]
        emu.wait_for_status(cid, "requires_action")
        emu.wait_for_status(cid, "waiting", timeout=3)
        assert any(e["kind"] == "requires_action_timeout" for e in emu.event_log())


async def test_remove_route_answers_404_until_cleared(emu: Emulator) -> None:
    """A removed route answers 404 ``Route not found.`` (REST and upgrade alike, whatever
    the token) as a build without it would; other routes and ``clear()`` are untouched."""
    async with client(emu) as c:
        chat = await create_chat(c, emu, "go")
        await wait_status(emu, chat["id"], "waiting")
        emu.faults.remove_route("/stream")
        with pytest.raises(websockets.InvalidStatus) as ei:
            async with Tap(emu, chat["id"]):
                pass
        assert ei.value.response.status_code == 404
        assert json.loads(ei.value.response.body) == {"message": "Route not found."}
        assert (await c.get(f"{P}/{chat['id']}")).status_code == 200  # the rest still serves
        emu.faults.remove_route(V2, method="POST")
        r = await c.post(V2, json={})
        assert r.status_code == 404 and r.json() == {"message": "Route not found."}
        assert (await c.get(V2)).status_code == 200  # GET of the same path is not removed
        async with httpx.AsyncClient(base_url=emu.base_url) as anonymous:
            assert (await anonymous.post(V2, json={})).status_code == 404  # before auth
        emu.faults.clear()
        async with Tap(emu, chat["id"]) as tap:
            await tap.wait_status("waiting")
    # Over the control API too.
    async with httpx.AsyncClient(base_url=emu.base_url) as raw:
        admin = {"X-Emulator-Admin-Token": emu.admin_token}
        r = await raw.post(
            "/__emulator__/faults/remove-route", headers=admin, json={"path": "/chats/models"}
        )
        assert r.status_code == 200
        faults = (await raw.get("/__emulator__/faults", headers=admin)).json()
        assert faults["removed_routes"] == [{"path": "/chats/models", "method": None}]
        models = f"/api/v2/organizations/{emu.organization_id}/chats/models"
        r = await raw.get(models, headers={"Coder-Session-Token": emu.token})
        assert r.status_code == 404 and r.json() == {"message": "Route not found."}


async def test_end_sleeps_finishes_a_long_scripted_sleep_without_interrupting(
    emu: Emulator,
) -> None:
    async with client(emu) as c:
        emu.set_default_script(Script.of(Sleep(600), Text("woke")))
        chat = await create_chat(c, emu, "go")
        cid = chat["id"]
        await emu.await_status(cid, "running")
        # The sleep has begun when the worker marks it; until then nothing is ended.
        deadline = time.monotonic() + 10
        while not emu.chat(cid)["sleeping"]:
            assert time.monotonic() < deadline, "the turn never reached its sleep"
            await asyncio.sleep(0.01)
        admin = {"X-Emulator-Admin-Token": emu.admin_token}
        async with httpx.AsyncClient(base_url=emu.base_url) as raw:
            r = await raw.post(f"/__emulator__/chats/{cid}/end-sleeps", headers=admin)
        assert r.json() == {"ended": 1}
        await emu.await_status(cid, "waiting", within=10)
        [end] = [e for e in emu.event_log(["turn_end"]) if e["chat_id"] == cid]
        assert end["details"]["outcome"] == "completed"
        assert emu.messages(cid, include_system=False)[-1]["content"][0]["text"] == "woke"
        assert [e["chat_id"] for e in emu.event_log(["sleep_ended"])] == [cid]
        # No sleep in progress: nothing to end.
        assert emu.end_sleeps() == 0
