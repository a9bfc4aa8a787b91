"""Shared test fixtures: a private, throwaway PostgreSQL cluster for the whole session,
and the session's one Prefect test server, on a database in that cluster.

Sub-directories keep their own fixtures in their own conftest.py files.

``postgres_url`` starts one cluster per test session (< 1 s): ``initdb -A trust``
into a temp dir, ``pg_ctl start`` on a free 127.0.0.1 port with the unix socket in
that dir, and yields a SQLAlchemy asyncpg URL to its ``postgres`` database. It is
independent of any PostgreSQL service on the machine. Binaries come from
``$PREFECT_CODER_TEST_PG_BIN`` or ``/usr/lib/postgresql/*/bin`` (``scripts/test``
installs them). When the tests run as root, initdb/pg_ctl run as the ``postgres``
OS user (PostgreSQL refuses to run as root). The cluster runs without fsync: it is
thrown away at the end.

``prefect_harness`` / ``prefect_server`` run a Prefect API server in a subprocess on
the database ``prefect_server`` of that cluster (not SQLite: see ``prefect_harness``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pwd
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest


def _one_certificate_trust_store() -> None:
    """Every process of the session trusts a CA bundle of one certificate (issue 12;
    why that is safe and what it saves: ``support/trust.py``). Set before anything
    imports Prefect (its settings are read then), in the environment, so the warm
    process, servers, workers, flow-run processes and children inherit it. It replaces
    a machine-wide ``SSL_CERT_FILE`` (this machine points it at the system bundle, as
    large): no test reaches anything but loopback. ``PREFECT_CODER_TEST_SYSTEM_TRUST=1``
    keeps the machine's trust store."""
    if os.environ.get("PREFECT_CODER_TEST_SYSTEM_TRUST") == "1":
        return
    from support.trust import one_certificate_bundle

    bundle = str(one_certificate_bundle())
    os.environ["PREFECT_API_SSL_CERT_FILE"] = bundle
    os.environ["SSL_CERT_FILE"] = bundle


_one_certificate_trust_store()

from warm_python import SOCKET_ENV, WarmPython  # noqa: E402

# The emulator's pytest plugin is opt-in (it is not auto-loaded into every pytest
# session of an environment that has prefect-coder installed); this is the one line a
# user's own conftest.py needs too.
pytest_plugins = ["coder_chat.emulator.pytest_plugin", "support.cpu_report"]


# Wall seconds each heavy file keeps one xdist worker busy, from the timeline of a full
# ``scripts/test`` run (CODER_TEST_TIMELINE, .ci/run at 8c197c1, 2026-12-02 00:40, quiet,
# two workers; a worker's first file also carries its session start-up: PostgreSQL,
# the Prefect test server, the warm process). Under pytest-xdist (scripts/test's main pass, ``--dist loadfile
# --no-loadscope-reorder``) files are handed to the workers in collection order; the
# heaviest go first, so the run does not end with one worker alone on a long file
# while the other idles (longest-first scheduling; in that run the two workers' last
# tests ended 1.1 s apart). A file not listed (< 6 s there) counts as light and keeps
# its place after these. Only the order changes, never what runs. ``.ci/run`` prints
# the timeline of every CI run: refresh these from it when files grow or move.
_HEAVY_FILES = {
    "tests/fanout/test_fanout_workers.py": 108,
    "tests/fanout/test_fanout_per_workflow.py": 103,
    "tests/recovery/test_crash_matrix_recover_turn.py": 56,
    "tests/fanout/test_fanout_rerun.py": 60,
    "tests/sweeps/test_sweep_leaves_crashed_attempts.py": 36,
    "tests/recovery/test_crash_followups.py": 36,
    "tests/recovery/test_crashed_trigger.py": 17,
    "tests/chaos/test_chaos.py": 30,
    "tests/recovery/test_crash_matrix.py": 27,
    "tests/fleet/test_fleet.py": 21,
    "tests/hostloss/test_slot_lapse.py": 21,
    "tests/hostloss/test_hostile_slot_abandon_probe.py": 21,
    "tests/approvals/test_approvals.py": 20,
    "tests/recovery/test_turn_recovery.py": 16,
    "tests/sweeps/test_orphan_sweep.py": 14,
    "tests/hostloss/test_takeover.py": 12,
    "tests/recovery/test_lost_response_live.py": 12,
    "tests/flows/test_transient_failures.py": 12,
    "tests/recovery/test_crash_property.py": 12,
    "tests/sweeps/test_stuck_sweep.py": 12,
    "tests/hostloss/test_zombie.py": 12,
    "tests/recovery/test_lost_and_archived.py": 11,
    "tests/sweeps/test_crash_and_concurrency.py": 11,
    "tests/recovery/test_window_past_deadline.py": 10,
    "tests/hostloss/test_hostile_slot_release.py": 10,
    "tests/fanout/test_hostile_concurrent_reruns.py": 9,
    "tests/client/test_agent_faults.py": 8,
    "tests/flows/test_workflow.py": 7,
    "tests/recovery/test_inflight_send.py": 7,
    "tests/recovery/test_recover_turn_flow.py": 7,
    "tests/store/test_leases.py": 7,
    "tests/flows/test_turn_exits.py": 7,
    "tests/model_steps/test_model_step_flow.py": 6,
}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist, heaviest files first (see ``_HEAVY_FILES``); whole files
    stay together, in their own order. Every worker sorts the same collection the
    same way, as xdist requires."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        first.setdefault(item.nodeid.split("::", 1)[0], i)

    def key(item: pytest.Item) -> tuple[int, int]:
        path = item.nodeid.split("::", 1)[0]
        return (-_HEAVY_FILES.get(path, 0), first[path])

    items.sort(key=key)


def _pg_bindir() -> Path:
    env = os.environ.get("PREFECT_CODER_TEST_PG_BIN")
    if env:
        return Path(env)
    found = sorted(
        Path("/usr/lib/postgresql").glob("*/bin"),
        key=lambda p: [int(x) for x in re.findall(r"\d+", p.parent.name)] or [0],
    )
    found = [p for p in found if (p / "initdb").exists()]
    if not found:
        pytest.fail(
            "PostgreSQL server binaries not found: set PREFECT_CODER_TEST_PG_BIN or run "
            "scripts/test (it installs the Debian `postgresql` package)"
        )
    return found[-1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_pg_user(cmd: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return cmd
    if shutil.which("runuser"):
        return ["runuser", "-u", "postgres", "--", *cmd]
    return ["su", "postgres", "-s", "/bin/sh", "-c", shlex.join(cmd)]


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """``postgresql+asyncpg://postgres@127.0.0.1:PORT/postgres`` of a private cluster."""
    bindir = _pg_bindir()
    root = Path(tempfile.mkdtemp(prefix="prefect-coder-pg-"))
    data = root / "data"
    if os.geteuid() == 0:
        pg = pwd.getpwnam("postgres")
        os.chown(root, pg.pw_uid, pg.pw_gid)
    port = _free_port()
    run = {"check": True, "capture_output": True, "text": True, "timeout": 60}
    try:
        subprocess.run(
            _as_pg_user(
                [
                    str(bindir / "initdb"),
                    "-D",
                    str(data),
                    "-A",
                    "trust",
                    "-U",
                    "postgres",
                    "-E",
                    "UTF8",
                    "--no-sync",
                ]
            ),
            **run,  # type: ignore[arg-type]
        )
        # Trust for the admin role; a real SCRAM password check for every other role over
        # TCP, so the store's separate-password path is exercised end to end.
        (data / "pg_hba.conf").write_text(
            "local all all trust\n"
            "host all postgres 127.0.0.1/32 trust\n"
            "host all all 127.0.0.1/32 scram-sha-256\n"
        )
        # A throwaway cluster: no durability work (the Prefect server migrates ~200
        # revisions at start; fsync per DDL statement made that several times slower).
        opts = (
            f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c max_connections=200 "
            "-c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        )
        subprocess.run(
            _as_pg_user(
                [
                    str(bindir / "pg_ctl"),
                    "-D",
                    str(data),
                    "-o",
                    opts,
                    "-l",
                    str(root / "log"),
                    "-w",
                    "start",
                ]
            ),
            **run,  # type: ignore[arg-type]
        )
        # The postmaster is pg_ctl's daemon, nobody's child here: the opt-in CPU
        # report (CODER_TEST_CPU_REPORT) counts it by pid. (Imported here: a module
        # imported before pytest registers it as a plugin is not assert-rewritten.)
        from support.cpu_report import track_pid

        track_pid(int((data / "postmaster.pid").read_text().split()[0]))
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        detail = getattr(exc, "stderr", None) or exc
        log = (root / "log").read_text() if (root / "log").exists() else ""
        shutil.rmtree(root, ignore_errors=True)
        pytest.fail(
            f"could not start the test PostgreSQL from {bindir}: {detail}\n{log}\n"
            "(set PREFECT_CODER_TEST_PG_BIN to a PostgreSQL bin directory, or run scripts/test)"
        )
    try:
        yield f"postgresql+asyncpg://postgres@127.0.0.1:{port}/postgres"
    finally:
        with contextlib.suppress(Exception):
            subprocess.run(
                _as_pg_user([str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"]),
                **run,  # type: ignore[arg-type]
            )
        shutil.rmtree(root, ignore_errors=True)


# --------------------------------------------------------------------- Prefect server


@dataclass(frozen=True)
class PrefectHarness:
    """The session's one Prefect test server and its isolated result storage."""

    api_url: str
    results_dir: Path
    database_url: str


def _create_database(admin_url: str, name: str, replace: bool = False) -> str:
    """Create database ``name`` in the cluster of ``admin_url`` (dropping it first if
    ``replace``); its URL (same dialect)."""
    import asyncio

    import asyncpg  # type: ignore[import-untyped]
    from sqlalchemy.engine import make_url

    url = make_url(admin_url)

    async def create() -> None:
        conn = await asyncpg.connect(
            host=url.host, port=url.port, user=url.username, database=url.database
        )
        try:
            if replace:
                await conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
            await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()

    asyncio.run(create())
    return url.set(database=name).render_as_string(hide_password=False)


def _server_database(admin_url: str, name: str) -> tuple[str, bool]:
    """Database ``name`` for a Prefect server, loaded from the cached dump when there is
    one: (its URL, whether it holds a migrated schema)."""
    database = _create_database(admin_url, name)
    restored = _restore_server_db(database)
    if restored is False:
        # A partial restore leaves tables the migrations would trip over: start empty.
        database = _create_database(admin_url, name, replace=True)
    return database, bool(restored)


def harness_settings() -> dict[Any, Any]:
    """The settings this process runs flows with against a test server (the suite's
    harness; ``bench/chaos.py``'s restartable server)."""
    from prefect.settings import (
        PREFECT_CLIENT_RETRY_JITTER_FACTOR,
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
        PREFECT_LOGGING_LEVEL,
        PREFECT_SERVER_ANALYTICS_ENABLED,
    )

    return {
        # With heartbeats on, every flow run waits ≈ 1 s for a heartbeat thread.
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None,
        PREFECT_LOGGING_LEVEL: "WARNING",
        # Offline test machines: the telemetry service only logs DNS errors.
        PREFECT_SERVER_ANALYTICS_ENABLED: False,
        # Prefect's client retries (a busy server's 503/429) jitter with the global
        # `random` module, from its log and event worker threads. Hypothesis checks
        # that the global random state does not change while it draws an example,
        # and such a retry in the middle of a draw made it warn "Do not use the
        # `random` module inside strategies". No jitter: no use of `random` there.
        PREFECT_CLIENT_RETRY_JITTER_FACTOR: 0,
    }


def _server_db_cache() -> Path:
    """Where a started Prefect server's database is kept between sessions (issue 12).

    A Prefect server's first start on an empty database runs ~200 migrations and
    registers its block types: ~6 of its ~16 CPU-s of start-up, paid by every pytest
    session (each xdist worker has its own cluster). A plain SQL dump of that database
    right after the first healthy start, restored into the next session's fresh
    database, lets the server find its schema at head. Keyed by the Prefect version and
    the PostgreSQL major version, in the virtualenv (thrown away with it); a dump that
    does not restore is ignored and the server migrates as before.
    """
    import prefect

    major = _pg_bindir().parent.name
    return (
        Path(sys.prefix)
        / ".prefect-coder-test-cache"
        / f"server-{prefect.__version__}-pg{major}.sql"
    )


def _restore_server_db(database_url: str) -> bool | None:
    """Load the cached dump into the (fresh) database of ``database_url``: True if done,
    None without a dump, False if the restore failed part-way."""
    from sqlalchemy.engine import make_url

    dump = _server_db_cache()
    if not dump.is_file():
        return None
    url = make_url(database_url)
    done = subprocess.run(
        [str(_pg_bindir() / "psql"), "-q", "-X", "-v", "ON_ERROR_STOP=1", "-h", str(url.host),
         "-p", str(url.port), "-U", str(url.username), "-d", str(url.database), "-f", str(dump)],
        capture_output=True, timeout=120,
    )  # fmt: skip
    return done.returncode == 0


def _save_server_db(database_url: str) -> None:
    """Dump the started server's database for the next session (atomically: xdist workers
    and side-by-side passes may write it at once)."""
    from sqlalchemy.engine import make_url

    dump = _server_db_cache()
    url = make_url(database_url)
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        dump.parent.mkdir(parents=True, exist_ok=True)
        part = dump.with_name(f"{dump.name}.{os.getpid()}.part")
        done = subprocess.run(
            [str(_pg_bindir() / "pg_dump"), "--no-owner", "--no-privileges", "-h",
             str(url.host), "-p", str(url.port), "-U", str(url.username), "-f", str(part),
             str(url.database)],
            capture_output=True, timeout=120,
        )  # fmt: skip
        if done.returncode == 0:
            part.replace(dump)
        else:
            part.unlink(missing_ok=True)


@contextlib.contextmanager
def _prefect_test_server(database_url: str, startup_timeout: int) -> Iterator[str]:
    """A Prefect API server in a subprocess on ``database_url``; yields its API URL.

    ``prefect_test_harness`` always runs its server on a fresh SQLite file, and a
    SQLite-backed server answers 503 ("database is locked") to concurrent writers on
    a busy machine (``POST /flow_runs/`` during the crash matrix). This is the same
    arrangement on the session's PostgreSQL: the server process Prefect's own
    ``SubprocessASGIServer`` runs (uvicorn on ``create_app``, its settings passed
    through the environment, the database URL among them), and ``PREFECT_API_URL``
    points at it in this process and in every settings context copied from now on,
    so no client here starts an ephemeral server of its own.

    Started here rather than through ``SubprocessASGIServer``: importing
    ``prefect.server.api.server`` into the test process (the whole server app, only
    to launch a subprocess) cost ~3.4 CPU-s per pytest session (issue 12), and
    nothing in the test process uses the server's modules.
    """
    from prefect.context import _temporary_global_settings_context, get_settings_context
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_SERVER_DATABASE_CONNECTION_URL,
        temporary_settings,
    )

    with temporary_settings(updates={PREFECT_SERVER_DATABASE_CONNECTION_URL: database_url}):
        with _server_process(database_url, startup_timeout) as api_url:
            with (
                temporary_settings(updates={PREFECT_API_URL: api_url}),
                _temporary_global_settings_context(get_settings_context()),
            ):
                yield api_url


@contextlib.contextmanager
def _server_process(database_url: str, startup_timeout: int) -> Iterator[str]:
    """A Prefect API server subprocess on ``database_url``; yields its API URL and changes
    no setting of this process (``_prefect_test_server`` points the session at it; a
    scratch server for one test, ``scratch_prefect_server``, leaves the session alone)."""
    import httpx
    import prefect
    from prefect.settings import get_current_settings

    def launch(port: int) -> subprocess.Popen[bytes]:
        env = {
            **os.environ,
            # What SubprocessASGIServer sets for its server: no UI, ephemeral mode.
            "PREFECT_UI_ENABLED": "0",
            "PREFECT__SERVER_EPHEMERAL": "1",
            "PREFECT__SERVER_FINAL": "1",
            # Events reach /events/filter (and so the tests that wait for one) within a
            # second, not the default five (issue 12: several waits per file paid it).
            "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL": "1",
            # Task-run state events recorded in batches of up to 50 per transaction
            # (Prefect's default: one transaction per event; docs/deploy.md recommends
            # this for production servers too). Measured on three flow-heavy files,
            # alternated: 68.0 / 65.7 -> 57.9 / 57.3 CPU-s, 71 / 64 -> 62 / 61 s (issue 12).
            "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "50",
            "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "1",
            **get_current_settings().to_environment_variables(exclude_unset=True),
            "PREFECT_SERVER_DATABASE_CONNECTION_URL": database_url,
            # Offline test machines: the telemetry service only logs DNS errors.
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        }
        app_dir = str(prefect.__module_path__.parent)
        factory = "prefect.server.api.server:create_app"
        return subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--app-dir", app_dir, "--factory", factory,
             "--host", "127.0.0.1", "--port", str(port), "--log-level", "error",
             "--lifespan", "on"],
            env=env,
        )  # fmt: skip

    def stop(proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    port = _free_port()
    proc = launch(port)
    atexit.register(stop, proc)
    try:
        deadline = time.monotonic() + startup_timeout
        with httpx.Client() as client:
            while True:
                rc = proc.poll()
                if rc == 3 and time.monotonic() < deadline:  # the port was taken
                    port = _free_port()
                    proc = launch(port)
                    atexit.register(stop, proc)
                    continue
                if rc is not None:
                    raise RuntimeError(f"the Prefect test server exited with code {rc}")
                with contextlib.suppress(httpx.TransportError):
                    if client.get(f"http://127.0.0.1:{port}/api/health").status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the Prefect test server did not answer within {startup_timeout} s"
                    )
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/api"
    finally:
        stop(proc)


@pytest.fixture(scope="session")
def prefect_harness(
    tmp_path_factory: pytest.TempPathFactory, postgres_url: str
) -> Iterator[PrefectHarness]:
    """One real Prefect test server for the whole session, on its own database in the
    session's PostgreSQL cluster, shared by every directory that runs flows.

    PostgreSQL, not SQLite: under concurrent load (flow runs in subprocesses, fan-outs,
    a busy 2-core machine) a SQLite-backed server answers 503 "database is locked".
    Flow heartbeats are off (with them on, every flow run waits ≈ 1 s for a heartbeat
    thread). Result storage is a fresh temp dir: step results are keyed by
    (workflow, step) across runs, so a stale result from an earlier session must
    never be found. One server, not one per directory: Prefect's event and log
    workers are process-wide singletons bound to the server current when they
    start, and nested harnesses left them pointing at the wrong one.
    """
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_RESULTS_LOCAL_STORAGE_PATH, temporary_settings

    results = tmp_path_factory.mktemp("prefect-results")
    database, restored = _server_database(postgres_url, "prefect_server")
    save_after_start = not restored
    with temporary_settings(
        updates={**harness_settings(), PREFECT_RESULTS_LOCAL_STORAGE_PATH: results}
    ):
        # Generous: the server migrates a fresh schema at start, slow on a loaded machine.
        with _prefect_test_server(database, startup_timeout=300) as api_url:
            if save_after_start:
                _save_server_db(database)
            yield PrefectHarness(api_url, results, database)
            EventsWorker.drain_all(timeout=10)
            APILogWorker.drain_all(timeout=10)


@pytest.fixture(autouse=True)
def _no_websocket_pings_during_hypothesis(request: pytest.FixtureRequest) -> None:
    """Close Prefect's events websocket before a Hypothesis test draws its examples.

    Hypothesis warns "Do not use the `random` module inside strategies" when the global
    ``random`` state changes while it draws an example. Once a test of this session has
    run a flow, Prefect's events worker keeps a websocket to the server open in a
    background thread, and websockets picks each keepalive/checkpoint ping's payload
    with the global ``random.getrandbits`` - so a ping landing in the middle of a draw
    (tests/client/test_translator_props.py, 300 examples) made the warning. Draining
    the worker sends what it holds and closes that socket; the next flow starts a new
    one. Only when Prefect is already imported: pure-client tests never import it.
    """
    if request.node.get_closest_marker("hypothesis") is None:
        return
    events_worker = sys.modules.get("prefect.events.worker")
    if events_worker is not None:
        events_worker.EventsWorker.drain_all(timeout=10, at_exit=False)


@pytest.fixture(scope="session")
def warm_python(prefect_harness: PrefectHarness) -> Iterator[WarmPython]:
    """Fresh child processes forked from one warm process (tests/warm_python.py).

    For tests whose child process stands in for a worker's flow-run process: it is
    a separate process (own pid, memory, sockets; a real SIGKILL kills it) without
    a new interpreter importing Prefect again (~4.5 s CPU per child). Its Prefect
    settings are the session's: ``PREFECT_API_URL`` of the test server, the result
    storage, logging at WARNING. A child asking for other ``PREFECT_*`` settings
    runs in a fresh interpreter.
    """
    root = Path(__file__).resolve().parents[1]
    env = dict(
        os.environ,
        PREFECT_API_URL=prefect_harness.api_url,
        PREFECT_RESULTS_LOCAL_STORAGE_PATH=str(prefect_harness.results_dir),
        PREFECT_LOGGING_LEVEL="WARNING",
        PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p),
        # A process worker reads these at import, so a worker is forked from here only
        # when its own are the same: these are what tests/fanout's workers run with
        # (fanout_env.WORKER_QUERY_S, child_env). Flow runs and other children ignore them.
        PREFECT_WORKER_QUERY_SECONDS="2",
        PREFECT_WORKER_HEARTBEAT_SECONDS="5",
    )
    warm = WarmPython(env)
    try:
        warm.wait_ready()
        # Process workers started from now on hand it their flow runs
        # (tests/warm_launch.py, the `command` of tests/fanout's deployments).
        os.environ[SOCKET_ENV] = warm.socket_path
        yield warm
    finally:
        os.environ.pop(SOCKET_ENV, None)
        warm.close()


#: Directories whose tests start process workers for the deployments of
#: tests/fanout/fanout_env.py, whose flow runs start as tests/warm_launch.py: with the
#: warm process up (and its socket in the environment the workers inherit) each flow
#: run is forked from it instead of importing Prefect again.
_WARM_ENGINE_DIRS = frozenset({"fanout"})


@pytest.fixture(autouse=True)
def _warm_engines(request: pytest.FixtureRequest) -> None:
    if request.path.parent.name in _WARM_ENGINE_DIRS and "prefect_harness" in request.fixturenames:
        request.getfixturevalue("warm_python")


@pytest.fixture
def collector_off() -> Iterator[None]:
    """The cyclic garbage collector off for one test (collected once before): what is
    still alive after it was dropped is held by a reference cycle or a live owner."""
    import gc

    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.fixture
def scratch_prefect_server(postgres_url: str) -> Iterator[str]:
    """A Prefect API server of its own for one test (a fresh database; the cached schema
    dump when there is one), leaving the session's server and settings alone: for tests
    that run a user's set-up commands (``prefect deploy --all``, automations) whose
    deployments and schedules must not reach the other tests. Yields its API URL."""
    database, _ = _server_database(postgres_url, f"scratch_{uuid.uuid4().hex[:12]}")
    with _server_process(database, startup_timeout=300) as api_url:
        yield api_url


@pytest.fixture(scope="session")
def prefect_server(prefect_harness: PrefectHarness) -> Path:
    """The Prefect test server's result dir, for tests that only need the server up."""
    return prefect_harness.results_dir
