"""What a ``reconcile-workflows`` tick costs: the Prefect server, its PostgreSQL and the
reconciler's own process, per tick, when there is nothing to do — and with N live
workflows to look at (flow runs Running, their leases renewed: every one is read and
left alone).

    PREFECT_CODER_TEST_PG_BIN=/usr/lib/postgresql/15/bin \\
        nice -n 10 .venv/bin/python bench/reconcile_idle.py --seconds 30 --live 0 50

Set-up: a private PostgreSQL cluster, a Prefect API server on it (a subprocess), the
product's deployments registered (so the reconciler's adoption read finds them), a
SQLite state store. The reconciler ticks in this process every ``--every`` seconds for
``--seconds`` (as a looping ``reconcile-workflows`` flow run does, with one Prefect
client); the server's and PostgreSQL's CPU over that window, minus the same window
with no ticks (their own service loops), divided by the ticks, is the per-tick cost.
Also printed: the CPU of starting a fresh Python that imports the reconciler — what a
tick would cost if every tick were its own flow run on a process worker.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from fleet_procs import (
    create_database,
    loadavg,
    postgres_cpu_s,
    postmaster_pid,
    prefect_server,
    private_postgres,
    process_cpu_s,
)

ROOT = Path(__file__).resolve().parents[1]


def _server_cpu_s(pid: int) -> float:
    """The server process and its children (uvicorn may fork none; cheap to include)."""
    total = process_cpu_s(pid)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def import_cpu_s() -> float:
    """CPU seconds of a fresh interpreter importing the reconciler's module."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(
        [sys.executable, "-c", "import prefect_coder.flows.deployments.reconcile_workflows"],
        check=True,
        cwd=ROOT,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


async def _live_workflows(store: object, count: int, deployment_id: uuid.UUID) -> list[object]:
    """``count`` agent-workflow flow runs set Running, each with a record and a live
    lease this process renews (what a healthy fleet looks like to the reconciler)."""
    from prefect.client.orchestration import get_client
    from prefect.states import Running

    from prefect_coder.blocks.state.leases import workflow_key
    from prefect_coder.flows.liveness.track import workflow_record_key

    held = []
    async with get_client() as client:
        for i in range(count):
            wf = f"bench-live-{i}"
            params = {"workflow_id": wf, "steps": [], "settings": {"lease_ttl_s": 60}}
            run = await client.create_flow_run_from_deployment(deployment_id, parameters=params)
            await client.set_flow_run_state(run.id, Running(), force=True)
            await store.workflows.started(  # type: ignore[attr-defined]
                workflow_record_key(wf),
                deployment=str(deployment_id),
                parameters=params,
                flow_run_id=str(run.id),
                workflow_id=wf,
                lease_keys=[workflow_key(wf)],
            )
            cm = store.lease(workflow_key(wf), holder=f"bench@run={run.id}", ttl=60)  # type: ignore[attr-defined]
            held.append((cm, await cm.__aenter__()))
    return held


async def measure(seconds: float, every: float, live: int) -> dict[str, float]:
    from prefect.client.orchestration import get_client

    from prefect_coder.blocks import ChatStateStore, StateStore
    from prefect_coder.flows.deployments.agent_fanout import agent_fanout
    from prefect_coder.flows.deployments.agent_turn import agent_turn
    from prefect_coder.flows.deployments.agent_workflow import agent_workflow
    from prefect_coder.flows.deployments.fanout_shard import agent_fanout_shard
    from prefect_coder.flows.deployments.reconcile_workflows import reconcile_once
    from prefect_coder.flows.deployments.recover_turn import recover_turn

    tmp = Path(tempfile.mkdtemp(prefix="bench-reconcile-"))
    store = StateStore(f"sqlite+aiosqlite:///{tmp / 'state.db'}")
    block = f"bench-{uuid.uuid4().hex[:8]}"
    await ChatStateStore(url=store.url).save(block, overwrite=True)
    ids = {}
    for name, fl in (
        ("agent-workflow", agent_workflow),
        ("agent-turn", agent_turn),
        ("recover-turn", recover_turn),
        ("agent-fanout", agent_fanout),
        ("agent-fanout-shard", agent_fanout_shard),
    ):
        ids[name] = await (await fl.ato_deployment(name=name)).aapply()
    held = await _live_workflows(store, live, ids["agent-workflow"])
    await store.workflows.snapshot()  # the schema and the pool, before measuring
    try:
        async with get_client() as client:
            # Two warm-up ticks: imports, the client's connection, statement caches.
            for _ in range(2):
                await reconcile_once(store, store_block=block, client=client)
            await asyncio.sleep(2)
            quiet_server, quiet_pg = SERVER_CPU(), PG_CPU()
            await asyncio.sleep(seconds)
            quiet = (SERVER_CPU() - quiet_server, PG_CPU() - quiet_pg)
            busy_server, busy_pg = SERVER_CPU(), PG_CPU()
            own = 0.0
            ticks = 0
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                t0 = time.process_time()
                rows = await reconcile_once(store, store_block=block, client=client)
                own += time.process_time() - t0
                ticks += 1
                assert all(r.action == "leave" for r in rows), rows
                assert len(rows) == live
                await asyncio.sleep(every)
            busy = (SERVER_CPU() - busy_server, PG_CPU() - busy_pg)
    finally:
        for cm, _ in held:
            await cm.__aexit__(None, None, None)  # type: ignore[attr-defined]
        await store.aclose()
    return {
        "ticks": ticks,
        "server_ms": 1000 * (busy[0] - quiet[0]) / ticks,
        "pg_ms": 1000 * (busy[1] - quiet[1]) / ticks,
        "reconciler_ms": 1000 * own / ticks,
        "server_quiet_ms_per_s": 1000 * quiet[0] / seconds,
    }


SERVER_CPU = lambda: 0.0  # noqa: E731  (set once the server is up)
PG_CPU = lambda: 0.0  # noqa: E731


def main() -> None:
    global SERVER_CPU, PG_CPU
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--every", type=float, default=1.0, help="seconds between ticks")
    parser.add_argument("--live", type=int, nargs="*", default=[0, 50])
    args = parser.parse_args()
    from prefect.settings import PREFECT_LOGGING_LEVEL, temporary_settings

    with (
        temporary_settings(updates={PREFECT_LOGGING_LEVEL: "WARNING"}),
        private_postgres() as admin,
    ):
        db = create_database(admin, "prefect_reconcile_bench")
        postmaster = postmaster_pid(admin)
        with prefect_server(db) as (_, server_pid):
            SERVER_CPU = lambda: _server_cpu_s(server_pid)  # noqa: E731
            PG_CPU = lambda: postgres_cpu_s(postmaster)  # noqa: E731
            print(f"load before: {loadavg()}")
            for live in args.live:
                got = asyncio.run(measure(args.seconds, args.every, live))
                print(
                    f"live workflows {live:4d}: {got['ticks']:.0f} ticks; per tick "
                    f"server {got['server_ms']:.1f} ms, PostgreSQL {got['pg_ms']:.1f} ms, "
                    f"reconciler {got['reconciler_ms']:.1f} ms "
                    f"(server alone: {got['server_quiet_ms_per_s']:.1f} ms/s); load {loadavg()}"
                )
    print(f"a fresh interpreter importing the reconciler: {import_cpu_s():.2f} CPU-s")
    print(f"load after: {loadavg()}")


if __name__ == "__main__":
    main()
