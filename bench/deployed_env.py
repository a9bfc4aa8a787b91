"""A deployed prefect-coder on this machine, as a user sets it up, for benchmarks.

Reusable harness (``bench/recovery.py --deployed`` uses it; other benches may):

* a private PostgreSQL cluster (``initdb -A trust`` into a temp dir, ``pg_ctl start``
  on a free 127.0.0.1 port, no fsync: thrown away at the end) — binaries from
  ``$PREFECT_CODER_TEST_PG_BIN`` or the newest ``/usr/lib/postgresql/*/bin``;
* ``prefect server start`` (all its services: triggers, actions, scheduler …) on a
  database of that cluster, with ``PREFECT_HOME`` in the temp dir;
* the chatd emulator as its own process (``coder-chat-emulator``), read back through
  its control API (:class:`EmulatorProcess`: chats, messages, event log);
* the blocks a user saves (``CoderCredentials`` named ``coder``, what ``prefect.yaml``
  names), ``prefect work-pool create coder-process --type process``,
  ``prefect --no-prompt deploy --all`` from the repository root and
  ``prefect-coder automations apply`` (the zombie-run automation);
* ``prefect worker start`` process workers, each in its own process group
  (:class:`WorkerProcess`: SIGKILL of one flow-run process, or of the worker with
  its children = a lost host).

Usage::

    async with deployed_env(tmp, worker_env={...}) as env:
        w = await env.start_worker("w1")
        async with env.prefect():          # PREFECT_API_URL → this server
            run = await run_deployment("agent-workflow/agent-workflow", ...)

Everything it starts is stopped on exit (by process id / process group). The
deployments use ``prefect.yaml``'s defaults: ``store_block: null`` is the SQLite
store under the workers' ``PREFECT_HOME`` (one machine), results go to
``PREFECT_HOME/storage`` (:attr:`DeployedEnv.results_dir`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pg_cluster import PgCluster, free_port

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
POOL = "coder-process"  # prefect.yaml's work pool

__all__ = [
    "POOL",
    "DeployedEnv",
    "EmulatorProcess",
    "PgCluster",
    "WorkerProcess",
    "children_of",
    "deployed_env",
    "parent_of",
    "snapshot_head",
]


def parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` (Linux /proc), or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and parent_of(int(entry.name)) == pid:
            out.append(int(entry.name))
    return out


# ------------------------------------------------------------------------- PostgreSQL


# --------------------------------------------------------------------------- emulator


@dataclass
class EmulatorProcess:
    """``coder-chat-emulator`` in its own process, and a client of its control API."""

    proc: asyncio.subprocess.Process
    base_url: str
    organization_id: str
    token: str
    admin_token: str

    @classmethod
    async def start(cls, token: str, log: Path, *extra: str) -> EmulatorProcess:
        err = log.open("wb")
        proc = await asyncio.create_subprocess_exec(
            str(BIN / "coder-chat-emulator"), "--token", token, *extra,
            stdout=asyncio.subprocess.PIPE, stderr=err, start_new_session=True,
        )  # fmt: skip
        err.close()
        assert proc.stdout is not None
        values: dict[str, str] = {}
        while "CODER_EMULATOR_ADMIN_TOKEN" not in values:
            line = await asyncio.wait_for(proc.stdout.readline(), 120)
            if not line:
                raise RuntimeError(f"the emulator exited; see {log}")
            key, _, value = line.decode().strip().partition("=")
            values[key] = value
        return cls(
            proc, values["CODER_URL"], values["CODER_ORG_ID"], token,
            values["CODER_EMULATOR_ADMIN_TOKEN"],
        )  # fmt: skip

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()

    def _get(self, path: str) -> Any:
        req = urllib.request.Request(
            f"{self.base_url}/__emulator__{path}",
            headers={"X-Emulator-Admin-Token": self.admin_token},
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())

    async def get(self, path: str) -> Any:
        """GET a control-API path (``/chats``, ``/events?since=N`` …) off the event loop."""
        return await asyncio.to_thread(self._get, path)

    async def chats(self) -> list[dict[str, Any]]:
        return list(await self.get("/chats"))

    async def messages(self, chat_id: str) -> list[dict[str, Any]]:
        return list(await self.get(f"/chats/{chat_id}/messages?include_system=false"))

    async def events(self, since: int = 0) -> list[dict[str, Any]]:
        """The emulator's event log (``time`` is wall-clock, comparable to time.time())."""
        return list(await self.get(f"/events?since={since}"))


# ---------------------------------------------------------------------------- workers


@dataclass
class WorkerProcess:
    """A ``prefect worker start`` process in its own process group."""

    name: str
    proc: asyncio.subprocess.Process
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill_host(self) -> list[int]:
        """A lost host: SIGKILL the worker and every flow-run process it started."""
        pids = [self.pid, *children_of(self.pid)]
        pids += [g for c in pids[1:] for g in children_of(c)]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.kill_host()
        await self.proc.wait()


# ------------------------------------------------------------------------ environment


@dataclass
class DeployedEnv:
    """What :func:`deployed_env` set up; see the module docstring."""

    tmp: Path
    api_url: str
    env: dict[str, str]  # the environment of the CLI calls and the workers
    emulator: EmulatorProcess
    pg: PgCluster
    workers: list[WorkerProcess] = field(default_factory=list)
    server: asyncio.subprocess.Process | None = None
    source: Path = ROOT

    @property
    def results_dir(self) -> Path:
        """Where flow runs persist results (PREFECT_HOME/storage, Prefect's default)."""
        return Path(self.env["PREFECT_HOME"]) / "storage"

    @contextlib.contextmanager
    def prefect(self) -> Iterator[None]:
        """Point this process's Prefect client at the server."""
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings(updates={PREFECT_API_URL: self.api_url}):
            yield

    async def cli(self, *args: str, log: Path | None = None, limit_s: float = 600) -> str:
        """Run a command (e.g. ``prefect deploy``) with the deployment's environment."""
        proc = await asyncio.create_subprocess_exec(
            *args, cwd=str(self.source), env=self.env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        out, _ = await asyncio.wait_for(proc.communicate(), limit_s)
        text = out.decode(errors="replace")
        if log is not None:
            with log.open("a") as f:
                f.write(f"$ {shlex.join(args)}\n{text}\n")
        if proc.returncode != 0:
            raise RuntimeError(f"{shlex.join(args)} failed ({proc.returncode}):\n{text[-3000:]}")
        return text

    async def start_worker(self, name: str, *extra: str) -> WorkerProcess:
        """``prefect worker start --pool coder-process`` (own process group)."""
        log = self.tmp / f"worker-{name}.log"
        out = log.open("ab")
        proc = await asyncio.create_subprocess_exec(
            str(BIN / "prefect"), "worker", "start", "--pool", POOL, "--type", "process",
            "--name", name, *extra,
            env=self.env, cwd=str(self.source), stdout=out, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        out.close()
        worker = WorkerProcess(name, proc, log)
        self.workers.append(worker)
        return worker

    async def set_pool_command(self, command: str | None) -> None:
        """Set the default ``command`` job variable of the pool's base job template
        (an operator's setting, not prefect.yaml's). With a command, a process worker
        starts the flow run as that one process (``python -m prefect.engine`` runs the
        pull steps itself); without one, Prefect 3.9 first runs a separate workspace
        resolver process for the pull steps, then the engine process."""
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.actions import WorkPoolUpdate

        with self.prefect():
            async with get_client() as client:
                pool = await client.read_work_pool(POOL)
                template = dict(pool.base_job_template)
                template["variables"]["properties"]["command"]["default"] = command
                await client.update_work_pool(POOL, WorkPoolUpdate(base_job_template=template))

    def worker_of(self, pid: int) -> WorkerProcess | None:
        """The live worker whose child (or grandchild) is process ``pid``."""
        up = parent_of(pid)
        for _ in range(3):
            for w in self.workers:
                if w.proc.returncode is None and up == w.pid:
                    return w
            if up is None:
                return None
            up = parent_of(up)
        return None


def snapshot_head(dest: Path) -> str:
    """Extract the repository's HEAD commit into ``dest`` (``git archive``: the work
    tree and the index are not touched); returns the commit id.

    Flow-run processes import the product from the directory they run in: running
    them from a snapshot keeps half-saved edits in the shared work tree out of a
    measurement (``deployed_env(source=...)``)."""
    dest.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    archive = subprocess.Popen(
        ["git", "-C", str(ROOT), "archive", "--format=tar", commit], stdout=subprocess.PIPE
    )
    subprocess.run(["tar", "-x", "-C", str(dest)], stdin=archive.stdout, check=True)
    assert archive.stdout is not None
    archive.stdout.close()
    if archive.wait() != 0:
        raise RuntimeError("git archive failed")
    return commit


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=3) as r:
            return bool(r.status == 200)
    except Exception:
        return False


@contextlib.asynccontextmanager
async def deployed_env(
    tmp: Path,
    *,
    worker_env: dict[str, str] | None = None,
    emulator_args: tuple[str, ...] = (),
    heartbeat_s: int = 30,
    missed_heartbeats: int | None = None,
    server_timeout: float = 300,
    source: Path = ROOT,
) -> AsyncIterator[DeployedEnv]:
    """Start PostgreSQL, ``prefect server start``, the emulator; save the ``coder``
    credentials block; create the pool, ``prefect deploy --all``, apply the zombie
    automation. ``worker_env`` is added to the environment of every CLI call and
    worker (tool modules, PREFECT_WORKER_QUERY_SECONDS …). Workers: ``start_worker``.

    ``source``: the checkout deployed from and run in (``prefect deploy`` there, its
    ``prefect.yaml``; it leads ``PYTHONPATH`` so flow runs import the product from
    it, ahead of the editable install) — e.g. a :func:`snapshot_head` directory.
    """
    home = tmp / "prefect-home"
    await asyncio.to_thread(home.mkdir, parents=True, exist_ok=True)
    pg = PgCluster(tmp / "pg")
    await asyncio.to_thread(pg.start)
    emulator: EmulatorProcess | None = None
    env_obj: DeployedEnv | None = None
    server: asyncio.subprocess.Process | None = None
    try:
        db_url = await pg.create_database("prefect")
        port = free_port()
        api_url = f"http://127.0.0.1:{port}/api"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "CODER_"))}
        env.update(
            PREFECT_HOME=str(home),
            PREFECT_API_URL=api_url,
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
            PREFECT_CLI_PROMPT="false",
            PREFECT_CLI_COLORS="false",
            PREFECT_CLI_WRAP_LINES="false",
            PYTHONUNBUFFERED="1",
            COLUMNS="200",
        )
        env.update(worker_env or {})
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(source), env.get("PYTHONPATH", "")) if p
        )
        # prefect.yaml's pull step is `set_working_directory: "{{ $PWD }}"`, resolved at
        # deploy time from the PWD *variable*, which a subprocess inherits from this
        # shell, not from its cwd: without this the flow runs chdir into the shared work
        # tree and import half-saved flows from it beside the snapshot's coder_chat.
        env["PWD"] = str(source)
        server_log = (tmp / "server.log").open("wb")
        server = await asyncio.create_subprocess_exec(
            str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port),
            env={
                **env,
                "PREFECT_SERVER_DATABASE_CONNECTION_URL": db_url,
                "PREFECT_UI_ENABLED": "false",
                "PREFECT_LOGGING_LEVEL": "INFO",
            },
            cwd=str(tmp), stdout=server_log, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        server_log.close()
        deadline = time.monotonic() + server_timeout
        while not await asyncio.to_thread(_healthy, api_url):
            if server.returncode is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prefect server did not start; see {tmp / 'server.log'}")
            await asyncio.sleep(1)

        token = f"bench-{uuid.uuid4().hex}"
        emulator = await EmulatorProcess.start(token, tmp / "emulator.log", *emulator_args)
        env_obj = DeployedEnv(tmp, api_url, env, emulator, pg, server=server, source=source)
        with env_obj.prefect():
            from pydantic import SecretStr

            from prefect_coder.blocks import CoderCredentials

            # What a user saves once (docs/deploy.md step 2); prefect.yaml names it.
            await CoderCredentials(
                base_url=emulator.base_url,
                organization_id=uuid.UUID(emulator.organization_id),
                token=SecretStr(token),
            ).save("coder", overwrite=True)
        deploy_log = tmp / "deploy.log"
        await env_obj.cli(str(BIN / "prefect"), "work-pool", "create", POOL, "--type", "process",
                          log=deploy_log)  # fmt: skip
        await env_obj.cli(str(BIN / "prefect"), "--no-prompt", "deploy", "--all", log=deploy_log)
        apply = [str(BIN / "python"), "-m", "prefect_coder.cli", "automations", "apply",
                 "--heartbeat-seconds", str(heartbeat_s)]  # fmt: skip
        if missed_heartbeats is not None:
            apply += ["--missed", str(missed_heartbeats)]
        await env_obj.cli(*apply, log=deploy_log)
        yield env_obj
    finally:
        if env_obj is not None:
            for w in env_obj.workers:
                await w.stop()
        if emulator is not None:
            await emulator.stop()
        if server is not None and server.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(server.wait(), 20)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(server.pid, signal.SIGKILL)
                await server.wait()
        await asyncio.to_thread(pg.stop)
