"""Conformance: /stream handshake, framing, connect order, episodes, keepalive; /watch."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
import websockets
from websockets.client import ClientProtocol
from websockets.frames import Opcode
from websockets.uri import parse_uri

from coder_chat.emulator import Emulator, Script, ScriptStep, Sleep, Text

from .helpers import V2, P, Tap, client, create_chat, send, wait_status
from .wire_check import check_watch


async def test_handshake_errors_are_plain_http(emu: Emulator) -> None:
    async with client(emu) as c:
        chat = await create_chat(c, emu, "x")
    cases = [
        (f"{P}/{chat['id']}/stream", "bad-token", 401),
        (f"{P}/{uuid.uuid4()}/stream", None, 404),
        (f"{P}/nope/stream", None, 400),
        (f"{P}/{chat['id']}/stream?after_id=abc", None, 400),
    ]
    for path, token, status in cases:
        with pytest.raises(websockets.InvalidStatus) as ei:
            await websockets.connect(
                emu.ws_url + path, additional_headers={"Coder-Session-Token": token or emu.token}
            )
        assert ei.value.response.status_code == status
        if status == 400 and "after_id" in path:
            assert json.loads(ei.value.response.body)["message"] == "Invalid after_id parameter."


async def test_connect_order_without_and_with_after_id(emu: Emulator) -> None:
    async with client(emu) as c:
        chat = await create_chat(c, emu, "one")
        cid = chat["id"]
        await wait_status(emu, cid, "waiting")
        await send(c, cid, "two")
        await wait_status(emu, cid, "waiting")
        async with Tap(emu, cid) as tap:
            await tap.wait_for(lambda ev: "preview_reset" in [e["type"] for e in ev])
            await asyncio.sleep(0.02)
        # queue never changed → no queue_update
        assert tap.types() == ["message"] * 4 + ["status", "preview_reset"]
        ids = [e["message"]["id"] for e in tap.of("message")]
        assert ids == sorted(ids)
        assert tap.of("status")[0]["status"]["status"] == "waiting"
        assert all(e["chat_id"] == cid for e in tap.events)
        async with Tap(emu, cid, after_id=ids[1], prefix=V2) as tap:
            await tap.wait_for(lambda ev: "preview_reset" in [e["type"] for e in ev])
        assert [e["message"]["id"] for e in tap.of("message")] == ids[2:]
        assert tap.types()[2:] == ["status", "preview_reset"]
        assert tap.raw[0].endswith("\n") and tap.raw[0].startswith("[")


async def test_connect_order_with_queue_and_requires_action(emu: Emulator) -> None:
    async with client(emu) as c:
        chat = await create_chat(
            c,
            emu,
            '#emu {"tool_calls": [{"name": "t", "args": {}}]}',
            unsafe_dynamic_tools=[{"name": "t"}],
        )
        cid = chat["id"]
        await wait_status(emu, cid, "requires_action")
        assert (await send(c, cid, "later")).json()["queued"] is True
        async with Tap(emu, cid) as tap:
            await tap.wait_for(lambda ev: "preview_reset" in [e["type"] for e in ev])
        assert tap.types() == [
            "message",
            "message",
            "queue_update",
            "status",
            "action_required",
            "preview_reset",
        ]
        q = tap.of("queue_update")[0]["queued_messages"]
        assert q[0]["content"] == [{"type": "text", "text": "later"}]
        calls = tap.of("action_required")[0]["action_required"]["tool_calls"]
        assert set(calls[0]) == {"tool_call_id", "tool_name", "args"} and calls[0]["args"] == "{}"


async def test_connect_during_retry_gets_retry_event(emu: Emulator) -> None:
    async with client(emu) as c:
        emu.set_default_script(
            Script.of(
                ScriptStep(
                    (Text("x"),),
                    failures=(
                        __import__("coder_chat.emulator", fromlist=["Failure"]).Failure(
                            delay_ms=400
                        ),
                    ),
                )
            )
        )
        chat = await create_chat(c, emu, "go")
        cid = chat["id"]
        await asyncio.sleep(0.1)
        async with Tap(emu, cid) as tap:
            await tap.wait_for(lambda ev: "retry" in [e["type"] for e in ev])
            types = tap.types()
            assert types[:4] == ["message", "status", "retry", "preview_reset"]
            assert "message_part" not in types  # retired attempt: no parts
            await tap.wait_status("waiting")


async def test_reconnect_mid_episode_replays_from_seq_1(emu: Emulator) -> None:
    async with client(emu) as c:
        emu.set_default_script(Script.long_running(0.4, "0123456789", chunks=10))
        chat = await create_chat(c, emu, "go")
        cid = chat["id"]
        async with Tap(emu, cid) as tap:
            await tap.wait_for(lambda ev: len([e for e in ev if e["type"] == "message_part"]) >= 4)
        first = [e["message_part"] for e in tap.of("message_part")]
        async with Tap(emu, cid, after_id=tap.of("message")[-1]["message"]["id"]) as tap2:
            await tap2.wait_status("waiting")
        assert tap2.types()[:3] == ["status", "preview_reset", "message_part"]
        replay = [e["message_part"] for e in tap2.of("message_part")]
        assert replay[0]["seq"] == 1
        assert [p["part"] for p in replay[: len(first)]] == [p["part"] for p in first]
        assert "".join(p["part"]["text"] for p in replay) == "0123456789"


async def test_frames_are_arrays_of_at_most_256(emu: Emulator) -> None:
    async with client(emu) as c:
        emu.set_default_script(
            Script.of(ScriptStep((Sleep(0.1), Text("x" * 600, deltas=600, delay=0), Sleep(0.6))))
        )
        chat = await create_chat(c, emu, "go")
        emu.faults.stall_stream(chat["id"], seconds=0.4)
        async with Tap(emu, chat["id"]) as tap:
            await tap.wait_status("waiting", within=5)
        assert all(isinstance(f, list) and 1 <= len(f) <= 256 for f in tap.frames)
        assert max(len(f) for f in tap.frames) == 256
        parts = tap.of("message_part")
        assert [p["message_part"]["seq"] for p in parts] == list(range(1, 601))


def _raw_ws_connect(emu: Emulator, path: str) -> tuple[ClientProtocol, object]:
    return ClientProtocol(parse_uri(emu.ws_url + path)), None


@pytest.mark.emu(ping_interval=0.05, ping_timeout=0.1)
async def test_ping_keepalive_and_liveness_close(emu: Emulator) -> None:
    async with client(emu) as c:
        chat = await create_chat(c, emu, "x")
    proto = ClientProtocol(parse_uri(f"{emu.ws_url}{P}/{chat['id']}/stream"))
    req = proto.connect()
    req.headers["Coder-Session-Token"] = emu.token
    proto.send_request(req)
    reader, writer = await asyncio.open_connection("127.0.0.1", emu.port)
    for d in proto.data_to_send():
        writer.write(d)
    pings = 0
    close = None
    async with asyncio.timeout(5):
        while close is None:
            data = await reader.read(65536)
            if not data:
                proto.receive_eof()
            else:
                proto.receive_data(data)
            for ev in proto.events_received():
                if getattr(ev, "opcode", None) is Opcode.PING:
                    pings += 1
                if getattr(ev, "opcode", None) is Opcode.CLOSE:
                    close = (proto.close_rcvd.code, proto.close_rcvd.reason)  # type: ignore[union-attr]
            # Deliberately never flush our automatic pongs: the server must give up.
            proto.data_to_send()
            if not data:
                break
    writer.close()
    assert pings >= 1
    assert close == (1001, "liveness probe failed")


@pytest.mark.emu(ping_interval=0.05, ping_timeout=0.5)
async def test_responsive_client_survives_pings(emu: Emulator) -> None:
    async with client(emu) as c:
        chat = await create_chat(c, emu, "x")
        async with Tap(emu, chat["id"]) as tap:  # websockets answers pings itself
            await asyncio.sleep(0.3)
            assert not tap.closed.is_set()


async def test_watch(emu: Emulator) -> None:
    async with client(emu) as c:
        ws = await websockets.connect(
            f"{emu.ws_url}{P}/watch", additional_headers={"Coder-Session-Token": emu.token}
        )
        try:
            chat = await create_chat(c, emu, "x")
            seen = []
            async with asyncio.timeout(5):
                while not any(
                    e["kind"] == "status_change" and e["chat"]["status"] == "waiting" for e in seen
                ):
                    raw = await ws.recv()
                    obj = json.loads(raw)
                    assert isinstance(obj, dict)  # one object per frame, not an array
                    check_watch(obj)
                    seen.append(obj)
            assert seen[0]["kind"] == "created" and seen[0]["chat"]["id"] == chat["id"]
            await c.patch(f"{P}/{chat['id']}", json={"archived": True, "title": "New"})
            kinds = []
            async with asyncio.timeout(5):
                while "deleted" not in kinds:
                    obj = json.loads(await ws.recv())
                    check_watch(obj)
                    kinds.append(obj["kind"])
            assert kinds == ["title_change", "deleted"]
        finally:
            await ws.close()


async def test_queue_promotion_stream(emu: Emulator) -> None:
    async with client(emu) as c:
        emu.set_default_script(Script.long_running(0.1, "slow", chunks=2))
        chat = await create_chat(c, emu, "a")
        cid = chat["id"]
        async with Tap(emu, cid) as tap:
            await send(c, cid, "b")
            await tap.wait_for(
                lambda ev: (
                    sum(
                        1
                        for e in ev
                        if e["type"] == "message" and e["message"]["role"] == "assistant"
                    )
                    == 2
                )
            )
            await tap.wait_status("waiting")
        types = [t for t in tap.types() if t != "message_part"]
        # promotion: user message + queue_update, no status change between the runs
        i = max(i for i, e in enumerate(tap.events) if e["type"] == "queue_update")
        assert tap.events[i - 1]["type"] == "message"
        assert tap.events[i - 1]["message"]["role"] == "user"
        assert tap.statuses() == ["running", "waiting"]
        assert types.count("queue_update") == 2


async def test_edit_message_history_reset(emu: Emulator) -> None:
    async with client(emu) as c:
        chat = await create_chat(c, emu, "first")
        cid = chat["id"]
        await wait_status(emu, cid, "waiting")
        await send(c, cid, "second")
        await wait_status(emu, cid, "waiting")
        msgs = (await c.get(f"{P}/{cid}/messages")).json()["messages"]
        first_id = msgs[-1]["id"]
        async with Tap(emu, cid) as tap:
            await tap.wait_for(lambda ev: "preview_reset" in [e["type"] for e in ev])
            emu.set_default_script(Script.long_running(0.3, "slow", chunks=3))
            await send(c, cid, "third")  # running when edited: the turn is abandoned
            emu.set_default_script(None)
            r = await c.patch(
                f"{P}/{cid}/messages/{first_id}",
                json={"content": [{"type": "text", "text": "edited"}]},
            )
            assert r.status_code == 200, r.text
            assert r.json()["message"]["id"] == first_id
            assert r.json()["message"]["content"] == [{"type": "text", "text": "edited"}]
            await tap.wait_for(lambda ev: "history_reset" in [e["type"] for e in ev])
            await wait_status(emu, cid, "waiting")
            await tap.wait_for(
                lambda ev: (
                    ev[-1]["type"] == "status"
                    and any(
                        e["type"] == "message"
                        and e["message"]["content"][0].get("text") == "Echo: edited"
                        for e in ev
                    )
                )
            )
        i = tap.types().index("history_reset")
        assert tap.events[i + 1]["message"]["id"] == first_id
        visible = (await c.get(f"{P}/{cid}/messages")).json()["messages"]
        texts = [m["content"][0]["text"] for m in reversed(visible)]
        assert texts == ["edited", "Echo: edited"]
        # a fresh connect after an edit: history_reset + all, after_id ignored
        async with Tap(emu, cid, after_id=10_000) as tap2:
            await tap2.wait_for(lambda ev: "preview_reset" in [e["type"] for e in ev])
        assert tap2.types()[:3] == ["history_reset", "message", "message"]
        r = await c.patch(
            f"{P}/{cid}/messages/{visible[0]['id']}",
            json={"content": [{"type": "text", "text": "x"}]},
        )
        assert r.status_code == 400 and r.json()["message"] == "Only user messages can be edited."
        r = await c.patch(
            f"{P}/{cid}/messages/999999", json={"content": [{"type": "text", "text": "x"}]}
        )
        assert r.status_code == 404 and r.json()["message"] == "Chat message not found."
