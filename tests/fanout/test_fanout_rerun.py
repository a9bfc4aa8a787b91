"""``max_parallel`` on a real process worker: right after the fan-out's own crash, and
across a fan-out's shards. The two tests share one ``prefect worker start`` process
worker and one set of deployments (``fleet``: a worker start is ≈ 4 CPU-s and a deploy
≈ 1.5 CPU-s of server, issue 12); each has its own emulator, store tenant and blocks,
and reads only its own deployments' runs.

Right after the fan-out's own crash, through the real path: a Prefect server, the
process worker, ``run_deployment`` of ``agent-fanout`` with ``shard_size`` 1 (each
workflow its own ``agent-workflow`` run, keyed ``fanout-<workflow_id>``),
``max_parallel`` 1.

The fan-out starts ``w0``; the test holds the one turn slot (cap 1) in the store, so
``w0``'s run stays live, waiting for it. The fan-out's own flow-run process is then
SIGKILLed (the worker and ``w0`` live on; the worker reports the fan-out Crashed) and
the fan-out is run again by hand with the same workflows listed the other way round —
per-workflow keys do not depend on the order, so the re-run finds ``w0``'s run by its
key. (The re-run by hand is a call of the flow in the test process, with
``workflow_deployment``: the one-run-per-workflow mode the deployment run chose at
``shard_size`` 1, the same lookup and gate, without a second fan-out process — ≈ 5
CPU-s, issue 12.) Walking in list order, as it did before it looked the live runs up,
the re-run started ``w1`` while ``w0`` still ran: two runs at ``max_parallel`` 1. Now it attaches
to ``w0`` first and starts ``w1`` when ``w0`` has ended. The slot is let go once the
re-run has made its first move (a task run of its own), so a re-run that started
``w1`` first would have it overlap ``w0``.

(A re-run in the *same* order — the ``prefect.yaml`` Crashed trigger's, covered by
test_fanout_workers.py — reaches the live runs before any new one even without the
lookup: the runs a fan-out started are a prefix of its list. This test is the case
where they are not.)

Measured: from Prefect's flow-run state history (first state to final state, as order
facts) never more than ``max_parallel`` workflow runs at once, and ``w0`` still live
when the re-run was created; every workflow finished with one user message per step
(the emulator's event log), every chat archived, the turn cap held.

Across shards (was test_shard_parallel.py): six one-step workflows in three
``agent-fanout-shard`` runs of 2, ``max_parallel`` 4: ``cut_shards`` makes that 2
workflows per shard and 2 shards at once (the pure rule is in test_shards.py). No turn
cap, and the worker has room for all three shard runs at once (``--limit 3``), so only
the fan-out's split can keep the running turns to 4. Measured: the emulator's event log
never shows more than 4 running turns, and the Prefect server never shows more than 2
of the shard runs running at once (from their start and end times: the third started
after one of the first two ended).
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import pytest
from fanout_env import (
    WORKER_QUERY_S,
    Worker,
    child_env,
    deploy,
    deployment_id,
    fanout_items,
    fanout_settings,
    most_at_once,
    parent_of,
    runs_of,
    start_worker,
    stop_worker,
    undeploy,
    until,
    user_messages_per_step,
)
from prefect.client.orchestration import PrefectClient, get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterName
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.deployments import run_deployment
from prefect.states import Cancelled, Completed, Crashed

from coder_chat.emulator import Emulator
from prefect_coder.blocks import StateStore
from prefect_coder.flows.common.params import step_marker
from prefect_coder.flows.deployments.agent_fanout import (
    SHARD_DEPLOYMENT,
    WORKFLOW_DEPLOYMENT,
    agent_fanout,
    live_runs,
    shard_idempotency_key,
)
from prefect_coder.flows.fleet.slots import WAITING_STATE_NAME, slot_key

CAP = 1
MAX_PARALLEL = 1
STEPS = ("only",)
HOLDER = "test-holds-the-only-slot"
#: The shard test's size (see the module docstring).
SHARD_WORKFLOWS = 6
SHARD_SIZE = 2
SHARD_MAX_PARALLEL = 4


@dataclass
class Fleet:
    """The tests' pool, their deployments (ids as :func:`fanout_env.deploy` returns them)
    and its one process worker."""

    pool: str
    deployed: list[UUID]
    worker: Worker

    def log(self) -> str:
        return self.worker.log.read_text(errors="replace")[-4000:]


@pytest.fixture(scope="class")
async def fleet(
    prefect_harness: Any, warm_python: Any, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Fleet]:
    """One process worker (``--limit 3``: the fan-out and both workflow runs of the
    re-run test — a re-run that broke max_parallel must be able to show it; the three
    shard runs of the shard test at once) and the deployments, for both tests. The
    re-run test re-runs the fan-out by hand: no Crashed trigger on ``agent-fanout``
    starting a second re-run beside it. ``warm_python`` first: the worker's flow runs
    fork from it (tests/warm_launch.py), so its socket must be in the worker's
    environment. The pool is made first and the worker started before the deploy, so
    the worker's start overlaps it."""
    pool = f"fanout-rerun-{uuid.uuid4().hex[:6]}"
    async with get_client() as client:
        await client.create_work_pool(WorkPoolCreate(name=pool, type="process"), overwrite=True)
    env = child_env(prefect_harness.api_url, prefect_harness.results_dir, query_s=WORKER_QUERY_S)
    log = tmp_path_factory.mktemp("fleet") / "w.log"
    worker = await start_worker(pool, f"{pool}-w", env, log, limit=3)
    deployed: list[UUID] = []
    try:
        deployed = await deploy(pool, untriggered=("agent-fanout",))
        yield Fleet(pool, deployed, worker)
    finally:
        await stop_worker(worker)
        if deployed:
            await undeploy(deployed)


async def _task_runs(client: PrefectClient, run_id: Any) -> list[Any]:
    return await client.read_task_runs(
        flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id]))
    )


async def _span(client: PrefectClient, run: FlowRun) -> tuple[Any, Any]:
    """A run's first and final state's timestamps, from its state history."""
    states = sorted(await client.read_flow_run_states(run.id), key=lambda s: s.timestamp)
    final = [s for s in states if s.is_final()]
    assert states and final, (run.name, [(s.type, s.timestamp) for s in states])
    return states[0].timestamp, final[-1].timestamp


class TestOnOneWorker:
    """The tests of the one worker (``fleet``, class-scoped: torn down, deployments
    removed, before the module's test below deploys the same deployment names to a
    pool of its own)."""

    async def test_rerun_after_the_fanouts_crash_attaches_to_live_runs_within_max_parallel(
        self, fleet: Fleet, emu: Emulator, pg_store: tuple[str, str]
    ) -> None:
        store_url, tenant = pg_store
        # The slot is held through the fan-out's process start and its crash: a loaded
        # machine takes tens of seconds for those, so the waiting turn gets a generous bound.
        settings = await fanout_settings(emu, store_url, CAP, tenant=tenant, slot_wait_s=300.0)
        pool, deployed, worker = fleet.pool, fleet.deployed, fleet.worker
        tag = uuid.uuid4().hex[:6]
        items = fanout_items(tag, 2, STEPS, 0.5)
        w0, w1 = (i.workflow_id for i in items)

        parameters = {
            "workflows": [i.model_dump(mode="json") for i in items],
            "settings": settings.model_dump(mode="json"),
            "max_parallel": MAX_PARALLEL,
            "fail_on_error": True,
            "shard_size": 1,
        }

        workflow_dep = deployment_id(deployed, "agent-workflow")
        rerun_name = f"rerun-by-hand-{tag}"

        async def rerun_by_hand() -> Any:
            return await agent_fanout.with_options(flow_run_name=rerun_name)(
                list(reversed(items)),
                settings,
                max_parallel=MAX_PARALLEL,
                fail_on_error=True,
                workflow_deployment=WORKFLOW_DEPLOYMENT,
                return_state=True,
            )

        store = StateStore(store_url, tenant=tenant)
        assert await store.leases.acquire(slot_key(0), HOLDER, ttl=600) is not None
        held = True
        rerun: asyncio.Task[Any] | None = None
        try:
            async with get_client() as client:
                first = await run_deployment(  # type: ignore[misc]
                    "agent-fanout/agent-fanout", parameters=parameters, timeout=0
                )

                # Mid-way: w0's run waits for the slot, and the fan-out's process (a child
                # of the worker) is known.
                async def fanout_process() -> int | None:
                    runs = await runs_of(client, workflow_dep, [StateType.RUNNING], pool=pool)
                    run = next((r for r in runs if r.name == w0), None)
                    if run is None or not any(
                        t.state_name == WAITING_STATE_NAME for t in await _task_runs(client, run.id)
                    ):
                        return None
                    fanout = await client.read_flow_run(first.id)
                    pid = str(fanout.infrastructure_pid or "").split(":")[-1]
                    return int(pid) if pid and parent_of(int(pid)) == worker.pid else None

                pid = await until("w0 waiting for the turn slot", 240, fanout_process)
                os.kill(pid, signal.SIGKILL)

                async def crashed() -> bool:
                    run = await client.read_flow_run(first.id)
                    return bool(run.state and run.state.is_crashed())

                await until("the worker to report the fan-out Crashed", 120, crashed)
                rerun = asyncio.create_task(rerun_by_hand())

                # The re-run's first move: a task run of its own (the attach to, or the
                # start of, a workflow run). Then the slot goes: whatever it started runs.
                async def moved() -> bool:
                    return bool(
                        await client.read_task_runs(
                            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[rerun_name]))
                        )
                    )

                await until("the re-run's first workflow run", 240, moved)
                assert await store.leases.release(slot_key(0), HOLDER)
                held = False
                # The re-run's own end, here in this process: no server reads to wait.
                state = await asyncio.wait_for(rerun, 240)
                final = await client.read_flow_run(state.state_details.flow_run_id)
                outcomes = await state.aresult() if state.is_completed() else None
                workflow_runs = await runs_of(client, workflow_dep, pool=pool)
                spans = {r.name: await _span(client, r) for r in workflow_runs}
                fanout_spans = [await _span(client, r) for r in (first, final)]
        finally:
            if rerun is not None and not rerun.done():
                rerun.cancel()
                await asyncio.gather(rerun, return_exceptions=True)
            if held:
                await store.leases.release(slot_key(0), HOLDER)
            await store.aclose()
            log = fleet.log()

        assert state.is_completed(), (state, log)
        # Each workflow ran once (the re-run attached to w0's run, started none twice) …
        assert sorted((r.name, r.state_type) for r in workflow_runs) == [
            (w0, StateType.COMPLETED),
            (w1, StateType.COMPLETED),
        ], [(r.name, r.state_name) for r in workflow_runs]
        assert outcomes is not None
        got = [o if isinstance(o, dict) else o.model_dump(mode="json") for o in outcomes]
        run_of = {r.name: str(r.id) for r in workflow_runs}
        assert [(o["workflow_id"], o["ok"], o["runs"], o["flow_run_id"]) for o in got] == [
            (w1, True, 1, run_of[w1]),
            (w0, True, 1, run_of[w0]),
        ], got
        # … w0's run, started by the crashed fan-out, was still live when the re-run was
        # created (the case under test, not assumed) …
        (_, crashed_end), (rerun_start, _) = fanout_spans
        assert crashed_end < rerun_start < spans[w0][1], (fanout_spans, spans, log)
        # … and never more than max_parallel workflow runs at once, from their state
        # histories (created → final).
        shown = {n: (a.isoformat(), b.isoformat()) for n, (a, b) in sorted(spans.items())}
        assert most_at_once(list(spans.values())) <= MAX_PARALLEL, (shown, log)
        assert spans[w0][1] <= spans[w1][0], shown
        # One user message per step (the emulator's event log), every chat archived, the
        # turn cap held.
        counts = user_messages_per_step(emu, items, STEPS)
        assert counts == {step_marker(i.workflow_id, s): 1 for i in items for s in STEPS}, counts
        chats = emu.chats()
        assert len(chats) == len(items) and all(c["archived"] for c in chats), chats
        assert emu.max_concurrent_turns() <= CAP, emu.event_log(["turn_start", "turn_end"])

    async def test_max_parallel_holds_across_shards(
        self, fleet: Fleet, emu: Emulator, pg_store: tuple[str, str]
    ) -> None:
        store_url, tenant = pg_store
        settings = await fanout_settings(emu, store_url, None, tenant=tenant)
        items = fanout_items(uuid.uuid4().hex[:6], SHARD_WORKFLOWS, ["only"], 2.0)
        # The fan-out itself runs here (no process start for it); its shards are
        # deployment runs on the worker.
        outcomes = await agent_fanout(
            items,
            settings,
            max_parallel=SHARD_MAX_PARALLEL,
            shard_size=SHARD_SIZE,
            shard_deployment=SHARD_DEPLOYMENT,
            # Each look at a shard run's state is a read of the server; 1 s of lag
            # before the next shard starts changes no order fact below.
            poll_interval_s=1.0,
        )
        async with get_client() as client:
            shard_runs = await runs_of(
                client, deployment_id(fleet.deployed, "agent-fanout-shard"), pool=fleet.pool
            )
        log = fleet.log()

        assert [o.ok for o in outcomes] == [True] * SHARD_WORKFLOWS, (outcomes, log)
        assert [r.state_type for r in shard_runs] == [StateType.COMPLETED] * 3, shard_runs
        assert len(emu.event_log(["turn_start"])) == SHARD_WORKFLOWS
        # The server's own count of running turns: never above max_parallel …
        assert 1 <= emu.max_concurrent_turns() <= SHARD_MAX_PARALLEL, emu.event_log(["turn_start"])
        # … because never more than max_parallel // per-shard shards ran at once.
        spans = [(r.start_time, r.end_time) for r in shard_runs]
        assert all(s is not None and e is not None for s, e in spans), spans
        assert most_at_once(spans) <= SHARD_MAX_PARALLEL // SHARD_SIZE, spans


async def test_live_runs_follow_a_crashed_run_to_its_restart(prefect_harness: Any) -> None:
    """The lookup behind the re-run's order, on shard keys (no worker: the runs are made
    through the API and stay where they are put). A unit is live when its run, or the
    restart of its crashed run (``…-after-<run id>``), is not final yet."""
    pool = f"fanout-live-{uuid.uuid4().hex[:6]}"
    deployed = await deploy(pool)
    shard_dep = deployment_id(deployed, "agent-fanout-shard")
    tag = uuid.uuid4().hex[:6]
    shards = [[f"lv-{tag}-{n}-{i}" for i in range(2)] for n in range(5)]

    def key(ids: list[str]) -> Any:
        return lambda after: shard_idempotency_key(ids, after)

    made: list[FlowRun] = []
    try:
        async with get_client() as client:

            async def make(ids: list[str], after: str | None = None) -> FlowRun:
                run = await client.create_flow_run_from_deployment(
                    shard_dep, parameters={"workflows": []}, idempotency_key=key(ids)(after)
                )
                made.append(run)
                return run

            async def end(run: FlowRun, state: Any) -> None:
                await client.set_flow_run_state(run.id, state, force=True)

            await end(await make(shards[0]), Completed())  # done: nothing to attach to
            crashed = await make(shards[1])
            await end(crashed, Crashed())
            restart = await make(shards[1], str(crashed.id))  # its restart, Scheduled
            waiting = await make(shards[2])  # Scheduled
            # shards[3]: never started
            crashed_again = await make(shards[4])
            await end(crashed_again, Crashed())
            await end(await make(shards[4], str(crashed_again.id)), Completed())

            live = await live_runs(SHARD_DEPLOYMENT, [key(ids) for ids in shards])
            for run in made:
                current = await client.read_flow_run(run.id)
                if current.state is not None and not current.state.is_final():
                    await end(run, Cancelled())
    finally:
        await undeploy(deployed)

    assert {i: r.id for i, r in live.items()} == {1: restart.id, 2: waiting.id}, live
