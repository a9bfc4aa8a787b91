"""Fresh Python processes without paying Prefect's import each time.

A test that stands a child process in for a worker's flow-run process (a resume in
a new process, single flight across processes, a SIGKILL mid-tool, a suspended
flow run continued by ``python -m prefect.engine``) needs a *separate process*:
its own pid, memory, sockets and event loop, killable with a real SIGKILL. It
does not need a new interpreter to import Prefect and this project again — about
4.5 s of CPU per child on the test machine, the biggest single cost of those
tests. So one warm process per test session imports them once and *forks* a
child per request; the child then runs the requested ``-c CODE`` / ``-m MODULE``
/ ``SCRIPT`` as ``__main__`` with the requested argv, environment, working
directory and ``PYTHONPATH``, and exits like an interpreter does (non-daemon
threads joined, ``atexit`` handlers run, stdio flushed).

What a fork cannot give is an import-time decision made under a different
environment: Prefect reads its ``PREFECT_*`` settings (and sets up logging) when
it is imported. So a request whose ``PREFECT_*`` variables differ from the warm
process's runs in a real fresh interpreter instead (``subprocess``), as does every
request when the warm process is not up. ``PREFECT_CODER_*`` variables are read by
this project at call time and ``PREFECT__FLOW_RUN_ID`` by the engine's
``__main__``, so those may differ.

The warm process imports only installed packages (prefect, prefect_coder,
coder_chat), never a test helper module: each child imports its own helpers from
its own ``PYTHONPATH``, as a fresh interpreter would. It starts no thread and no
event loop before forking.

Protocol (one JSON object per line): request ``{"id", "argv", "env", "cwd",
"out", "err"}`` on the warm process's stdin; answers ``{"id", "pid"}`` when
forked and ``{"id", "rc"}`` when that child ended (``rc`` = ``-N`` if killed by
signal N). The child's stdout/stderr go to the files ``out``/``err``.

Flow runs that a *process worker* starts (tests/fanout's deployments) reach the warm
process through its unix socket instead (:data:`SOCKET_ENV`, ``tests/warm_launch.py``):
the worker starts the small launcher as the flow run's ``command``; the launcher hands
its stdin/stdout/stderr over (``SCM_RIGHTS``) with its argv, environment and working
directory, and the warm process forks the engine with those as its stdio. The launcher
stays the worker's child for the run's whole life and ends with the engine's exit
status (by the same signal when the engine was killed). When the launcher dies — a
``kill -9`` of it, of its worker's process group — the warm process SIGKILLs the
engine at once (it watches the launcher's end of the socket), so a kill of "the
flow-run process" still stops the flow run with no ``finally`` run. A request whose
import-time ``PREFECT_*`` settings differ from the warm process's is refused and the
launcher becomes ``python -m prefect.engine`` itself (``exec``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Environment variables a fork may not change (read by Prefect at import time).
_FIXED_PREFIXES = ("PREFECT_",)
_FREE_PREFIXES = ("PREFECT_CODER_", "PREFECT__")
#: Also free for a launcher's request: whether an ephemeral server may start (a worker
#: writes it out for its flow runs; they, like the warm process, have ``PREFECT_API_URL``
#: — compared — so none starts either way) and, unless the request runs a worker
#: itself, the worker's own settings (its poll and heartbeat intervals), which the
#: worker hands down to its flow runs' environment and the engine never reads.
_LAUNCH_FREE_PREFIXES = (*_FREE_PREFIXES, "PREFECT_SERVER_EPHEMERAL_ENABLED")
_ENGINE_FREE_PREFIXES = (*_LAUNCH_FREE_PREFIXES, "PREFECT_WORKER_")


def _launch_free(argv: list[str]) -> tuple[str, ...]:
    runs_worker = argv[:3] == ["-m", "prefect", "worker"]
    return _LAUNCH_FREE_PREFIXES if runs_worker else _ENGINE_FREE_PREFIXES


#: The environment variable that carries the warm process's unix socket path to
#: ``tests/warm_launch.py`` (set by the ``warm_python`` fixture for the session).
SOCKET_ENV = "CODER_TEST_WARM_SOCKET"


def _import_time_env(env: dict[str, str], free: tuple[str, ...] = _FREE_PREFIXES) -> dict[str, str]:
    return {
        k: v for k, v in env.items() if k.startswith(_FIXED_PREFIXES) and not k.startswith(free)
    }


@dataclass(frozen=True)
class Completed:
    """What ``subprocess.run(..., capture_output=True, text=True)`` would return."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    forked: bool  # False: ran in a fresh interpreter (PREFECT_* differed, or no warm process)


class Child:
    """A running child: ``pid``, ``wait()`` (sync) / ``await communicate()`` (async)."""

    def __init__(
        self,
        args: list[str],
        pid: int,
        done: concurrent.futures.Future[int],
        out: Path,
        err: Path,
        forked: bool,
    ) -> None:
        self.args = args
        self.pid = pid
        self._done = done
        self._out = out
        self._err = err
        self.forked = forked
        self.returncode: int | None = None

    def _result(self, rc: int) -> Completed:
        self.returncode = rc
        out = self._out.read_text(errors="replace")
        err = self._err.read_text(errors="replace")
        with contextlib.suppress(OSError):
            self._out.unlink()
            self._err.unlink()
        return Completed(self.args, rc, out, err, self.forked)

    def poll(self) -> int | None:
        """The exit status if the child has ended (``-N``: killed by signal N), else None."""
        return self._done.result() if self._done.done() else None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> Completed:
        try:
            rc = self._done.result(timeout)
        except concurrent.futures.TimeoutError:
            self.kill()
            self._done.result(30)
            raise subprocess.TimeoutExpired(self.args, timeout or 0) from None
        return self._result(rc)

    async def communicate(self, limit_s: float | None = None) -> Completed:
        import asyncio

        done = asyncio.wrap_future(self._done)
        try:
            # shield: a timeout must not cancel the future the reader thread resolves.
            rc = await asyncio.wait_for(asyncio.shield(done), limit_s)
        except TimeoutError:
            self.kill()
            await asyncio.wait_for(done, 30)
            raise subprocess.TimeoutExpired(self.args, limit_s or 0) from None
        return self._result(rc)


class WarmPython:
    """Client of one warm process (see the module docstring); thread-safe, loop-free."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = dict(env)
        self._tmp = Path(tempfile.mkdtemp(prefix="warm-python-"))
        self._lock = threading.Lock()
        self._next = 0
        self._pids: dict[int, concurrent.futures.Future[int]] = {}
        self._dones: dict[int, concurrent.futures.Future[int]] = {}
        self._fallbacks: list[subprocess.Popen[bytes]] = []
        self.forks = 0
        self.fresh = 0
        #: Where flow-run launchers reach the warm process (:data:`SOCKET_ENV`).
        self.socket_path = str(self._tmp / "engine.sock")
        with (self._tmp / "server.err").open("wb") as server_err:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, "--serve", self.socket_path],
                env=self.env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=server_err,
                cwd=str(Path(__file__).resolve().parents[1]),
            )
        self._ready = concurrent.futures.Future[None]()
        self._reader = threading.Thread(target=self._read, name="warm-python", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = json.loads(line)
            if msg.get("ready"):
                self._ready.set_result(None)
                continue
            with self._lock:
                if "pid" in msg:
                    fut, value = self._pids.pop(msg["id"]), int(msg["pid"])
                else:
                    fut, value = self._dones.pop(msg["id"]), int(msg["rc"])
                if not fut.done():
                    fut.set_result(value)
        # The warm process is gone: nothing pending will ever be answered.
        with self._lock:
            for fut in [*self._pids.values(), *self._dones.values()]:
                if not fut.done():
                    fut.set_exception(RuntimeError("the warm Python process exited"))
            if not self._ready.done():
                self._ready.set_exception(RuntimeError(self.server_stderr()))

    def server_stderr(self) -> str:
        with contextlib.suppress(OSError):
            return (self._tmp / "server.err").read_text(errors="replace")[-3000:]
        return ""

    def would_fork(self, env: dict[str, str]) -> bool:
        """Whether a request with ``env`` is forked (its import-time ``PREFECT_*``
        settings are the warm process's) rather than run in a fresh interpreter."""
        free = _ENGINE_FREE_PREFIXES  # (no request of this kind runs a worker)
        return _import_time_env(env, free) == _import_time_env(self.env, free)

    def start(
        self, argv: list[str], *, env: dict[str, str], cwd: str | os.PathLike[str] | None = None
    ) -> Child:
        """Start ``python *argv`` (``argv`` = ``["-c", code, ...]``, ``["-m", mod, ...]``
        or ``[script, ...]``) as a forked child when its ``PREFECT_*`` settings are the
        warm process's, else as a fresh interpreter."""
        with self._lock:
            self._next += 1
            rid = self._next
        out, err = self._tmp / f"{rid}.out", self._tmp / f"{rid}.err"
        cwd = str(cwd or os.getcwd())
        args = [sys.executable, *argv]
        if self.would_fork(env) and self._up():
            pid_fut = concurrent.futures.Future[int]()
            done = concurrent.futures.Future[int]()
            with self._lock:
                self._pids[rid], self._dones[rid] = pid_fut, done
            req = {
                "id": rid,
                "argv": argv,
                "env": env,
                "cwd": cwd,
                "out": str(out),
                "err": str(err),
            }
            assert self.proc.stdin is not None
            with self._lock:
                self.proc.stdin.write((json.dumps(req) + "\n").encode())
                self.proc.stdin.flush()
                self.forks += 1
            return Child(args, pid_fut.result(60), done, out, err, forked=True)
        with out.open("wb") as o, err.open("wb") as e:
            proc = subprocess.Popen(
                args, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=o, stderr=e
            )
        done = concurrent.futures.Future[int]()
        threading.Thread(target=lambda: done.set_result(proc.wait()), daemon=True).start()
        with self._lock:
            self.fresh += 1
            self._fallbacks.append(proc)
        return Child(args, proc.pid, done, out, err, forked=False)

    def run(
        self,
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: str | os.PathLike[str] | None = None,
        timeout: float | None = None,
    ) -> Completed:
        """``start`` and wait (kills the child and raises ``TimeoutExpired`` on timeout)."""
        return self.start(argv, env=env, cwd=cwd).wait(timeout)

    def wait_ready(self, timeout: float = 300) -> bool:
        """Block until the warm process has imported everything (False: it failed;
        every request then runs in a fresh interpreter)."""
        try:
            self._ready.result(timeout)
        except Exception:
            return False
        return self.proc.poll() is None

    def _up(self) -> bool:
        return self._ready.done() and self.wait_ready(0)

    def close(self) -> None:
        early = self.proc.poll()
        if early is not None:
            # It should serve until its input closes (here): every fork the session
            # asked for since then ran in a fresh interpreter instead. Say why.
            warnings.warn(
                f"the warm Python process ended early (status {early}): "
                f"{self.server_stderr() or 'no stderr'}",
                stacklevel=2,
            )
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for p in self._fallbacks:
            if p.poll() is None:
                p.kill()
                p.wait()
        self._reader.join(5)
        for f in self._tmp.iterdir():
            f.unlink()
        self._tmp.rmdir()


# ----------------------------------------------------------------- the warm process


def _run_child(req: dict[str, Any], stdio: list[int] | None = None) -> int:
    """In the forked child: become ``python *argv`` and return its exit status.

    ``stdio``: the launcher's stdin/stdout/stderr (a socket request); else stdin is
    ``/dev/null`` and stdout/stderr go to the request's ``out``/``err`` files."""
    import runpy
    import traceback

    if stdio is not None:
        # Its own process group, as the launcher has: what the launcher's death takes
        # down (the warm process kills the whole group) is this child and everything it
        # started - a worker's flow-run processes, as a kill of the worker's group would.
        os.setsid()
        for target, fd in enumerate(stdio):
            os.dup2(fd, target)
            os.close(fd)
    else:
        fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(fd, 0)
        os.close(fd)
        for target, path in ((1, req["out"]), (2, req["err"])):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(fd, target)
            os.close(fd)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    argv: list[str] = req["argv"]
    # sys.path as a fresh interpreter builds it: argv's entry, then PYTHONPATH, then
    # the installation's own entries (the warm process's PYTHONPATH taken out).
    own = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    warm = set(_WARM_PYTHONPATH)
    base = [p for p in sys.path[1:] if p not in warm]
    if argv[0] == "-c":
        first, sys.argv = "", ["-c", *argv[2:]]
    elif argv[0] == "-m":
        first, sys.argv = os.getcwd(), [argv[1], *argv[2:]]
    else:
        first, sys.argv = str(Path(argv[0]).resolve().parent), list(argv)
    sys.path[:] = [first, *[os.path.abspath(p) for p in own], *base]
    code = 0
    try:
        if argv[0] == "-c":
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        elif argv[0] == "-m":
            # A fresh interpreter has not imported the module it runs as __main__
            # (the warm process may have, through another import).
            sys.modules.pop(argv[1], None)
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    # What interpreter shutdown does before the process ends.
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]
    import atexit

    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    return code


_WARM_PYTHONPATH = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


def _read_launch(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """A launcher's request: its stdio (three fds with the first byte), then one JSON line."""
    _, fds, _, _ = socket.recv_fds(conn, 1, 3)
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = conn.recv(1 << 16)
        if not chunk:
            for fd in fds:
                os.close(fd)
            raise ConnectionError("the launcher went away before its request was complete")
        buf += chunk
    if len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise ConnectionError(f"expected the launcher's 3 stdio fds, got {len(fds)}")
    return json.loads(buf), fds


def _fork(req: dict[str, Any], stdio: list[int] | None, close: list[int]) -> int:
    """Fork a child that runs ``req`` (closing the warm process's own fds ``close``)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            for fd in close:
                with contextlib.suppress(OSError):
                    os.close(fd)
            code = _run_child(req, stdio)
        finally:
            os._exit(code)
    return pid


def _serve_launch(
    conn: socket.socket, listener: socket.socket, own_env: dict[str, str], others: list[Any]
) -> int | None:
    """One launcher's request: fork its engine and answer with the pid (returned), or
    answer why not (None). A launcher may die at any moment of this exchange (a test
    kills a worker and its launchers at once): its connection is then closed and a
    fork made for it killed — never an error that would end the warm process, which
    every later flow run of the session relies on."""
    fds: list[int] = []
    pid: int | None = None
    try:
        req, fds = _read_launch(conn)
        free = _launch_free(req["argv"])
        theirs, own = _import_time_env(req["env"], free), _import_time_env(own_env, free)
        if theirs != own:
            differ = sorted(set(theirs.items()) ^ set(own.items()))
            reply = {"pid": None, "differ": [k for k, _ in differ]}
            conn.sendall((json.dumps(reply) + "\n").encode())
            conn.close()
            return None
        pid = _fork(req, fds, [listener.fileno(), conn.fileno(), *(c.fileno() for c in others)])
        # Who stands for whom, for tests that look a process up by its parent
        # (warm_launch.behind): the launcher's pid from the socket.
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        launcher_pid = struct.unpack("3i", creds)[0]
        # Written whole, then renamed into place: a reader never sees it half-written.
        record = Path(listener.getsockname()).with_name(f"launcher-{launcher_pid}")
        part = record.with_name(f"{record.name}.part")
        part.write_text(str(pid))
        part.replace(record)
        conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
        return pid
    except (OSError, ValueError):
        if pid is not None:  # the launcher went away: what it stood for goes too
            # Its group, and itself: it may not have made its own group yet.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        conn.close()
        return None
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def _serve() -> int:
    # Everything heavy imported BEFORE any fork; no thread or event loop started.
    import anyio._backends._asyncio  # noqa: F401
    import fastapi.encoders  # noqa: F401  (Flow.serialize_parameters, per flow run)
    import prefect.engine  # (the launchers' `-m prefect.engine`)
    import prefect.flow_engine
    import prefect.flows
    import prefect.task_engine
    import prefect.utilities.visualization
    import prefect.workers.process  # noqa: F401  (launched `-m prefect worker start`)
    from prefect.cli import worker as _cli_worker  # noqa: F401

    import coder_chat.crash_safe  # noqa: F401
    import prefect_coder.flows.deployments.agent_fanout
    import prefect_coder.flows.deployments.agent_turn
    import prefect_coder.flows.deployments.agent_workflow
    import prefect_coder.flows.deployments.fanout_shard
    import prefect_coder.flows.deployments.recover_turn  # noqa: F401

    own_env = dict(os.environ)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sys.argv[sys.argv.index("--serve") + 1])
    listener.listen(64)
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    running: dict[int, int] = {}  # pid -> request id (stdin requests)
    launched: dict[int, socket.socket] = {}  # pid -> its launcher's connection
    by_conn: dict[socket.socket, int] = {}
    buf = b""
    stdin = sys.stdin.fileno()
    open_input = True
    while open_input or running or launched:
        watch: list[Any] = [*by_conn]
        if open_input:
            watch += [stdin, listener]
        readable, _, _ = select.select(watch, [], [], 0.02)
        if stdin in readable:
            chunk = os.read(stdin, 1 << 16)
            open_input = bool(chunk)
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if not line.strip():
                    continue
                req = json.loads(line)
                pid = _fork(req, None, [listener.fileno(), *(c.fileno() for c in by_conn)])
                running[pid] = req["id"]
                out.write(json.dumps({"id": req["id"], "pid": pid}) + "\n")
                out.flush()
        if listener in readable:
            conn, _ = listener.accept()
            pid = _serve_launch(conn, listener, own_env, [*by_conn])
            if pid is not None:
                launched[pid], by_conn[conn] = conn, pid
        for conn in [c for c in by_conn if c in readable]:
            # The launcher only ever closes its end: it died (or was killed). The
            # engine it stood for goes with it, as it would in the launcher's process.
            with contextlib.suppress(OSError):
                if conn.recv(1):
                    continue
            pid = by_conn.pop(conn)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if not open_input:
            # The session is over: nothing may outlive it.
            for pid in launched:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
        while running or launched:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            if pid in launched:
                conn = launched.pop(pid)
                by_conn.pop(conn, None)
                with contextlib.suppress(OSError):
                    conn.sendall((json.dumps({"rc": rc}) + "\n").encode())
                conn.close()
            elif pid in running:
                out.write(json.dumps({"id": running.pop(pid), "rc": rc}) + "\n")
                out.flush()
    listener.close()
    return 0


if __name__ == "__main__" and "--serve" in sys.argv:
    sys.exit(_serve())
