"""The per-turn fast path keeps its guarantees (docs/performance.md, issue 13):

* the send's write-ahead (``store.turns.begin``) is committed before the
  message leaves, also when the calling flow holds the lease (no result re-check);
* ``coder.turn.settled`` is emitted off the turn's path, in a batch, yet still
  arrives after the flow, names its own task run and keeps the turn's time;
* the batch runs every item in the context it was queued from, and ``drain``
  flushes it at once.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import sqlite3
import time
from datetime import datetime
from typing import Any

import pytest
from flow_helpers import say, user_messages

from coder_chat.emulator import Emulator
from coder_chat.events import HttpRequest, TransportEvent
from prefect_coder.blocks import ChatStateStore, StateStore
from prefect_coder.flows.common.params import Step, WorkflowSettings, step_marker
from prefect_coder.flows.common.resources import hold_workflow_lease, load_resources
from prefect_coder.flows.observe import background
from prefect_coder.flows.turn.durable_turn import execute_turn


async def test_write_ahead_is_committed_before_the_send_under_a_held_lease(
    emu: Emulator,
    settings: WorkflowSettings,
    workflow_id: str,
    sqlite_block: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="prefect_coder.flows.turn.durable_turn")
    settings = settings.model_copy(update={"artifacts": False})  # no flow run to attach to
    resources = await load_resources(settings)
    first = await execute_turn(
        workflow_id, Step(name="one", prompt="hi" + say("one")), settings, resources
    )
    marker = step_marker(workflow_id, "two")
    db = str((await ChatStateStore.aload(sqlite_block)).url).split("///", 1)[1]
    seen: list[tuple[str, str, int] | None] = []

    def hook(ev: TransportEvent) -> None:
        # Synchronously, on the request's way out: what another process (a
        # recovery) would find in the file right now.
        if isinstance(ev, HttpRequest) and ev.op == "createChatMessage":
            with sqlite3.connect(db) as conn:
                row = conn.execute(
                    "SELECT state, marker, attempt FROM coder_state_journal WHERE chat_id = ?",
                    (first.chat_id,),
                ).fetchone()
            seen.append(None if row is None else (row[0], row[1], row[2]))

    async with (
        resources.credentials.get_client(on_transport_event=hook) as client,
        hold_workflow_lease(workflow_id, resources.store, settings) as held,
    ):
        shared = dataclasses.replace(resources, client=client, lease=held)
        second = await execute_turn(
            workflow_id, Step(name="two", prompt="again" + say("two")), settings, shared
        )
    assert second.chat_id == first.chat_id and second.text == "two"
    assert seen == [("submitting", marker, 0)]
    assert sum(marker in m for m in user_messages(emu, first.chat_id)) == 1
    # the finally checkpoint moved the cursor on
    cp = await resources.store.checkpoints.get(workflow_id)
    assert cp is not None and cp.last_seen_message_id is not None
    # A routine turn's "settled" line is DEBUG (round 8: off the console and the API
    # log handler); its coder.turn.settled event carries the same.
    settled = [r for r in caplog.records if "settled on chat" in r.getMessage()]
    assert [r.levelno for r in settled] == [logging.DEBUG, logging.DEBUG]
    await resources.store.aclose()
    await background.drain()  # the deferred turn events


async def test_deferred_settled_events_arrive_with_their_own_task_run_and_time(
    settings: WorkflowSettings,
    workflow_id: str,
    store: StateStore,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName

    from prefect_coder.flows.deployments.agent_workflow import agent_workflow

    # A batch that would wait 60 s: only the flow's drain can have flushed it.
    monkeypatch.setenv(background.BATCH_ENV, "60")
    steps = [Step(name="a", prompt="one" + say("a")), Step(name="b", prompt="two" + say("b"))]
    t0 = time.monotonic()
    await agent_workflow(workflow_id, steps, settings.model_copy(update={"keep_chat": True}))
    assert time.monotonic() - t0 < 30
    async with get_client() as client:
        settled: list[dict[str, Any]] = []
        # Events reach the server asynchronously (the events worker, then the server's
        # event persister): a look every 0.25 s (each read costs the shared test server
        # CPU), bounded at 10 s.
        for _ in range(40):
            resp = await client._client.post(
                "/events/filter",
                json={
                    "filter": {
                        "event": {"name": ["coder.turn.settled"]},
                        "any_resource": {"id": [f"coder.workflow.{workflow_id}"]},
                    },
                    "limit": 10,
                },
            )
            resp.raise_for_status()
            settled = resp.json()["events"]
            if len(settled) >= 2:
                break
            await asyncio.sleep(0.25)
        assert sorted(e["payload"]["step"] for e in settled) == ["a", "b"]
        # The task runs by name (the session's server holds every test's task runs),
        # once the server has recorded both as ended: task-run states reach it as
        # events, recorded in batches (tests/conftest.py) — bounded at 10 s.
        names = [f"{workflow_id}/a", f"{workflow_id}/b"]
        runs: dict[str, Any] = {}
        for _ in range(40):
            found = await client.read_task_runs(
                task_run_filter=TaskRunFilter(name=TaskRunFilterName(any_=names))
            )
            runs = {r.name: r for r in found}
            if len(runs) == 2 and all(r.end_time is not None for r in runs.values()):
                break
            await asyncio.sleep(0.25)
    for event in settled:
        run = runs[f"{workflow_id}/{event['payload']['step']}"]
        related = {r["prefect.resource.id"] for r in event["related"]}
        # the context of its own turn, not of whichever item opened the batch
        assert f"prefect.task-run.{run.id}" in related
        # the time the turn settled, not the time the batch was flushed
        assert run.end_time is not None
        assert datetime.fromisoformat(event["occurred"]) <= run.end_time


async def test_batch_runs_items_in_their_own_context_and_drain_flushes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(background.BATCH_ENV, "60")
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="-")
    ran: list[tuple[str, str]] = []

    async def later(name: str) -> None:
        await asyncio.sleep(0)
        ran.append((name, var.get()))

    def failing() -> None:
        raise RuntimeError("observability must never break a turn")

    for name in ("x", "y"):
        var.set(name)
        background.defer(lambda name=name: ran.append(("sync " + name, var.get())), name=name)
        background.defer(lambda name=name: later(name), name=name)
    background.defer(failing, name="failing")
    var.set("after")
    await asyncio.sleep(0.05)
    assert ran == []  # batched: nothing yet
    t0 = time.monotonic()
    await background.drain(bound_s=10)
    assert time.monotonic() - t0 < 5
    assert sorted(ran) == [("sync x", "x"), ("sync y", "y"), ("x", "x"), ("y", "y")]
