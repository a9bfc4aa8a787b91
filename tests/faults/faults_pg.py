"""A private PostgreSQL cluster a fault test may stop and start at will.

The session's cluster (``tests/conftest.py``) is shared by every test of a worker:
restarting it would fail them. A fault test makes its own (``initdb`` ≈ 1 s), on
a fixed port, so a restart brings it back at the same URL — as a real
PostgreSQL restart or failover does for the store.
"""

from __future__ import annotations

import os
import pwd
import re
import shlex
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_RUN = {"check": True, "capture_output": True, "text": True, "timeout": 60}


def pg_bindir() -> Path:
    """``$PREFECT_CODER_TEST_PG_BIN``, else the newest ``/usr/lib/postgresql/*/bin``."""
    env = os.environ.get("PREFECT_CODER_TEST_PG_BIN")
    if env:
        return Path(env)
    found = sorted(
        (p for p in Path("/usr/lib/postgresql").glob("*/bin") if (p / "initdb").exists()),
        key=lambda p: [int(x) for x in re.findall(r"\d+", p.parent.name)] or [0],
    )
    if not found:
        raise RuntimeError("PostgreSQL binaries not found: set PREFECT_CODER_TEST_PG_BIN")
    return found[-1]


def _as_pg_user(cmd: list[str]) -> list[str]:
    # PostgreSQL refuses to run as root.
    if os.geteuid() != 0:
        return cmd
    if shutil.which("runuser"):
        return ["runuser", "-u", "postgres", "--", *cmd]
    return ["su", "postgres", "-s", "/bin/sh", "-c", shlex.join(cmd)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivateCluster:
    """``initdb`` + ``pg_ctl`` in a temp dir; :meth:`stop` / :meth:`start` / :meth:`close`."""

    def __init__(self) -> None:
        self.bindir = pg_bindir()
        self.root = Path(tempfile.mkdtemp(prefix="prefect-coder-faults-pg-"))
        self.data = self.root / "data"
        self.port = _free_port()
        if os.geteuid() == 0:
            pg = pwd.getpwnam("postgres")
            os.chown(self.root, pg.pw_uid, pg.pw_gid)
        self._pg(
            "initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "-E", "UTF8",
            "--no-sync",
        )  # fmt: skip
        self.url = f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/postgres"
        self.running = False

    def _pg(self, tool: str, *args: str) -> None:
        subprocess.run(_as_pg_user([str(self.bindir / tool), *args]), **_RUN)  # type: ignore[call-overload]

    def start(self) -> None:
        """Start (or restart after :meth:`stop`) on the same port; waits until it accepts."""
        opts = (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 "
            "-c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        )
        log = str(self.root / "log")
        self._pg("pg_ctl", "-D", str(self.data), "-o", opts, "-l", log, "-w", "start")
        self.running = True

    def stop(self) -> None:
        """``pg_ctl stop -m fast``: every backend is terminated, every client connection
        of the store's pool goes dead — what a restart or a failover does to them."""
        self._pg("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")
        self.running = False

    def close(self) -> None:
        """Stop (immediately) and delete the cluster."""
        try:
            if self.running:
                self._pg("pg_ctl", "-D", str(self.data), "-m", "immediate", "stop")
        finally:
            self.running = False
            shutil.rmtree(self.root, ignore_errors=True)


@contextmanager
def running_cluster() -> Iterator[PrivateCluster]:
    """A started :class:`PrivateCluster`, closed (and deleted) afterwards."""
    cluster = PrivateCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()
