"""Opt-in per-file CPU report of a pytest session (issue 12: the suite is CPU-bound).

``CODER_TEST_CPU_REPORT=PATH`` turns it on (``CODER_TEST_TIMELINE=PATH``: the same
table without measuring CPU — no /proc scan, so it costs nothing; ``.ci/run`` prints
it for every pass). ``{era}`` in PATH becomes
``$CODER_CHAT_EMULATOR_ERA``, so ``scripts/test``'s side-by-side passes write files of
their own. Around every test (its setup, call and teardown) it samples the CPU of
the session's process tree and adds the difference to the test's file:

* ``self``: this process (``getrusage(RUSAGE_SELF)``);
* ``reaped``: children this process has waited for (``getrusage(RUSAGE_CHILDREN)``:
  only *reaped* children count there, and a child counts only once it is reaped);
* ``live``: every process still running below this one (``/proc``: user + system
  time, plus that of the children each of them reaped), and every process registered
  with :func:`track_pid` and its own descendants (the PostgreSQL postmaster: pg_ctl
  daemonizes it, so it is nobody's child here). A child moves from ``live`` to
  ``reaped`` when it ends, so a long-lived server's CPU lands on the file whose tests
  made it work, not on the file that stopped it.

What it cannot see: a process orphaned before it was reaped (its parent ended first;
it was re-parented to init). Session-scoped fixtures are set up inside the first test
that asks for them and torn down inside the session's last test, so their start-up
(the PostgreSQL cluster, the Prefect test server, the warm Python process) lands on the
first file that uses them and their shutdown on the last file of the session; the
report says so in its header. Start-up and collection before the first test, and what
runs after the last, are rows of their own.

Under pytest-xdist every worker writes ``PATH.<worker>.json`` and the controller
merges them into one table at ``PATH`` when the session ends. Each row also says
when the file ran (``from_s``/``to_s``) and the table ends with where each worker's
last test ended: the run's timeline, to see which worker idled at the tail.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

_ENV = "CODER_TEST_CPU_REPORT"
#: The same report without the CPU columns (no /proc scan: ~8 ms of CPU per sample,
#: two per test), for every CI run: which file ran where and when, and its wall time.
_TIMELINE_ENV = "CODER_TEST_TIMELINE"
_wall_only = False
_TICK = os.sysconf("SC_CLK_TCK")
_tracked: set[int] = set()
# CPU last seen of each tracked process tree; a tree that ended (the cluster was
# stopped) keeps its last figure, as a reaped child's stays in RUSAGE_CHILDREN.
_tracked_seen: dict[int, float] = {}


def track_pid(pid: int) -> None:
    """Count ``pid`` and its descendants as part of this session's CPU (a daemon the
    session started that is not its child, e.g. a PostgreSQL postmaster)."""
    _tracked.add(pid)


def _report_path() -> Path | None:
    global _wall_only
    raw = os.environ.get(_ENV)
    if not raw:
        raw = os.environ.get(_TIMELINE_ENV)
        _wall_only = bool(raw)
    if not raw:
        return None
    return Path(raw.replace("{era}", os.environ.get("CODER_CHAT_EMULATOR_ERA") or "default"))


def _proc_table() -> dict[int, tuple[int, float]]:
    """pid -> (ppid, CPU seconds incl. reaped children) of every process on the host."""
    table: dict[int, tuple[int, float]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        rest = raw[raw.rfind(b")") + 2 :].split()
        # rest[1] = ppid; rest[11..14] = utime, stime, cutime, cstime (clock ticks)
        ticks = int(rest[11]) + int(rest[12]) + int(rest[13]) + int(rest[14])
        table[int(entry.name)] = (int(rest[1]), ticks / _TICK)
    return table


@dataclass
class _Sample:
    self_s: float
    reaped_s: float
    live_s: float
    wall: float
    epoch: float  # time.time(): when, on a clock every worker shares

    @staticmethod
    def take() -> _Sample:
        if _wall_only:
            return _Sample(0.0, 0.0, 0.0, time.monotonic(), time.time())
        own = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        table = _proc_table()
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        me = os.getpid()
        seen: set[int] = {me}

        def tree(root: int) -> float:
            cpu, todo = 0.0, [root]
            while todo:
                pid = todo.pop()
                if pid in seen or pid not in table:
                    continue
                seen.add(pid)
                cpu += table[pid][1]
                todo.extend(children.get(pid, []))
            return cpu

        for pid in _tracked:
            if pid in table:
                _tracked_seen[pid] = tree(pid)
        live = sum(_tracked_seen.values())
        for pid in children.get(me, []):
            live += tree(pid)
        return _Sample(
            own.ru_utime + own.ru_stime,
            kids.ru_utime + kids.ru_stime,
            live,
            time.monotonic(),
            time.time(),
        )


@dataclass
class _Row:
    tests: int = 0
    self_s: float = 0.0
    reaped_s: float = 0.0
    live_s: float = 0.0
    wall_s: float = 0.0
    #: When the file's first test began and its last ended (epoch seconds): with the
    #: worker, the run's timeline (which worker ran what when, where one idled).
    began: float = 0.0
    ended: float = 0.0

    def add(self, a: _Sample, b: _Sample, tests: int) -> None:
        self.began = min(self.began or a.epoch, a.epoch)
        self.ended = max(self.ended, b.epoch)
        self.tests += tests
        self.self_s += b.self_s - a.self_s
        self.reaped_s += b.reaped_s - a.reaped_s
        self.live_s += b.live_s - a.live_s
        self.wall_s += b.wall - a.wall

    @property
    def total(self) -> float:
        return self.self_s + self.reaped_s + self.live_s


@dataclass
class _Recorder:
    path: Path
    worker: str
    start: _Sample = field(default_factory=_Sample.take)
    rows: dict[str, _Row] = field(default_factory=dict)
    first: _Sample | None = None
    last: _Sample | None = None

    def row(self, name: str) -> _Row:
        return self.rows.setdefault(name, _Row())


_recorder: _Recorder | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _recorder
    path = _report_path()
    if path is None:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    _recorder = _Recorder(path, worker)
    if not worker:
        # A controller or a plain session: no stale worker files from an earlier run.
        for old in path.parent.glob(f"{path.name}.gw*.json"):
            old.unlink()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    if _recorder is None:
        yield
        return
    before = _Sample.take()
    if _recorder.first is None:
        _recorder.first = before
        _recorder.row("(before the first test: start-up, collection)").add(
            _recorder.start, before, 0
        )
    yield
    after = _Sample.take()
    _recorder.row(item.nodeid.split("::", 1)[0]).add(before, after, 1)
    _recorder.last = after


def _rows_json(rec: _Recorder, end: _Sample) -> list[dict[str, Any]]:
    if rec.last is not None:
        rec.row("(after the last test: session finish)").add(rec.last, end, 0)
    return [
        {"file": name, "worker": rec.worker, "server_mods": _server_modules(), **vars(row)}
        for name, row in rec.rows.items()
    ]


def _server_modules() -> int:
    """How many ``prefect.server`` modules this process imported (the test server runs
    in its own process: the test process needs none of them)."""
    return sum(1 for m in sys.modules if m.startswith("prefect.server"))


def _table(rows: list[dict[str, Any]], workers: int, server_mods: str) -> str:
    def total(r: dict[str, Any]) -> float:
        return float(r["self_s"] + r["reaped_s"] + r["live_s"])

    rows = sorted(rows, key=lambda r: r["wall_s"] if _wall_only else total(r), reverse=True)
    all_cpu = sum(total(r) for r in rows)
    zero = min((r["began"] for r in rows if r.get("began")), default=0.0)

    def at(r: dict[str, Any], key: str) -> float:
        return float(r.get(key) or zero) - zero

    lines = [
        f"# CPU per test file ({_ENV}); {workers or 'no'} xdist worker(s); "
        + (f"WALL ONLY ({_TIMELINE_ENV}: no CPU measured); " if _wall_only else "")
        + f"load at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        "# cpu = self + reaped + live. self: the pytest process; reaped: children it",
        "# waited for (getrusage CHILDREN counts a child only once reaped); live:",
        "# processes still running below it + the PostgreSQL postmaster tree (/proc).",
        "# Session-scoped fixtures (PostgreSQL cluster, Prefect test server, warm",
        "# Python) start inside the FIRST file that uses them and stop inside the",
        "# session's LAST file: their start-up and shutdown land there.",
        f"# total {all_cpu:.1f} CPU-s; prefect.server modules imported by the test "
        f"process(es): {server_mods}",
        "# from_s/to_s: when the file's first test began and its last ended, seconds",
        "# after the first worker's session began; per worker at the end: where its",
        "# last test ended (a worker done long before the others idled from there).",
        f"{'cpu_s':>8} {'self_s':>8} {'reaped_s':>8} {'live_s':>8} {'wall_s':>8} "
        f"{'from_s':>7} {'to_s':>7} {'tests':>5} {'worker':>6}  file",
    ]
    for r in rows:
        lines.append(
            f"{total(r):8.1f} {r['self_s']:8.1f} {r['reaped_s']:8.1f} {r['live_s']:8.1f} "
            f"{r['wall_s']:8.1f} {at(r, 'began'):7.1f} {at(r, 'ended'):7.1f} "
            f"{r['tests']:5d} {r['worker'] or '-':>6}  {r['file']}"
        )
    for worker in sorted({r["worker"] for r in rows}):
        mine = [r for r in rows if r["worker"] == worker and r["tests"]]
        if mine:
            busy = sum(r["wall_s"] for r in mine)
            end = max(at(r, "ended") for r in mine)
            lines.append(
                f"# worker {worker or '-'}: last test ended at {end:.1f} s; "
                f"{busy:.1f} s in tests; {len(mine)} files"
            )
    return "\n".join(lines) + "\n"


def pytest_sessionfinish(session: pytest.Session) -> None:
    rec = _recorder
    if rec is None:
        return
    rows = _rows_json(rec, _Sample.take())
    if rec.worker:
        Path(f"{rec.path}.{rec.worker}.json").write_text(json.dumps(rows))
        return
    workers = 0
    for part in sorted(rec.path.parent.glob(f"{rec.path.name}.gw*.json")):
        workers += 1
        with contextlib.suppress(ValueError, OSError):
            rows += json.loads(part.read_text())
        part.unlink()
    mods = sorted({f"{r['worker'] or 'main'}={r.pop('server_mods', '?')}" for r in rows})
    rec.path.write_text(_table(rows, workers, " ".join(mods)))
