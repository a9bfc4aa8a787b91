"""``max_parallel`` right after the fan-out's own crash, through the real path: a Prefect
server, a ``prefect worker start`` process worker, ``run_deployment`` of ``agent-fanout``
with ``shard_size`` 1 (each workflow its own ``agent-workflow`` run, keyed
``fanout-<workflow_id>``), ``max_parallel`` 1.

The fan-out starts ``w0``; the test holds the one turn slot (cap 1) in the store, so
``w0``'s run stays live, waiting for it. The fan-out's own flow-run process is then
SIGKILLed (the worker and ``w0`` live on; the worker reports the fan-out Crashed) and
the fan-out is run again by hand with the same workflows listed the other way round —
per-workflow keys do not depend on the order, so the re-run finds ``w0``'s run by its
key. Walking in list order, as it did before it looked the live runs up, the re-run
started ``w1`` while ``w0`` still ran: two runs at ``max_parallel`` 1. Now it attaches
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
"""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path
from typing import Any

from fanout_env import (
    WORKER_QUERY_S,
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
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.deployments import run_deployment
from prefect.states import Cancelled, Completed, Crashed

from coder_chat.emulator import Emulator
from prefect_coder.blocks import StateStore
from prefect_coder.flows.deployments.agent_fanout import (
    SHARD_DEPLOYMENT,
    live_runs,
    shard_idempotency_key,
)
from prefect_coder.flows.parts.params import step_marker
from prefect_coder.flows.parts.turn_slot import WAITING_STATE_NAME, slot_key

CAP = 1
MAX_PARALLEL = 1
STEPS = ("only",)
HOLDER = "test-holds-the-only-slot"


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


async def test_rerun_after_the_fanouts_crash_attaches_to_live_runs_within_max_parallel(
    prefect_harness: Any, emu: Emulator, pg_store: tuple[str, str], tmp_path: Path
) -> None:
    store_url, tenant = pg_store
    # The slot is held for the re-run's process start: a loaded machine takes tens of
    # seconds for it, so the waiting turn gets a generous bound.
    settings = await fanout_settings(emu, store_url, CAP, tenant=tenant, slot_wait_s=300.0)
    pool = f"fanout-rerun-{uuid.uuid4().hex[:6]}"
    # The fan-out is re-run by hand below (reversed list): no Crashed trigger starting
    # a second re-run beside it.
    deployed = await deploy(pool, untriggered=("agent-fanout",))
    env = child_env(prefect_harness.api_url, prefect_harness.results_dir, query_s=WORKER_QUERY_S)
    # --limit 4: the fan-out, its re-run and both workflow runs (a re-run that broke
    # max_parallel must be able to show it).
    worker = await start_worker(pool, f"{pool}-w", env, tmp_path / "w.log", limit=4)
    items = fanout_items(uuid.uuid4().hex[:6], 2, STEPS, 0.5)
    w0, w1 = (i.workflow_id for i in items)

    def parameters(order: list[Any]) -> dict[str, Any]:
        return {
            "workflows": [i.model_dump(mode="json") for i in order],
            "settings": settings.model_dump(mode="json"),
            "max_parallel": MAX_PARALLEL,
            "fail_on_error": True,
            "shard_size": 1,
        }

    workflow_dep = deployment_id(deployed, "agent-workflow")
    store = StateStore(store_url, tenant=tenant)
    assert await store.leases.acquire(slot_key(0), HOLDER, ttl=600) is not None
    held = True
    try:
        async with get_client() as client:
            first = await run_deployment(  # type: ignore[misc]
                "agent-fanout/agent-fanout", parameters=parameters(items), timeout=0
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
                return int(pid) if pid and parent_of(int(pid)) == worker.proc.pid else None

            pid = await until("w0 waiting for the turn slot", 240, fanout_process)
            os.kill(pid, signal.SIGKILL)

            async def crashed() -> bool:
                run = await client.read_flow_run(first.id)
                return bool(run.state and run.state.is_crashed())

            await until("the worker to report the fan-out Crashed", 120, crashed)
            rerun = await run_deployment(  # type: ignore[misc]
                "agent-fanout/agent-fanout",
                parameters=parameters(list(reversed(items))),
                timeout=0,
            )

            # The re-run's first move: a task run of its own (the attach to, or the
            # start of, a workflow run). Then the slot goes: whatever it started runs.
            async def moved() -> bool:
                return bool(await _task_runs(client, rerun.id))

            await until("the re-run's first workflow run", 240, moved)
            assert await store.leases.release(slot_key(0), HOLDER)
            held = False

            async def rerun_final() -> FlowRun | None:
                run = await client.read_flow_run(rerun.id)
                return run if run.state and run.state.is_final() else None

            # Both workflows' turns have ended before the re-run can (a local fact):
            # until then the server is read only now and then.
            def turns_ended() -> bool:
                return len(emu.event_log(["turn_end"])) >= len(items) * len(STEPS)

            final = await until("the re-run to end", 240, rerun_final, gate=turns_ended)
            outcomes = await final.state.aresult() if final.state.is_completed() else None
            workflow_runs = await runs_of(client, workflow_dep, pool=pool)
            spans = {r.name: await _span(client, r) for r in workflow_runs}
            fanout_spans = [await _span(client, r) for r in (first, final)]
    finally:
        if held:
            await store.leases.release(slot_key(0), HOLDER)
        await stop_worker(worker)
        await undeploy(deployed)
        await store.aclose()
        log = worker.log.read_text(errors="replace")[-4000:]

    assert final.state.is_completed(), (final.state, log)
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
