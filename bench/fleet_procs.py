"""The benchmarks' process fleet: a private PostgreSQL cluster, a Prefect API server on
it (a subprocess), and the chatd emulator as its own program (``coder-chat-emulator``).

Separate processes on purpose: a fan-out benchmark measures the worker process
(turns/s, CPU and memory per turn), so neither the emulator nor the Prefect server
may run inside it and eat its core. PostgreSQL, not SQLite, behind the Prefect
server: a SQLite-backed server answers 503 "database is locked" to concurrent
writers on a busy machine (the first two-worker run lost 5 of 24 workflows to it).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode
from urllib.request import Request, urlopen

from pg_cluster import free_port, private_postgres

__all__ = [
    "RECORDER_BATCH",
    "RECORDER_FLUSH_S",
    "EmulatorProcess",
    "create_database",
    "loadavg",
    "postgres_cpu_s",
    "postmaster_pid",
    "prefect_server",
    "private_postgres",
    "process_cpu_s",
]


def create_database(admin_url: str, name: str) -> str:
    """Create database ``name`` in the cluster of ``admin_url``; returns its URL."""
    import asyncio

    import asyncpg
    from sqlalchemy.engine import make_url

    url = make_url(admin_url)

    async def create() -> None:
        conn = await asyncpg.connect(
            host=url.host, port=url.port, user=url.username, database=url.database
        )
        try:
            await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()

    asyncio.run(create())
    return url.set(database=name).render_as_string(hide_password=False)


#: The task-run recorder settings of a server that records fan-outs (docs/performance.md,
#: round 11a). Prefect's defaults (batch 1, flush every 5 s) write each task-run state
#: event in a transaction of its own (a SELECT, an upsert, a SELECT, an INSERT and a
#: COMMIT, each compiled anew): at cap 50 that was half of the server's CPU per turn,
#: and the recorder fell behind the fan-out. Batches of up to 50, flushed at least
#: every second, record the same rows; a task run's state shows in the UI ≤ 1 s later
#: when the server is idle.
RECORDER_BATCH = 50
RECORDER_FLUSH_S = 1.0


@contextlib.contextmanager
def prefect_server(
    database_url: str,
    startup_timeout: int = 240,
    *,
    recorder_batch: int = RECORDER_BATCH,
    recorder_flush_s: float = RECORDER_FLUSH_S,
) -> Iterator[tuple[str, int]]:
    """A Prefect API server subprocess on ``database_url``; yields its API URL (also this
    process's ``PREFECT_API_URL`` for the duration, as in tests/conftest.py) and pid.

    ``recorder_batch`` / ``recorder_flush_s``: its task-run recorder's batch size and
    flush interval (Prefect's defaults: 1 and 5 s)."""
    from prefect.context import _temporary_global_settings_context, get_settings_context
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.server.database.dependencies import temporary_database_interface
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_SERVER_DATABASE_CONNECTION_URL,
        temporary_settings,
    )

    with contextlib.ExitStack() as stack:
        stack.enter_context(temporary_database_interface())
        stack.enter_context(
            temporary_settings(updates={PREFECT_SERVER_DATABASE_CONNECTION_URL: database_url})
        )
        # The server's own database pool (default 5 + 10 overflow) timed out
        # (30 s) under a two-worker fan-out on a loaded machine: size it like a
        # production server for this load.
        for var, value in (
            ("PREFECT_SERVER_DATABASE_SQLALCHEMY_POOL_SIZE", "20"),
            ("PREFECT_SERVER_DATABASE_SQLALCHEMY_MAX_OVERFLOW", "40"),
        ):
            os.environ.setdefault(var, value)
        # The server subprocess reads its settings from this environment.
        for var, value in (
            ("PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE", str(recorder_batch)),
            ("PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL", str(recorder_flush_s)),
        ):
            saved = os.environ.get(var)
            os.environ[var] = value
            stack.callback(_restore_env, var, saved)
        server = SubprocessASGIServer(port=free_port())
        previous = SubprocessASGIServer._instances.get(None)
        SubprocessASGIServer._instances[None] = server
        try:
            server.start(timeout=startup_timeout)
            stack.callback(server.stop)
            stack.enter_context(temporary_settings(updates={PREFECT_API_URL: server.api_url}))
            stack.enter_context(_temporary_global_settings_context(get_settings_context()))
            assert server.server_process is not None
            yield server.api_url, server.server_process.pid
        finally:
            stack.close()
            if previous is not None:
                SubprocessASGIServer._instances[None] = previous
            else:
                SubprocessASGIServer._instances.pop(None, None)


def _restore_env(var: str, saved: str | None) -> None:
    if saved is None:
        os.environ.pop(var, None)
    else:
        os.environ[var] = saved


@dataclass
class EmulatorProcess:
    """``coder-chat-emulator`` as its own process; its event log through the control API."""

    proc: subprocess.Popen[str]
    base_url: str
    organization_id: str
    admin_token: str

    @classmethod
    @contextlib.contextmanager
    def running(cls, token: str, *, capacity: int = 0) -> Iterator[EmulatorProcess]:
        cmd = [
            sys.executable,
            "-m",
            "coder_chat.emulator.cli",
            "--token",
            token,
            "--delta-delay",
            "0",
            "--max-concurrent-root-chats",
            str(capacity),
        ]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        try:
            env: dict[str, str] = {}
            assert proc.stdout is not None
            while "CODER_EMULATOR_ADMIN_TOKEN" not in env:
                line = proc.stdout.readline()
                if not line:
                    raise RuntimeError("the emulator exited before it was ready")
                k, _, v = line.strip().partition("=")
                env[k] = v
            yield cls(
                proc, env["CODER_URL"], env["CODER_ORG_ID"], env["CODER_EMULATOR_ADMIN_TOKEN"]
            )
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _get(self, path: str, query: list[tuple[str, str]] | None = None) -> Any:
        url = f"{self.base_url}/__emulator__/{path}"
        if query:
            url += "?" + urlencode(query)
        req = Request(url, headers={"X-Emulator-Admin-Token": self.admin_token})
        with urlopen(req, timeout=60) as resp:
            return json.loads(resp.read())

    def event_log(self, kinds: list[str] | None = None, since: int = 0) -> list[dict[str, Any]]:
        """Events (``time``, ``mono``, ``kind``, ``chat_id``, ``details``), oldest first;
        ``since`` skips that many of the (filtered) log."""
        q = [("kind", k) for k in kinds or []] + [("since", str(since))]
        return list(self._get("events", q))

    def chats(self) -> list[dict[str, Any]]:
        return list(self._get("chats"))


def process_cpu_s(pid: int) -> float:
    """CPU time (user + system) of one process, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def postmaster_pid(admin_url: str) -> int:
    """The pid of the cluster's postmaster (the parent of a backend), from ``admin_url``."""
    import asyncio

    import asyncpg
    from sqlalchemy.engine import make_url

    url = make_url(admin_url)

    async def backend() -> int:
        conn = await asyncpg.connect(
            host=url.host, port=url.port, user=url.username, database=url.database
        )
        try:
            pid = int(await conn.fetchval("SELECT pg_backend_pid()"))
            # read while connected: the backend exits with the connection
            stat = Path(f"/proc/{pid}/stat").read_text()  # noqa: ASYNC240 (procfs, instant)
            return int(stat.rsplit(")", 1)[1].split()[1])
        finally:
            await conn.close()

    return asyncio.run(backend())


def postgres_cpu_s(postmaster: int) -> float:
    """CPU seconds of a PostgreSQL cluster: its postmaster, the backends and helpers it
    has reaped (cutime, cstime) and those alive now (its direct children)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        pid = int(stat.parent.name)
        if pid == postmaster:
            total += sum(int(f) for f in fields[11:15])
        elif int(fields[1]) == postmaster:
            total += int(fields[11]) + int(fields[12])
    return total / tick


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])
