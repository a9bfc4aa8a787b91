"""``python -m prefect.engine`` for a process worker's flow run, forked from the warm process.

The tests' process workers start this file as each flow run's ``command`` (instead of
``python -m prefect.engine``, which imports Prefect and this project again: ≈ 3-4 CPU-s
per flow run on the test machine, the largest single cost of the worker-based tests).
It imports nothing but the standard library: it hands its stdin/stdout/stderr, argv,
environment and working directory to the session's warm process
(``tests/warm_python.py``, socket path in ``CODER_TEST_WARM_SOCKET``), which forks the
engine with them, and then stays the worker's child until the engine ends, ending
with the engine's exit status (killed by the same signal when the engine was killed).

What the worker and the tests see is what they would see of the engine itself: a
child of the worker that lives as long as the flow run and ends with its status. A
SIGTERM/SIGINT the worker sends (a cancellation) is passed on to the engine. A
``kill -9`` of this process (or of its worker's process group) makes the warm process
SIGKILL the engine at once, so the flow run stops with no ``finally`` run, as it would.

Without the socket, when the warm process refuses (the flow run's import-time
``PREFECT_*`` settings differ from its own) or cannot be reached, this process
becomes ``python -m prefect.engine`` itself (``exec``): the same run, only slower.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from pathlib import Path
from typing import BinaryIO

SOCKET_ENV = "CODER_TEST_WARM_SOCKET"
#: What runs without arguments (the worker's ``command``); ``warm_launch.py -c CODE``
#: / ``-m MODULE`` run that instead (tests/test_warm_launch.py).
ENGINE_ARGV = ["-m", "prefect.engine"]


def _ask(path: str, argv: list[str]) -> tuple[socket.socket, BinaryIO, int] | None:
    """The engine's pid and the connection to watch, or None (run it here instead)."""
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        request = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}
        socket.send_fds(sock, [b"L"], [0, 1, 2])
        sock.sendall((json.dumps(request) + "\n").encode())
        reader = sock.makefile("rb")
        reply = json.loads(reader.readline() or b"{}")
    except (OSError, ValueError) as exc:
        # Said, so a log shows why a run was slow (a fresh interpreter) or a test
        # that needs the fork failed: the warm process is gone or refused us.
        print(f"warm_launch: no warm process at {path} ({exc!r}); a fresh engine", file=sys.stderr)
        return None
    pid = reply.get("pid")
    if not pid:
        if reply.get("differ"):
            print(
                f"warm_launch: fresh engine, import-time settings differ: {reply['differ']}",
                file=sys.stderr,
            )
        sock.close()
        return None
    return sock, reader, int(pid)


def behind(launcher_pid: int) -> int:
    """The pid of the process a launcher stands for: the fork it asked for, or the
    launcher itself when it became the program (``exec``) or is not a launcher."""
    path = os.environ.get(SOCKET_ENV)
    if path:
        try:
            return int(Path(path).with_name(f"launcher-{launcher_pid}").read_text())
        except (OSError, ValueError):
            pass
    return launcher_pid


def main() -> None:
    argv = sys.argv[1:] or ENGINE_ARGV
    # The handlers go in before the fork is asked for: the fork can run (and its parent
    # be signalled) before this process has read the fork's pid. A signal that comes
    # before the pid is known is passed on once it is.
    target: list[int] = []
    pending: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        if not target:
            pending.append(signum)
            return
        try:
            os.kill(target[0], signum)
        except ProcessLookupError:
            pass

    forwarded = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    for signum in forwarded:
        signal.signal(signum, forward)
    path = os.environ.get(SOCKET_ENV)
    asked = _ask(path, argv) if path else None
    if asked is None:
        if pending:  # signalled before it became the program: as if it had no handler
            _die_by(pending[0])
        for signum in forwarded:
            signal.signal(signum, signal.SIG_DFL)
        os.execv(sys.executable, [sys.executable, *argv])
    _sock, reader, pid = asked
    target.append(pid)
    for signum in pending:
        forward(signum, None)
    line = reader.readline()
    rc = int(json.loads(line)["rc"]) if line else -int(signal.SIGKILL)
    if rc < 0:
        _die_by(-rc)  # end as the engine ended: by its signal
    sys.exit(rc)


def _die_by(signum: int) -> None:
    if signum != signal.SIGKILL:  # (SIGKILL has no handler to reset)
        signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    sys.exit(128 + signum)  # (a signal whose default is to be ignored)


if __name__ == "__main__":
    main()
