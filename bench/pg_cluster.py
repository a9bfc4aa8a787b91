"""A throwaway PostgreSQL cluster for the benchmarks (one implementation for all).

``initdb -A trust`` into a temp dir, ``pg_ctl start`` on a free 127.0.0.1 port with
fsync off — a bench measures our code, not the disk — and an immediate stop plus
removal at the end. Binaries from ``$PREFECT_CODER_TEST_PG_BIN`` or the newest
``/usr/lib/postgresql/*/bin`` (``scripts/test`` installs them). As root the server
runs as ``postgres``: PostgreSQL refuses to run as root.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["PgCluster", "as_pg_user", "free_port", "pg_bindir", "private_postgres"]


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pg_bindir() -> Path:
    """Where ``initdb`` and ``pg_ctl`` are; RuntimeError when nowhere."""
    env = os.environ.get("PREFECT_CODER_TEST_PG_BIN")
    if env:
        return Path(env)
    found = sorted(
        (p for p in Path("/usr/lib/postgresql").glob("*/bin") if (p / "initdb").exists()),
        key=lambda p: [int(x) for x in re.findall(r"\d+", p.parent.name)] or [0],
    )
    if not found:
        raise RuntimeError(
            "PostgreSQL binaries not found: run scripts/test once (it installs them) "
            "or set PREFECT_CODER_TEST_PG_BIN"
        )
    return found[-1]


def as_pg_user(cmd: list[str]) -> list[str]:
    """``cmd`` run as ``postgres`` when this process is root."""
    if os.geteuid() != 0:
        return cmd
    if shutil.which("runuser"):
        return ["runuser", "-u", "postgres", "--", *cmd]
    return ["su", "postgres", "-s", "/bin/sh", "-c", shlex.join(cmd)]


@dataclass
class PgCluster:
    """A throwaway cluster under ``root``; :meth:`create_database` gives asyncpg URLs."""

    root: Path
    port: int = 0
    bindir: Path = field(default_factory=pg_bindir)

    @property
    def admin_url(self) -> str:
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> None:
        subprocess.run(as_pg_user(list(args)), check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            import pwd

            pg = pwd.getpwnam("postgres")
            os.chown(self.root, pg.pw_uid, pg.pw_gid)
        data = self.root / "data"
        self.port = free_port()
        self._run(
            str(self.bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres",
            "-E", "UTF8", "--no-sync",
        )  # fmt: skip
        # 300 connections: a Prefect server with a large pool plus the stores of many
        # workers share the cluster in the fan-out and deployed benches.
        opts = (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 "
            "-c max_connections=300 -c fsync=off -c synchronous_commit=off "
            "-c full_page_writes=off"
        )
        self._run(
            str(self.bindir / "pg_ctl"), "-D", str(data), "-o", opts,
            "-l", str(self.root / "log"), "-w", "start",
        )  # fmt: skip

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._run(
                str(self.bindir / "pg_ctl"),
                "-D",
                str(self.root / "data"),
                "-m",
                "immediate",
                "stop",
            )

    async def create_database(self, name: str) -> str:
        """Create database ``name``; its asyncpg URL."""
        import asyncpg

        conn = await asyncpg.connect(host="127.0.0.1", port=self.port, user="postgres")
        try:
            await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/{name}"


@contextlib.contextmanager
def private_postgres() -> Iterator[str]:
    """A cluster in a fresh temp dir for the block; yields the asyncpg URL of ``postgres``."""
    root = Path(tempfile.mkdtemp(prefix="bench-pg-"))
    cluster = PgCluster(root)
    try:
        cluster.start()
        yield cluster.admin_url
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
