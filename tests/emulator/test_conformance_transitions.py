"""Conformance: the status-transition table driven over the wire (raw HTTP + introspection).

The pure machine is tested exhaustively in test_statemachine.py; this pins that the server
applies it: each row is reached through real requests and checked via GET /chats/{id}.
"""

from __future__ import annotations

import httpx
import pytest

from coder_chat.emulator import Emulator

from .helpers import P, client, create_chat, send, wait_status

TOOL = '#emu {"tool_calls": [{"name": "t", "args": {"a": 1}}]}'
SLOW = '#emu {"text": "slow slow slow slow", "deltas": 4, "delay": 0.5}'
FATAL = '#emu {"fatal": "boom"}'


async def reach(c: httpx.AsyncClient, emu: Emulator, state: str) -> str:
    """Create a chat and drive it into ``state`` (W, E0, R0, R1, I0, I1, A0, A1, XW, XE0)."""
    if state in ("W", "XW"):
        chat = await create_chat(c, emu, "hi")
        await wait_status(emu, chat["id"], "waiting")
    elif state in ("E0", "XE0"):
        chat = await create_chat(c, emu, FATAL)
        await wait_status(emu, chat["id"], "error")
    elif state[0] in "RI":
        chat = await create_chat(c, emu, SLOW)
        if state[1] == "1":
            assert (await send(c, chat["id"], "queued")).json()["queued"]
        if state[0] == "I":
            assert (await c.post(f"{P}/{chat['id']}/interrupt")).json()["status"] == "interrupting"
    else:  # A0 / A1
        chat = await create_chat(c, emu, TOOL, unsafe_dynamic_tools=[{"name": "t"}])
        await wait_status(emu, chat["id"], "requires_action")
        if state == "A1":
            assert (await send(c, chat["id"], "queued")).json()["queued"]
    if state.startswith("X"):
        assert (await c.patch(f"{P}/{chat['id']}", json={"archived": True})).status_code == 204
    got = emu.chat(chat["id"])["execution_state"]
    assert got == state, (state, got)
    return str(chat["id"])


async def results(c: httpx.AsyncClient, emu: Emulator, cid: str) -> httpx.Response:
    pending = emu.chat(cid)["pending_tool_calls"]
    return await c.post(
        f"{P}/{cid}/tool-results",
        json={
            "results": [
                {"tool_call_id": p["tool_call_id"], "output": {"ok": True}} for p in pending
            ]
        },
    )


ROWS = [
    # (from, trigger, expected execution state right after the request)
    ("W", "send_queue", "R0"),
    ("E0", "send_queue", "R0"),
    ("R0", "send_queue", "R1"),
    ("R1", "send_queue", "R1"),
    ("I0", "send_queue", "I1"),
    ("A0", "send_queue", "A1"),
    ("A1", "send_queue", "A1"),
    ("W", "send_interrupt", "R0"),
    ("R0", "send_interrupt", "I1"),
    ("R1", "send_interrupt", "I1"),
    ("I1", "send_interrupt", "I1"),
    ("A0", "send_interrupt", "R1"),
    ("A1", "send_interrupt", "R1"),
    ("A0", "tool_results", "R0"),
    ("A1", "tool_results", "R1"),
    ("R0", "interrupt", "I0"),
    ("R1", "interrupt", "I1"),
    ("A0", "interrupt", "R0"),
    ("A1", "interrupt", "R1"),
    ("A1", "promote", "R0"),
    ("R1", "promote", "I1"),
    ("I1", "promote", "I1"),
    ("R1", "delete", "R0"),
    ("A1", "delete", "A0"),
    ("W", "archive", "XW"),
    ("E0", "archive", "XE0"),
    ("XW", "unarchive", "W"),
    ("XE0", "unarchive", "E0"),
]


@pytest.mark.emu(interrupt_wind_down=0.4, delta_delay=0.0005)
@pytest.mark.parametrize("start,trigger,expected", ROWS)
async def test_transition_row(emu: Emulator, start: str, trigger: str, expected: str) -> None:
    async with client(emu) as c:
        cid = await reach(c, emu, start)
        if trigger in ("send_queue", "send_interrupt"):
            r = await send(c, cid, "go", busy=trigger.split("_")[1])
            assert r.status_code == 200, r.text
        elif trigger == "tool_results":
            assert (await results(c, emu, cid)).status_code == 204
        elif trigger == "interrupt":
            r = await c.post(f"{P}/{cid}/interrupt")
            assert r.status_code == 200
            assert r.json()["status"] == {"I": "interrupting", "R": "running"}[expected[0]]
        elif trigger in ("promote", "delete"):
            qid = emu.chat(cid)["queue"][-1]["id"]
            if trigger == "promote":
                assert (await c.post(f"{P}/{cid}/queue/{qid}/promote")).status_code == 202
            else:
                assert (await c.delete(f"{P}/{cid}/queue/{qid}")).status_code == 204
        else:
            r = await c.patch(f"{P}/{cid}", json={"archived": trigger == "archive"})
            assert r.status_code == 204
        got = emu.chat(cid)["execution_state"]
        assert got == expected, (start, trigger, got)
        wire = (await c.get(f"{P}/{cid}")).json()
        assert (
            wire["status"]
            == {
                "W": "waiting",
                "E": "error",
                "R": "running",
                "I": "interrupting",
                "A": "requires_action",
                "X": wire["status"],
            }[expected[0]]
        )


@pytest.mark.emu(interrupt_wind_down=0.05)
async def test_worker_rows_finish_interruption_and_error_with_queue(emu: Emulator) -> None:
    async with client(emu) as c:
        cid = await reach(c, emu, "I1")
        await wait_status(emu, cid, "running")  # I1 → head promoted → running
        assert emu.chat(cid)["queue"] == []
        cid = await reach(c, emu, "I0")
        await wait_status(emu, cid, "waiting")  # I0 → W
        chat = await create_chat(c, emu, '#emu {"sleep": 0.2, "fatal": "boom"}')
        await send(c, chat["id"], "q")
        await wait_status(emu, chat["id"], "error")
        assert emu.chat(chat["id"])["execution_state"] == "E1"  # R1 → E1
