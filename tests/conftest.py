"""Shared test fixtures: a private, throwaway PostgreSQL cluster for the whole session.

Sub-directories keep their own fixtures in their own conftest.py files.

``postgres_url`` starts one cluster per test session (< 1 s): ``initdb -A trust``
into a temp dir, ``pg_ctl start`` on a free 127.0.0.1 port with the unix socket in
that dir, and yields a SQLAlchemy asyncpg URL to its ``postgres`` database. It is
independent of any PostgreSQL service on the machine. Binaries come from
``$PREFECT_CODER_TEST_PG_BIN`` or ``/usr/lib/postgresql/*/bin`` (``scripts/test``
installs them). When the tests run as root, initdb/pg_ctl run as the ``postgres``
OS user (PostgreSQL refuses to run as root).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shlex
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# The emulator's pytest plugin is opt-in (it is not auto-loaded into every pytest
# session of an environment that has prefect-coder installed); this is the one line a
# user's own conftest.py needs too.
pytest_plugins = ["coder_chat.emulator.pytest_plugin"]


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
        opts = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c max_connections=200"
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


@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectHarness]:
    """One real Prefect test server for the whole session (≈ 9 s to start), shared by
    every directory that runs flows.

    Flow heartbeats are off (with them on, every flow run waits ≈ 1 s for a heartbeat
    thread). Result storage is a fresh temp dir: step results are keyed by
    (workflow, step) across runs, so a stale result from an earlier session must
    never be found. One server, not one per directory: Prefect's event and log
    workers are process-wide singletons bound to the server current when they
    start, and nested harnesses left them pointing at the wrong one.
    """
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
        PREFECT_LOGGING_LEVEL,
        PREFECT_RESULTS_LOCAL_STORAGE_PATH,
        temporary_settings,
    )
    from prefect.testing.utilities import prefect_test_harness

    results = tmp_path_factory.mktemp("prefect-results")
    with temporary_settings(
        updates={
            PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None,
            PREFECT_RESULTS_LOCAL_STORAGE_PATH: results,
            PREFECT_LOGGING_LEVEL: "WARNING",
        }
    ):
        with prefect_test_harness(server_startup_timeout=60):
            yield PrefectHarness(str(PREFECT_API_URL.value()), results)
            EventsWorker.drain_all(timeout=10)
            APILogWorker.drain_all(timeout=10)


@pytest.fixture(scope="session")
def prefect_server(prefect_harness: PrefectHarness) -> Path:
    """The Prefect test server's result dir, for tests that only need the server up."""
    return prefect_harness.results_dir
