"""tests/warm_launch.py: a process worker's flow run forked from the warm process.

The fan-out tests' process workers start ``warm_launch.py`` as every flow run's
command, so what these tests prove is what those tests rely on: the engine runs in a
fork of the warm process, with the launcher's stdio, argv, environment and working
directory; its exit status (or signal) becomes the launcher's; a signal the worker
sends reaches it; a ``kill -9`` of the launcher kills it; and import-time settings
that differ from the warm process's get a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from warm_launch import behind
from warm_python import SOCKET_ENV, WarmPython

LAUNCH = str(Path(__file__).resolve().parent / "warm_launch.py")


def _env(warm: WarmPython, **extra: str) -> dict[str, str]:
    return {**warm.env, SOCKET_ENV: warm.socket_path, **extra}


def _launch(warm: WarmPython, code: str) -> subprocess.Popen[str]:
    """``warm_launch.py -c code`` with its stdout readable here."""
    return subprocess.Popen(
        [sys.executable, LAUNCH, "-c", code], env=_env(warm), stdout=subprocess.PIPE, text=True
    )


def _gone(pid: int, bound_s: float = 20.0) -> bool:
    """Whether ``pid`` ended (and was reaped) within ``bound_s``."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_the_engine_is_forked_with_the_launchers_stdio_env_and_cwd(
    warm_python: WarmPython, tmp_path: Path
) -> None:
    code = (
        "import os, sys; print(os.getppid(), os.getcwd(), os.environ['MARK'], sys.argv[1:]);"
        "print('to stderr', file=sys.stderr); sys.exit(7)"
    )
    done = subprocess.run(
        [sys.executable, LAUNCH, "-c", code, "a1"],
        env=_env(warm_python, MARK="m-1"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 7, done.stderr
    ppid, cwd, mark, argv = done.stdout.split(maxsplit=3)
    assert int(ppid) == warm_python.proc.pid  # a fork of the warm process, not a fresh one
    assert (cwd, mark, argv.strip()) == (str(tmp_path), "m-1", "['a1']")
    assert "to stderr" in done.stderr


def test_a_killed_launcher_takes_its_engine_with_it(warm_python: WarmPython) -> None:
    code = "import os, time; print(os.getpid(), flush=True); time.sleep(120)"
    launcher = _launch(warm_python, code)
    assert launcher.stdout is not None
    engine = int(launcher.stdout.readline())
    assert engine != launcher.pid
    os.kill(launcher.pid, signal.SIGKILL)
    assert launcher.wait(30) == -signal.SIGKILL
    assert _gone(engine), "the engine outlived its killed launcher"


def test_a_killed_launcher_takes_the_forks_whole_process_group(warm_python: WarmPython) -> None:
    """A forked worker's flow-run processes are its children in its process group: a
    kill of the worker's launcher takes them down too, as a kill of the group would."""
    code = (
        "import os, subprocess, sys, time\n"
        "kid = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "print(os.getpid(), kid.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    launcher = _launch(warm_python, code)
    assert launcher.stdout is not None
    fork, grandchild = map(int, launcher.stdout.readline().split())
    # The warm process records which fork a launcher stands for right after the fork,
    # so the fork may print before the record exists (seen at load 4): wait for it.
    deadline = time.monotonic() + 20
    while behind(launcher.pid) != fork and time.monotonic() < deadline:
        time.sleep(0.02)
    assert behind(launcher.pid) == fork
    assert behind(os.getpid()) == os.getpid()  # not a launcher
    os.kill(launcher.pid, signal.SIGKILL)
    assert launcher.wait(30) == -signal.SIGKILL
    assert _gone(fork), "the fork outlived its killed launcher"
    # The grandchild is nobody's to reap here: gone or a zombie (state Z) is dead.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{grandchild}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            break
        if state == "Z":
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the fork's own child outlived the killed launcher")


def test_a_killed_engine_ends_its_launcher_by_the_same_signal(warm_python: WarmPython) -> None:
    code = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    done = subprocess.run([sys.executable, LAUNCH, "-c", code], env=_env(warm_python), timeout=120)
    assert done.returncode == -signal.SIGKILL


def test_a_signal_to_the_launcher_reaches_the_engine(warm_python: WarmPython) -> None:
    code = (
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))\n"
        "print(os.getpid(), flush=True)\n"
        "time.sleep(120)\n"
    )
    launcher = _launch(warm_python, code)
    assert launcher.stdout is not None
    int(launcher.stdout.readline())  # the handler is installed
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(30) == 3


@pytest.mark.parametrize("env", [{"PREFECT_LOGGING_LEVEL": "DEBUG"}, {SOCKET_ENV: "/nonexistent"}])
def test_other_settings_or_no_warm_process_run_a_fresh_engine(
    warm_python: WarmPython, env: dict[str, str]
) -> None:
    code = "import os; print(os.getpid())"
    launcher = subprocess.Popen(
        [sys.executable, LAUNCH, "-c", code],
        env=_env(warm_python, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 0, err
    assert int(out) == launcher.pid  # the launcher became the interpreter (exec)
    if "PREFECT_LOGGING_LEVEL" in env:
        assert "PREFECT_LOGGING_LEVEL" in err  # says why it did not fork


@pytest.mark.parametrize("whole", [False, True], ids=["mid-request", "before-the-reply"])
def test_a_launcher_gone_mid_exchange_leaves_the_warm_process_serving(
    warm_python: WarmPython, whole: bool
) -> None:
    """A launcher killed while it hands over its request (a test kills a worker and its
    launchers at once) must not end the warm process: every later flow run of the
    session is forked from it. A fork already made for the vanished launcher dies."""
    request = {
        "argv": ["-c", "import time; time.sleep(120)"],
        "env": _env(warm_python),
        "cwd": os.getcwd(),
    }
    data = (json.dumps(request) + "\n").encode()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(warm_python.socket_path)
    socket.send_fds(sock, [b"L"], [0, 1, 2])
    sock.sendall(data if whole else data[: len(data) // 2])
    sock.close()  # gone before the reply (or before the end of its request)
    if whole:
        # The warm process forked for it, found it gone, and killed the fork.
        record = Path(warm_python.socket_path).with_name(f"launcher-{os.getpid()}")
        deadline = time.monotonic() + 60
        while not record.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(int(record.read_text())), "the vanished launcher's fork lives on"
    # Still serving: the next launch is forked from it.
    done = subprocess.run(
        [sys.executable, LAUNCH, "-c", "import os; print(os.getppid())"],
        env=_env(warm_python),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == warm_python.proc.pid
