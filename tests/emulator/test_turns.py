"""Scripted-model turns over real sockets: echo, tools, retries, errors, interrupts."""

from __future__ import annotations

import asyncio
import json

import pytest

from coder_chat.emulator import Emulator, Script, ScriptedToolCall, ScriptStep, Sleep, Text

from .helpers import P, Tap, client, create_chat, send, wait_status

TOOLS = [
    {"name": "structured_output", "description": "answer", "input_schema": {"type": "object"}},
    {"name": "lookup", "input_schema": {"type": "object"}},
]


async def test_default_echo_turn_shape(emu: Emulator) -> None:
    async with client(emu) as c:
        chat = await create_chat(c, emu, "hello world")
        assert chat["status"] == "running"
        async with Tap(emu, chat["id"]) as tap:
            await tap.wait_status("waiting")
        msgs = [e["message"] for e in tap.of("message")]
        assert [m["role"] for m in msgs] == ["user", "assistant"]
        assert msgs[1]["content"] == [{"type": "text", "text": "Echo: hello world"}]
        u = msgs[1]["usage"]
        assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"] > 0
        parts = tap.of("message_part")
        assert len(parts) >= 3
        assert "".join(p["message_part"]["part"]["text"] for p in parts) == "Echo: hello world"
        assert [p["message_part"]["seq"] for p in parts] == list(range(1, len(parts) + 1))
        assert {p["message_part"]["generation_attempt"] for p in parts} == {1}
        # no terminal status in between: running then waiting
        assert tap.statuses() == ["running", "waiting"]


async def test_client_tool_requires_action_then_results(emu: Emulator) -> None:
    async with client(emu) as c:
        emu.set_default_script(
            Script.of(
                ScriptStep((Sleep(0.1), ScriptedToolCall("structured_output", {"answer": 42}))),
                ScriptStep((Text("Done."),)),
            )
        )
        chat = await create_chat(c, emu, "q", unsafe_dynamic_tools=TOOLS)
        async with Tap(emu, chat["id"]) as tap:
            await tap.wait_for(lambda ev: any(e["type"] == "action_required" for e in ev))
            ar = tap.of("action_required")[0]["action_required"]["tool_calls"]
            assert len(ar) == 1 and ar[0]["tool_name"] == "structured_output"
            assert json.loads(ar[0]["args"]) == {"answer": 42}
            assert isinstance(ar[0]["args"], str)
            types = tap.types()
            # assistant tool-call message precedes requires_action status and action_required
            assert types.index("action_required") > types.index("status")
            arg_parts = [
                p["message_part"]["part"]
                for p in tap.of("message_part")
                if p["message_part"]["part"]["type"] == "tool-call"
            ]
            assert any("args_delta" in p for p in arg_parts)
            assert arg_parts[-1]["args"] == {"answer": 42}
            r = await c.post(
                f"{P}/{chat['id']}/tool-results",
                json={"results": [{"tool_call_id": ar[0]["tool_call_id"], "output": {"ok": True}}]},
            )
            assert r.status_code == 204, r.text
            await tap.wait_status("waiting")
        assert tap.statuses() == ["running", "requires_action", "running", "waiting"]
        msgs = [e["message"] for e in tap.of("message")]
        tool = next(m for m in msgs if m["role"] == "tool")
        assert tool["content"][0] == {
            "type": "tool-result",
            "tool_call_id": ar[0]["tool_call_id"],
            "tool_name": "structured_output",
            "result": {"ok": True},
        }
        assert tool["created_by"] == emu.users[0]["id"]
        assert msgs[-1]["content"] == [{"type": "text", "text": "Done."}]


async def test_follow_up_mentions_results(emu: Emulator) -> None:
    async with client(emu) as c:
        chat = await create_chat(c, emu, "x", unsafe_dynamic_tools=TOOLS)
        emu.script_next_turn(chat["id"], Script.client_tool("lookup", {"k": 1}))
        # the create already started with the echo script; script the next one
        await wait_status(emu, chat["id"], "waiting")
        await send(c, chat["id"], "again")
        await wait_status(emu, chat["id"], "requires_action")
        pending = emu.chat(chat["id"])["pending_tool_calls"]
        r = await c.post(
            f"{P}/{chat['id']}/tool-results",
            json={"results": [{"tool_call_id": pending[0]["tool_call_id"], "output": "v1"}]},
        )
        assert r.status_code == 204
        await wait_status(emu, chat["id"], "waiting")
        last = emu.messages(chat["id"])[-1]
        assert last["content"][0]["text"] == 'Results: lookup → "v1"'


async def test_server_tool_and_multistep_and_reasoning(emu: Emulator) -> None:
    async with client(emu) as c:
        script = Script.of(
            ScriptStep((Sleep(0.1), Text("thinking", deltas=2))),
            Script.server_tool("web_search", {"q": "x"}, {"hits": 1}).steps[0],
            ScriptStep((Text("final"),)),
        )
        emu.set_default_script(script)
        chat = await create_chat(c, emu, "go")
        async with Tap(emu, chat["id"]) as tap:
            await tap.wait_status("waiting")
        msgs = [e["message"] for e in tap.of("message")]
        assert [m["role"] for m in msgs] == ["user", "assistant", "assistant", "assistant"]
        tc = msgs[2]["content"]
        assert tc[0]["type"] == "tool-call" and tc[0]["provider_executed"] is True
        assert tc[1] == {
            "type": "tool-result",
            "tool_call_id": tc[0]["tool_call_id"],
            "tool_name": "web_search",
            "result": {"hits": 1},
            "provider_executed": True,
        }
        assert tap.statuses() == ["running", "waiting"]
        # each step is its own episode: seq restarts at 1
        eps: dict[tuple[int, int], list[int]] = {}
        for p in tap.of("message_part"):
            mp = p["message_part"]
            eps.setdefault((mp["history_version"], mp["generation_attempt"]), []).append(mp["seq"])
        assert len(eps) == 3
        for seqs in eps.values():
            assert seqs == list(range(1, len(seqs) + 1))


async def test_retry_then_success(emu: Emulator) -> None:
    async with client(emu) as c:
        chat = await create_chat(c, emu, "first")
        await wait_status(emu, chat["id"], "waiting")
        # The reader is connected before the retrying turn starts, so it sees every retry
        # however slowly it connects (a loaded CI box).
        async with Tap(emu, chat["id"]) as tap:
            await tap.wait_status("waiting")
            emu.script_next_turn(chat["id"], Script.retry_then_success(2, "ok now"))
            await send(c, chat["id"], "go")
            await tap.wait_status("waiting", nth=2)
        retries = tap.of("retry")
        assert [r["retry"]["attempt"] for r in retries] == [1, 2]
        r0 = retries[0]["retry"]
        assert set(r0) >= {"attempt", "delay_ms", "error", "retrying_at"}
        assert tap.statuses() == ["waiting", "running", "waiting"]
        assert tap.of("message")[-1]["message"]["content"][0]["text"] == "ok now"
        attempts = {p["message_part"]["generation_attempt"] for p in tap.of("message_part")}
        assert 3 in attempts


async def test_fatal_error(emu: Emulator) -> None:
    async with client(emu) as c:
        chat = await create_chat(c, emu, '#emu {"fatal": {"message": "boom", "kind": "auth"}}')
        async with Tap(emu, chat["id"]) as tap:
            await tap.wait_for(lambda ev: any(e["type"] == "error" for e in ev))
        err = tap.of("error")[0]["error"]
        assert err["message"] == "boom" and err["kind"] == "auth" and err["retryable"] is False
        assert tap.statuses()[-1] == "error"
        r = await c.get(f"{P}/{chat['id']}")
        assert r.json()["status"] == "error" and r.json()["last_error"]["message"] == "boom"
        # reconnect re-sends the error
        async with Tap(emu, chat["id"]) as tap2:
            await tap2.wait_for(lambda ev: any(e["type"] == "error" for e in ev))
        # a new message clears it
        r = await send(c, chat["id"], "retry please")
        assert r.status_code == 200 and r.json()["queued"] is False
        await wait_status(emu, chat["id"], "waiting")
        assert "last_error" not in (await c.get(f"{P}/{chat['id']}")).json()


async def test_interrupt_long_running_commits_partial(emu: Emulator) -> None:
    async with client(emu) as c:
        emu.set_default_script(Script.long_running(5.0, "a b c d e f g h i j", chunks=10))
        chat = await create_chat(c, emu, "go")
        async with Tap(emu, chat["id"]) as tap:
            await tap.wait_for(lambda ev: len([e for e in ev if e["type"] == "message_part"]) >= 2)
            r = await c.post(f"{P}/{chat['id']}/interrupt")
            assert r.status_code == 200 and r.json()["status"] == "interrupting"
            r2 = await c.patch(f"{P}/{chat['id']}", json={"archived": True})
            assert r2.status_code in (409, 204)
            await tap.wait_status("waiting")
        assert tap.statuses() == ["running", "interrupting", "waiting"]
        partial = tap.of("message")[-1]["message"]
        assert partial["role"] == "assistant"
        assert 0 < len(partial["content"][0]["text"]) < len("a b c d e f g h i j")


async def test_queue_promotion_no_terminal_between(emu: Emulator) -> None:
    async with client(emu) as c:
        emu.set_default_script(Script.long_running(0.15, "slow", chunks=3))
        chat = await create_chat(c, emu, "one")
        async with Tap(emu, chat["id"]) as tap:
            r1 = await send(c, chat["id"], "two")
            r2 = await send(c, chat["id"], "three")
            assert r1.json()["queued"] and r2.json()["queued"]
            assert r2.json()["queued_message"]["id"] == r1.json()["queued_message"]["id"] + 1
            await tap.wait_for(
                lambda ev: (
                    sum(
                        1
                        for e in ev
                        if e["type"] == "message" and e["message"]["role"] == "assistant"
                    )
                    == 3
                ),
                within=5,
            )
            await tap.wait_status("waiting")
        assert tap.statuses() == ["running", "waiting"]
        users = [
            e["message"]["content"][0]["text"]
            for e in tap.of("message")
            if e["message"]["role"] == "user"
        ]
        assert users == ["one", "two", "three"]
        qu = tap.of("queue_update")
        assert "queued_messages" not in qu[-1]  # empty queue: key absent
        ids = [e["message"]["id"] for e in tap.of("message")]
        assert ids == sorted(ids)


@pytest.mark.emu(max_concurrent_root_chats=2)
async def test_capacity_seam_and_turn_log(emu: Emulator) -> None:
    async with client(emu) as c:
        emu.set_default_script(Script.long_running(0.15, "slow", chunks=3))
        chats = [await create_chat(c, emu, f"c{i}") for i in range(4)]
        await asyncio.sleep(0.05)
        waiting = [ch["id"] for ch in chats if emu.chat(ch["id"])["queued_for_capacity"]]
        assert len(waiting) == 2
        assert all(emu.chat(cid)["status"] == "running" for cid in waiting)
        for ch in chats:
            await wait_status(emu, ch["id"], "waiting", within=5)
        assert emu.max_concurrent_turns() == 2
        starts = emu.event_log(["turn_start"])
        ends = emu.event_log(["turn_end"])
        assert len(starts) == len(ends) == 4
        assert all(e["time"] > 0 and "running" in e["details"] for e in starts + ends)
