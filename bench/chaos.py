"""Randomized chaos benchmark: hundreds of seeded schedules, every invariant checked.

    .venv/bin/python bench/chaos.py [--seeds 300] [--first 1] [--only 7,42:shard] [--parallel 3]
                                    [--store sqlite|pg] [--no-infra] [--verbose] [--json FILE]

Each seed is a schedule (``tests/chaos/chaos_schedule.py``): real SIGKILLs of the
process running the workflow at crash points, emulator stream drops / REST faults /
stalls / lost responses, emulator restarts (state kept), sweeps racing recovery —
and lifecycle kills (issue 29: a run killed at its start, ``recover-turn`` runs
killed once or twice, the workflow as a fan-out shard, an approval workflow's
deployment runs killed around the suspension and decided through Prefect's API) —
then recovery to the end and the invariants of ``tests/chaos/chaos_invariants.py``
(exactly-once effects and one idempotency key per logical tool call, stored results
from finished attempts, no chat archived before its workflow finished nor left live
or unarchived, extra user turns ≤ crashes that cut a live attempt).
``--only 44:`` replays seed 44 without its lifecycle dimension, ``--only 7:approval``
forces one.

Faults of our own dependencies (issue 30, ``tests/chaos/chaos_infra.py``): the
stores are SQLite files (``--store sqlite``, one per rig) or one private PostgreSQL
cluster (``--store pg``); the Prefect API is a server of the bench's own (on a
database of the suite's PostgreSQL) so that it can be restarted; each rig has its
own result storage. A schedule may then restart the PostgreSQL store or terminate
its connections, hold the SQLite store's write lock from a stopped process, restart
the Prefect API, or make the result storage unwritable for a while. The store and
Prefect faults land on every rig, as on every worker of a deployment; each outcome
names those of other rigs that overlapped it. ``--no-infra``: none of them (the
schedules, the suite's Prefect server and SQLite stores of before issue 30).
Same engine as ``tests/chaos`` (which runs a short fixed seed set in CI).

``--parallel N`` runs N independent rigs (each its own emulator — faults and
restarts are global to an emulator — and fork server) against one Prefect test
server and one payments service; schedules are mostly waiting, so this divides the
wall time. Prints one line per schedule, the full schedule and evidence of every
violation, then: schedules run, violations by invariant (with seeds), timing. Exits
1 on any violation (2 on a harness error). See docs/chaos.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CHAOS = ROOT / "tests" / "chaos"
RECOVERY = ROOT / "tests" / "recovery"
FAULTS = ROOT / "tests" / "faults"
sys.path[:0] = [str(ROOT), str(CHAOS), str(RECOVERY), str(FAULTS)]
# tests/conftest.py imports its helper modules (e.g. warm_python) from its own
# folder, which pytest puts on sys.path; last, so another folder's ``conftest``
# still never shadows the ones above.
sys.path.append(str(ROOT / "tests"))


def _suite_conftest() -> Any:
    """``tests/conftest.py``: the suite's PostgreSQL cluster and Prefect server,
    reused, not copied (a SQLite-backed server answers "database is locked" to
    several rigs' concurrent flow runs). Loaded by path: ``conftest`` on sys.path
    would be another directory's."""
    spec = importlib.util.spec_from_file_location("_suite_conftest", ROOT / "tests" / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class _TmpFactory:
    """What the suite's ``prefect_harness`` fixture asks of pytest's tmp_path_factory."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def mktemp(self, name: str) -> Path:
        path = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.root))
        return path


def _coverage(outcomes: list[Any]) -> dict[str, int]:
    """How often each kind of event actually ran (not only was scheduled)."""
    seen: Counter[str] = Counter()
    for o in outcomes:
        for phase, line in zip(o.schedule.phases, o.phases, strict=False):
            if phase.kind == "child":
                seen["child runs"] += 1
                seen["kills that landed"] += line.startswith("killed")
                if phase.flow != "agent-workflow":
                    seen[f"child runs of {phase.flow}"] += 1
                    seen[f"kills that landed in {phase.flow}"] += line.startswith("killed")
                seen["runs suspended at an approval"] += line.startswith("suspended")
                seen["kills at run start"] += (
                    phase.crash_at == "turn.slot_held:1" and line.startswith("killed")
                )
            elif phase.kind == "decide":
                seen["approvals decided"] += 1
                seen["resumed runs"] += line.count("resumed run")
                seen["resumed runs killed"] += len(
                    re.findall(r"resumed run \d+ of \d+ killed", line)
                )
                seen["resumed runs killed before recording the answer"] += bool(
                    phase.crash_at.startswith("approval.answered")
                    and re.search(r"resumed run 1 of \d+ killed", line)
                )
            else:
                seen[f"recoveries by {phase.mode}"] += 1
            seen["faults armed"] += len(phase.faults)
            seen["emulator restarts"] += line.count("restart done")
            for what, label in _INFRA_LINES.items():
                seen[label] += line.count(what)
            seen["all-stream drops"] += line.count("drop-streams done")
            seen["sweeps racing"] += len(phase.sweeps)
        seen["crashes that left a live attempt"] += o.cuts
    return dict(seen)


#: What a phase's line says when a dependency fault ran (chaos_infra), by label.
_INFRA_LINES = {
    "store restarted": "store restarts",
    "store connections terminated": "store connection kills",
    "store write lock held": "store locks",
    "Prefect API restarted": "Prefect API restarts",
    "result storage unwritable": "result storage outages",
}


@contextlib.contextmanager
def _restartable_prefect(suite: Any, pg_url: str, tmp: Path) -> Iterator[Any]:
    """A Prefect server of the bench's own that a schedule may restart: uvicorn on
    Prefect's app (``tests/faults/prefect_server_proc.py``) on a database of the
    suite's PostgreSQL cluster (several rigs' concurrent runs: not SQLite), its schema
    from the suite's cached dump; this process's settings point at it as the suite's
    harness does (no flow heartbeats, no retry jitter, quiet logs)."""
    from prefect.context import _temporary_global_settings_context, get_settings_context
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect_server_proc import running_prefect_server

    database, migrated = suite._server_database(pg_url, "chaos_prefect")
    with (
        running_prefect_server(tmp / "prefect", database, migrated=migrated, timeout=300) as server,
        temporary_settings(updates={**suite.harness_settings(), PREFECT_API_URL: server.api_url}),
        _temporary_global_settings_context(get_settings_context()),
    ):
        yield server


def main(args: argparse.Namespace) -> int:
    """Start the suite's PostgreSQL and a Prefect server (synchronous: they run their
    own event loops to set up) and, for ``--store pg``, the stores' cluster; then run
    the seeds."""
    suite = _suite_conftest()
    tmp = Path(tempfile.mkdtemp(prefix="bench-chaos-"))
    t_start = time.perf_counter()
    postgres = contextlib.contextmanager(suite.postgres_url.__wrapped__)
    harness = contextlib.contextmanager(suite.prefect_harness.__wrapped__)
    code = 2
    try:
        with contextlib.ExitStack() as stack:
            from chaos_infra import Infra
            from faults_pg import PrivateCluster

            pg_url = stack.enter_context(postgres())
            if args.no_infra:
                stack.enter_context(harness(_TmpFactory(tmp), pg_url))
                infra = Infra()
            else:
                prefect = stack.enter_context(_restartable_prefect(suite, pg_url, tmp))
                cluster = None
                if args.store == "pg":
                    cluster = PrivateCluster()
                    stack.callback(cluster.close)
                    cluster.start()
                infra = Infra(args.store, pg=cluster, prefect=prefect)
            print(f"setup {time.perf_counter() - t_start:.0f} s", flush=True)
            code = asyncio.run(run_seeds(args, tmp, infra))
            return code
    finally:
        # Rigs, stores and logs of a clean run are gone with it; a run with a
        # violation (or a harness error) keeps them for the replay's comparison.
        if code == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"kept for inspection: {tmp}", flush=True)


async def run_seeds(args: argparse.Namespace, tmp: Path, infra: Any) -> int:
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "ERROR")
    from chaos_runner import Outcome, open_rig, process_env, run_schedule
    from chaos_schedule import LIFECYCLES, make_schedule
    from payments import running_payments
    from prefect.settings import PREFECT_API_URL

    logging.getLogger("coder_chat").setLevel(logging.ERROR)
    logging.getLogger("prefect").setLevel(logging.ERROR)
    # "N" = seed N as drawn; "N:LIFECYCLE" = with that lifecycle forced ("N:" = none)
    plan: dict[int, str | None] = {}
    if args.only:
        seeds = []  # a seed may be listed more than once (replays)
        for item in (s.strip() for s in args.only.split(",")):
            if item:
                n, sep, life = item.partition(":")
                if sep and life not in LIFECYCLES:
                    raise SystemExit(f"unknown lifecycle {life!r}: one of {list(LIFECYCLES)}")
                plan[int(n)] = life if sep else None
                seeds.append(int(n))
    else:
        seeds = list(range(args.first, args.first + args.seeds))
    outcomes: list[Outcome] = []
    harness_errors: list[tuple[int, str]] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for s in seeds:
        queue.put_nowait(s)
    with running_payments() as payments, process_env(payments):
        child_env = {
            **os.environ,
            "PREFECT_API_URL": str(PREFECT_API_URL.value()),
            "PREFECT_LOGGING_LEVEL": "ERROR",
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(RECOVERY)]),
        }
        restarts = infra.prefect_restarts
        faults = "none" if args.no_infra else f"store {infra.store}, Prefect restarts {restarts}"
        print(f"{len(seeds)} seeds, {args.parallel} rigs; dependency faults: {faults}", flush=True)

        # Rigs start one after another: a fresh Prefect server races its first
        # secret-block writes (duplicate ENCRYPTION_KEY), and calibrations overlap less.
        opened = [asyncio.Event() for _ in range(args.parallel)]

        async def worker(n: int) -> None:
            workdir = tmp / f"rig-{n}"
            workdir.mkdir()
            if n:
                await opened[n - 1].wait()
            try:
                async with open_rig(
                    child_env, workdir, payments, infra=infra, name=f"rig-{n}"
                ) as rig:
                    opened[n].set()
                    # every rig set up before any schedule runs: a schedule's Prefect
                    # restart must not land on another rig's set-up (not a workflow)
                    await asyncio.gather(*(e.wait() for e in opened))
                    await drain(rig)
            except Exception:  # this rig is lost; the others go on with the seeds
                harness_errors.append((-1, traceback.format_exc()))
                print(f"rig {n}: HARNESS ERROR\n{traceback.format_exc()}", flush=True)
            finally:
                opened[n].set()  # a rig that failed to start must not hold up the next

        async def drain(rig: Any) -> None:
            while True:
                if time.monotonic() > deadline:
                    return  # out of time: summarize what ran
                try:
                    seed = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                try:
                    store = None if args.no_infra else infra.store
                    schedule = make_schedule(
                        seed, plan.get(seed), store=store, prefect_restart=restarts
                    )
                    outcome = await run_schedule(rig, schedule)
                except Exception:
                    harness_errors.append((seed, traceback.format_exc()))
                    print(f"seed {seed}: HARNESS ERROR\n{traceback.format_exc()}", flush=True)
                    continue
                outcomes.append(outcome)
                status = "ok" if outcome.ok else f"{len(outcome.violations)} VIOLATION(S)"
                print(
                    f"seed {seed}: {status} in {outcome.seconds:.1f} s "
                    f"[{len(outcomes)}/{len(seeds)}]",
                    flush=True,
                )
                if not outcome.ok or args.verbose:
                    print(outcome.report(), flush=True)

        t_run = time.perf_counter()
        deadline = time.monotonic() + args.max_minutes * 60 if args.max_minutes else float("inf")
        await asyncio.gather(*(worker(n) for n in range(args.parallel)))
        wall = time.perf_counter() - t_run

    by_invariant: dict[str, list[int]] = defaultdict(list)
    for o in outcomes:
        for v in o.violations:
            if o.schedule.seed not in by_invariant[v.invariant]:
                by_invariant[v.invariant].append(o.schedule.seed)
    secs = sorted(o.seconds for o in outcomes)
    print("\n== chaos summary ==")
    print(f"schedules run: {len(outcomes)} of {len(seeds)} (harness errors: {len(harness_errors)})")
    bad = sorted(o.schedule.seed for o in outcomes if not o.ok)
    print(f"schedules with violations: {len(bad)} {bad if bad else ''}")
    invariants = (
        "exactly-once",
        "one-key",
        "finished-attempt",
        "archived-early",
        "chats-at-rest",
        "extra-turns",
        "recovery-finished",
        "phase-bounded",
    )
    for inv in invariants:
        seeds_of = sorted(by_invariant.get(inv, []))
        print(f"  {inv:18} {len(seeds_of):4} {seeds_of if seeds_of else ''}")
    for inv in sorted(set(by_invariant) - set(invariants)):
        print(f"  {inv:18} {len(by_invariant[inv]):4} {sorted(by_invariant[inv])}")
    noted = sorted(o.schedule.seed for o in outcomes if o.notes)
    kinds = Counter(n.split(": ", 1)[-1] for o in outcomes for n in o.notes)
    print(f"notes (not violations) in {len(noted)} schedules: {dict(kinds)}")
    print(
        "events that ran: " + ", ".join(f"{k} {v}" for k, v in sorted(_coverage(outcomes).items()))
    )
    if secs:
        p95 = secs[min(len(secs) - 1, int(0.95 * len(secs)))]
        print(
            f"per schedule: p50 {statistics.median(secs):.1f} s, p95 {p95:.1f} s, "
            f"max {secs[-1]:.1f} s; wall {wall:.0f} s with {args.parallel} rigs "
            f"({len(outcomes) / wall * 60:.1f} schedules/min)"
        )
        for life in LIFECYCLES:
            mine = sorted(o.seconds for o in outcomes if o.schedule.lifecycle == life)
            if mine:
                bad_here = sum(not o.ok for o in outcomes if o.schedule.lifecycle == life)
                print(
                    f"  lifecycle {life or '(none)':13} {len(mine):4} schedules, "
                    f"{bad_here} with violations: p50 {statistics.median(mine):.1f} s, "
                    f"p95 {mine[min(len(mine) - 1, int(0.95 * len(mine)))]:.1f} s, "
                    f"max {mine[-1]:.1f} s"
                )
    if args.json:
        text = json.dumps(
            [
                {
                    "seed": o.schedule.seed,
                    "lifecycle": o.schedule.lifecycle,
                    "ok": o.ok,
                    "seconds": round(o.seconds, 2),
                    "schedule": o.schedule.describe().splitlines(),
                    "phases": o.phases,
                    "violations": [str(v) for v in o.violations],
                }
                for o in sorted(outcomes, key=lambda o: o.schedule.seed)
            ],
            indent=1,
        )
        await asyncio.to_thread(Path(args.json).write_text, text)
    if harness_errors:
        return 2
    return 1 if bad else 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seeds", type=int, default=300, help="how many seeds (default 300)")
    p.add_argument("--first", type=int, default=1, help="first seed (default 1)")
    p.add_argument(
        "--only",
        default="",
        help="comma-separated seeds to run instead; N:LIFECYCLE forces a lifecycle "
        "dimension (start, recovery-run, shard, approval; 'N:' none)",
    )
    p.add_argument("--parallel", type=int, default=3, help="independent rigs (default 3)")
    p.add_argument(
        "--max-minutes",
        type=float,
        default=0,
        help="start no new schedule after this long (0 = no limit); the summary says how many ran",
    )
    p.add_argument(
        "--store",
        choices=["sqlite", "pg"],
        default="sqlite",
        help="the state store: SQLite files (one per rig) or a private PostgreSQL cluster",
    )
    p.add_argument(
        "--no-infra",
        action="store_true",
        help="no faults of the store, the Prefect API or result storage (before issue 30)",
    )
    p.add_argument("--verbose", action="store_true", help="print every schedule's report")
    p.add_argument("--json", default="", help="write every outcome to this file")
    sys.exit(main(p.parse_args()))
