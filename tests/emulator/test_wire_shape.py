"""Wire shape: every REST body and stream frame matches the server's types (issue 14).

``helpers.client`` and ``helpers.Tap`` validate everything they see against
``wire_models`` (extra keys forbidden, required keys required), so the conformance
scenarios all check shapes; this file proves the check bites and drives one scenario that
produces every event type, then the unknown-collection-word routes.
"""

from __future__ import annotations

import asyncio
import json

import pydantic
import pytest
import websockets

from coder_chat.emulator import ERA_NAMES, Emulator, Script, ScriptStep, Sleep, Text
from coder_chat.emulator.script import Failure

from .helpers import V2, P, Tap, client, create_chat, send, wait_status
from .wire_check import check_frame, check_rest, check_watch

CHAT = "00000000-0000-4000-8000-000000000001"


def test_checker_rejects_internal_and_missing_fields() -> None:
    queued = {"id": 1, "chat_id": CHAT, "content": [], "created_at": "2026-01-01T00:00:00Z"}
    check_frame([{"type": "queue_update", "chat_id": CHAT, "queued_messages": [queued]}])
    leaked = {**queued, "_created_by": CHAT}
    with pytest.raises(pydantic.ValidationError):
        check_frame([{"type": "queue_update", "chat_id": CHAT, "queued_messages": [leaked]}])
    with pytest.raises(pydantic.ValidationError):
        check_frame([{"type": "status", "chat_id": CHAT}])  # payload missing
    with pytest.raises(pydantic.ValidationError):
        check_frame([{"type": "status", "chat_id": CHAT, "status": {"status": "pending"}}])
    with pytest.raises(pydantic.ValidationError):
        check_rest("GET", f"{V2}/{CHAT}/messages", 200, {"messages": [], "has_more": False})
    with pytest.raises(pydantic.ValidationError):
        check_rest("POST", f"{V2}/{CHAT}/interrupt", 409, {"message": "x", "code": 1})


async def _watch_frames(ws: websockets.ClientConnection, out: list[dict[str, object]]) -> None:
    async for raw in ws:
        obj = json.loads(raw)
        check_watch(obj)
        out.append(obj)


@pytest.mark.parametrize("era", ERA_NAMES)
async def test_every_event_type_matches_the_wire_types(emu: Emulator, era: str) -> None:
    async with client(emu) as c:
        ws = await websockets.connect(
            f"{emu.ws_url}{V2}/watch", additional_headers={"Coder-Session-Token": emu.token}
        )
        watched: list[dict[str, object]] = []
        watcher = asyncio.create_task(_watch_frames(ws, watched))
        try:
            chat = await create_chat(
                c,
                emu,
                "go",
                prefix=V2,
                unsafe_dynamic_tools=[{"name": "lookup", "input_schema": {}}],
            )
            cid = chat["id"]
            async with Tap(emu, cid, prefix=V2) as tap:
                await wait_status(emu, cid, "waiting")
                # queue_update with queued messages, retry, message_part from a slow turn
                emu.script_next_turn(
                    cid,
                    Script.of(
                        ScriptStep(
                            (Sleep(0.2), Text("slow", deltas=2)),
                            failures=(Failure(delay_ms=20),),
                        )
                    ),
                )
                assert (await send(c, cid, "one", prefix=V2)).status_code == 200
                r = await send(c, cid, "queued", prefix=V2)
                assert r.json()["queued"] is True
                await tap.wait_for(lambda ev: any(e["type"] == "retry" for e in ev))
                await wait_status(emu, cid, "waiting")
                # action_required, then tool results
                emu.script_next_turn(cid, Script.client_tool("lookup", {"q": 1}))
                await send(c, cid, "tool", prefix=V2)
                await wait_status(emu, cid, "requires_action")
                call = emu.chat(cid)["pending_tool_calls"][0]["tool_call_id"]
                r = await c.post(
                    f"{V2}/{cid}/tool-results",
                    json={"results": [{"tool_call_id": call, "output": {"ok": 1}}]},
                )
                assert r.status_code == 204
                await wait_status(emu, cid, "waiting")
                # error event
                emu.script_next_turn(cid, Script.fatal("boom"))
                await send(c, cid, "fail", prefix=V2)
                await wait_status(emu, cid, "error")
                # history_reset via an edit (EditChatMessageResponse)
                page = (await c.get(f"{V2}/{cid}/messages")).json()["messages"]
                first_user = [m for m in page if m["role"] == "user"][-1]  # newest first
                r = await c.patch(
                    f"{V2}/{cid}/messages/{first_user['id']}",
                    json={"content": [{"type": "text", "text": "edited"}]},
                )
                assert r.status_code == 200 and r.json()["deleted_message_ids"]
                await wait_status(emu, cid, "waiting")
                await tap.wait_for(lambda ev: any(e["type"] == "history_reset" for e in ev))
                await tap.wait_status("waiting", nth=3)
            seen = set(tap.types())
            assert {
                "message",
                "message_part",
                "status",
                "error",
                "queue_update",
                "retry",
                "action_required",
                "preview_reset",
                "history_reset",
            } <= seen
            with_queue = [e for e in tap.of("queue_update") if e.get("queued_messages")]
            assert with_queue and all(
                set(q) <= {"id", "chat_id", "model_config_id", "content", "created_at"}
                for e in with_queue
                for q in e["queued_messages"]
            )
            # the rest of the REST surface, validated by the client hook
            assert (await c.get(f"{V2}/{cid}")).status_code == 200
            assert (await c.get(V2, params={"q": "archived:false"})).status_code == 200
            assert (await c.post(f"{V2}/{cid}/interrupt")).status_code == 409
            r = await c.get(f"/api/v2/organizations/{emu.organization_id}/chats/models")
            assert r.status_code == 200
            r = await c.post(
                f"{V2}/files",
                params={"organization": emu.organization_id},
                content=b"hello",
                headers={"Content-Type": "text/plain"},
            )
            assert r.status_code == 201
        finally:
            await ws.close()
            await asyncio.wait_for(watcher, 5)
        kinds = {e["kind"] for e in watched}
        assert {"created", "status_change", "action_required"} <= kinds


@pytest.mark.parametrize("prefix", [P, V2])
@pytest.mark.parametrize(
    "path",
    ["/models", "/model-configs", "/providers", "/config/x", "/by-workspace", "/models/x"],
)
async def test_collection_words_are_routes_not_chat_ids(
    emu: Emulator, prefix: str, path: str
) -> None:
    async with client(emu) as c:
        r = await c.get(prefix + path)
        assert r.status_code == 404 and r.json() == {"message": "Route not found."}
        r = await c.get(f"{prefix}/not-a-chat")  # an arbitrary word is a malformed chat id
        assert r.status_code == 400 and r.json()["message"] == 'Invalid UUID "not-a-chat".'
