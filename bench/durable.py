"""Per-turn overhead of the durable turn: ``agent_workflow`` vs raw ``CoderAgent.generate``.

The same 20-turn conversation runs twice on the local emulator:

* raw — one ``CoderAgent`` calling ``generate()`` 20 times (no Prefect, no store);
* durable — ``agent_workflow`` with 20 steps: per turn a Prefect task with a
  persisted JSON result, checkpoint load, journal write-ahead, a fresh agent
  (and stream dial) from the checkpoint, the ``finally`` checkpoint, Prefect
  events and a background markdown artifact; per run the workflow lease and one
  shared client.

Overhead of turn i = (completion of durable turn i - completion of turn i-1)
- (raw turn i). The first turn of each run (chat creation) is left out, and
``--rounds`` runs per backend are pooled. Reported for the SQLite and the
PostgreSQL store; targets: median ≤ 30 ms (SQLite) / ≤ 50 ms (PostgreSQL).

``--peer`` also runs the closest peer, Pydantic AI's durable agents on Prefect
(``pydantic-ai-slim[prefect]``, the ``PrefectDurability`` capability), in the same
process and the same rounds: per step one ``agent.run`` with one tool call on
``TestModel``, plain vs with ``PrefectDurability`` inside a flow (step 0 of each
flow left out, as ours). Its overhead per step is the durable step minus the plain
one; the ratio ours / peer is printed per store.

``--store-only`` measures just the state store's work of one steady-state turn (the
four single-purpose calls vs ``store.turns``), process CPU and wall per turn.

Run: ``.venv/bin/python bench/durable.py [--turns 20] [--rounds 3] [--pg-url URL] [--no-pg]
[--stores sqlite,pg] [--peer] [--store-only]``.
Without ``--pg-url`` a private throwaway PostgreSQL cluster is started when the
server binaries exist (``/usr/lib/postgresql/*/bin``); Prefect runs against a
temporary test server with result storage in a temp dir.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pg_cluster

TOKEN = f"bench-{uuid.uuid4().hex}"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q * (len(ordered) - 1))))
    return ordered[k]


@contextmanager
def private_postgres() -> Iterator[str | None]:
    """A throwaway PostgreSQL cluster (bench/pg_cluster.py), or None without binaries."""
    try:
        pg_cluster.pg_bindir()
    except RuntimeError:
        yield None
        return
    with pg_cluster.private_postgres() as url:
        yield url


def prompts(n: int) -> list[str]:
    return [f"turn {i} #emu " + json.dumps({"text": f"answer {i}"}) for i in range(n)]


# Process CPU per turn (ms), per run: wall-clock overheads swing with the load of a
# shared machine; the process's own CPU time per turn much less.
CPU_MS: dict[str, list[float]] = collections.defaultdict(list)


async def raw_turns(emu: object, n: int) -> list[float]:
    from coder_chat.agent import CoderAgent

    out = []
    async with CoderAgent(
        base_url=emu.base_url,  # type: ignore[attr-defined]
        token=TOKEN,
        organization_id=emu.organization_id,  # type: ignore[attr-defined]
        request_timeout=30,
    ) as agent:
        cpu0 = time.process_time()
        for p in prompts(n):
            t0 = time.perf_counter()
            await agent.generate(p, timeout=60)
            out.append((time.perf_counter() - t0) * 1000)
        CPU_MS["raw"].append((time.process_time() - cpu0) * 1000 / n)
    return out


async def durable_turns(
    coder: str, store_block: str, n: int, tag: str, poll_timeout: float = 30.0
) -> tuple[list[float], list[float]]:
    """(wall time per turn from the flow's view, generate time inside each turn)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from prefect_coder.flows import Step, WorkflowSettings, agent_workflow

    settings = WorkflowSettings(credentials_block=coder, store_block=store_block, keep_chat=True)
    steps = [Step(name=f"t{i:02d}", prompt=p) for i, p in enumerate(prompts(n))]
    wf = f"bench-{tag}-{uuid.uuid4().hex[:8]}"
    cpu0 = time.process_time()
    state = await agent_workflow(wf, steps, settings, return_state=True)
    results = await state.aresult()
    CPU_MS[f"durable:{store_block}"].append((time.process_time() - cpu0) * 1000 / n)
    # The server records task runs from events, asynchronously: on a loaded machine the
    # flow can finish before all of its turns are recorded. Poll, with a bound.
    deadline = time.monotonic() + poll_timeout
    async with get_client() as client:
        while True:
            runs = await client.read_task_runs(
                flow_run_filter=FlowRunFilter(
                    id=FlowRunFilterId(any_=[state.state_details.flow_run_id])
                )
            )
            turns = [r for r in runs if r.name.startswith(wf + "/")]
            ends = sorted(r.end_time for r in turns if r.end_time is not None)
            if len(ends) >= n or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.1)
    if len(ends) != n:
        raise RuntimeError(
            f"expected {n} finished turn task runs, found {len(ends)} of {len(runs)} "
            f"after waiting {poll_timeout:.0f}s for the server to record them"
        )
    start = min(r.start_time for r in turns if r.start_time)
    walls = []
    previous = start
    for end in ends:
        walls.append((end - previous).total_seconds() * 1000)
        previous = end
    return walls, [r.generate_ms for r in results]


def report(label: str, raw: list[float], walls: list[float], gens: list[float]) -> dict[str, float]:
    """Turn 0 of each run (it creates the chat and pays first-use costs) is already dropped."""
    over = [w - r for w, r in zip(walls, raw, strict=True)]
    row = {
        "turns": len(over),
        "raw_median_ms": statistics.median(raw),
        "durable_median_ms": statistics.median(walls),
        "generate_in_task_median_ms": statistics.median(gens),
        "overhead_median_ms": statistics.median(over),
        "overhead_p95_ms": pct(over, 0.95),
    }
    print(
        f"{label:10s} raw turn {row['raw_median_ms']:6.1f} ms | durable turn "
        f"{row['durable_median_ms']:6.1f} ms (generate inside {row['generate_in_task_median_ms']:5.1f})"
        f" | overhead median {row['overhead_median_ms']:5.1f} ms, p95 {row['overhead_p95_ms']:5.1f} ms"
    )
    return row


class Peer:
    """Pydantic AI's ``PrefectDurability``: one ``agent.run`` with one tool call per step."""

    def __init__(self) -> None:
        try:
            from pydantic_ai import Agent
            from pydantic_ai.durable_exec.prefect import PrefectDurability
            from pydantic_ai.models.test import TestModel
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise SystemExit(
                f"--peer needs pydantic-ai-slim[prefect] ({exc}); "
                "install it with: .venv/bin/pip install 'pydantic-ai-slim[prefect]'"
            ) from exc
        from prefect import flow

        def agent(durable: bool) -> Any:
            caps = [PrefectDurability()] if durable else []
            a = Agent(
                TestModel(), name="bench-peer" if durable else "bench-plain", capabilities=caps
            )

            @a.tool_plain
            def lookup(build: int) -> str:
                """Look up a CI build."""
                return f"build {build}: green"

            return a

        self.plain = agent(durable=False)
        durable = agent(durable=True)

        @flow(name="bench-peer-steps")
        async def steps(n: int) -> list[float]:
            out = []
            for i in range(n):
                t0 = time.perf_counter()
                await durable.run(f"step {i}: look up build {i}")
                out.append((time.perf_counter() - t0) * 1000)
            return out

        self.steps = steps

    async def plain_steps(self, n: int) -> list[float]:
        cpu0 = time.process_time()
        out = []
        for i in range(n):
            t0 = time.perf_counter()
            result = await self.plain.run(f"step {i}: look up build {i}")
            out.append((time.perf_counter() - t0) * 1000)
        # TestModel calls every tool once, then answers: one tool call per step.
        assert any(p.part_kind == "tool-call" for m in result.all_messages() for p in m.parts)
        CPU_MS["peer:plain"].append((time.process_time() - cpu0) * 1000 / n)
        return out

    async def durable_steps(self, n: int) -> list[float]:
        cpu0 = time.process_time()
        out = list(await self.steps(n))
        CPU_MS["peer:durable"].append((time.process_time() - cpu0) * 1000 / n)
        return out


async def store_work(url: str, mode: str, n: int = 200) -> tuple[float, float]:
    """(process CPU ms, median wall ms) of one steady-state turn's store work, ``n``
    turns on one checkpointed chat: ``four`` = the single-purpose calls the turn made
    before ``store.turns`` (checkpoint get, journal get, journal set, checkpoint set),
    ``turns`` = ``store.turns.begin`` + ``store.turns.record``."""
    from prefect_coder.blocks import StateStore
    from prefect_coder.blocks.state import JournalEntry

    store = StateStore(url, tenant=f"micro-{uuid.uuid4().hex[:8]}")

    async def turn(i: int) -> None:
        marker = f"[wf/s{i}]"
        if mode == "four":
            await store.checkpoints.get("wf")
            await store.journal.get("chat")
            entry = JournalEntry(state="submitting", marker=marker, attempt=0)
            await store.journal.set("chat", entry)
            await store.checkpoints.set("wf", "chat", i + 1)
        else:
            await store.turns.begin("wf", marker)
            await store.turns.record("wf", "chat", i + 1)

    try:
        await store.checkpoints.set("wf", "chat", 1)
        for i in range(20):  # warm-up: pools, prepared statements
            await turn(n + i)
        cpu0 = time.process_time()
        walls = []
        for i in range(n):
            t0 = time.perf_counter()
            await turn(i)
            walls.append((time.perf_counter() - t0) * 1000)
        return (time.process_time() - cpu0) * 1000 / n, statistics.median(walls)
    finally:
        await store.aclose()


def store_only(pg_url: str | None) -> None:
    """``--store-only``: the store's work per turn, both ways, without Prefect."""
    root = tempfile.mkdtemp(prefix="bench-store-")
    urls = [("SQLite", f"sqlite+aiosqlite:///{root}/state.db")]
    if pg_url:
        urls.append(("PostgreSQL", pg_url))
    try:
        for label, url in urls:
            for mode in ("four", "turns", "four", "turns"):
                cpu, wall = asyncio.run(store_work(url, mode))
                print(f"{label:10s} {mode:5s} CPU {cpu:5.2f} ms/turn, wall median {wall:6.2f} ms")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def peer_version() -> str:
    from importlib.metadata import version

    return version("pydantic-ai-slim")


async def main_async(args: argparse.Namespace, pg_url: str | None, results_dir: str) -> None:
    from pydantic import SecretStr

    from coder_chat.emulator import Emulator
    from prefect_coder.blocks import ChatStateStore, CoderCredentials

    peer = Peer() if args.peer else None
    with Emulator.running_in_thread(tokens=[TOKEN]) as emu:
        await CoderCredentials(
            base_url=emu.base_url,
            organization_id=uuid.UUID(str(emu.organization_id)),
            token=SecretStr(TOKEN),
        ).save("bench-coder", overwrite=True)
        await ChatStateStore(url=f"sqlite+aiosqlite:///{results_dir}/state.db").save(
            "bench-sqlite", overwrite=True
        )
        backends = [("SQLite", "bench-sqlite")] if "sqlite" in args.stores else []
        if pg_url and "pg" in args.stores:
            await ChatStateStore(url=pg_url, tenant="bench").save("bench-pg", overwrite=True)
            backends.append(("PostgreSQL", "bench-pg"))
        # warm-up: imports, engines, first flow run, server caches
        await raw_turns(emu, 3)
        for _, block in backends:
            await durable_turns("bench-coder", block, 3, "warm")
        if peer is not None:
            await peer.plain_steps(3)
            await peer.durable_steps(3)
        CPU_MS.clear()
        pooled: dict[str, tuple[list[float], list[float], list[float]]] = {
            label: ([], [], []) for label, _ in backends
        }
        peer_plain: list[float] = []
        peer_durable: list[float] = []
        # Several rounds, interleaved raw/durable and ours/peer, pooled: one noisy
        # moment on a shared machine then moves the p95, not the median, and both
        # sides see the same machine.
        for r in range(args.rounds):
            for label, block in backends:
                raw, walls, gens = pooled[label]
                raw += (await raw_turns(emu, args.turns))[1:]
                w, g = await durable_turns("bench-coder", block, args.turns, f"{label}-{r}".lower())
                walls += w[1:]
                gens += g[1:]
            if peer is not None:
                peer_plain += (await peer.plain_steps(args.turns))[1:]
                peer_durable += (await peer.durable_steps(args.turns))[1:]
        summary: dict[str, dict[str, float]] = {}
        for label, _ in backends:
            summary[label] = report(label, *pooled[label])
        if peer is not None:
            over = [d - p for d, p in zip(peer_durable, peer_plain, strict=True)]
            row = {
                "steps": len(over),
                "plain_median_ms": statistics.median(peer_plain),
                "durable_median_ms": statistics.median(peer_durable),
                "overhead_median_ms": statistics.median(over),
                "overhead_p95_ms": pct(over, 0.95),
            }
            summary["peer"] = row
            print(
                f"{'peer':10s} plain step {row['plain_median_ms']:5.1f} ms | durable step "
                f"{row['durable_median_ms']:6.1f} ms | overhead median "
                f"{row['overhead_median_ms']:5.1f} ms, p95 {row['overhead_p95_ms']:5.1f} ms"
                f"  (pydantic-ai-slim {peer_version()}, PrefectDurability, TestModel, 1 tool call)"
            )
            for label, _ in backends:
                ratio = summary[label]["overhead_median_ms"] / row["overhead_median_ms"]
                summary[label]["ratio_to_peer"] = ratio
                print(f"ratio ours/peer ({label}): {ratio:.2f}x  (goal <= 0.5x)")
        raw_cpu = statistics.median(CPU_MS["raw"])
        for label, block in backends:
            over_cpu = statistics.median(CPU_MS[f"durable:{block}"]) - raw_cpu
            summary[label]["cpu_overhead_ms_per_turn"] = over_cpu
            print(f"{label:10s} process CPU overhead per turn {over_cpu:5.1f} ms (median of runs)")
        if peer is not None:
            peer_cpu = statistics.median(CPU_MS["peer:durable"]) - statistics.median(
                CPU_MS["peer:plain"]
            )
            summary["peer"]["cpu_overhead_ms_per_step"] = peer_cpu
            print(f"{'peer':10s} process CPU overhead per step {peer_cpu:5.1f} ms (median of runs)")
            for label, _ in backends:
                ratio = summary[label]["cpu_overhead_ms_per_turn"] / peer_cpu
                print(f"CPU ratio ours/peer ({label}): {ratio:.2f}x")
        print(json.dumps(summary, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3, help="runs per backend, pooled")
    parser.add_argument("--pg-url", default=None, help="PostgreSQL URL (default: private)")
    parser.add_argument("--no-pg", action="store_true")
    parser.add_argument(
        "--stores",
        default="sqlite,pg",
        help="comma-separated subset of sqlite,pg (e.g. to profile one store)",
    )
    parser.add_argument(
        "--peer", action="store_true", help="also run Pydantic AI's PrefectDurability peer"
    )
    parser.add_argument(
        "--store-only",
        action="store_true",
        help="only the state store's work per turn (4 single calls vs store.turns), no Prefect",
    )
    args = parser.parse_args()
    if args.store_only:
        if args.no_pg or args.pg_url:
            store_only(None if args.no_pg else args.pg_url)
        else:
            with private_postgres() as url:
                store_only(url)
        return
    args.stores = {s.strip() for s in args.stores.split(",") if s.strip()}
    if "pg" not in args.stores:
        args.no_pg = True

    from prefect.settings import (
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
        PREFECT_RESULTS_LOCAL_STORAGE_PATH,
        temporary_settings,
    )
    from prefect.testing.utilities import prefect_test_harness

    results_dir = tempfile.mkdtemp(prefix="bench-results-")
    try:
        with (
            temporary_settings(
                updates={
                    PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None,
                    PREFECT_RESULTS_LOCAL_STORAGE_PATH: results_dir,
                }
            ),
            prefect_test_harness(server_startup_timeout=180),
        ):
            if args.no_pg:
                asyncio.run(main_async(args, None, results_dir))
            elif args.pg_url:
                asyncio.run(main_async(args, args.pg_url, results_dir))
            else:
                with private_postgres() as url:
                    if url is None:
                        print("no PostgreSQL server binaries found: SQLite only")
                    asyncio.run(main_async(args, url, results_dir))
    finally:
        shutil.rmtree(results_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
