"""A private Prefect API server a test may kill and start again on the same port.

The session's server (tests/conftest.py) is shared by every test and must never go
down; this one is a test's own: uvicorn on Prefect's ``create_app`` (what
``prefect server start`` and Prefect's ``SubprocessASGIServer`` run), with its own
``PREFECT_HOME`` and SQLite database under a temp dir, on a port chosen once.
:meth:`kill` ends it with a real signal (SIGKILL by default: nothing is flushed);
:meth:`start` brings it back on the same port and the same database, as an
operator's restart (or a crashed pod's replacement) would.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

__all__ = ["PrivatePrefectServer", "running_prefect_server"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivatePrefectServer:
    """One Prefect API server process at a time, on a fixed port and database."""

    def __init__(
        self, root: Path, database_url: str | None = None, *, migrated: bool = False
    ) -> None:
        """``database_url``: the server's database (default: a SQLite file under
        ``root``, its schema copied from a cache); ``migrated``: that database already
        holds a migrated schema and Prefect's block types (a restored dump), so even
        the first start skips the migrations."""
        self.root = root
        self.home = root / "prefect-home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.sqlite = database_url is None
        self.database_url = database_url or f"sqlite+aiosqlite:///{root / 'prefect.db'}"
        self.migrated = migrated
        self.port = _free_port()
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self.log_path = root / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def env(self) -> dict[str, str]:
        """What a client of this server (a flow-run process) runs with."""
        base = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        # Keep the session's trust store (tests/conftest.py: one certificate).
        for k in ("PREFECT_API_SSL_CERT_FILE",):
            if k in os.environ:
                base[k] = os.environ[k]
        return {
            **base,
            "PREFECT_HOME": str(self.home),
            "PREFECT_API_URL": self.api_url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        }

    @staticmethod
    def _schema_cache() -> Path:
        """A migrated, empty database kept in the virtualenv between sessions: a fresh
        SQLite schema costs ~200 migrations (≈ 10 s of a busy machine) per session."""
        import prefect

        return Path(sys.prefix) / ".prefect-coder-test-cache" / f"sqlite-{prefect.__version__}.db"

    def start(self, timeout: float = 120.0) -> float:
        """Start the server (again) on the same port and database; seconds until healthy."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        import prefect

        database = self.root / "prefect.db"
        cache = self._schema_cache()
        fresh = self.sqlite and not self.starts and not database.exists()
        from_cache = fresh and cache.is_file()
        if from_cache:
            shutil.copyfile(cache, database)

        env = {
            **self.env(),
            "PREFECT_UI_ENABLED": "0",
            "PREFECT_SERVER_DATABASE_CONNECTION_URL": self.database_url,
            "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL": "1",
            "PREFECT__SERVER_EPHEMERAL": "1",
            "PREFECT__SERVER_FINAL": "1",
            "PREFECT_LOGGING_LEVEL": "WARNING",
            # Services these tests never use: less CPU on a shared machine.
            "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "false",
            "PREFECT_SERVER_SERVICES_LATE_RUNS_ENABLED": "false",
            "PREFECT_SERVER_SERVICES_FOREMAN_ENABLED": "false",
            "PREFECT_SERVER_SERVICES_CANCELLATION_CLEANUP_ENABLED": "false",
            "PREFECT_SERVER_SERVICES_PAUSE_EXPIRATIONS_ENABLED": "false",
            "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "false",
        }
        if self.starts or from_cache or self.migrated:
            # A restart finds its schema and block types in place: skip the checks
            # (seconds of start-up on a busy machine, not part of what is tested).
            env["PREFECT_SERVER_DATABASE_MIGRATE_ON_START"] = "false"
            env["PREFECT_SERVER_REGISTER_BLOCKS_ON_START"] = "false"
        env.pop("PREFECT_API_URL")
        began = time.monotonic()
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "--app-dir",
                 str(Path(prefect.__file__).parent.parent), "--factory",
                 "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port",
                 str(self.port), "--log-level", "error", "--lifespan", "on"],
                env=env, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        self.starts += 1
        deadline = began + timeout
        with httpx.Client() as client:
            while True:
                rc = self.proc.poll()
                if rc is not None:
                    raise RuntimeError(
                        f"the private Prefect server exited with {rc}: "
                        + self.log_path.read_text()[-2000:]
                    )
                with contextlib.suppress(httpx.TransportError):
                    if client.get(f"{self.api_url}/health", timeout=2).status_code == 200:
                        if fresh and not from_cache:
                            self._save_schema(database, cache)
                        return time.monotonic() - began
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the private Prefect server was not healthy in {timeout} s")
                time.sleep(0.05)

    @staticmethod
    def _save_schema(database: Path, cache: Path) -> None:
        """Copy the just-migrated database (SQLite's backup: consistent while the server
        runs), atomically: side-by-side sessions may write it at once."""
        with contextlib.suppress(OSError, sqlite3.Error):
            cache.parent.mkdir(parents=True, exist_ok=True)
            part = cache.with_name(f"{cache.name}.{os.getpid()}.part")
            with contextlib.closing(sqlite3.connect(database)) as src:
                with contextlib.closing(sqlite3.connect(part)) as dst:
                    src.backup(dst)
            part.replace(cache)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """End the server with ``sig`` and wait until its port refuses connections."""
        assert self.proc is not None
        self.proc.send_signal(sig)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def close(self) -> None:
        if self.running:
            self.kill(signal.SIGKILL)


@contextlib.contextmanager
def running_prefect_server(
    root: Path, database_url: str | None = None, *, migrated: bool = False, timeout: float = 120.0
) -> Iterator[PrivatePrefectServer]:
    """A started :class:`PrivatePrefectServer` (see its arguments), closed afterwards."""
    server = PrivatePrefectServer(root, database_url, migrated=migrated)
    try:
        server.start(timeout)
        yield server
    finally:
        server.close()
