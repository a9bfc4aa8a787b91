"""What the turn-slot host-loss tests share: a fan-out in a child process forked from
the warm process (a real process to SIGKILL or SIGSTOP), a bounded wait on a
condition, the slot rows as the store has them (database clock) and a workflow's chat."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from warm_python import Child, WarmPython

from coder_chat.emulator import Emulator
from prefect_coder.blocks import StateStore
from prefect_coder.blocks.state.schema import leases as lease_table
from prefect_coder.flows.common.labels import LABEL_WORKFLOW
from prefect_coder.flows.common.params import Step, WorkflowSettings
from prefect_coder.flows.deployments.agent_fanout import FanoutItem, agent_fanout
from prefect_coder.flows.fleet.slots import slot_key

ROOT = Path(__file__).resolve().parents[2]

#: A child that runs ``agent_fanout`` in process: one SIGKILL kills its flows and all.
FANOUT_CHILD = """
import asyncio, json, sys
from prefect_coder.flows.deployments.agent_fanout import FanoutItem, agent_fanout
from prefect_coder.flows.common.params import Step, WorkflowSettings

args = json.loads(sys.argv[1])
items = [FanoutItem.model_validate(i) for i in args["items"]]
asyncio.run(agent_fanout(items, WorkflowSettings.model_validate(args["settings"])))
"""


def start_fanout_child(
    warm_python: WarmPython, items: list[FanoutItem], settings: WorkflowSettings
) -> Child:
    """``agent_fanout(items, settings)`` in a child forked from the warm process (its
    environment: the session's Prefect server and result storage). Blocking: call it
    through ``asyncio.to_thread``."""
    payload = json.dumps(
        {
            "items": [i.model_dump(mode="json") for i in items],
            "settings": settings.model_dump(mode="json"),
        }
    )
    return warm_python.start(["-c", FANOUT_CHILD, payload], env=dict(warm_python.env), cwd=ROOT)


async def until(what: str, limit_s: float, check: Callable[[], Any]) -> Any:
    """``check()`` (plain or async) polled every 50 ms until it is truthy; its value.
    A bound, not a timing claim: AssertionError naming ``what`` after ``limit_s``."""
    for _ in range(int(limit_s / 0.05)):
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def slot_rows(store: StateStore, cap: int) -> dict[str, Any]:
    """Every row of slots ``0 … cap-1`` by key, live, lapsed or released, each with
    ``left``: its seconds to expiry on the database clock (≤ 0 once lapsed)."""
    now = store.now()
    async with store.read() as conn:
        rows = await conn.execute(
            sa.select(lease_table, (lease_table.c.expires_at - now).label("left")).where(
                lease_table.c.tenant == store.tenant,
                lease_table.c.key.in_([slot_key(i) for i in range(cap)]),
            )
        )
        return {str(r.key): r for r in rows}


async def slot_row(store: StateStore) -> Any:
    """Slot 0's row (cap 1), or None."""
    return (await slot_rows(store, 1)).get(slot_key(0))


def chat_of(emu: Emulator, workflow_id: str) -> str:
    """The id of the (first) chat labelled with ``workflow_id``."""
    return next(c["id"] for c in emu.chats() if c["labels"].get(LABEL_WORKFLOW) == workflow_id)


TEST_HOLDER = "test-holds-the-only-slot"


async def left_and_other_after_a_lost_response(
    emu: Emulator,
    settings: WorkflowSettings,
    store_url: str,
    tenant: str,
    *,
    b_runs_s: float,
    probes_fail_for_s: float | None = None,
) -> tuple[list[Any], list[Any], str]:
    """Workflow ``left`` runs step ``a``; then its step ``b`` (running ``b_runs_s``
    server-side) and workflow ``other`` queue in this process for the one slot (cap 1),
    held by the test until both wait. ``b``'s ``POST …/messages`` lands but its response
    is lost, so ``b``'s turn fails while its run goes on in chatd. With
    ``probes_fail_for_s``, every ``GET /api/v2/chats…`` is then held that long (past
    the slot probe's bound). Returns ``left``'s and ``other``'s outcomes and
    ``left``'s chat. Order facts come from the turns' own logs (each one's
    "waiting for a turn slot" log line), not from sleeps."""
    run = uuid.uuid4().hex[:6]
    left, other = f"left-{run}", f"other-{run}"
    first = Step(name="a", prompt='first #emu {"text": "one"}')
    long = Step(name="b", prompt=f'second #emu {{"sleep": {b_runs_s}, "text": "two"}}')
    quick = Step(name="v", prompt='other #emu {"text": "three"}')
    # `left`'s first step, finished and stored: its chat is checkpointed and kept
    # (settings.keep_chat), so b is a POST …/messages on it.
    done = await agent_fanout([FanoutItem(workflow_id=left, steps=[first])], settings)
    assert [o.ok for o in done] == [True]
    chat = chat_of(emu, left)
    store = StateStore(store_url, tenant=tenant)
    held = await store.leases.acquire(slot_key(0), TEST_HOLDER, ttl=120)
    assert held is not None
    runs: list[asyncio.Task[Any]] = []

    said: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    runs_logger = logging.getLogger("prefect.task_runs")
    level = runs_logger.level
    runs_logger.setLevel(logging.INFO)
    runs_logger.addHandler(handler)

    def waiting(step: str, workflow_id: str) -> bool:
        # The turn's own log line, once its claim found the one slot busy.
        return any(
            m.startswith("waiting for a turn slot") and f"(step {step} of {workflow_id};" in m
            for m in said
        )

    try:
        # b claims first (this process's claim queue is FIFO), `other` behind it.
        runs.append(
            asyncio.create_task(
                agent_fanout(
                    [FanoutItem(workflow_id=left, steps=[first, long])],
                    settings,
                    fail_on_error=False,
                )
            )
        )
        await until("b to wait for the slot", 60, lambda: waiting("b", left))
        runs.append(
            asyncio.create_task(
                agent_fanout([FanoutItem(workflow_id=other, steps=[quick])], settings)
            )
        )
        await until("`other` to wait for the slot", 60, lambda: waiting("v", other))
        emu.faults.drop_response(1, method="POST", path="/messages")
        if probes_fail_for_s is not None:
            emu.faults.delay_commit(
                probes_fail_for_s, count=1000, method="GET", path="/api/v2/chats"
            )
        assert await store.leases.release(slot_key(0), TEST_HOLDER)
        await until(
            "b's message to land",
            60,
            lambda: any(e["chat_id"] == chat for e in emu.event_log(["turn_start"])[1:]),
        )
        left_out, other_out = await asyncio.wait_for(asyncio.gather(*runs), 120)
    finally:
        runs_logger.removeHandler(handler)
        runs_logger.setLevel(level)
        emu.faults.clear()
        for task in runs:
            if not task.done():
                task.cancel()
        await store.aclose()
    return left_out, other_out, chat
