"""Property test: random interleavings of sends, interrupts, tool results, archives, drops.

Invariants: the chat is never in an invalid execution state; message and queued ids only
increase; ``seq`` is contiguous from 1 per episode on every connection; a reader that
reconnects with its ``after_id`` cursor receives every committed visible message exactly
once.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import websockets
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coder_chat.emulator import Emulator
from coder_chat.emulator.statemachine import ExecView, classify

P = "/api/v2/chats"  # served by every era

ACTIONS = st.lists(
    st.sampled_from(
        [
            "send",
            "send_interrupt",
            "interrupt",
            "tool_results",
            "archive",
            "unarchive",
            "drop",
            "pause",
            "tool_turn",
            "slow_turn",
        ]
    ),
    min_size=3,
    max_size=14,
)


@pytest.fixture(scope="module")
def emu() -> Iterator[Emulator]:
    # The default (newest) era; the transitions it exercises do not differ per era.
    with Emulator.running_in_thread(
        delta_delay=0.0005,
        interrupt_wind_down=0.003,
        requires_action_timeout=30,
        log_requests=False,
    ) as e:
        yield e


class Reader:
    """Reconnecting /stream reader that keeps an ``after_id`` cursor."""

    def __init__(self, emu: Emulator, chat_id: str) -> None:
        self.emu = emu
        self.chat_id = chat_id
        self.cursor = 0
        self.delivered: list[int] = []
        self.connections: list[list[dict[str, Any]]] = []
        self.stop = False
        self.task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        while not self.stop:
            url = f"{self.emu.ws_url}{P}/{self.chat_id}/stream?after_id={self.cursor}"
            events: list[dict[str, Any]] = []
            self.connections.append(events)
            try:
                async with websockets.connect(
                    url,
                    additional_headers={"Coder-Session-Token": self.emu.token},
                    compression=None,
                ) as ws:
                    async for raw in ws:
                        frame = json.loads(raw)
                        assert isinstance(frame, list) and len(frame) <= 256
                        for ev in frame:
                            events.append(ev)
                            if ev["type"] == "history_reset":
                                # full replacement follows
                                self.cursor = 0
                                self.delivered = []
                            if ev["type"] == "message":
                                mid = ev["message"]["id"]
                                assert mid > self.cursor, "message re-delivered or out of order"
                                self.cursor = mid
                                self.delivered.append(mid)
            except (websockets.ConnectionClosed, OSError):
                pass
            await asyncio.sleep(0.002)


def check_valid(emu: Emulator, chat_id: str) -> dict[str, Any]:
    info = emu.chat(chat_id)
    view = ExecView(info["status"], len(info["queue"]), info["archived"])
    assert classify(view) != "INVALID", info
    assert info["execution_state"] == classify(view)
    return info


async def scenario(emu: Emulator, actions: list[str]) -> None:
    h = {"Coder-Session-Token": emu.token}
    async with httpx.AsyncClient(base_url=emu.base_url, headers=h, timeout=10) as c:
        r = await c.post(
            P,
            json={
                "organization_id": emu.organization_id,
                "content": [{"type": "text", "text": "start"}],
                "unsafe_dynamic_tools": [{"name": "t"}],
            },
        )
        assert r.status_code == 201
        cid = r.json()["id"]
        reader = Reader(emu, cid)
        reader.task = asyncio.create_task(reader.run())
        last_queued = 0
        for a in actions:
            if reader.task.done():
                reader.task.result()
            info = check_valid(emu, cid)
            if a in (
                "send",
                "send_interrupt",
                "tool_turn",
                "slow_turn",
                "fatal_turn",
                "retry_turn",
            ):
                if a == "fatal_turn":
                    text = '#emu {"sleep": 0.01, "fatal": "boom"}'
                elif a == "retry_turn":
                    text = '#emu {"retries": 1, "text": "again"}'
                elif a == "tool_turn":
                    text = '#emu {"tool_calls": [{"name": "t", "args": {"n": 1}}]}'
                elif a == "slow_turn":
                    text = '#emu {"text": "slow slow slow", "deltas": 6, "delay": 0.004}'
                else:
                    text = f"m{len(reader.delivered)}"
                busy = "interrupt" if a == "send_interrupt" else "queue"
                r = await c.post(
                    f"{P}/{cid}/messages",
                    json={"content": [{"type": "text", "text": text}], "busy_behavior": busy},
                )
                if info["archived"]:
                    assert r.status_code == 400
                else:
                    assert r.status_code in (200, 429), r.text
                    body = r.json()
                    if r.status_code == 200 and body["queued"]:
                        qid = body["queued_message"]["id"]
                        assert qid > last_queued
                        last_queued = qid
            elif a == "interrupt":
                r = await c.post(f"{P}/{cid}/interrupt")
                assert r.status_code in (200, 409)
                if r.status_code == 200:
                    assert r.json()["status"] in ("interrupting", "running", "waiting")
            elif a == "tool_results":
                pending = info["pending_tool_calls"]
                results = [
                    {"tool_call_id": p["tool_call_id"], "output": {"ok": 1}} for p in pending
                ] or [{"tool_call_id": "x", "output": 1}]
                r = await c.post(f"{P}/{cid}/tool-results", json={"results": results})
                assert r.status_code in (204, 400, 409), r.text
            elif a in ("archive", "unarchive"):
                r = await c.patch(f"{P}/{cid}", json={"archived": a == "archive"})
                assert r.status_code in (204, 400, 409), r.text
            elif a == "edit":
                users = [m for m in emu.messages(cid, include_system=False) if m["role"] == "user"]
                r = await c.patch(
                    f"{P}/{cid}/messages/{users[-1]['id']}",
                    json={"content": [{"type": "text", "text": "edited"}]},
                )
                if info["archived"]:
                    assert r.status_code == 400
                else:
                    assert r.status_code == 200, r.text
            elif a == "drop":
                emu.faults.drop_stream(cid)
            else:
                await asyncio.sleep(0.01)
            check_valid(emu, cid)
        # settle: bring the chat to rest
        async with asyncio.timeout(10):
            while True:
                info = check_valid(emu, cid)
                if info["archived"]:
                    await c.patch(f"{P}/{cid}", json={"archived": False})
                elif info["status"] == "requires_action":
                    await c.post(
                        f"{P}/{cid}/tool-results",
                        json={
                            "results": [
                                {"tool_call_id": p["tool_call_id"], "output": 1}
                                for p in info["pending_tool_calls"]
                            ]
                        },
                    )
                elif info["status"] in ("waiting", "error") and not info["queue"]:
                    break
                await asyncio.sleep(0.005)
            visible = [m["id"] for m in emu.messages(cid, include_system=False)]
            while reader.delivered != visible:
                assert len(reader.delivered) <= len(visible), (reader.delivered, visible)
                if reader.task.done():
                    reader.task.result()  # surfaces the reader's assertion
                await asyncio.sleep(0.005)
        reader.stop = True
        emu.faults.drop_stream(cid, code=1000)
        reader.task.cancel()
        await asyncio.gather(reader.task, return_exceptions=True)
        # global ids strictly increase in storage order
        all_ids = [m["id"] for m in emu.messages(cid)]
        assert all_ids == sorted(set(all_ids))
        # seq contiguity per episode per connection
        for events in reader.connections:
            eps: dict[tuple[int, int], list[int]] = {}
            for ev in events:
                if ev["type"] == "message_part":
                    mp = ev["message_part"]
                    eps.setdefault((mp["history_version"], mp["generation_attempt"]), []).append(
                        mp["seq"]
                    )
            for seqs in eps.values():
                assert seqs == list(range(1, len(seqs) + 1)), seqs


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(actions=ACTIONS)
def test_random_interleavings(emu: Emulator, actions: list[str]) -> None:
    asyncio.run(scenario(emu, actions))
