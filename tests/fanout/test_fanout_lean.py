"""What a fan-out no longer sends to the Prefect server per workflow (issue 13, round 5),
and what it still does.

* A fan-out's workflow archives its chat inline: no ``archive-chat`` task run (one
  task run per one-turn workflow instead of two), while the chat is archived and
  its ``coder.chat.archived`` event still reaches the server.
* A turn slot claim queued behind its neighbours' claims announces nothing (no log
  line, event or task-run state) while slots are free; one queued behind a head that
  finds the cap full announces as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from fanout_env import fanout_items, fanout_settings
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

from coder_chat.emulator import Emulator
from prefect_coder.blocks import StateStore
from prefect_coder.flows.deployments.agent_fanout import agent_fanout
from prefect_coder.flows.fleet import slots as slot_module
from prefect_coder.flows.fleet.slots import turn_slot

WAITING = "waiting for a turn slot"


async def _archived_events(run: str) -> list[dict[str, Any]]:
    async with get_client() as client:
        response = await client._client.post(
            "/events/filter",
            json={
                "filter": {
                    "event": {"name": ["coder.chat.archived"]},
                    "related": {"id": [f"coder.workflow.fw-{run}-{i}" for i in range(3)]},
                },
                "limit": 50,
            },
        )
        response.raise_for_status()
        return list(response.json()["events"])


async def test_fanout_workflows_archive_without_a_task_run(
    prefect_server: Path, emu: Emulator, store_url: str
) -> None:
    settings = await fanout_settings(emu, store_url, cap=5)
    run = uuid.uuid4().hex[:6]
    items = fanout_items(run, 3, ["only"], 0.05)
    state = await agent_fanout(items, settings, return_state=True)
    outcomes = await state.aresult()
    assert [o.ok for o in outcomes] == [True] * 3
    chats = emu.chats()
    assert len(chats) == 3 and all(c["archived"] for c in chats)
    flow_run_id = state.state_details.flow_run_id
    assert flow_run_id is not None
    async with get_client() as client:

        async def names() -> list[str]:
            runs = await client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
            )
            return sorted(r.name for r in runs)

        # The server records task runs and events from the events stream, later on a
        # loaded machine: polled with a bound. The archived events are sent after the
        # archive (and, before this change, after its task run's start).
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if len(await names()) >= 3 and len(await _archived_events(run)) >= 3:
                break
            await asyncio.sleep(0.3)
        assert len(await _archived_events(run)) == 3
        # An archive task run would have been recorded by now, or within a moment.
        for _ in range(10):
            assert await names() == [f"fw-{run}-{i}/only" for i in range(3)]
            await asyncio.sleep(0.2)


async def test_a_queued_claim_announces_only_behind_a_full_cap(
    store_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Short: a queued claim decides after this long whether it waits on the cap.
    monkeypatch.setattr(slot_module, "SHOW_WAITING_AFTER_S", 0.01)
    logger = logging.getLogger("test.slot-queue")
    store = StateStore(store_url)

    def announced() -> set[str]:
        return {
            r.getMessage().split(" of ")[1].split(";")[0]
            for r in caplog.records
            if WAITING in r.getMessage()
        }

    async def claim(
        cap: int, wid: str, held: asyncio.Event | None = None, release: asyncio.Event | None = None
    ) -> int | None:
        async with turn_slot(store, cap, wait=60, ttl=10, workflow_id=wid, logger=logger) as i:
            if held is not None and release is not None:
                held.set()
                await release.wait()
            return i

    try:
        with caplog.at_level(logging.INFO, logger="test.slot-queue"):
            # Free slots, a queue: the head's claim waits for the SQLite write lock held
            # here, so every other claim queues behind it far longer than 0.01 s.
            async with store.transaction() as tx:
                await tx.checkpoints.set("hold-the-write-lock", "c", 1)
                queued = [asyncio.create_task(claim(50, f"free-{i}")) for i in range(5)]
                await asyncio.sleep(0.3)
            assert all(i is not None for i in await asyncio.gather(*queued))
            assert announced() == set()

            # A full cap: the head polls the store, the others queue behind it. All
            # announce (the head itself, the queued ones once it found the cap full).
            held, release = asyncio.Event(), asyncio.Event()
            holder = asyncio.create_task(claim(1, "holder", held, release))
            await held.wait()
            waiters = [asyncio.create_task(claim(1, f"full-{i}")) for i in range(3)]
            deadline = time.monotonic() + 60
            while announced() != {f"full-{i}" for i in range(3)}:
                assert time.monotonic() < deadline, announced()
                await asyncio.sleep(0.02)
            release.set()
            assert await holder == 0
            assert await asyncio.gather(*waiters) == [0, 0, 0]
    finally:
        await store.aclose()
