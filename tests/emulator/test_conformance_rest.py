"""Conformance: every REST route and error-table row, asserted on raw JSON."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from coder_chat.emulator import Emulator, Script

from .helpers import V2, P, client, create_chat, send, wait_status

NOT_FOUND = "Resource not found or you do not have access to this resource"
CHAT_KEYS = {
    "id",
    "organization_id",
    "owner_id",
    "last_model_config_id",
    "title",
    "status",
    "created_at",
    "updated_at",
    "archived",
    "shared",
    "pin_order",
    "mcp_server_ids",
    "labels",
    "has_unread",
    "client_type",
    "children",
    "last_turn_summary",
    "summary",
}


@pytest.mark.parametrize("prefix", [P, V2])
async def test_create_get_shape(emu: Emulator, prefix: str) -> None:
    async with client(emu) as c:
        chat = await create_chat(
            c, emu, "  Title line\nmore  ", prefix=prefix, labels={"team": "a", "k.x/y": "v:w"}
        )
        assert CHAT_KEYS <= set(chat)
        assert chat["status"] == "running" and chat["archived"] is False
        assert chat["title"] == "Title line" and chat["client_type"] == "api"
        assert chat["labels"] == {"team": "a", "k.x/y": "v:w"}
        assert chat["children"] == [] and chat["mcp_server_ids"] == []
        assert chat["organization_id"] == emu.organization_id
        r = await c.get(f"{prefix}/{chat['id']}")
        assert r.status_code == 200 and r.json()["id"] == chat["id"]
        other = P if prefix == V2 else V2
        assert (await c.get(f"{other}/{chat['id']}")).status_code == 200


async def test_create_validation_order(emu: Emulator) -> None:
    org = emu.organization_id
    cases = [
        ({"content": [{"type": "text", "text": "x"}]}, 400, "organization_id is required."),
        (
            {"organization_id": str(uuid.uuid4()), "content": []},
            403,
            "You are not a member of the specified organization.",
        ),
        ({"organization_id": org, "content": []}, 400, "Content is required."),
        ({"organization_id": org}, 400, "Content is required."),
        (
            {"organization_id": org, "content": [{"type": "text", "text": "  "}]},
            400,
            "Invalid input part.",
        ),
        (
            {"organization_id": org, "content": [{"type": "image", "url": "x"}]},
            400,
            "Invalid input part.",
        ),
        (
            {"organization_id": org, "content": [{"type": "file", "file_id": str(uuid.uuid4())}]},
            400,
            "Invalid input part.",
        ),
        (
            {
                "organization_id": org,
                "content": [{"type": "text", "text": "x"}],
                "model_config_id": str(uuid.uuid4()),
            },
            400,
            None,
        ),
        (
            {
                "organization_id": org,
                "content": [{"type": "text", "text": "x"}],
                "plan_mode": "yolo",
            },
            400,
            "Invalid plan_mode value.",
        ),
        (
            {
                "organization_id": org,
                "content": [{"type": "text", "text": "x"}],
                "labels": {"-bad": "v"},
            },
            400,
            "Invalid labels.",
        ),
        (
            {
                "organization_id": org,
                "content": [{"type": "text", "text": "x"}],
                "unsafe_dynamic_tools": [{"name": "a"}, {"name": "a"}],
            },
            400,
            "Duplicate dynamic tool name.",
        ),
        (
            {
                "organization_id": org,
                "content": [{"type": "text", "text": "x"}],
                "unsafe_dynamic_tools": [{"name": ""}],
            },
            400,
            "Dynamic tool name must not be empty.",
        ),
        (
            {
                "organization_id": org,
                "content": [{"type": "text", "text": "x"}],
                "unsafe_dynamic_tools": [{"name": f"t{i}"} for i in range(251)],
            },
            400,
            "Too many dynamic tools.",
        ),
        (
            {
                "organization_id": org,
                "content": [{"type": "text", "text": "x"}],
                "client_type": "cli",
            },
            400,
            "Invalid client_type.",
        ),
        (
            {
                "organization_id": org,
                "content": [{"type": "text", "text": "x"}],
                "reasoning_effort": "extreme",
            },
            400,
            "Invalid reasoning_effort value.",
        ),
    ]
    async with client(emu) as c:
        for body, status, message in cases:
            r = await c.post(P, json=body)
            assert r.status_code == status, (body, r.text)
            if message:
                assert r.json()["message"] == message
        r = await c.post(
            P,
            json={
                "organization_id": org,
                "content": [{"type": "text", "text": "x"}],
                "labels": {"": "v", "ok": ""},
            },
        )
        assert len(r.json()["validations"]) == 2
        assert r.json()["validations"][0]["field"] == "labels"
        r = await c.post(
            P,
            json={
                "organization_id": org,
                "content": [{"type": "text", "text": "x"}],
                "system_prompt": "y" * (300 * 1024),
            },
        )
        assert r.status_code == 413
        r = await c.post(
            P, json={"organization_id": org, "content": [{"type": "text", "text": " a "}]}
        )
        assert r.status_code == 201
    assert len(emu.chats()) == 1


async def test_auth_and_ownership(emu: Emulator) -> None:
    async with client(emu) as alice, client(emu, "tok-bob") as bob, client(emu, "nope") as bad:
        chat = await create_chat(alice, emu, "mine")
        cid = chat["id"]
        alice.headers.pop("Coder-Session-Token")
        r = await alice.get(f"{P}/{cid}")
        assert r.status_code == 401
        assert r.json() == {
            "message": "You are signed out or your session has expired. Please sign in again "
            "to continue.",
            "detail": 'Cookie "coder_session_token" or query parameter must be provided.',
        }
        alice.headers["Coder-Session-Token"] = "tok-alice"
        r = await bad.get(P)
        assert r.status_code == 401 and r.json()["detail"] == "API key is invalid."
        assert (await bad.get(f"{P}/not-a-uuid")).status_code == 401  # auth before parsing
        # not shared: another user's chat does not exist for them
        assert (await bob.get(f"{P}/{cid}")).json()["message"] == NOT_FOUND
        assert (await send(bob, cid, "x")).status_code == 404
        assert await bob.get(P) is not None and (await bob.get(P)).json() == []
        emu.share_chat(cid, "user1")
        assert (await bob.get(f"{P}/{cid}")).status_code == 200
        r = await send(bob, cid, "x")
        assert (
            r.status_code == 403 and r.json()["message"] == "Only the chat owner may send messages."
        )
        r = await bob.post(f"{P}/{cid}/tool-results", json={"results": []})
        assert r.status_code == 403
        assert (await bob.patch(f"{P}/{cid}", json={"title": "t"})).status_code == 404
        assert (await bob.post(f"{P}/{cid}/interrupt")).status_code == 404
        r = await bob.get(P, params={"q": "source:shared_with_me"})
        assert [x["id"] for x in r.json()] == [cid]
        r = await alice.get(f"{P}/not-a-uuid")
        assert r.status_code == 400 and r.json()["message"] == 'Invalid UUID "not-a-uuid".'
        assert "detail" in r.json()
        r = await alice.get(f"{P}/{uuid.uuid4()}")
        assert r.status_code == 404 and r.json()["message"] == NOT_FOUND


async def test_list_filters_order_paging(emu: Emulator) -> None:
    async with client(emu) as c:
        ids = []
        for i in range(5):
            chat = await create_chat(
                c, emu, f"c{i}", labels={"n": str(i), "grp": "g" if i % 2 else "h"}
            )
            ids.append(chat["id"])
            await wait_status(emu, chat["id"], "waiting")
        r = await c.get(P)
        assert r.status_code == 200 and isinstance(r.json(), list)
        assert [x["id"] for x in r.json()] == ids[::-1]  # newest updated_at first
        await send(c, ids[0], "bump")
        await wait_status(emu, ids[0], "waiting")
        assert (await c.get(P)).json()[0]["id"] == ids[0]
        assert (await c.patch(f"{P}/{ids[1]}", json={"archived": True})).status_code == 204
        assert ids[1] not in [x["id"] for x in (await c.get(P)).json()]
        arch = (await c.get(P, params={"q": "archived:true"})).json()
        assert [x["id"] for x in arch] == [ids[1]]
        assert len((await c.get(P, params={"q": "archived:any"})).json()) == 5
        r = await c.get(P, params=[("label", "grp:g"), ("label", "n:3")])
        assert [x["id"] for x in r.json()] == [ids[3]]
        r = await c.get(P, params=[("label", "n:1"), ("label", "n:3")])  # last value wins
        assert [x["id"] for x in r.json()] == [ids[3]]
        r = await c.get(P, params={"q": "status:waiting archived:any"})
        assert len(r.json()) == 5
        page1 = (await c.get(P, params={"limit": 2})).json()
        page2 = (await c.get(P, params={"limit": 2, "offset": 2})).json()
        page_k = (await c.get(P, params={"limit": 2, "after_id": page1[-1]["id"]})).json()
        assert len(page1) == 2 and page2 == page_k
        for params, msg in [
            ({"q": "hello"}, "Invalid chat search query."),
            ({"q": "owner:me"}, "Invalid chat search query."),
            ({"q": "archived:maybe"}, "Invalid chat search query."),
        ]:
            r = await c.get(P, params=params)
            assert r.status_code == 400 and r.json()["message"] == msg
        r = await c.get(P, params={"label": "nocolon"})
        assert r.status_code == 400
        assert r.json()["message"] == (
            'Invalid label filter: "nocolon" (expected format key:value, both must be non-empty)'
        )
        assert (await c.get(P, params={"label": ":v"})).status_code == 400
        r = await c.get(P, params={"limit": "-1"})
        assert (
            r.status_code == 400 and r.json()["message"] == "Query parameters have invalid values."
        )
        assert (await c.get(P, params={"after_id": "zzz"})).status_code == 400


@pytest.mark.emu(interrupt_wind_down=0.3)
async def test_patch_rules(emu: Emulator) -> None:
    async with client(emu) as c:
        emu.set_default_script(Script.long_running(2.0, "slow", chunks=4))
        chat = await create_chat(c, emu, "x")
        cid = chat["id"]
        r = await c.patch(
            f"{P}/{cid}", json={"title": "T1", "labels": {"a": "b"}, "archived": True}
        )
        assert r.status_code == 409
        assert r.json()["message"] == (
            "Cannot archive an active chat. Interrupt or wait for the chat to finish first."
        )
        got = (await c.get(f"{P}/{cid}")).json()
        assert got["title"] == "T1" and got["labels"] == {"a": "b"}  # non-atomic
        assert got["archived"] is False
        r = await c.post(f"{P}/{cid}/interrupt")
        assert r.json()["status"] == "interrupting"
        assert (await c.patch(f"{P}/{cid}", json={"archived": True})).status_code == 409
        await wait_status(emu, cid, "waiting")
        r = await c.patch(f"{P}/{cid}", json={"archived": False})
        assert r.status_code == 400 and r.json()["message"] == "Chat is already not archived."
        assert (await c.patch(f"{P}/{cid}", json={"archived": True})).status_code == 204
        r = await c.patch(f"{P}/{cid}", json={"archived": True})
        assert r.status_code == 400 and r.json()["message"] == "Chat is already archived."
        r = await c.patch(f"{P}/{cid}", json={"labels": {"bad key": "v"}})
        assert r.status_code == 400 and r.json()["message"] == "Invalid labels."
        r = await send(c, cid, "x")
        assert r.status_code == 400
        assert r.json()["message"] == "Cannot send messages to an archived chat."
        # archived is checked before the body is read
        r = await c.post(f"{P}/{cid}/messages", content=b"not json")
        assert r.json()["message"] == "Cannot send messages to an archived chat."
        r = await c.post(f"{P}/{cid}/tool-results", json={"results": [{"tool_call_id": "a"}]})
        assert r.status_code == 400
        assert r.json()["message"] == "Cannot submit tool results to an archived chat."
        r = await c.post(f"{P}/{cid}/interrupt")
        assert r.status_code == 409
        assert r.json()["message"] == "Chat is not in an interruptible state."
        assert (await c.patch(f"{P}/{cid}", json={"archived": False})).status_code == 204


async def test_messages_paging(emu: Emulator) -> None:
    async with client(emu) as c:
        chat = await create_chat(c, emu, "m0")
        cid = chat["id"]
        await wait_status(emu, cid, "waiting")
        for i in range(1, 4):
            await send(c, cid, f"m{i}")
            await wait_status(emu, cid, "waiting")
        r = (await c.get(f"{P}/{cid}/messages")).json()
        ids = [m["id"] for m in r["messages"]]
        assert len(ids) == 8 and ids == sorted(ids, reverse=True)
        assert r["has_more"] is False and r["queued_messages"] == []
        assert all(m["role"] != "system" for m in r["messages"])
        r = (await c.get(f"{P}/{cid}/messages", params={"limit": 3})).json()
        assert [m["id"] for m in r["messages"]] == ids[:3] and r["has_more"] is True
        r = (await c.get(f"{P}/{cid}/messages", params={"before_id": ids[2], "limit": 2})).json()
        assert [m["id"] for m in r["messages"]] == ids[3:5] and r["has_more"] is True
        r = (await c.get(f"{P}/{cid}/messages", params={"after_id": ids[5]})).json()
        assert [m["id"] for m in r["messages"]] == sorted(ids[:5])  # ascending
        r = (
            await c.get(f"{P}/{cid}/messages", params={"after_id": ids[6], "before_id": ids[1]})
        ).json()
        assert [m["id"] for m in r["messages"]] == ids[2:6]  # DESC within range
        for params, msg in [
            ({"limit": 0}, "Invalid limit parameter (1-200)."),
            ({"limit": 201}, "Invalid limit parameter (1-200)."),
            ({"limit": -1}, "Query parameters have invalid values."),
            ({"limit": "x"}, "Query parameters have invalid values."),
            ({"after_id": "x"}, "Query parameters have invalid values."),
            ({"after_id": 5, "before_id": 5}, "after_id must be less than before_id."),
        ]:
            r = await c.get(f"{P}/{cid}/messages", params=params)
            assert r.status_code == 400 and r.json()["message"] == msg, params
        assert (await c.get(f"{P}/{cid}/messages", params={"limit": 200})).status_code == 200


@pytest.mark.emu(queue_cap=20)
async def test_send_queue_and_queue_routes(emu: Emulator) -> None:
    async with client(emu) as c:
        emu.set_default_script(Script.long_running(3.0, "slow", chunks=4))
        chat = await create_chat(c, emu, "x")
        cid = chat["id"]
        r = await send(c, cid, "x", busy="later")
        assert r.status_code == 400 and r.json()["message"] == "Invalid busy_behavior value."
        r = await c.post(f"{P}/{cid}/messages", json={"content": []})
        assert r.json()["message"] == "Content is required."
        queued = []
        for i in range(20):
            r = await send(c, cid, f"q{i}")
            assert r.status_code == 200 and r.json()["queued"] is True
            assert "message" not in r.json()
            queued.append(r.json()["queued_message"])
        r = await send(c, cid, "overflow")
        assert r.status_code == 429 and r.json()["message"] == "Message queue is full."
        assert r.json()["detail"] == "Maximum 20 messages can be queued."
        q = (await c.get(f"{P}/{cid}/messages")).json()["queued_messages"]
        assert [x["id"] for x in q] == [x["id"] for x in queued]
        assert set(q[0]) >= {"id", "chat_id", "content", "created_at"}
        r = (await c.get(f"{P}/{cid}/messages", params={"after_id": 1})).json()
        assert r["queued_messages"] == []
        r = await c.delete(f"{P}/{cid}/queue/{queued[0]['id']}")
        assert r.status_code == 204
        r = await c.delete(f"{P}/{cid}/queue/{queued[0]['id']}")
        assert r.status_code == 404 and r.json()["message"] == "Queued message not found."
        r = await c.post(f"{P}/{cid}/queue/{queued[5]['id']}/promote")
        assert r.status_code == 202
        assert r.json() == {"message": "Queued message promotion accepted."}
        assert emu.chat(cid)["queue"][0]["id"] == queued[5]["id"]
        await wait_status(emu, cid, "running")  # interrupt done, promoted head runs
        # empty queue → 409
        for item in emu.chat(cid)["queue"]:
            assert (await c.delete(f"{P}/{cid}/queue/{item['id']}")).status_code == 204
        r = await c.delete(f"{P}/{cid}/queue/999")
        assert (
            r.status_code == 409 and r.json()["message"] == "Chat has no queued messages to delete."
        )
        r = await c.post(f"{P}/{cid}/queue/999/promote")
        assert r.status_code == 409
        assert r.json()["message"] == "Chat has no queued messages to promote."


async def test_tool_results_errors(emu: Emulator) -> None:
    async with client(emu) as c:
        chat = await create_chat(c, emu, "x", unsafe_dynamic_tools=[{"name": "a"}, {"name": "b"}])
        cid = chat["id"]
        await wait_status(emu, cid, "waiting")
        r = await c.post(f"{P}/{cid}/tool-results", json={"results": []})
        assert (
            r.status_code == 400 and r.json()["message"] == "At least one tool result is required."
        )
        r = await c.post(
            f"{P}/{cid}/tool-results", json={"results": [{"tool_call_id": "nope", "output": 1}]}
        )
        assert (
            r.status_code == 409 and r.json()["message"] == "Chat is not waiting for tool results."
        )
        assert r.json()["detail"] == 'chat status is "waiting", expected "requires_action"'
        emu.script_next_turn(cid, Script.client_tools([("a", {}), ("b", {"x": 1})]))
        await send(c, cid, "go")
        await wait_status(emu, cid, "requires_action")
        ids = [p["tool_call_id"] for p in emu.chat(cid)["pending_tool_calls"]]
        url = f"{P}/{cid}/tool-results"
        r = await c.post(url, json={"results": [{"tool_call_id": ids[0], "output": 1}]})
        assert r.status_code == 400 and r.json()["message"] == "Missing tool result."
        r = await c.post(
            url,
            json={
                "results": [
                    {"tool_call_id": ids[0], "output": 1},
                    {"tool_call_id": ids[0], "output": 1},
                ]
            },
        )
        assert r.json()["message"] == "Duplicate tool_call_id in results."
        r = await c.post(
            url, json={"results": [{"tool_call_id": ids[0]}, {"tool_call_id": ids[1], "output": 1}]}
        )
        assert r.json()["message"] == "Tool result output must be valid JSON."
        r = await c.post(
            url,
            json={
                "results": [{"tool_call_id": i, "output": 1} for i in ids]
                + [{"tool_call_id": "zz", "output": 1}]
            },
        )
        assert r.json()["message"] == "Unexpected tool result."
        assert r.json()["detail"] == 'No pending tool call with ID "zz".'
        assert emu.chat(cid)["status"] == "requires_action"
        r = await c.post(
            url,
            json={
                "results": [
                    {"tool_call_id": ids[1], "output": {"b": 2}, "is_error": True},
                    {"tool_call_id": ids[0], "output": None},
                ]
            },
        )
        assert r.status_code == 204 and r.content == b""
        r = await c.post(url, json={"results": [{"tool_call_id": ids[0], "output": 1}]})
        assert r.status_code in (409, 400)  # resubmission never succeeds


async def test_interrupt_requires_action_synthetic_results(emu: Emulator) -> None:
    async with client(emu) as c:
        chat = await create_chat(
            c,
            emu,
            '#emu {"tool_calls": [{"name": "a", "args": {"q": 1}}]}',
            unsafe_dynamic_tools=[{"name": "a"}],
        )
        cid = chat["id"]
        await wait_status(emu, cid, "requires_action")
        r = await c.post(f"{P}/{cid}/interrupt")
        assert r.status_code == 200 and r.json()["status"] == "running"
        await wait_status(emu, cid, "waiting")
        tool = next(m for m in emu.messages(cid) if m["role"] == "tool")
        part = tool["content"][0]
        assert part["result"] == "Tool execution interrupted by user" and part["is_error"] is True
        r = await c.post(f"{P}/{cid}/interrupt")
        assert r.status_code == 409


async def test_send_interrupt_while_running(emu: Emulator) -> None:
    async with client(emu) as c:
        emu.set_default_script(Script.long_running(2.0, "slow", chunks=4))
        chat = await create_chat(c, emu, "x")
        cid = chat["id"]
        await asyncio.sleep(0.05)
        emu.set_default_script(None)
        r = await send(c, cid, "now", busy="interrupt")
        assert r.json()["queued"] is True
        assert emu.chat(cid)["status"] in ("interrupting", "running")
        await wait_status(emu, cid, "waiting")
        roles = [(m["role"], m["content"][0].get("text")) for m in emu.messages(cid, False)]
        assert roles[-2] == ("user", "now") and roles[-1] == ("assistant", "Echo: now")


async def test_files_and_models(emu: Emulator) -> None:
    png = b"\x89PNG\r\n\x1a\n" + b"\x00" * 32
    async with client(emu) as c:
        url = f"{P}/files"
        r = await c.post(
            url,
            params={"organization": emu.organization_id},
            content=png,
            headers={
                "Content-Type": "image/png",
                "Content-Disposition": 'attachment; filename="a.png"',
            },
        )
        assert r.status_code == 201 and set(r.json()) == {"id"}
        fid = r.json()["id"]
        r = await c.get(f"{V2}/files/{fid}")
        assert r.status_code == 200 and r.content == png
        assert r.headers["content-type"] == "image/png"
        r = await c.post(url, content=png, headers={"Content-Type": "image/png"})
        assert r.status_code == 400
        r = await c.post(
            url,
            params={"organization": emu.organization_id},
            content=png,
            headers={"Content-Type": "application/zip"},
        )
        assert r.status_code == 400 and r.json()["message"] == "Unsupported file type."
        r = await c.post(
            url,
            params={"organization": emu.organization_id},
            content=b"text",
            headers={"Content-Type": "image/png"},
        )  # sniffed bytes disagree
        assert r.json()["message"] == "Unsupported file type."
        r = await c.post(
            url,
            params={"organization": emu.organization_id},
            content=b"a" * (10 * 1024 * 1024 + 1),
            headers={"Content-Type": "text/plain"},
        )
        assert r.status_code == 413 and r.json()["message"] == "File too large."
        chat = await create_chat(
            c,
            emu,
            "see file",
            content=[{"type": "text", "text": "see"}, {"type": "file", "file_id": fid}],
        )
        await wait_status(emu, chat["id"], "waiting")
        user = emu.messages(chat["id"], False)[0]
        assert user["content"][1] == {
            "type": "file",
            "file_id": fid,
            "media_type": "image/png",
            "name": "a.png",
        }
        assert (await c.get(f"{P}/model-configs")).status_code == 404
        r = await c.get(f"/api/v2/organizations/{emu.organization_id}/chats/models")
        assert r.status_code == 200 and set(r.json()) == {
            "models",
            "providers",
            "unsupported_providers",
        }
        assert r.json()["models"][0]["id"] == chat["last_model_config_id"]


FATAL_AFTER_SLEEP = '#emu {"sleep": 0.15, "fatal": {"message": "boom"}}'


async def _chat_in_e1(c, emu: Emulator) -> str:  # type: ignore[no-untyped-def]
    chat = await create_chat(c, emu, FATAL_AFTER_SLEEP)
    cid = chat["id"]
    r = await send(c, cid, "queued-1")
    assert r.json()["queued"] is True
    await wait_status(emu, cid, "error")
    assert emu.chat(cid)["execution_state"] == "E1"
    return cid


async def test_error_with_queue_send_promotes_old_head(emu: Emulator) -> None:
    async with client(emu) as c:
        cid = await _chat_in_e1(c, emu)
        r = await send(c, cid, "new")
        body = r.json()
        assert r.status_code == 200 and body["queued"] is True
        assert body["queued_message"]["content"] == [{"type": "text", "text": "new"}]
        assert [m["content"][0]["text"] for m in body["messages"]] == ["queued-1"]
        got = (await c.get(f"{P}/{cid}")).json()
        assert got["status"] == "running" and "last_error" not in got
        await wait_status(emu, cid, "waiting")
        users = [m["content"][0]["text"] for m in emu.messages(cid, False) if m["role"] == "user"]
        assert users == [FATAL_AFTER_SLEEP, "queued-1", "new"]


async def test_error_with_queue_promote_and_archive(emu: Emulator) -> None:
    async with client(emu) as c:
        cid = await _chat_in_e1(c, emu)
        # archive keeps status and queue (XE1), unarchive returns to E1
        assert (await c.patch(f"{P}/{cid}", json={"archived": True})).status_code == 204
        assert emu.chat(cid)["execution_state"] == "XE1"
        qid = emu.chat(cid)["queue"][0]["id"]
        r = await c.post(f"{P}/{cid}/queue/{qid}/promote")
        assert r.status_code == 400
        assert r.json()["message"] == "Cannot promote queued messages in an archived chat."
        assert (await c.patch(f"{P}/{cid}", json={"archived": False})).status_code == 204
        r = await c.post(f"{P}/{cid}/queue/{qid}/promote")
        assert r.status_code == 202
        await wait_status(emu, cid, "waiting")
        assert emu.chat(cid)["queue"] == []


async def test_stream_after_revision_b2(emu: Emulator) -> None:
    from .helpers import Tap

    async with client(emu) as c:
        chat = await create_chat(c, emu, "x")
        cid = chat["id"]
        await wait_status(emu, cid, "waiting")
        hv = emu.chat(cid)["history_version"]
        async with Tap(emu, cid, query=f"after_revision={hv}") as tap:
            await tap.wait_status("waiting")
            await asyncio.sleep(0.02)
        assert tap.types() == ["status"]  # nothing newer, no preview_reset at the cursor
        assert tap.of("status")[0]["status"]["history_version"] == hv
        import websockets

        with pytest.raises(websockets.InvalidStatus) as ei:
            await websockets.connect(
                f"{emu.ws_url}{P}/{cid}/stream?after_revision=-1",
                additional_headers={"Coder-Session-Token": emu.token},
            )
        assert ei.value.response.status_code == 400
