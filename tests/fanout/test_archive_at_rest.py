"""A workflow whose steps all finished archives its chat with one PATCH, no read first
(issue 13, round 6), and a chat that is busy all the same is still stopped the long
way: "cut short" journaled, interrupted, then archived."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

from fanout_env import fanout_items, fanout_settings

from coder_chat.emulator import Emulator
from coder_chat.models import ChatInputPart, CreateChatRequest
from prefect_coder.blocks.state import JournalEntry
from prefect_coder.flows.common.resources import load_resources
from prefect_coder.flows.deployments.agent_fanout import agent_fanout
from prefect_coder.flows.recovery.retire import retire_workflow_chat


def _requests(emu: Emulator, chat_id: str) -> list[tuple[str, str]]:
    return [
        (e["details"]["method"], e["details"]["path"].split(chat_id, 1)[1])
        for e in emu.event_log(["request"])
        if e["chat_id"] == chat_id
    ]


async def test_a_finished_workflow_archives_with_one_patch(
    prefect_server: Path, emu: Emulator, store_url: str
) -> None:
    settings = await fanout_settings(emu, store_url, cap=5)
    run = uuid.uuid4().hex[:6]
    outcomes = await agent_fanout(fanout_items(run, 3, ["only"], 0.05), settings)
    assert [o.ok for o in outcomes] == [True] * 3
    chats = emu.chats()
    assert len(chats) == 3 and all(c["archived"] for c in chats)
    for chat in chats:
        calls = _requests(emu, chat["id"])
        # The turn's own calls (messages, stream) plus the archive: no GET of the chat.
        assert calls.count(("PATCH", "")) == 1, calls
        assert ("GET", "") not in calls, calls


async def test_a_busy_chat_is_still_cut_short_interrupted_and_archived(
    prefect_server: Path, emu: Emulator, store_url: str
) -> None:
    settings = await fanout_settings(emu, store_url, cap=5)
    resources = await load_resources(settings)
    wid = f"busy-{uuid.uuid4().hex[:6]}"
    store = resources.store
    try:
        async with resources.credentials.get_client() as client:
            chat = await client.create_chat(
                CreateChatRequest(
                    organization_id=str(emu.organization_id),
                    content=[ChatInputPart.text_part('m1 #emu {"sleep": 30, "text": "late"}')],
                )
            )
        deadline = time.monotonic() + 30
        while next(c for c in emu.chats() if c["id"] == chat.id)["status"] != "running":
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        await store.checkpoints.set(wid, chat.id, None)
        await store.journal.set(
            chat.id, JournalEntry(state="submitting", marker="m1", attempt=0, at=time.time())
        )
        outcome = await retire_workflow_chat(wid, resources, settled=True, interrupt_bound_s=15)
        assert outcome.archived_chat_ids == [chat.id]
        calls: list[Any] = _requests(emu, chat.id)
        # The PATCH first (refused: a run is active), then stop_chat: its read, the
        # journal's "cut short" (it counts the step's messages), the interrupt, polls
        # until the run is at rest, the archive.
        rest = calls[calls.index(("PATCH", "")) :]
        assert rest[:2] == [("PATCH", ""), ("GET", "")], calls
        assert ("POST", "/interrupt") in rest and rest[-1] == ("PATCH", ""), calls
        assert next(c for c in emu.chats() if c["id"] == chat.id)["archived"]
        entry = await store.journal.get(chat.id)
        assert entry is not None and entry.state == "cut-short"
    finally:
        await store.aclose()
