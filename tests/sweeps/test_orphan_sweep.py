"""``sweep-orphans`` against the emulator, the Prefect test server and a real SQLite
store: every orphan case of the durable design, and what the sweep never touches."""

from __future__ import annotations

import asyncio
import time

import pytest
from flow_helpers import say, user_messages
from sweep_helpers import directive, new_chat, ours, snapshot, wait_status

from coder_chat.emulator import Emulator
from coder_chat.rest import ChatClient
from coder_chat.stop import stop_chat
from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state import workflow_key
from prefect_coder.flows.common.labels import (
    COLLECTION,
    LABEL_COLLECTION,
    LABEL_FLOW_RUN,
    LABEL_WORKFLOW,
    chat_labels,
)
from prefect_coder.flows.common.params import Step, WorkflowSettings, step_marker
from prefect_coder.flows.deployments.agent_turn import agent_turn
from prefect_coder.flows.deployments.sweep_orphans import sweep_orphans
from prefect_coder.flows.sweeps.options import SweepOptions
from prefect_coder.flows.sweeps.run import run_orphan_sweep

# Long enough to still be running after a sweep on a loaded machine; every test
# retires its SLOW chats, so the length costs no time.
SLOW = {"text": "working slowly. " * 40, "deltas": 600, "delay": 0.1}


def _chats_of(emu: Emulator, marker: str) -> list[str]:
    return [c["id"] for c in emu.chats() if any(marker in m for m in user_messages(emu, c["id"]))]


async def test_lost_create_response_leaves_an_orphan_the_sweep_retires_after_a_dry_run(
    emu: Emulator,
    client: ChatClient,
    settings: WorkflowSettings,
    store: StateStore,
    workflow_id: str,
    tenant: str,
    options: SweepOptions,
) -> None:
    # The create POST commits but its response is lost: the checkpoint stays empty
    # while the server holds a chat nobody knows the id of.
    emu.faults.drop_response(1, method="POST", path="/chats")
    try:
        with pytest.raises(Exception):  # noqa: B017 - any transport failure
            await agent_turn(workflow_id, Step(name="one", prompt="hi" + say("a")), settings)
    finally:
        emu.faults.clear()
    assert await store.checkpoints.get(workflow_id) is None
    [orphan] = _chats_of(emu, step_marker(workflow_id, "one"))
    chat = await client.get_chat(orphan)
    assert chat.labels[LABEL_COLLECTION] == COLLECTION
    assert chat.labels[LABEL_WORKFLOW] == workflow_id
    assert chat.labels.get(LABEL_FLOW_RUN)  # the flow run that created it
    await wait_status(client, orphan, "waiting")

    before = await snapshot(client, store, [orphan])
    dry = await sweep_orphans(settings, dry_run=True, grace_s=0, options=options)
    assert dry.count("retire") == 1 and dry.rows[0].outcome == "dry run: would retire"
    assert await snapshot(client, store, [orphan]) == before  # a dry run changes nothing

    report = await sweep_orphans(settings, grace_s=0, options=options)
    assert report.count("retire") == 1 and report.failed == 0
    [row] = report.rows
    assert row.chat_id == orphan and "no checkpoint accounts for it" in row.reason
    assert "archived" in row.outcome
    assert (await client.get_chat(orphan)).archived
    # a second sweep finds nothing left to do
    again = await sweep_orphans(settings, grace_s=0, options=options)
    assert again.count("retire") == 0 and again.count("keep") == 1


async def test_several_orphans_of_one_workflow_are_all_retired_the_checkpointed_chat_kept(
    emu: Emulator,
    client: ChatClient,
    settings: WorkflowSettings,
    store: StateStore,
    workflow_id: str,
    tenant: str,
    options: SweepOptions,
) -> None:
    done = await agent_turn(workflow_id, Step(name="one", prompt="a" + say("ok")), settings)
    labels = ours(tenant, workflow_id)
    settled = await new_chat(client, labels=labels, script={"text": "settled on its own"})
    failed = await new_chat(client, labels=labels, script={"fatal": "boom"})
    running = await new_chat(client, labels=labels, script=SLOW)
    paused = await new_chat(
        client,
        labels=labels,
        tools=["record_note"],
        script={"tool_calls": [{"name": "record_note", "args": {"title": "t", "body": "b"}}]},
    )
    await wait_status(client, settled, "waiting")
    await wait_status(client, failed, "error")
    await wait_status(client, paused, "requires_action")
    assert (await client.get_chat(running)).status == "running"
    orphans = {settled, failed, running, paused}

    report = await sweep_orphans(settings, grace_s=0, options=options)
    assert report.failed == 0, report.rows
    assert {r.chat_id for r in report.rows if r.decision == "retire"} == orphans, report.rows
    for cid in orphans:
        chat = await client.get_chat(cid)
        assert chat.archived and chat.status in ("waiting", "error"), (cid, chat.status)
    # the paused orphan had nothing on the ledger: interrupted (that only closes the
    # pause and the model continues, so the sweep stops the run again if it must)
    paused_row = next(r for r in report.rows if r.chat_id == paused)
    assert paused_row.outcome.startswith("interrupted → running")
    # checkpointed chats are never archived by the orphan sweep
    kept = await client.get_chat(done.chat_id)
    assert not kept.archived
    assert report.count("keep") == 1


async def test_a_stranded_chat_is_retired_and_forgotten(
    client: ChatClient,
    settings: WorkflowSettings,
    store: StateStore,
    workflow_id: str,
    tenant: str,
    options: SweepOptions,
) -> None:
    # A live chat of the workflow recorded stranded: what a first turn's orphan check
    # leaves for every chat it does not adopt (flows/recovery/orphans.py), and a turn
    # for the older sessions its SDK discarded.
    stranded = await new_chat(client, labels=ours(tenant, workflow_id), script={"text": "x"})
    await wait_status(client, stranded, "waiting")
    await store.stranded.record(workflow_id, stranded, "not adopted")
    assert await store.checkpoints.get(workflow_id) is None
    # known dead: no grace period protects it
    report = await sweep_orphans(settings, grace_s=3600, options=options)
    [row] = report.rows
    assert row.chat_id == stranded and row.decision == "retire" and "stranded" in row.reason
    assert (await client.get_chat(stranded)).archived
    assert await store.stranded.list() == []


async def test_a_stranded_record_of_an_archived_or_deleted_chat_is_forgotten(
    client: ChatClient,
    settings: WorkflowSettings,
    store: StateStore,
    workflow_id: str,
    tenant: str,
    options: SweepOptions,
) -> None:
    archived = await new_chat(client, labels=ours(tenant, workflow_id), script={"text": "x"})
    await wait_status(client, archived, "waiting")
    await client.archive_chat(archived)
    await store.stranded.record(workflow_id, archived, "test")
    await store.stranded.record(workflow_id, "00000000-0000-4000-8000-00000000dead", "test")
    report = await sweep_orphans(settings, grace_s=0, options=options)
    assert report.count("forget") == 2 and report.failed == 0
    assert await store.stranded.list() == []


async def test_a_live_first_turn_inside_the_grace_window_is_never_touched(
    emu: Emulator,
    client: ChatClient,
    settings: WorkflowSettings,
    store: StateStore,
    workflow_id: str,
    tenant: str,
    options: SweepOptions,
) -> None:
    # A real first turn, live: never touched, even with no grace period at all.
    marker = step_marker(workflow_id, "slow")
    slow = directive({"text": "working slowly", "deltas": 15, "delay": 0.1})
    turn = asyncio.create_task(
        agent_turn(workflow_id, Step(name="slow", prompt="go" + slow), settings)
    )
    try:
        chat_id = None
        for _ in range(500):
            found = _chats_of(emu, marker)
            if found:
                chat_id = found[0]
                break
            await asyncio.sleep(0.01)
        assert chat_id is not None
        during = await run_orphan_sweep(client, store, grace_s=0, options=options)
        assert not turn.done()
        result = await turn
    finally:
        turn.cancel()
    assert result.text == "working slowly" and result.chat_id == chat_id
    assert during.failed == 0 and during.count("retire") == 0
    assert not (await client.get_chat(chat_id)).archived

    # A live chat no checkpoint names yet (a first turn before its checkpoint is
    # written): the grace period protects it ...
    other = f"{workflow_id}-2"
    live = await new_chat(client, labels=ours(tenant, other), script=SLOW)
    inside = await sweep_orphans(settings, grace_s=60, options=options)
    [row] = inside.rows
    assert (row.chat_id, row.decision) == (live, "wait") and "grace" in row.reason
    # ... and past the grace, the lease its live run holds still does.
    async with store.lease(workflow_key(other), ttl=10, wait=1):
        held = await run_orphan_sweep(client, store, grace_s=0, options=options)
    [row] = held.rows
    assert (row.chat_id, row.decision) == (live, "busy")
    chat = await client.get_chat(live)
    assert chat.status == "running" and not chat.archived
    await _retire(client, live)


async def test_chats_not_created_by_this_collection_are_never_touched(
    emu: Emulator,
    client: ChatClient,
    settings: WorkflowSettings,
    store: StateStore,
    workflow_id: str,
    tenant: str,
    options: SweepOptions,
) -> None:
    foreign = [
        await new_chat(client, labels=None, script=SLOW),  # unlabelled, running
        await new_chat(client, labels={"team": "other"}, script={"text": "x"}),
        # our collection, another tenant (another store sharing the Coder identity)
        await new_chat(client, labels=chat_labels("not-" + tenant, workflow_id), script=SLOW),
        # a look-alike: our collection label but no tenant
        await new_chat(client, labels={LABEL_COLLECTION: COLLECTION}, script={"text": "y"}),
    ]
    mine = await new_chat(client, labels=ours(tenant, workflow_id), script={"text": "z"})
    await wait_status(client, mine, "waiting")
    await asyncio.sleep(0.05)
    before = {cid: (c.status, c.archived) for cid in foreign for c in [await client.get_chat(cid)]}
    t0 = time.time()

    report = await sweep_orphans(settings, grace_s=0, options=options)
    assert report.listed == 1 and [r.chat_id for r in report.rows] == [mine]
    assert (await client.get_chat(mine)).archived
    for cid in foreign:
        chat = await client.get_chat(cid)
        assert not chat.archived
        assert before[cid][1] is False
    # not one interrupt or archive request went to a foreign chat
    writes = [
        e
        for e in emu.event_log(["request"])
        if e["time"] >= t0 and e["chat_id"] in foreign and e["details"]["method"] != "GET"
    ]
    assert writes == []
    for cid in foreign:  # tidy the shared emulator
        await _retire(client, cid)


async def _retire(client: ChatClient, chat_id: str) -> None:
    stopped = await stop_chat(client, chat_id, timeout=10, archive=True, poll_interval=0.05)
    assert stopped.archived, stopped


async def test_listing_pages_through_every_chat_and_publishes_a_table_artifact(
    client: ChatClient,
    settings: WorkflowSettings,
    workflow_id: str,
    tenant: str,
    options: SweepOptions,
    prefect_env: object,
) -> None:
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    # 3 pages of 7 (with overlap) plus archived ones: all are seen, none twice
    ids = [
        await new_chat(client, labels=ours(tenant, f"{workflow_id}-{i}"), script={"text": "x"})
        for i in range(17)
    ]
    for cid in ids:
        await wait_status(client, cid, "waiting")
    for cid in ids[:3]:
        await client.archive_chat(cid)
    report = await sweep_orphans(settings, grace_s=0, options=options)
    assert report.listed == 17
    assert report.count("retire") == 14 and report.count("keep") == 3
    assert sorted(r.chat_id for r in report.rows) == sorted(ids[3:])
    for cid in ids:
        assert (await client.get_chat(cid)).archived

    async with get_client() as pc:
        arts = await pc.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["coder-sweep-orphans"])),
            limit=50,
        )
    mine = [a for a in arts if any(cid in str(a.data) for cid in ids[3:])]
    assert mine and mine[0].type == "table"
    assert "no checkpoint accounts for it" in str(mine[0].data)
    assert f"`{tenant}`" in (mine[0].description or "")


async def test_a_paused_orphan_with_a_committed_effect_is_reconciled_then_retired(
    emu: Emulator,
    client: ChatClient,
    settings: WorkflowSettings,
    store: StateStore,
    workflow_id: str,
    tenant: str,
    options: SweepOptions,
) -> None:
    # The process crashed inside a client tool after its effect committed (ledger
    # "done") and before the chat id was checkpointed: the pause is the only
    # pending record of the effect. Interrupting it would lose that record.
    marker = step_marker(workflow_id, "note")
    call = {"name": "record_note", "args": {"title": "t", "body": "b"}, "id": "call-7"}
    paused = await new_chat(
        client,
        labels=ours(tenant, workflow_id),
        tools=["record_note"],
        prompt=f"{marker} write it down",
        script=[{"tool_calls": [call]}, {"text": "noted"}],
    )
    await wait_status(client, paused, "requires_action")
    await store.ledger.begin(paused, "call-7", tool_name="record_note")
    await store.ledger.complete(paused, "call-7", {"saved": "note-7"})

    first = await sweep_orphans(settings, grace_s=0, options=options)
    [row] = first.rows
    assert (row.decision, row.outcome) == ("reconcile", "reconciled (resumed)"), row
    await wait_status(client, paused, "waiting")
    results = [
        p
        for m in emu.messages(paused, include_system=False)
        for p in m.get("content") or []
        if p.get("type") == "tool-result"
    ]
    assert [r["tool_call_id"] for r in results] == ["call-7"]
    assert "note-7" in str(results[0].get("result")) and not results[0].get("is_error")
    assert not (await client.get_chat(paused)).archived

    # the revived run settled: the next sweep retires the orphan like any other
    second = await sweep_orphans(settings, grace_s=0, options=options)
    [row] = second.rows
    assert row.decision == "retire" and (await client.get_chat(paused)).archived
    assert await store.ledger.list(paused) == []  # forgotten with the chat


async def test_one_chats_failure_is_a_failed_row_not_the_end_of_the_sweep(
    emu: Emulator,
    client: ChatClient,
    settings: WorkflowSettings,
    store: StateStore,
    workflow_id: str,
    tenant: str,
    options: SweepOptions,
    prefect_env: object,
) -> None:
    from flow_helpers import TOKEN
    from prefect import get_client

    ids = [
        await new_chat(client, labels=ours(tenant, f"{workflow_id}-{i}"), script={"text": "x"})
        for i in range(3)
    ]
    for cid in ids:
        await wait_status(client, cid, "waiting")
    # the server answers one archive with a 500: that chat fails, the others go
    emu.faults.fail_rest(1, status=500, method="PATCH")
    try:
        report = await sweep_orphans(settings, grace_s=0, options=options)
    finally:
        emu.faults.clear()
    assert report.failed == 1 and report.count("retire") == 3
    [bad] = [r for r in report.rows if not r.ok]
    assert "CoderApiError" in bad.outcome and "500" in bad.outcome
    assert [(await client.get_chat(cid)).archived for cid in ids].count(True) == 2
    # the next run retires what failed
    again = await sweep_orphans(settings, grace_s=0, options=options)
    assert again.failed == 0 and [r.chat_id for r in again.rows] == [bad.chat_id]
    assert [(await client.get_chat(cid)).archived for cid in ids] == [True] * 3
    # nothing the sweep published carries the session token
    async with get_client() as pc:
        arts = await pc.read_artifacts(limit=200)
    haystack = str([a.data for a in arts]) + str([a.description for a in arts])
    haystack += report.model_dump_json() + again.model_dump_json()
    assert TOKEN not in haystack and bad.chat_id in haystack
