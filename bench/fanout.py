"""Fan-out throughput per worker process, memory per open turn, and the fleet of workers.

Every part of the system runs in its own process, as in production: the chatd
emulator (``coder-chat-emulator``, no capacity limit), a Prefect API server on a
private PostgreSQL cluster (a SQLite-backed server answers 503 to concurrent
writers on a loaded machine), and the worker. So the numbers below are the
worker process's own.

Default mode — one worker process, i.e. what one ``agent-fanout-shard`` run (or an
in-process ``agent_fanout``) does: ``--workflows`` workflows of ``--steps`` turns
(turn ``--turn-s``) in THIS process under caps 5 and 50, SQLite or PostgreSQL store
(``--store``). Prints per cap: turns/s of the process, its CPU ms per turn (all its
threads), the emulator's and the Prefect server's CPU ms per turn (other processes,
for scale), the server-side peak of running turns (emulator event log) and the load
average. Then the memory phase: ``--memory-workflows`` workflows with long turns
(``--memory-turn-s``) at cap 50, RSS of this process sampled every 50 ms; memory per
open turn = (RSS at the moment of the peak of running turns in the emulator's event
log - RSS before the fan-out) / that peak.

The Prefect server's side of each fan-out (docs/performance.md, round 11a): its CPU
and its PostgreSQL cluster's (postmaster and backends), the rows it stored per turn
(``event_resources`` = one per event resource and related resource), the commits and
rows written per table (PostgreSQL's statistics views); ``--count-api`` counts this
process's Prefect API requests by route, ``--server-pyspy PATH`` samples the server,
``--pin`` puts the worker on one CPU and the rest on the other, ``--artifacts`` lets
the turns publish their artifacts, ``--event-cost N`` measures the server's CPU per
event by its related resources. The bench's server records task runs in batches
(``--recorder-batch``/``--recorder-flush-s``; ``1``/``5`` are Prefect's defaults).

``--workers-mode`` — the fan-out as a deployment run on ``prefect worker start``
process workers (PostgreSQL store): turns/s with 1 and with 2 workers at
``--workers-cap`` (50), in shards of ``--shard-size`` (1 = one ``agent-workflow`` run
per workflow), with the workers' CPU per turn (worker + its flow-run processes).
With ``--kill`` (alone, or after the throughput runs with ``--workers-mode``): two
workers (``--kill-worker-limit`` 5) at ``--kill-cap`` (all slots busy), shards of
``--kill-shard-size`` (5), long turns; the worker whose flow runs hold the most turn
slots (not the fan-out's own) is SIGKILLed with its flow-run processes, its runs are
marked Crashed at once (what the zombie automation does), and the bench times, per
slot the dead worker held, how long until a live process holds it again — against
``--slot-ttl`` —, the first turn start after the kill (emulator log) and the
fan-out's end.

``--latency-mode`` — turns bound by model latency, as real ones are: each turn waits
``--latency-turn-s`` (20 s) in the emulator's scripted model, each worker runs at most
``--latency-worker-limit`` (2) shard runs of ``--latency-shard-size`` (5) workflows,
i.e. a bounded number of turns at once; turns/s with 1 and 2 workers at cap
``--workers-cap`` (50). The fan-out's flow run runs in this process.

``--handoff``: the slot hand-off latency of a store turn slot vs a Prefect global
concurrency limit (limit 1, idle process; docs/fleet.md).

Run: ``.venv/bin/python bench/fanout.py [--workflows 200] [--caps 5,50] [--steps 1]``,
``... --workers-mode [--shard-size 20] [--kill]``, ``... --kill`` or ``... --latency-mode``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
# The fan-out tests' worker fleet helpers (deploy, start_worker, ...).
sys.path.insert(0, str(ROOT / "tests" / "fanout"))

from fleet_procs import (  # noqa: E402
    RECORDER_BATCH,
    RECORDER_FLUSH_S,
    EmulatorProcess,
    create_database,
    loadavg,
    postgres_cpu_s,
    postmaster_pid,
    prefect_server,
    private_postgres,
    process_cpu_s,
)
from prefect.settings import (  # noqa: E402
    PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
    PREFECT_LOGGING_LEVEL,
    PREFECT_RESULTS_LOCAL_STORAGE_PATH,
    temporary_settings,
)
from pydantic import SecretStr  # noqa: E402

from prefect_coder.blocks import ChatStateStore, CoderCredentials  # noqa: E402
from prefect_coder.flows.common.params import Step, WorkflowSettings  # noqa: E402
from prefect_coder.flows.deployments.agent_fanout import FanoutItem, agent_fanout  # noqa: E402
from prefect_coder.flows.fleet import slots as turn_slot  # noqa: E402

TOKEN = f"bench-{uuid.uuid4().hex}"


@dataclass
class Fleet:
    tmp: Path
    api_url: str
    server_pid: int
    emu: EmulatorProcess
    pg_store_url: str
    server_db_url: str
    #: The private cluster's postmaster: its CPU and its backends' is the server's
    #: database work (the store is SQLite unless ``--store pg``).
    postmaster_pid: int = 0


@contextlib.contextmanager
def _fleet(
    tmp: Path, recorder_batch: int = RECORDER_BATCH, recorder_flush_s: float = RECORDER_FLUSH_S
) -> Iterator[Fleet]:
    with private_postgres() as admin:
        server_db = create_database(admin, "prefect_server")
        store_db = create_database(admin, "coder_store")
        with (
            temporary_settings(
                updates={
                    PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None,
                    PREFECT_RESULTS_LOCAL_STORAGE_PATH: tmp / "results",
                    PREFECT_LOGGING_LEVEL: "ERROR",
                }
            ),
            prefect_server(
                server_db, recorder_batch=recorder_batch, recorder_flush_s=recorder_flush_s
            ) as (api_url, server_pid),
            EmulatorProcess.running(TOKEN) as emu,
        ):
            yield Fleet(tmp, api_url, server_pid, emu, store_db, server_db, postmaster_pid(admin))


#: What the worker makes the Prefect server store, table by table (its own database).
_SERVER_TABLES = (
    "events",
    "event_resources",
    "task_run",
    "task_run_state",
    "log",
    "artifact",
    "flow_run_state",
)


async def _server_rows(fleet: Fleet) -> dict[str, int]:
    """Row counts of the Prefect server's tables, and ``event:<name>`` per event name."""
    import asyncpg
    from sqlalchemy.engine import make_url

    url = make_url(fleet.server_db_url)
    conn = await asyncpg.connect(
        host=url.host, port=url.port, user=url.username, database=url.database
    )
    try:
        # One transaction per reading: the settle poll adds one commit to the
        # cluster's counters (see _pg_writes), not one per table.
        async with conn.transaction():
            out = {t: int(await conn.fetchval(f"SELECT count(*) FROM {t}")) for t in _SERVER_TABLES}
            for row in await conn.fetch("SELECT event, count(*) AS n FROM events GROUP BY event"):
                out[f"event:{row['event']}"] = int(row["n"])
        return out
    finally:
        await conn.close()


async def _pg_writes(fleet: Fleet) -> dict[str, int]:
    """The server database's commits and rolled-back transactions (``xact_commit``,
    ``xact_rollback``), and rows inserted/updated/deleted per table (``ins:<table>``,
    ...), from PostgreSQL's statistics views: what the server's CPU went into on the
    database side. The counters reach the views up to a second after a commit."""
    import asyncpg
    from sqlalchemy.engine import make_url

    url = make_url(fleet.server_db_url)
    conn = await asyncpg.connect(
        host=url.host, port=url.port, user=url.username, database=url.database
    )
    try:
        db = await conn.fetchrow(
            "SELECT xact_commit, xact_rollback FROM pg_stat_database WHERE datname = $1",
            url.database,
        )
        out = {"xact_commit": int(db["xact_commit"]), "xact_rollback": int(db["xact_rollback"])}
        for row in await conn.fetch(
            "SELECT relname, n_tup_ins, n_tup_upd, n_tup_del FROM pg_stat_user_tables"
        ):
            for kind in ("ins", "upd", "del"):
                out[f"{kind}:{row['relname']}"] = int(row[f"n_tup_{kind}"])
        return out
    finally:
        await conn.close()


async def _settled_server_rows(fleet: Fleet, bound_s: float = 20.0) -> dict[str, int]:
    """The server's row counts once they stopped moving: it records events from its
    queue in batches, seconds after the fan-out returned on a loaded machine."""
    last = await _server_rows(fleet)
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        await asyncio.sleep(2.0)
        now = await _server_rows(fleet)
        if now == last:
            break
        last = now
    return last


def _per_turn(before: dict[str, int], after: dict[str, int], turns: int) -> dict[str, float]:
    return {
        k: (after.get(k, 0) - before.get(k, 0)) / turns
        for k in sorted(after)
        if after.get(k, 0) != before.get(k, 0)
    }


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def _retry_503(make: Callable[[], Awaitable[object]], attempts: int = 6) -> None:
    """A loaded server may answer 503 to a write: retry."""
    from prefect.exceptions import PrefectHTTPStatusError

    for i in range(attempts):
        try:
            await make()
            return
        except PrefectHTTPStatusError as exc:
            if exc.response.status_code != 503 or i == attempts - 1:
                raise
            await asyncio.sleep(0.5 * (i + 1))


async def _settings(
    fleet: Fleet,
    store_url: str,
    cap: int,
    *,
    slot_ttl: float = 30,
    lease_ttl: float = 30,
    artifacts: bool = False,
) -> WorkflowSettings:
    name = uuid.uuid4().hex[:8]
    creds = CoderCredentials(
        base_url=fleet.emu.base_url,
        organization_id=uuid.UUID(fleet.emu.organization_id),
        token=SecretStr(TOKEN),
        max_concurrent_turns=cap,
        turn_slot_wait=900,
        turn_slot_ttl=slot_ttl,
    )
    await _retry_503(lambda: creds.save(f"bench-coder-{name}", overwrite=True))
    store = ChatStateStore(url=store_url)
    await _retry_503(lambda: store.save(f"bench-store-{name}", overwrite=True))
    return WorkflowSettings(
        credentials_block=f"bench-coder-{name}",
        store_block=f"bench-store-{name}",
        retries=0,
        lease_ttl_s=lease_ttl,
        lease_wait_s=300,
        artifacts=artifacts,
    )


def _items(prefix: str, n: int, steps: int, turn_s: float) -> list[FanoutItem]:
    body = f'#emu {{"sleep": {turn_s}, "text": "ok"}}'
    return [
        FanoutItem(
            workflow_id=f"{prefix}-{i}",
            steps=[Step(name=f"s{j}", prompt=f"go {j} {body}") for j in range(steps)],
        )
        for i in range(n)
    ]


class _ApiCounter(logging.Handler):
    """Requests this process sent to the Prefect API, by method and route (ids
    replaced by ``{id}``), from httpx's own ``HTTP Request:`` INFO record — written by
    every ``httpx`` client, i.e. Prefect's; our Coder client writes none (round 10b).
    Attached only for the fan-out with ``--count-api``: the records cost the loop."""

    _ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")

    def __init__(self, api_url: str) -> None:
        super().__init__(logging.INFO)
        self.api_url = api_url.rstrip("/")
        self.counts: dict[str, int] = {}
        self._logger = logging.getLogger("httpx")
        self._saved = (self._logger.level, self._logger.propagate)

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args
        if not isinstance(args, tuple) or len(args) < 2:
            return
        url = str(args[1])
        if not url.startswith(self.api_url):
            return
        route = self._ID.sub("{id}", url[len(self.api_url) :].split("?", 1)[0])
        key = f"{args[0]} {route}"
        self.counts[key] = self.counts.get(key, 0) + 1

    def __enter__(self) -> _ApiCounter:
        self._logger.addHandler(self)
        self._logger.setLevel(logging.INFO)
        self._logger.propagate = False
        return self

    def __exit__(self, *exc: object) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._saved[0])
        self._logger.propagate = self._saved[1]


class _PySpy:
    """``py-spy record`` of another process (the Prefect server) in raw (collapsed
    stack) format, from :meth:`start` until :meth:`stop` (SIGINT: it writes then)."""

    def __init__(self, pid: int, path: str, rate: int = 100) -> None:
        self.cmd = [
            str(Path(sys.executable).parent / "py-spy"),
            "record",
            "--pid",
            str(pid),
            "--rate",
            str(rate),
            "--format",
            "raw",
            "--nonblocking",
            "--output",
            path,
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)  # attached before the fan-out starts

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class _GcClock:
    """CPU time this process spends in the cyclic garbage collector, per generation
    (the collecting thread's CPU clock: wall time would count a loaded machine's
    waits). It runs inside whatever frame allocated last, so a profile spreads it
    over allocation-heavy frames (pydantic's ``BaseModel.__init__`` above all)."""

    def __init__(self) -> None:
        self.s = [0.0, 0.0, 0.0]
        self.n = [0, 0, 0]
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.thread_time()
        else:
            gen = info["generation"]
            self.s[gen] += time.thread_time() - self._t0
            self.n[gen] += 1


def _thread_cpu() -> dict[int, tuple[str, float, float]]:
    """CPU seconds (user, system) of each live thread of this process, by native id,
    with its Python thread name (digits dropped: a pool's threads share one group)."""
    import re
    import threading

    names = {t.native_id: re.sub(r"[-_]?\d+", "", t.name) for t in threading.enumerate()}
    main = threading.main_thread().native_id
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[str, float, float]] = {}
    for task in Path("/proc/self/task").iterdir():
        tid = int(task.name)
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        name = "main (event loop)" if tid == main else names.get(tid, "other")
        out[tid] = (name, int(fields[11]) / tick, int(fields[12]) / tick)
    return out


def _thread_cpu_delta(
    before: dict[int, tuple[str, float, float]],
    after: dict[int, tuple[str, float, float]],
    turns: int,
) -> str:
    """ms of CPU per turn by thread group (and of it system time) between two
    :func:`_thread_cpu` readings (threads that ended in between are missing: their
    CPU is in the process total)."""
    groups: dict[str, list[float]] = {}
    for tid, (name, user, system) in after.items():
        _, user0, system0 = before.get(tid, (name, 0.0, 0.0))
        g = groups.setdefault(name, [0.0, 0.0])
        g[0] += user - user0 + system - system0
        g[1] += system - system0
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return ", ".join(
        f"{k} {v[0] / turns * 1000:.1f} (sys {v[1] / turns * 1000:.1f})"
        for k, v in ranked
        if v[0] > 0
    )


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


async def _sample_rss(samples: list[tuple[float, int]], every_s: float) -> None:
    while True:
        samples.append((time.time(), _rss_kib()))
        await asyncio.sleep(every_s)


def _store_url(fleet: Fleet, kind: str, name: str) -> str:
    if kind == "pg":
        return fleet.pg_store_url
    return f"sqlite+aiosqlite:///{fleet.tmp / f'{name}.db'}"


async def _open_turns(fleet: Fleet, before: int) -> int:
    """Turns running on the emulator now (its event log since ``before`` starts)."""
    log = await asyncio.to_thread(fleet.emu.event_log, ["turn_start", "turn_end"])
    starts = [e for e in log if e["kind"] == "turn_start"][before:]
    ids = {e["chat_id"] for e in starts}
    ended = sum(1 for e in log if e["kind"] == "turn_end" and e["chat_id"] in ids)
    return len(starts) - ended


async def _snapshot_when_open(
    fleet: Fleet, before: int, want: int, out: dict[str, Any], bound_s: float
) -> None:
    """A tracemalloc snapshot once ``want`` turns run at once (or ``bound_s`` after the
    first one started: a starved process may never open them all)."""
    import tracemalloc

    deadline = time.monotonic() + 600
    while True:
        await asyncio.sleep(0.25)
        n = await _open_turns(fleet, before)
        if n > 0 and "first" not in out:
            # The baseline: the store, its engine and first-use caches exist by now.
            out["first"], out["first_open"] = tracemalloc.take_snapshot(), n
            deadline = min(deadline, time.monotonic() + bound_s)
        if n >= want or time.monotonic() > deadline:
            out["snapshot"], out["open"] = tracemalloc.take_snapshot(), n
            return


async def _in_process(
    fleet: Fleet,
    cap: int,
    n: int,
    steps: int,
    turn_s: float,
    store: str,
    *,
    trace: dict[str, Any] | None = None,
    profile: str | None = None,
    server_profile: str | None = None,
    count_api: bool = False,
    artifacts: bool = False,
) -> dict[str, Any]:
    """One fan-out of ``n`` workflows in this process; the numbers of this process.

    ``profile``: cProfile the event loop's thread during the fan-out, timed by that
    thread's CPU clock (py-spy's on-CPU shares count a runnable thread waiting for a
    core of a loaded machine as busy, which overweights system calls); the stats go
    to that path. Its overhead roughly doubles the loop's CPU: read shares."""
    name = uuid.uuid4().hex[:8]
    settings = await _settings(fleet, _store_url(fleet, store, name), cap, artifacts=artifacts)
    items = _items(f"b-{name}", n, steps, turn_s)
    before = len(fleet.emu.event_log(["turn_start"]))
    load0 = loadavg()
    samples: list[tuple[float, int]] = []
    rss0 = _rss_kib()
    # Reading /proc costs loop CPU: often only when memory is what is measured.
    sampler = asyncio.create_task(_sample_rss(samples, 0.05 if turn_s >= 1 else 0.5))
    if trace is not None:
        import tracemalloc

        trace["before"] = tracemalloc.take_snapshot()
        snap = asyncio.create_task(
            _snapshot_when_open(fleet, before, min(n, cap), trace, bound_s=turn_s * 0.6)
        )
    rows0 = await _settled_server_rows(fleet)
    await asyncio.sleep(1.0)  # PostgreSQL's statistics views lag commits by up to 1 s
    pgw0 = await _pg_writes(fleet)
    spy = _PySpy(fleet.server_pid, server_profile) if server_profile else None
    if spy is not None:
        spy.start()
    api = _ApiCounter(fleet.api_url) if count_api else None
    emu0, srv0 = process_cpu_s(fleet.emu.proc.pid), process_cpu_s(fleet.server_pid)
    pg0 = postgres_cpu_s(fleet.postmaster_pid)
    gc_clock = _GcClock()
    gc.callbacks.append(gc_clock)
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile(time.thread_time)
    threads0 = _thread_cpu()
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    try:
        if api is not None:
            api.__enter__()
        if profiler is not None:
            profiler.enable()
        outcomes = await agent_fanout(
            items, settings, max_parallel=max(64, 2 * cap), fail_on_error=False
        )
    finally:
        if api is not None:
            api.__exit__()
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(str(profile))
        gc.callbacks.remove(gc_clock)
        sampler.cancel()
        if trace is not None:
            await snap
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    threads1 = _thread_cpu()
    emu_cpu = process_cpu_s(fleet.emu.proc.pid) - emu0
    srv_cpu = process_cpu_s(fleet.server_pid) - srv0
    pg_cpu = postgres_cpu_s(fleet.postmaster_pid) - pg0
    # The server goes on recording the fan-out's events after it returned: its CPU
    # until its tables stop moving is part of the turns' cost.
    rows1 = await _settled_server_rows(fleet)
    srv_cpu_settled = process_cpu_s(fleet.server_pid) - srv0
    pg_cpu_settled = postgres_cpu_s(fleet.postmaster_pid) - pg0
    if spy is not None:
        spy.stop()
    await asyncio.sleep(1.0)
    pgw1 = await _pg_writes(fleet)
    bad = [o.error or "" for o in outcomes if not o.ok]
    starts = fleet.emu.event_log(["turn_start"], since=before)
    # Turns that finished (a failed workflow's turns are not counted as throughput).
    turns = (n - len(bad)) * steps
    if bad:
        kinds: dict[str, int] = {}
        for e in bad:
            kinds[e[:90]] = kinds.get(e[:90], 0) + 1
        print(f"cap {cap}: {len(bad)} of {n} workflows FAILED: {kinds}", flush=True)
    turns = max(1, turns)
    peak_event = max(starts, key=lambda e: e["details"]["running"])
    peak = int(peak_event["details"]["running"])
    at_peak = min(samples, key=lambda s: abs(s[0] - peak_event["time"]))[1] if samples else rss0
    return {
        "cap": cap,
        "workflows": n,
        "turns": turns,
        "wall_s": wall,
        "turns_per_s": turns / wall,
        "cpu_ms_per_turn": cpu / turns * 1000,
        "gc_ms_per_turn": sum(gc_clock.s) / turns * 1000,
        "gc": ", ".join(f"gen{g} {gc_clock.n[g]}x {gc_clock.s[g] * 1000:.0f} ms" for g in range(3)),
        "threads": _thread_cpu_delta(threads0, threads1, turns),
        "emu_ms_per_turn": emu_cpu / turns * 1000,
        "server_ms_per_turn": srv_cpu / turns * 1000,
        "server_settled_ms_per_turn": srv_cpu_settled / turns * 1000,
        "server_rows_per_turn": _per_turn(rows0, rows1, turns),
        "pg_ms_per_turn": pg_cpu / turns * 1000,
        "pg_settled_ms_per_turn": pg_cpu_settled / turns * 1000,
        "pg_writes_per_turn": _per_turn(pgw0, pgw1, turns),
        "api_per_turn": (
            {k: v / turns for k, v in sorted(api.counts.items(), key=lambda kv: -kv[1])}
            if api is not None
            else None
        ),
        "server_peak": peak,
        "rss_delta_at_peak_kib": at_peak - rss0,
        "kib_per_open_turn": (at_peak - rss0) / max(1, peak),
        "load": f"{load0} → {loadavg()}",
    }


def _print_in_process(r: dict[str, Any], steps: int) -> None:
    print(
        f"cap {r['cap']:>3}: {r['workflows']} workflows x {steps} turn(s) in {r['wall_s']:.1f}s "
        f"= {r['turns_per_s']:.2f} turns/s in one worker process; its CPU "
        f"{r['cpu_ms_per_turn']:.0f} ms/turn (of it GC {r['gc_ms_per_turn']:.1f}: {r['gc']}; "
        f"emulator {r['emu_ms_per_turn']:.0f}, "
        f"Prefect server {r['server_ms_per_turn']:.0f} ms/turn in their own processes); "
        f"server peak {r['server_peak']} running turns; load {r['load']}",
        flush=True,
    )
    print(f"cap {r['cap']:>3}: worker CPU ms/turn by thread: {r['threads']}", flush=True)
    print(
        f"cap {r['cap']:>3}: Prefect server CPU until its tables settled "
        f"{r['server_settled_ms_per_turn']:.0f} ms/turn; what it stored per turn: "
        + ", ".join(f"{k} {v:.2f}" for k, v in r["server_rows_per_turn"].items()),
        flush=True,
    )
    print(
        f"cap {r['cap']:>3}: the server's PostgreSQL CPU {r['pg_ms_per_turn']:.0f} ms/turn "
        f"during the fan-out, {r['pg_settled_ms_per_turn']:.0f} until settled; per turn "
        + ", ".join(f"{k} {v:.2f}" for k, v in r["pg_writes_per_turn"].items()),
        flush=True,
    )
    if r["api_per_turn"] is not None:
        total = sum(r["api_per_turn"].values())
        print(
            f"cap {r['cap']:>3}: Prefect API requests of this process per turn {total:.2f}: "
            + ", ".join(f"{k} {v:.3f}" for k, v in r["api_per_turn"].items()),
            flush=True,
        )


def _cost_event(shape: str) -> Any:
    """One ``coder.turn.settled``-like event of ``shape``: ``run-context`` (the three
    related resources Prefect adds in a turn's task run: flow run, task run, flow),
    ``+workflow`` (and ours before round 11a: ``+workflow+step``), ``none``; each
    with the real payload of a one-turn workflow's ``coder.turn.settled``."""
    from prefect.events.schemas.events import Event, RelatedResource, Resource

    wf, chat = f"wf-{uuid.uuid4().hex[:8]}", str(uuid.uuid4())
    related: list[dict[str, str]] = []
    if shape != "none":
        related += [
            {
                "prefect.resource.id": f"prefect.{kind}.{uuid.uuid4()}",
                "prefect.resource.name": name,
                "prefect.resource.role": kind,
            }
            for kind, name in (("flow-run", "denim-ladybug"), ("task-run", f"{wf}/s0"))
        ] + [
            {
                "prefect.resource.id": f"prefect.flow.{uuid.uuid4()}",
                "prefect.resource.name": "agent-fanout",
                "prefect.resource.role": "flow",
            }
        ]
    if "+workflow" in shape:
        related.append(
            {"prefect.resource.id": f"coder.workflow.{wf}", "prefect.resource.role": "workflow"}
        )
    if "+step" in shape:
        related.append(
            {"prefect.resource.id": f"coder.step.{wf}.s0", "prefect.resource.role": "step"}
        )
    usage = dict.fromkeys(("input_tokens", "total_tokens", "output_tokens"), 38)
    return Event(
        event="coder.turn.settled",
        resource=Resource(
            {
                "prefect.resource.id": f"coder.chat.{chat}",
                "coder.workflow-id": wf,
                "coder.step": "s0",
            }
        ),
        related=[RelatedResource(r) for r in related],
        payload={
            "workflow_id": wf,
            "step": "s0",
            "usage": usage,
            "attempt": 1,
            "redials": 0,
            "segments": 1,
            "duration_ms": 74.7,
            "finish_reason": "stop",
        },
    )


async def _event_cost(fleet: Fleet, n: int, rounds: int) -> None:
    """The Prefect server's CPU (and its PostgreSQL's) per event, by the event's related
    resources: ``n`` events of each shape sent through Prefect's events client (the
    websocket a worker uses), until the server stored them all; shapes alternate their
    order per round."""
    from prefect.events.clients import get_events_client

    shapes = ["none", "run-context", "run-context+workflow", "run-context+workflow+step"]
    for round_ in range(rounds):
        for shape in shapes if round_ % 2 == 0 else shapes[::-1]:
            await _settled_server_rows(fleet)
            n0 = (await _server_rows(fleet))["events"]
            load0 = loadavg()
            s0, p0 = process_cpu_s(fleet.server_pid), postgres_cpu_s(fleet.postmaster_pid)
            async with get_events_client() as client:
                for i in range(n):
                    await client.emit(_cost_event(shape))
                    if i % 50 == 49:  # about a fan-out's pace, not one burst
                        await asyncio.sleep(0.05)
            deadline = time.monotonic() + 120
            while (await _server_rows(fleet))["events"] - n0 < n:
                if time.monotonic() > deadline:
                    raise SystemExit(f"event cost: {shape}: not all {n} events stored in 120 s")
                await asyncio.sleep(0.5)
            srv = process_cpu_s(fleet.server_pid) - s0
            pg = postgres_cpu_s(fleet.postmaster_pid) - p0
            print(
                f"event cost, round {round_ + 1}: {shape:26s} server {srv / n * 1000:.2f} "
                f"ms/event, its PostgreSQL {pg / n * 1000:.2f} ms/event; load {load0} → "
                f"{loadavg()}",
                flush=True,
            )


def _pin(fleet: Fleet) -> str:
    """This process (the worker) on the first CPU, the Prefect server, its PostgreSQL
    cluster (the postmaster and its live children; backends forked later inherit its
    affinity) and the emulator on the second: which side's CPU limits the wall clock."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return "not pinned (one CPU)"
    worker, rest = {cpus[0]}, {cpus[1]}
    others = [fleet.server_pid, fleet.emu.proc.pid, fleet.postmaster_pid]
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == fleet.postmaster_pid:
                others.append(int(stat.parent.name))
        except (OSError, ValueError):
            continue
    for pid in others:
        with contextlib.suppress(OSError):  # a backend that ended meanwhile
            os.sched_setaffinity(pid, rest)
    # The worker's threads (the SQLite workers, Prefect's events threads) follow it.
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(task.name), worker)
    return f"worker on CPU {cpus[0]}, server + PostgreSQL + emulator on CPU {cpus[1]}"


async def _main(args: argparse.Namespace, fleet: Fleet) -> None:
    if args.pin:
        print(f"pinned: {_pin(fleet)}", flush=True)
    print(
        f"store: {args.store}; Prefect server's task-run recorder: batch "
        f"{args.recorder_batch}, flush every {args.recorder_flush_s:g} s; load {loadavg()}",
        flush=True,
    )
    # warm-up: imports, the store's schema, the first flow run, the server's caches
    await _in_process(fleet, 5, 5, 1, args.turn_s, args.store)
    results = []
    caps = [int(c) for c in args.caps.split(",") if c]
    for i, cap in enumerate(caps):
        last = i == len(caps) - 1
        r = await _in_process(
            fleet,
            cap,
            args.workflows,
            args.steps,
            args.turn_s,
            args.store,
            profile=args.cprofile if last else None,
            server_profile=args.server_pyspy if last else None,
            count_api=args.count_api,
            artifacts=args.artifacts,
        )
        results.append(r)
        _print_in_process(r, args.steps)
    if results:
        print(
            "turns/s per worker process: "
            + ", ".join(f"cap {r['cap']}: {r['turns_per_s']:.2f}" for r in results)
            + " (goal at cap 50: >= 20); CPU-bound ceiling on one idle core: "
            + ", ".join(f"cap {r['cap']}: {1000 / r['cpu_ms_per_turn']:.1f}" for r in results),
            flush=True,
        )
    # RSS growth depends on the process's history (a first large fan-out grows the
    # allocator's arenas): later rounds show what a warmed worker adds per open turn.
    for round_ in range(args.memory_rounds if args.memory_workflows else 0):
        m = await _in_process(fleet, 50, args.memory_workflows, 1, args.memory_turn_s, args.store)
        print(
            f"memory (round {round_ + 1}): {m['server_peak']} turns open at once (emulator "
            f"log), RSS of this process then {m['rss_delta_at_peak_kib'] / 1024:.1f} MiB above "
            f"its level before the fan-out = {m['kib_per_open_turn']:.0f} KiB per open turn "
            f"(goal <= 50); load {m['load']}",
            flush=True,
        )
    if args.tracemalloc:
        await _trace_memory(fleet, args)
    if args.event_cost:
        await _event_cost(fleet, args.event_cost, args.event_cost_rounds)
    if args.handoff:
        await _handoffs(fleet, args.gcl_rounds)


async def _trace_memory(fleet: Fleet, args: argparse.Namespace) -> None:
    """What an open turn's memory is: tracemalloc (Python allocations only, unlike
    the RSS figure) between the fan-out's start and the moment ``--memory-workflows``
    turns run at once, grouped by source file."""
    import tracemalloc

    tracemalloc.start(1)
    trace: dict[str, Any] = {}
    try:
        await _in_process(
            fleet,
            50,
            args.memory_workflows,
            1,
            args.memory_turn_s,
            args.store,
            trace=trace,
        )
    finally:
        tracemalloc.stop()
    first = int(trace.get("first_open", 0))
    opened = max(1, int(trace["open"]) - first)
    diff = trace["snapshot"].compare_to(trace.get("first", trace["before"]), "filename")
    total = sum(d.size_diff for d in diff)
    print(
        f"tracemalloc: {first} → {trace['open']} turns open; Python heap +{total / 1024:.0f} "
        f"KiB = {total / 1024 / opened:.1f} KiB per further open turn; largest by file:",
        flush=True,
    )
    for d in diff[:15]:
        name = str(d.traceback[0].filename).split("site-packages/")[-1].replace(str(ROOT), ".")
        print(f"  {d.size_diff / 1024 / opened:6.2f} KiB/turn  {d.count_diff:+6d} blocks  {name}")


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


async def _handoffs(fleet: Fleet, rounds: int) -> None:
    store_h = await _store_handoff(fleet.tmp, rounds)
    gcl = await _gcl_handoff(rounds)
    for label, v in (("store turn slot", store_h), ("Prefect GCL (strict)", gcl)):
        print(
            f"{label} (limit 1, idle): hand-off p50 {_pct(v, 0.5) * 1000:.0f} ms, "
            f"p95 {_pct(v, 0.95) * 1000:.0f} ms, mean {statistics.mean(v) * 1000:.0f} ms "
            f"({len(v)} rounds)",
            flush=True,
        )


# ------------------------------------------------------------------ workers mode


def _tree_cpu_s(pid: int) -> float:
    """CPU of a process and of its children it has waited for (utime, stime, cutime, cstime)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _live_children_cpu_s(pid: int) -> float:
    from fanout_env import _children

    return sum(_tree_cpu_s(c) for c in _children(pid))


async def _fanout_params(
    items: list[FanoutItem], settings: WorkflowSettings, args: argparse.Namespace
) -> dict[str, Any]:
    return {
        "workflows": [i.model_dump(mode="json") for i in items],
        "settings": settings.model_dump(mode="json"),
        "max_parallel": max(64, len(items)),
        "fail_on_error": True,
        "poll_interval_s": 0.5,
        "shard_size": args.shard_size,
    }


async def _slot_holders(store: Any, cap: int) -> dict[int, str]:
    """Live turn slots: index -> holder id (read from the store's lease table)."""
    import sqlalchemy as sa

    from prefect_coder.blocks.state.schema import leases

    keys = [f"{turn_slot.SLOT_PREFIX}{i}" for i in range(cap)]
    async with store.read() as conn:
        rows = await conn.execute(
            sa.select(leases.c.key, leases.c.holder).where(
                leases.c.tenant == store.tenant,
                leases.c.key.in_(keys),
                leases.c.expires_at > store.now(),
            )
        )
        return {int(str(r.key)[len(turn_slot.SLOT_PREFIX) :]): str(r.holder) for r in rows}


def _holder_pid(holder: str) -> int:
    try:
        return int(holder.split("@", 1)[0].split(":")[1])
    except (IndexError, ValueError):
        return -1


async def _mark_dead_runs_crashed(client: Any, dead: set[int]) -> int:
    """What the zombie automation does for a lost host: Crashed for each unfinished run
    whose process is gone."""
    from fanout_env import parent_of
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    runs = await client.read_flow_runs(
        flow_run_filter=FlowRunFilter(
            state=FlowRunFilterState(
                type=FlowRunFilterStateType(any_=[StateType.RUNNING, StateType.PENDING])
            )
        ),
        limit=200,
    )
    marked = 0
    for run in runs:
        pid = str(run.infrastructure_pid or "").split(":")[-1]
        if pid and (int(pid) in dead or parent_of(int(pid)) is None):
            await client.set_flow_run_state(
                run.id, Crashed(message="host lost (bench)"), force=True
            )
            marked += 1
    return marked


async def _workers_mode(args: argparse.Namespace, fleet: Fleet) -> None:
    from fanout_env import child_env, deploy, start_worker, stop_worker, undeploy
    from prefect.deployments import run_deployment

    pool = f"bench-{uuid.uuid4().hex[:6]}"
    deployed = await deploy(pool)
    env = child_env(fleet.api_url, fleet.tmp / "results")
    env["PREFECT_LOGGING_LEVEL"] = "ERROR"
    steps = args.steps
    if args.worker_counts:
        print(
            f"workers mode: shard size {args.shard_size}, worker --limit {args.worker_limit}, "
            f"PostgreSQL store and Prefect server; load {loadavg()}",
            flush=True,
        )
    try:
        for count in [int(c) for c in args.worker_counts.split(",") if c]:
            workers = [
                await start_worker(
                    pool,
                    f"{pool}-{count}-{i}",
                    env,
                    fleet.tmp / f"w{count}{i}.log",
                    args.worker_limit,
                )
                for i in range(count)
            ]
            try:
                settings = await _settings(fleet, fleet.pg_store_url, args.workers_cap)
                items = _items(
                    f"bw{count}-{uuid.uuid4().hex[:6]}", args.workflows, steps, args.turn_s
                )
                params = await _fanout_params(items, settings, args)
                before = len(fleet.emu.event_log(["turn_start"]))
                load0 = loadavg()
                cpu0 = sum(
                    _tree_cpu_s(w.proc.pid) + _live_children_cpu_s(w.proc.pid) for w in workers
                )
                srv0 = process_cpu_s(fleet.server_pid)
                emu0 = process_cpu_s(fleet.emu.proc.pid)
                t0 = time.perf_counter()
                run = await run_deployment(  # type: ignore[misc]
                    "agent-fanout/agent-fanout",
                    parameters=params,
                    timeout=None,
                    poll_interval=0.5,
                )
                wall = time.perf_counter() - t0
                cpu = (
                    sum(_tree_cpu_s(w.proc.pid) + _live_children_cpu_s(w.proc.pid) for w in workers)
                    - cpu0
                )
                srv_cpu = process_cpu_s(fleet.server_pid) - srv0
                emu_cpu = process_cpu_s(fleet.emu.proc.pid) - emu0
            finally:
                for w in workers:
                    await stop_worker(w)
            starts = fleet.emu.event_log(["turn_start"], since=before)
            peak = max((e["details"]["running"] for e in starts), default=0)
            turns = len(items) * steps
            ok = run.state is not None and run.state.is_completed()
            print(
                f"{count} worker(s), cap {args.workers_cap}: {len(items)} workflows x {steps} "
                f"turn(s) in {wall:.1f}s = {turns / wall:.2f} turns/s "
                f"({'ok' if ok else run.state}; {len(starts)} turns started); workers' CPU "
                f"(incl. flow-run processes) {cpu / turns * 1000:.0f} ms/turn, Prefect server "
                f"{srv_cpu / turns * 1000:.0f} ms/turn, emulator {emu_cpu / turns * 1000:.0f} "
                f"ms/turn; all three {(cpu + srv_cpu + emu_cpu) / wall:.2f} CPU-s per second "
                f"(2 cores: 2.0); server peak {peak}; load {load0} → {loadavg()}",
                flush=True,
            )
        if args.kill:
            await _kill_run(args, fleet, pool, env)
    finally:
        await undeploy(deployed)


async def _kill_run(args: argparse.Namespace, fleet: Fleet, pool: str, env: dict[str, str]) -> None:
    from fanout_env import parent_of, start_worker, stop_worker
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    # The kill run's own shard size and worker limit (not --shard-size/--worker-limit of
    # the throughput runs): with the throughput defaults (shards of 20, --limit 12) its
    # 40 workflows were two shards that both landed on one worker, and no other worker
    # ever held a slot. Shards of 5 and --limit 5 make 8 shards the pool must spread
    # (the fan-out and 4 shards fill one worker).
    workers = [
        await start_worker(
            pool, f"{pool}-k{i}", env, fleet.tmp / f"k{i}.log", args.kill_worker_limit
        )
        for i in range(2)
    ]
    cap = args.kill_cap
    settings = await _settings(
        fleet, fleet.pg_store_url, cap, slot_ttl=args.slot_ttl, lease_ttl=args.slot_ttl
    )
    items = _items(f"bk-{uuid.uuid4().hex[:6]}", args.kill_workflows, 1, args.kill_turn_s)
    params = await _fanout_params(items, settings, args)
    params["shard_size"] = args.kill_shard_size
    print(
        f"kill run: {len(items)} workflows of one {args.kill_turn_s:.0f}s turn, shards of "
        f"{args.kill_shard_size}, two workers --limit {args.kill_worker_limit}, cap {cap}, "
        f"slot ttl {args.slot_ttl:.0f}s; load {loadavg()}",
        flush=True,
    )
    store = ChatStateStore(url=fleet.pg_store_url).get_store()
    by_pid = {w.proc.pid: w.name for w in workers}
    try:
        async with get_client() as client:
            t0 = time.perf_counter()
            fan = await run_deployment(  # type: ignore[misc]
                "agent-fanout/agent-fanout", parameters=params, timeout=0
            )

            # Wait until the slots are all busy and a worker other than the fan-out's
            # holds some of them.
            victim = None
            held: dict[int, str] = {}
            while victim is None:
                await asyncio.sleep(0.2)
                if time.perf_counter() - t0 > 300:
                    raise SystemExit("kill run: no worker held slots within 300 s")
                fan_run = await client.read_flow_run(fan.id)
                fan_pid = str(fan_run.infrastructure_pid or "").split(":")[-1]
                fan_host = by_pid.get(parent_of(int(fan_pid)) or -1) if fan_pid else None
                held = await _slot_holders(store, cap)
                if len(held) < cap or fan_host is None:
                    continue
                by_worker: dict[str, int] = {}
                for h in held.values():
                    parent = _parent(_holder_pid(h))
                    for w in workers:
                        if parent == w.proc.pid and w.name != fan_host:
                            by_worker[w.name] = by_worker.get(w.name, 0) + 1
                # ... while the fan-out's worker runs a shard of its own (whose turns
                # then wait for the dead worker's slots).
                fan_worker = next((w for w in workers if w.name == fan_host), None)
                if by_worker and fan_worker and len(_children_of(fan_worker.proc.pid)) >= 2:
                    most = max(by_worker.items(), key=lambda kv: kv[1])[0]
                    victim = next(w for w in workers if w.name == most)
            dead_pids = set(victim.kill_with_children())
            killed_at = time.perf_counter()
            killed_wall = time.time()
            dead_slots = {i for i, h in held.items() if _holder_pid(h) in dead_pids}
            retaken: dict[int, float] = {}
            freed: list[float] = []

            # The store is polled from the kill on, beside the Crashed marking below: polled
            # after it, as before, the clock started only once the marking ended (78 s at
            # load 20-27, the server's database timing out), not at the death.
            async def poll_slots() -> None:
                while (
                    len(retaken) < len(dead_slots)
                    and time.perf_counter() - killed_at < 10 * args.slot_ttl + 300
                ):
                    now_held = await _slot_holders(store, cap)
                    if not freed and not any(
                        _holder_pid(h) in dead_pids for h in now_held.values()
                    ):
                        freed.append(time.perf_counter() - killed_at)
                    for i in dead_slots - set(retaken):
                        now = now_held.get(i)
                        if now is not None and _holder_pid(now) not in dead_pids:
                            retaken[i] = time.perf_counter() - killed_at
                    await asyncio.sleep(0.1)

            poller = asyncio.create_task(poll_slots())
            await victim.proc.wait()
            marked = await _mark_dead_runs_crashed(client, dead_pids)
            print(
                f"kill: worker {victim.name} SIGKILLed with its flow runs at "
                f"{killed_at - t0:.1f}s, holding {len(dead_slots)} of {cap} turn slots; "
                f"{marked} runs marked Crashed {time.perf_counter() - killed_at:.1f}s after "
                f"the kill (slot ttl {args.slot_ttl:.0f}s)",
                flush=True,
            )
            await poller
            freed_after = freed[0] if freed else None
            times = sorted(retaken.values())
            print(
                f"kill: no slot held by the dead worker any more after "
                f"{freed_after if freed_after is not None else float('nan'):.1f}s (lapsed "
                f"or taken over)",
                flush=True,
            )
            print(
                f"kill: the surviving worker held the dead worker's {len(dead_slots)} slots "
                f"again after first {times[0] if times else float('nan'):.1f}s, median "
                f"{_pct(times, 0.5):.1f}s, last {times[-1] if times else float('nan'):.1f}s "
                f"({len(times)} of {len(dead_slots)} retaken)",
                flush=True,
            )

            async def fanout_final() -> Any:
                from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

                runs = await client.read_flow_runs(
                    deployment_filter=DeploymentFilter(
                        name=DeploymentFilterName(any_=["agent-fanout"])
                    )
                )
                mine = [
                    r
                    for r in runs
                    if r.parameters.get("workflows")
                    and r.parameters["workflows"][0]["workflow_id"] == items[0].workflow_id
                ]
                done = [
                    r for r in mine if r.state and r.state.is_final() and not r.state.is_crashed()
                ]
                return done[0] if done else None

            final = None
            while final is None and time.perf_counter() - t0 < 900:
                final = await fanout_final()
                await asyncio.sleep(0.5)
            wall = time.perf_counter() - t0
            # The first turn after the kill, from the emulator's log (its wall clock, the
            # same machine's): read once the fan-out ended. Read right after the slots
            # were retaken, as before, it was often empty (a slot is claimed before its
            # turn's message is sent) and printed nan.
            later = [
                e["time"] - killed_wall
                for e in await asyncio.to_thread(fleet.emu.event_log, ["turn_start"])
                if e["time"] > killed_wall
            ]
            print(
                f"kill: first turn started anywhere after the kill: "
                f"{min(later) if later else float('nan'):.1f}s ({len(later)} turns started "
                f"after it)",
                flush=True,
            )
            ideal = len(items) * args.kill_turn_s / cap
            print(
                f"kill: fan-out {final.state.type.value if final else 'not finished'} after "
                f"{wall:.1f}s ({len(items)} workflows of {args.kill_turn_s:.0f}s turns at cap "
                f"{cap}: ≥ {ideal:.0f}s without the kill); server peak "
                f"{max((e['details']['running'] for e in fleet.emu.event_log(['turn_start'])), default=0)}",
                flush=True,
            )
    finally:
        for w in workers:
            await stop_worker(w)
        await store.aclose()


async def _latency_mode(args: argparse.Namespace, fleet: Fleet) -> None:
    """Turns bound by model latency, as real ones are (seconds to minutes each): every
    turn waits ``--latency-turn-s`` in the emulator's scripted model (``#emu`` sleep),
    and each worker drives a bounded number of turns at once — ``--latency-worker-limit``
    shard runs (the process worker's ``--limit``) of ``--latency-shard-size`` workflows
    each. Turns/s with 1 and with 2 workers at cap ``--workers-cap`` (50, not binding).

    The fan-out's own flow run runs in this process (``shard_deployment`` given), so it
    takes none of the workers' limit: only the workers' shard runs count."""
    from fanout_env import child_env, deploy, start_worker, stop_worker, undeploy

    from prefect_coder.flows.deployments.agent_fanout import SHARD_DEPLOYMENT

    pool = f"bench-lat-{uuid.uuid4().hex[:6]}"
    deployed = await deploy(pool)
    env = child_env(fleet.api_url, fleet.tmp / "results")
    env["PREFECT_LOGGING_LEVEL"] = "ERROR"
    per_worker = args.latency_worker_limit * args.latency_shard_size
    steps, turn_s = args.latency_steps, args.latency_turn_s
    print(
        f"latency mode: {args.latency_workflows} workflows x {steps} turns of {turn_s:.0f}s "
        f"model latency, shards of {args.latency_shard_size}, worker --limit "
        f"{args.latency_worker_limit} (≤ {per_worker} turns per worker at once), cap "
        f"{args.workers_cap}; ideal per worker {per_worker / turn_s:.2f} turns/s; load "
        f"{loadavg()}",
        flush=True,
    )
    rates: dict[int, float] = {}
    try:
        for count in [int(c) for c in args.worker_counts.split(",") if c]:
            workers = [
                await start_worker(
                    pool,
                    f"{pool}-{count}-{i}",
                    env,
                    fleet.tmp / f"lat{count}{i}.log",
                    args.latency_worker_limit,
                )
                for i in range(count)
            ]
            try:
                settings = await _settings(fleet, fleet.pg_store_url, args.workers_cap)
                items = _items(
                    f"bl{count}-{uuid.uuid4().hex[:6]}", args.latency_workflows, steps, turn_s
                )
                before = len(fleet.emu.event_log(["turn_start"]))
                ends_before = len(fleet.emu.event_log(["turn_end"]))
                load0 = loadavg()
                cpu0 = sum(
                    _tree_cpu_s(w.proc.pid) + _live_children_cpu_s(w.proc.pid) for w in workers
                )
                srv0 = process_cpu_s(fleet.server_pid)
                t0 = time.perf_counter()
                outcomes = await agent_fanout(
                    items,
                    settings,
                    max_parallel=max(64, len(items)),
                    fail_on_error=False,
                    shard_size=args.latency_shard_size,
                    shard_deployment=SHARD_DEPLOYMENT,
                    poll_interval_s=0.5,
                )
                wall = time.perf_counter() - t0
                cpu = (
                    sum(_tree_cpu_s(w.proc.pid) + _live_children_cpu_s(w.proc.pid) for w in workers)
                    - cpu0
                )
                srv_cpu = process_cpu_s(fleet.server_pid) - srv0
            finally:
                for w in workers:
                    await stop_worker(w)
            starts = fleet.emu.event_log(["turn_start"], since=before)
            ends = fleet.emu.event_log(["turn_end"], since=ends_before)
            peak = max((e["details"]["running"] for e in starts), default=0)
            failed = sum(not o.ok for o in outcomes)
            turns = (len(items) - failed) * steps
            rates[count] = turns / wall
            # The steady part, from the emulator's clock: turns ended between the first
            # and the last turn end (leaves out the first shards' process starts).
            span = ends[-1]["time"] - ends[0]["time"] if len(ends) > 1 else float("nan")
            print(
                f"{count} worker(s): {turns} turns in {wall:.1f}s = {rates[count]:.2f} turns/s "
                f"({failed} workflows failed; {len(starts)} turns started); between the first "
                f"and the last turn end {(len(ends) - 1) / span:.2f} turns/s; server peak "
                f"{peak} running turns; workers' CPU (incl. shard processes) "
                f"{cpu / max(1, turns) * 1000:.0f} ms/turn, Prefect server "
                f"{srv_cpu / max(1, turns) * 1000:.0f} ms/turn; load {load0} → {loadavg()}",
                flush=True,
            )
        if 1 in rates and 2 in rates:
            print(
                f"latency mode: 2 workers / 1 worker = {rates[2] / rates[1]:.2f}x turns/s",
                flush=True,
            )
    finally:
        await undeploy(deployed)


def _children_of(pid: int) -> list[int]:
    from fanout_env import _children

    return _children(pid)


def _parent(pid: int) -> int | None:
    from fanout_env import parent_of

    return parent_of(pid) if pid > 0 else None


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workflows", type=int, default=200)
    p.add_argument("--steps", type=int, default=1, help="turns per workflow")
    p.add_argument("--caps", default="5,50")
    p.add_argument("--turn-s", type=float, default=0.05)
    p.add_argument("--store", choices=["sqlite", "pg"], default="sqlite")
    p.add_argument("--memory-workflows", type=int, default=50, help="0: no memory phase")
    p.add_argument("--memory-turn-s", type=float, default=5.0)
    p.add_argument("--memory-rounds", type=int, default=1, help="memory phases in a row")
    p.add_argument("--handoff", action="store_true", help="store slot vs Prefect GCL hand-off")
    p.add_argument(
        "--tracemalloc",
        action="store_true",
        help="after the memory phase: the Python heap per open turn by source file",
    )
    p.add_argument(
        "--cprofile",
        metavar="PATH",
        help="cProfile the event loop's thread (its CPU clock) during the last cap's "
        "fan-out; pstats written to PATH",
    )
    p.add_argument(
        "--server-pyspy",
        metavar="PATH",
        help="py-spy record (raw collapsed stacks, 100 Hz, non-blocking) of the Prefect "
        "server process during the last cap's fan-out until its tables settled",
    )
    p.add_argument(
        "--count-api",
        action="store_true",
        help="count this process's Prefect API requests by route during each fan-out",
    )
    p.add_argument(
        "--recorder-batch",
        type=int,
        default=RECORDER_BATCH,
        help="the Prefect server's task-run recorder batch size (Prefect's default: 1)",
    )
    p.add_argument(
        "--recorder-flush-s",
        type=float,
        default=RECORDER_FLUSH_S,
        help="the Prefect server's task-run recorder flush interval (Prefect's default: 5)",
    )
    p.add_argument(
        "--artifacts",
        action="store_true",
        help="the turns publish their artifacts (the deployments' default; off otherwise)",
    )
    p.add_argument(
        "--event-cost",
        type=int,
        default=0,
        metavar="N",
        help="after the fan-outs: the server's CPU per event by its related resources, "
        "N events per shape (use --caps '' --memory-workflows 0 for this alone)",
    )
    p.add_argument("--event-cost-rounds", type=int, default=2)
    p.add_argument(
        "--pin",
        action="store_true",
        help="the worker (this process) on one CPU, server + PostgreSQL + emulator on another",
    )
    p.add_argument("--gcl-rounds", type=int, default=10)
    p.add_argument("--workers-mode", action="store_true", help="1 vs 2 process workers")
    p.add_argument("--worker-counts", default="1,2")
    p.add_argument("--workers-cap", type=int, default=50)
    p.add_argument("--worker-limit", type=int, default=12, help="flow runs per worker at once")
    p.add_argument("--shard-size", type=int, default=20)
    p.add_argument("--kill", action="store_true", help="time the takeover after a worker's death")
    p.add_argument("--kill-cap", type=int, default=5)
    p.add_argument("--kill-workflows", type=int, default=40)
    p.add_argument("--kill-turn-s", type=float, default=3.0)
    p.add_argument("--kill-shard-size", type=int, default=5, help="shard size of the kill run")
    p.add_argument(
        "--kill-worker-limit", type=int, default=5, help="flow runs per worker in the kill run"
    )
    p.add_argument("--slot-ttl", type=float, default=15.0)
    p.add_argument(
        "--latency-mode",
        action="store_true",
        help="1 vs 2 workers with turns bound by model latency and a bounded worker limit",
    )
    p.add_argument("--latency-workflows", type=int, default=40)
    p.add_argument("--latency-steps", type=int, default=2)
    p.add_argument("--latency-turn-s", type=float, default=20.0, help="model latency per turn")
    p.add_argument("--latency-shard-size", type=int, default=5)
    p.add_argument(
        "--latency-worker-limit", type=int, default=2, help="shard runs per worker at once"
    )
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-fanout-"))
    with _fleet(tmp, args.recorder_batch, args.recorder_flush_s) as fleet:
        if args.latency_mode:
            asyncio.run(_latency_mode(args, fleet))
        elif args.workers_mode or args.kill:
            if not args.workers_mode:  # --kill alone: only the kill run
                args.worker_counts = ""
            asyncio.run(_workers_mode(args, fleet))
        else:
            asyncio.run(_main(args, fleet))


if __name__ == "__main__":
    main()
