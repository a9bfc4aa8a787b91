"""Fleet quota: the deployment-wide turn-slot cap, measured from the emulator's own
event log (``turn_start``/``turn_end`` carry the server's count of running turns)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
import uuid
from pathlib import Path
from typing import Any, cast

import pytest
from fleet_env import ROOT, TOKEN
from prefect import flow, task
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName
from support.prefect_blocks import emulator_credentials, save_settings
from warm_python import Child, WarmPython

from coder_chat.emulator import Emulator
from prefect_coder.blocks import ChatStateStore, StateStore
from prefect_coder.flows.common.labels import LABEL_WORKFLOW
from prefect_coder.flows.common.params import Step, WorkflowSettings
from prefect_coder.flows.deployments.agent_fanout import FanoutItem, agent_fanout
from prefect_coder.flows.fleet.slots import (
    WAITING_STATE_NAME,
    TurnSlotUnavailableError,
    busy_slots,
    turn_slot,
)


async def _settings(
    emu: Emulator, store_url: str, *, cap: int | None, wait: float = 60.0, ttl: float = 10.0
) -> WorkflowSettings:
    credentials = emulator_credentials(
        emu, TOKEN, max_concurrent_turns=cap, turn_slot_wait=wait, turn_slot_ttl=ttl
    )
    return await save_settings("fleet", credentials, store_url)


def _step(name: str, seconds: float) -> Step:
    return Step(name=name, prompt=f'work #emu {{"sleep": {seconds}, "text": "done {name}"}}')


#: Workflows of the capped fan-out: four times the cap. Every slot is handed over at
#: least three times under a full queue (15 waiters when the first 5 start), which is
#: all the cap's rule sees; 50 (10 rounds) ran the same hand-over ten times over at
#: 2.5x the CPU (each turn is a task run the shared test server records). The
#: fan-out at scale is measured by bench/fanout.py (docs/fleet.md), not here.
FAN = 20


async def test_a_fanout_of_four_times_the_cap_never_runs_more_than_5_turns(
    prefect_server: Path, emu: Emulator, store_url: str
) -> None:
    # The wait only bounds a hang: on a 2-core machine at load 20 the last of 50
    # turns waited over 60 s for its slot (10 rounds of 5 turns, each slowed down).
    settings = await _settings(emu, store_url, cap=5, wait=300.0)
    run = uuid.uuid4().hex[:6]
    items = [
        FanoutItem(workflow_id=f"fan-{run}-{i}", steps=[_step("only", 0.3)]) for i in range(FAN)
    ]
    outcomes = await agent_fanout(items, settings)
    assert [o.ok for o in outcomes] == [True] * FAN
    assert {o.results[0].text for o in outcomes} == {"done only"}
    starts = emu.event_log(["turn_start"])
    assert len(starts) == FAN
    # The server's own count: never above the cap, and the turns did overlap (a slot
    # is held from before the chat exists, so the server may see one or two fewer).
    assert 3 <= emu.max_concurrent_turns() <= 5
    # Every chat was archived at the end of its workflow.
    assert all(c["archived"] for c in emu.chats())
    # Queued turns said so: the coder.turn.waiting_for_slot event reached the server
    # (sent asynchronously by the events worker: polled). The named UI state is
    # checked where the waiting is arranged, not hoped for (next test).
    waited: list[dict[str, Any]] = []
    async with get_client() as client:
        # Every 0.25 s (each read costs the shared test server CPU), bounded at 30 s.
        for _ in range(120):
            response = await client._client.post(
                "/events/filter",
                json={
                    "filter": {
                        "event": {"name": ["coder.turn.waiting_for_slot"]},
                        "resource": {"id_prefix": [f"coder.workflow.fan-{run}-"]},
                    },
                    "limit": FAN,
                },
            )
            response.raise_for_status()
            waited = response.json()["events"]
            if waited:
                break
            await asyncio.sleep(0.25)
    assert waited


async def test_a_waiting_turn_shows_as_waiting(prefect_server: Path, store_url: str) -> None:
    # The only slot is held here until the waiting turn's task run shows the named
    # state on the server: the turn keeps waiting until then, so nothing is timed.
    name = f"waits-{uuid.uuid4().hex[:6]}"

    @task(name=name)
    async def waits() -> int | None:
        store = StateStore(store_url)
        try:
            async with turn_slot(store, 1, wait=180, ttl=10) as index:
                return index
        finally:
            await store.aclose()

    @flow(name="fleet-waits")
    async def one_turn() -> int | None:
        return await waits()

    store = StateStore(store_url)
    try:
        async with get_client() as client:
            async with turn_slot(store, 1, wait=5, ttl=10):
                running = asyncio.create_task(one_turn())
                names: set[str] = set()
                run_ids: list[Any] = []
                # Every 0.25 s, bounded: 2 min on a loaded machine. Each look costs the
                # shared test server: the task run is searched by name (a scan of every
                # task run of the session) only until it is found, then only its
                # states are read.
                for _ in range(480):
                    if not run_ids:
                        runs = await client.read_task_runs(
                            task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_=name))
                        )
                        run_ids = [r.id for r in runs]
                    for run_id in run_ids:
                        states = await client.read_task_run_states(run_id)
                        names |= {str(st.name) for st in states}
                    if WAITING_STATE_NAME in names or running.done():
                        break
                    await asyncio.sleep(0.25)
                assert WAITING_STATE_NAME in names
                assert not running.done()  # still waiting for the slot held here
            assert await asyncio.wait_for(running, 60) == 0
    finally:
        await store.aclose()


async def test_two_steps_each_take_and_return_a_slot(
    prefect_server: Path, emu: Emulator, store_url: str
) -> None:
    settings = await _settings(emu, store_url, cap=2)
    run = uuid.uuid4().hex[:6]
    items = [
        FanoutItem(workflow_id=f"two-{run}-{i}", steps=[_step("a", 0.05), _step("b", 0.05)])
        for i in range(6)
    ]
    outcomes = await agent_fanout(items, settings)
    assert all(o.ok for o in outcomes)
    assert len(emu.event_log(["turn_start"])) == 12
    # Never over the cap. (Whether two 50 ms turns overlap is up to the machine's
    # load; overlap is shown where it is arranged: the cross-process test.)
    assert 1 <= emu.max_concurrent_turns() <= 2
    block = cast(ChatStateStore, await ChatStateStore.aload(str(settings.store_block)))
    store = block.get_store()
    try:
        assert await busy_slots(store, 2) == set()  # every slot released
    finally:
        await store.aclose()


_HOLDER = """
import asyncio, sys
from prefect_coder.blocks.state import StateStore
from prefect_coder.flows.fleet.slots import turn_slot

async def main():
    store = StateStore(sys.argv[1])
    async with turn_slot(store, 1, wait=5, ttl=float(sys.argv[2])):
        with open(sys.argv[3], "w") as mark:
            mark.write("HELD")
        await asyncio.sleep(3600)

asyncio.run(main())
"""


async def _start_holder(warm: WarmPython, store_url: str, ttl: float, mark: Path) -> Child:
    """The holder: a separate process (own pid, killed for real) forked from the
    session's warm process, so it does not import Prefect and the flows again (~4 CPU-s
    a fresh interpreter). Returns once it holds the slot."""
    argv = ["-c", _HOLDER, store_url, str(ttl), str(mark)]
    child = await asyncio.to_thread(warm.start, argv, env=dict(warm.env), cwd=ROOT)

    def held() -> bool:
        return mark.exists()

    for _ in range(2400):  # bounded: 2 min on a loaded machine
        if held() or child.poll() is not None:
            break
        await asyncio.sleep(0.05)
    if not held():
        child.kill()
        done = await child.communicate(30)
        raise AssertionError(f"the holder took no slot (rc {done.returncode}): {done.stderr}")
    return child


async def test_crashed_holder_blocks_the_cap_at_most_its_lease(
    warm_python: WarmPython, store_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ttl = 2.0
    proc = await _start_holder(warm_python, store_url, ttl, tmp_path / "held")
    proc.kill()  # a real crash (SIGKILL): no release, no more renewals
    assert (await proc.communicate(30)).returncode == -signal.SIGKILL
    store = StateStore(store_url)
    try:
        assert await busy_slots(store, 1) == {0}
        logger = logging.getLogger("test.fleet")
        with caplog.at_level(logging.INFO, logger="test.fleet"):
            # No credentials: the ttl alone frees a dead holder's slot. The wait bounds
            # it (a never-freed slot fails here); no wall-clock assertion beyond that,
            # a loaded machine may take seconds to run the waiter at all.
            async with turn_slot(store, 1, wait=ttl * 10, ttl=ttl, logger=logger):
                pass
        assert any("waiting for a turn slot" in r.getMessage() for r in caplog.records)
    finally:
        await store.aclose()


@pytest.fixture(params=["sqlite", "postgresql"])
def any_store_url(request: pytest.FixtureRequest, store_url: str) -> str:
    if request.param == "sqlite":
        return store_url
    return str(request.getfixturevalue("postgres_url"))


async def test_wait_is_bounded_with_a_clear_error(any_store_url: str) -> None:
    # A tenant of its own: the PostgreSQL cluster is shared by the session.
    store = StateStore(any_store_url, tenant=f"fleet-{uuid.uuid4().hex[:8]}")
    try:
        async with turn_slot(store, 1, wait=5, ttl=5):
            t0 = time.monotonic()
            with pytest.raises(TurnSlotUnavailableError) as err:
                async with turn_slot(store, 1, wait=0.3, ttl=5):
                    pytest.fail("got a slot that is held")
            # It waited its whole wait (no upper bound: a loaded machine may take
            # any time to raise; that it raised at all proves the wait is bounded).
            assert time.monotonic() - t0 >= 0.3
        assert "max_concurrent_turns" in str(err.value)
        assert "turn_slot_wait" in str(err.value)
        # Released on exit: the next holder gets it at once.
        async with turn_slot(store, 1, wait=0.1, ttl=5) as held:
            assert held == 0
    finally:
        await store.aclose()


async def test_a_workflow_past_its_slot_wait_fails_clearly(
    prefect_server: Path, emu: Emulator, store_url: str
) -> None:
    settings = await _settings(emu, store_url, cap=1, wait=0.3)
    store = StateStore(store_url)
    try:
        async with turn_slot(store, 1, wait=1, ttl=10):
            outcomes = await agent_fanout(
                [FanoutItem(workflow_id=f"late-{uuid.uuid4().hex[:6]}", steps=[_step("s", 0)])],
                settings,
                fail_on_error=False,
            )
    finally:
        await store.aclose()
    assert not outcomes[0].ok
    assert "TurnSlotUnavailableError" in (outcomes[0].error or "")
    assert emu.event_log(["turn_start"]) == []  # nothing was sent


_FANOUT_CHILD = """
import asyncio, json, logging, sys
from prefect_coder.flows.deployments.agent_fanout import FanoutItem, agent_fanout
from prefect_coder.flows.common.params import WorkflowSettings

# The turns' INFO lines ("waiting for a turn slot") into a file the test reads while
# this runs. The level is set here, at run time: a PREFECT_LOGGING_LEVEL of its own
# would make the warm process start a fresh interpreter (a second Prefect import).
runs = logging.getLogger("prefect.task_runs")
runs.setLevel(logging.INFO)
runs.addHandler(logging.FileHandler(sys.argv[2]))
args = json.loads(sys.argv[1])
items = [FanoutItem.model_validate(i) for i in args["items"]]
outcomes = asyncio.run(agent_fanout(items, WorkflowSettings.model_validate(args["settings"])))
print("OK", sum(o.ok for o in outcomes), flush=True)
"""


async def test_cap_holds_across_worker_processes(
    warm_python: WarmPython, emu: Emulator, store_url: str, tmp_path: Path
) -> None:
    # Two processes (this one and a child, like two workers) share the store and the
    # cap of 3. This process first holds all three slots; the child's turns queue behind
    # them (its log says so), and only then are the slots freed to the child's waiters
    # and ours: the overlap is arranged by ordering, not hoped for by timing.
    settings = await _settings(emu, store_url, cap=3)
    run = uuid.uuid4().hex[:6]
    mine = [FanoutItem(workflow_id=f"p0-{run}-{i}", steps=[_step("s", 0.1)]) for i in range(6)]
    theirs = [
        FanoutItem(workflow_id=f"p1-{run}-{i}", steps=[_step("s", 0.1)]).model_dump(mode="json")
        for i in range(9)
    ]
    payload = json.dumps({"items": theirs, "settings": settings.model_dump(mode="json")})
    said = tmp_path / "child-turns.log"  # the child's turns' INFO lines

    def child_waits() -> bool:
        return said.exists() and "waiting for a turn slot" in said.read_text(errors="replace")

    store = StateStore(store_url)
    child: Child | None = None
    try:
        async with contextlib.AsyncExitStack() as held:
            for _ in range(3):
                await held.enter_async_context(turn_slot(store, 3, wait=10, ttl=30))
            # A separate process forked from the session's warm process (no second
            # import of Prefect and the flows).
            child = await asyncio.to_thread(
                warm_python.start,
                ["-c", _FANOUT_CHILD, payload, str(said)],
                env=dict(warm_python.env),
                cwd=ROOT,
            )
            ours = asyncio.create_task(agent_fanout(mine, settings))
            for _ in range(1800):  # bounded: 3 min for the child to start and wait
                if child_waits() or child.poll() is not None:
                    break
                await asyncio.sleep(0.1)
            if not child_waits():
                child.kill()
                raise AssertionError((await child.communicate(30)).stderr[-2000:])
            # The slots this process holds kept the other process's turns out.
            assert emu.event_log(["turn_start"]) == []
            released = time.monotonic()
        outcomes = await asyncio.wait_for(ours, 120)
        done = await child.communicate(120)
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            await child.communicate(30)
        await store.aclose()
    assert done.returncode == 0, done.stderr[-2000:]
    assert "OK 9" in done.stdout.splitlines()
    assert all(o.ok for o in outcomes)
    starts = emu.event_log(["turn_start"])
    assert len(starts) == 15
    # Ordering from the emulator's own log (same process, same monotonic clock): no
    # turn of either process started before the held slots were released, and from
    # then on both processes' waiters shared three slots.
    assert min(e["mono"] for e in starts) > released
    owner = {c["id"]: c["labels"][LABEL_WORKFLOW][:2] for c in emu.chats()}
    assert sorted(owner[e["chat_id"]] for e in starts) == ["p0"] * 6 + ["p1"] * 9
    assert emu.max_concurrent_turns() <= 3
