"""What a fan-out shard shares between its workflows, and what it must not.

* One ``ChatClient`` for all workflows of a shard: each turn's transport events
  (the eager checkpoint reads its chat id from the stream's dial) still reach only
  that turn — a misrouted dial would checkpoint another workflow's chat.
* A first turn lists the workflow's chats for orphans only when an earlier hold of
  the workflow's lease could have left one.
* A workflow's end waits for its own background items, not its neighbours'.
"""

from __future__ import annotations

import asyncio
import uuid

from fleet_env import TOKEN
from support.prefect_blocks import emulator_credentials, save_settings

from coder_chat.emulator import Emulator
from coder_chat.models import ChatInputPart, CreateChatRequest
from prefect_coder.blocks import CoderCredentials, StateStore
from prefect_coder.blocks.state import workflow_key
from prefect_coder.flows.common.labels import chat_labels
from prefect_coder.flows.common.params import Step, WorkflowSettings, step_marker
from prefect_coder.flows.deployments.agent_fanout import FanoutItem, agent_fanout
from prefect_coder.flows.observe import background


def _creds(emu: Emulator) -> CoderCredentials:
    return emulator_credentials(emu, TOKEN)


async def _settings(emu: Emulator, store_url: str) -> WorkflowSettings:
    # keep_chat: the checkpoints are read after the fan-out.
    return await save_settings("share", _creds(emu), store_url, keep_chat=True)


def _step(name: str) -> Step:
    return Step(name=name, prompt=f'work #emu {{"sleep": 0.2, "text": "done {name}"}}')


def _first_prompt(emu: Emulator, chat_id: str) -> str:
    for m in emu.messages(chat_id, include_system=False):
        if m.get("role") == "user":
            return str(m.get("content"))
    return ""


async def test_concurrent_workflows_of_a_shard_keep_their_own_chats(
    prefect_server: object, emu: Emulator, store_url: str
) -> None:
    settings = await _settings(emu, store_url)
    run = uuid.uuid4().hex[:6]
    ids = [f"share-{run}-{i}" for i in range(12)]
    outcomes = await agent_fanout(
        [FanoutItem(workflow_id=w, steps=[_step("a"), _step("b")]) for w in ids], settings
    )
    assert [o.ok for o in outcomes] == [True] * len(ids)
    store = StateStore(store_url)
    try:
        chats = set()
        for wid, outcome in zip(ids, outcomes, strict=True):
            cp = await store.checkpoints.get(wid)
            assert cp is not None
            # Both steps ran on the workflow's own chat, which its checkpoint names.
            assert {
                r["chat_id"] if isinstance(r, dict) else r.chat_id for r in outcome.results
            } == {cp.chat_id}
            assert step_marker(wid, "a") in _first_prompt(emu, cp.chat_id)
            chats.add(cp.chat_id)
        assert len(chats) == len(ids)
        assert len(emu.chats()) == len(ids)
    finally:
        await store.aclose()


async def _labelled_chat(
    creds: CoderCredentials, emu: Emulator, store: StateStore, wid: str
) -> str:
    async with creds.get_client() as client:
        chat = await client.create_chat(
            CreateChatRequest(
                organization_id=str(emu.organization_id),
                content=[ChatInputPart.text_part("hi")],
                labels=chat_labels(store.tenant, wid),
            )
        )
    return chat.id


async def test_orphan_listing_only_after_an_earlier_lease_hold(
    prefect_server: object, emu: Emulator, store_url: str
) -> None:
    settings = await _settings(emu, store_url)
    creds = _creds(emu)
    store = StateStore(store_url)
    run = uuid.uuid4().hex[:6]
    fresh, held_before = f"fresh-{run}", f"held-{run}"
    try:
        # A workflow that held its lease before (a crashed first turn's run) may have
        # left a chat no checkpoint names: its next first turn finds and strands it.
        async with store.lease(workflow_key(held_before), holder="earlier-run", ttl=5, wait=5):
            orphan = await _labelled_chat(creds, emu, store, held_before)
        # A workflow whose lease nobody ever held cannot have one; a labelled chat
        # arranged by the test is left alone, i.e. nothing was listed.
        planted = await _labelled_chat(creds, emu, store, fresh)
        outcomes = await agent_fanout(
            [
                FanoutItem(workflow_id=fresh, steps=[_step("a")]),
                FanoutItem(workflow_id=held_before, steps=[_step("a")]),
            ],
            settings,
        )
        assert [o.ok for o in outcomes] == [True, True]
        assert [s.chat_id for s in await store.stranded.list(held_before)] == [orphan]
        assert await store.stranded.list(fresh) == []
        assert planted not in {s.chat_id for s in await store.stranded.list()}
    finally:
        await store.aclose()


async def test_a_workflows_drain_waits_only_for_its_own_items() -> None:
    neighbour_may_end = asyncio.Event()
    ran: list[str] = []

    async def neighbours_artifact() -> None:
        await neighbour_may_end.wait()
        ran.append("neighbour")

    async def own_event() -> None:
        await asyncio.sleep(0)
        ran.append("own")

    async def neighbour() -> None:
        with background.scope():
            background.spawn(neighbours_artifact(), name="neighbour artifact")

    await asyncio.create_task(neighbour())
    with background.scope() as mine:
        background.defer(own_event, name="own event")
        background.spawn(asyncio.sleep(0.01), name="own artifact")
    await asyncio.wait_for(background.drain(only=mine), 5)
    assert ran == ["own"]  # its own deferred item ran; the neighbour's task still waits
    assert not mine.items
    neighbour_may_end.set()
    await asyncio.wait_for(background.drain(), 5)  # everything, as a flow's end does
    assert ran == ["own", "neighbour"]
