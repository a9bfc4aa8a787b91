"""Fan-out throughput under the fleet's turn-slot cap, and the two cap mechanisms.

1. ``agent_fanout`` of ``--workflows`` short one-turn workflows (default 200) under
   caps 5 and 50 (``CoderCredentials.max_concurrent_turns``), on the local
   emulator (no server capacity limit) with a SQLite store and a temporary
   Prefect test server: wall time, turns/s, the server-side peak of running
   turns (emulator event log), the slot hand-off latency (a turn that found
   every slot busy: its acquire minus the latest release before it) and the
   acquire latency of every turn (asking to holding, incl. the process queue).
2. The hand-off latency of a Prefect global concurrency limit (``concurrency(name,
   occupy=1, strict=True)``, limit 1) on the same server, next to the same
   holder/waiter pair on a store turn slot (limit 1), both on an idle process.

Everything runs in ONE worker process (the fan-out drives its workflows
in-process), so turns/s is per worker process; alongside it the process CPU time
per turn (the fan-out is CPU-bound at cap 50) and the resident memory per open
turn (peak RSS during the run minus RSS before it, over the server-side peak of
running turns; an upper bound: it also counts caches and allocator slack).

Run: ``.venv/bin/python bench/fanout.py [--workflows 200] [--caps 5,50] [--turn-s 0.05]``.

``--workers-mode``: the fan-out as a deployment run on ``prefect worker start``
process workers (each workflow its own ``agent-workflow`` flow run, so a flow-run
process each): turns/s at cap 50 (``--workers-cap``) with 1 and with 2 workers,
and the time from SIGKILLing a worker (with its flow-run processes) that holds
turn slots until turns of the other worker hold those slots again (the dead
runs marked Crashed at once, as the zombie automation would).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prefect.settings import (  # noqa: E402
    PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
    PREFECT_LOGGING_LEVEL,
    PREFECT_RESULTS_LOCAL_STORAGE_PATH,
    temporary_settings,
)
from prefect.testing.utilities import prefect_test_harness  # noqa: E402
from pydantic import SecretStr  # noqa: E402

from coder_chat.emulator import Emulator  # noqa: E402
from prefect_coder.blocks import ChatStateStore, CoderCredentials  # noqa: E402
from prefect_coder.flows.deployments.agent_fanout import FanoutItem, agent_fanout  # noqa: E402
from prefect_coder.flows.parts import turn_slot  # noqa: E402
from prefect_coder.flows.parts.params import Step, WorkflowSettings  # noqa: E402

TOKEN = f"bench-{uuid.uuid4().hex}"


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _handoffs(trace: list[tuple[str, float]]) -> list[float]:
    """For every acquire that had to wait: its time minus the latest release before it."""
    out: list[float] = []
    last_release: float | None = None
    for kind, at in sorted(trace, key=lambda e: e[1]):
        if kind == "release":
            last_release = at
        elif kind == "acquire_waited" and last_release is not None:
            out.append(at - last_release)
    return out


async def _retry_503(make: Callable[[], Awaitable[object]], attempts: int = 6) -> None:
    """A Prefect test server on SQLite answers 503 to writes on a loaded machine: retry."""
    from prefect.exceptions import PrefectHTTPStatusError

    for i in range(attempts):
        try:
            await make()
            return
        except PrefectHTTPStatusError as exc:
            if exc.response.status_code != 503 or i == attempts - 1:
                raise
            await asyncio.sleep(0.5 * (i + 1))


async def _one_cap(emu: Emulator, tmp: Path, cap: int, n: int, turn_s: float) -> dict[str, float]:
    name = uuid.uuid4().hex[:8]
    creds = CoderCredentials(
        base_url=emu.base_url,
        organization_id=uuid.UUID(str(emu.organization_id)),
        token=SecretStr(TOKEN),
        max_concurrent_turns=cap,
        turn_slot_wait=600,
        turn_slot_ttl=30,
    )
    await _retry_503(lambda: creds.save(f"bench-coder-{name}", overwrite=True))
    store = ChatStateStore(url=f"sqlite+aiosqlite:///{tmp / f'{name}.db'}")
    await _retry_503(lambda: store.save(f"bench-store-{name}", overwrite=True))
    settings = WorkflowSettings(
        credentials_block=f"bench-coder-{name}",
        store_block=f"bench-store-{name}",
        retries=0,
        lease_ttl_s=30,
        artifacts=False,
    )
    items = [
        FanoutItem(
            workflow_id=f"b-{name}-{i}",
            steps=[Step(name="s", prompt=f'go #emu {{"sleep": {turn_s}, "text": "ok"}}')],
        )
        for i in range(n)
    ]
    before = len(emu.event_log(["turn_start"]))
    turn_slot.SLOT_TRACE = []
    rss0 = _rss_kib()
    peak_rss = [rss0]
    sampler = asyncio.create_task(_sample_rss(peak_rss))
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    try:
        outcomes = await agent_fanout(items, settings, max_parallel=max(64, 2 * cap))
    finally:
        sampler.cancel()
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    trace, turn_slot.SLOT_TRACE = turn_slot.SLOT_TRACE, None
    assert all(o.ok for o in outcomes), [o.error for o in outcomes if not o.ok][:3]
    starts = emu.event_log(["turn_start"])[before:]
    assert len(starts) == n
    peak = max(e["details"]["running"] for e in starts)
    hand = _handoffs(trace)
    latency = [v for k, v in trace if k == "acquire_latency"]
    return {
        "cap": cap,
        "wall_s": wall,
        "turns_per_s": n / wall,
        "cpu_ms_per_turn": cpu / n * 1000,
        "rss_kib_per_open_turn": (max(peak_rss) - rss0) / max(1, peak),
        "server_peak": peak,
        "handoffs": len(hand),
        "handoff_p50_ms": _pct(hand, 0.5) * 1000,
        "handoff_p95_ms": _pct(hand, 0.95) * 1000,
        "acquire_p50_ms": _pct(latency, 0.5) * 1000,
        "acquire_p95_ms": _pct(latency, 0.95) * 1000,
    }


def _rss_kib() -> int:
    """This process's resident set size (Linux /proc), in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


async def _sample_rss(peak: list[int]) -> None:
    while True:
        peak.append(_rss_kib())
        await asyncio.sleep(0.05)


async def _store_handoff(tmp: Path, rounds: int) -> list[float]:
    from prefect_coder.blocks import StateStore

    store = StateStore(f"sqlite+aiosqlite:///{tmp / 'handoff.db'}")

    async def holder(at: dict[str, float]) -> None:
        async with turn_slot.turn_slot(store, 1, wait=10, ttl=30):
            await asyncio.sleep(0.2)
        at["release"] = time.monotonic()

    async def waiter(at: dict[str, float]) -> None:
        await asyncio.sleep(0.05)
        async with turn_slot.turn_slot(store, 1, wait=10, ttl=30):
            at["acquire"] = time.monotonic()

    out: list[float] = []
    try:
        for _ in range(rounds):
            at: dict[str, float] = {}
            await asyncio.gather(holder(at), waiter(at))
            out.append(at["acquire"] - at["release"])
    finally:
        await store.aclose()
    return out


async def _gcl_handoff(rounds: int) -> list[float]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.concurrency.asyncio import concurrency

    name = f"bench-gcl-{uuid.uuid4().hex[:6]}"
    async with get_client() as client:
        await client.create_global_concurrency_limit(
            GlobalConcurrencyLimitCreate(name=name, limit=1)
        )
    out: list[float] = []

    async def holder(at: dict[str, float]) -> None:
        async with concurrency(name, occupy=1, strict=True):
            await asyncio.sleep(0.2)
        at["release"] = time.monotonic()

    async def waiter(at: dict[str, float]) -> None:
        await asyncio.sleep(0.05)
        async with concurrency(name, occupy=1, strict=True):
            at["acquire"] = time.monotonic()

    for _ in range(rounds):
        at: dict[str, float] = {}
        await asyncio.gather(holder(at), waiter(at))
        out.append(at["acquire"] - at["release"])
    return out


async def _main(args: argparse.Namespace, tmp: Path) -> None:
    results: list[dict[str, float]] = []
    with Emulator.running_in_thread(tokens=[TOKEN], delta_delay=0.0) as emu:
        # warm-up: imports, the store's schema, the first flow run
        await _one_cap(emu, tmp, 5, 5, args.turn_s)
        for cap in [int(c) for c in args.caps.split(",")]:
            r = await _one_cap(emu, tmp, cap, args.workflows, args.turn_s)
            results.append(r)
            print(
                f"cap {r['cap']:>3}: {args.workflows} workflows in {r['wall_s']:.1f}s = "
                f"{r['turns_per_s']:.1f} turns/s per worker process "
                f"({r['cpu_ms_per_turn']:.0f} ms CPU/turn, "
                f"≤ {r['rss_kib_per_open_turn']:.0f} KiB RSS per open turn); "
                f"server peak {r['server_peak']}; "
                f"slot hand-off p50 {r['handoff_p50_ms']:.0f} ms, p95 "
                f"{r['handoff_p95_ms']:.0f} ms ({r['handoffs']} waits); slot acquire "
                f"p50 {r['acquire_p50_ms']:.0f} ms, p95 {r['acquire_p95_ms']:.0f} ms",
                flush=True,
            )
    print(
        "turns/s per worker process: "
        + ", ".join(f"cap {r['cap']}: {r['turns_per_s']:.1f}" for r in results)
        + " (goal at cap 50: >= 20)",
        flush=True,
    )
    if args.no_handoff:
        return
    store_h = await _store_handoff(tmp, args.gcl_rounds)
    print(
        f"store turn slot (limit 1, idle): hand-off p50 {_pct(store_h, 0.5) * 1000:.0f} ms, "
        f"p95 {_pct(store_h, 0.95) * 1000:.0f} ms ({len(store_h)} rounds)",
        flush=True,
    )
    gcl = await _gcl_handoff(args.gcl_rounds)
    print(
        f"Prefect global concurrency limit (strict, limit 1): hand-off p50 "
        f"{_pct(gcl, 0.5) * 1000:.0f} ms, p95 {_pct(gcl, 0.95) * 1000:.0f} ms "
        f"({len(gcl)} rounds)",
        flush=True,
    )
    print(
        f"means: store {statistics.mean(store_h) * 1000:.0f} ms, "
        f"GCL {statistics.mean(gcl) * 1000:.0f} ms"
    )


async def _fanout_on_workers(
    emu: Emulator, tmp: Path, pool: str, n: int, args: argparse.Namespace, workers: int
) -> float:
    """turns/s of one agent-fanout deployment run of ``n`` one-turn workflows."""
    from prefect.deployments import run_deployment

    name = uuid.uuid4().hex[:8]
    await _retry_503(
        lambda: CoderCredentials(
            base_url=emu.base_url,
            organization_id=uuid.UUID(str(emu.organization_id)),
            token=SecretStr(TOKEN),
            max_concurrent_turns=args.workers_cap,
            turn_slot_wait=600,
            turn_slot_ttl=5,
        ).save(f"bench-coder-{name}", overwrite=True)
    )
    store = ChatStateStore(url=f"sqlite+aiosqlite:///{tmp / 'workers.db'}")
    await _retry_503(lambda: store.save(f"bench-store-{name}", overwrite=True))
    settings = WorkflowSettings(
        credentials_block=f"bench-coder-{name}",
        store_block=f"bench-store-{name}",
        retries=0,
        lease_ttl_s=5,
        artifacts=False,
    )
    items = [
        FanoutItem(
            workflow_id=f"bw-{name}-{i}",
            steps=[Step(name="s", prompt=f'go #emu {{"sleep": {args.turn_s}, "text": "ok"}}')],
        ).model_dump(mode="json")
        for i in range(n)
    ]
    t0 = time.perf_counter()
    run = await run_deployment(  # type: ignore[misc]
        "agent-fanout/agent-fanout",
        parameters={
            "workflows": items,
            "settings": settings.model_dump(mode="json"),
            "max_parallel": n,
            "fail_on_error": True,
            "poll_interval_s": 0.5,
        },
        timeout=None,
        poll_interval=0.5,
    )
    wall = time.perf_counter() - t0
    assert run.state is not None and run.state.is_completed(), run.state
    return n / wall


async def _workers_mode(args: argparse.Namespace, tmp: Path) -> None:
    sys.path.insert(0, str(ROOT / "tests" / "fanout"))
    from fanout_env import child_env, deploy, start_worker, stop_worker
    from prefect.settings import PREFECT_API_URL

    pool = f"bench-{uuid.uuid4().hex[:6]}"
    await deploy(pool)
    env = child_env(str(PREFECT_API_URL.value()), tmp / "results")
    with Emulator.running_in_thread(tokens=[TOKEN], delta_delay=0.0) as emu:
        for count in (1, 2):
            workers = [
                await start_worker(
                    pool, f"{pool}-{count}-{i}", env, tmp / f"w{count}{i}.log", args.worker_limit
                )
                for i in range(count)
            ]
            try:
                rate = await _fanout_on_workers(emu, tmp, pool, args.workflows, args, count)
            finally:
                for w in workers:
                    await stop_worker(w)
            print(
                f"{count} worker(s), cap {args.workers_cap}, limit {args.worker_limit} runs "
                f"each: {args.workflows} workflows = {rate:.2f} turns/s",
                flush=True,
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workflows", type=int, default=200)
    p.add_argument("--caps", default="5,50")
    p.add_argument("--turn-s", type=float, default=0.05)
    p.add_argument("--gcl-rounds", type=int, default=10)
    p.add_argument(
        "--no-handoff", action="store_true", help="skip the store-vs-GCL hand-off comparison"
    )
    p.add_argument("--workers-mode", action="store_true", help="1 vs 2 process workers")
    p.add_argument("--workers-cap", type=int, default=50)
    p.add_argument("--worker-limit", type=int, default=12, help="flow runs per worker at once")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-fanout-"))
    with temporary_settings(
        updates={
            PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None,
            PREFECT_RESULTS_LOCAL_STORAGE_PATH: tmp / "results",
            PREFECT_LOGGING_LEVEL: "ERROR",
        }
    ):
        with prefect_test_harness(server_startup_timeout=180):
            if args.workers_mode:
                asyncio.run(_workers_mode(args, tmp))
            else:
                asyncio.run(_main(args, tmp))


if __name__ == "__main__":
    main()
