"""Child processes of the crash matrix: run a workflow and SIGKILL itself at a named point.

Two modes:

* ``python crash_child.py`` — one run; ``CRASH_AT`` = ``<point>:<occurrence>``
  (empty = never; ``<point>:<n>+<seconds>`` kills that long after the point), ``CRASH_SPEC`` = JSON ``{"workflow_id", "steps", "settings"}``.
* ``python crash_child.py --serve`` — a fork server: imports Prefect and the flows
  once (≈ 2 s), then reads one JSON request per line from stdin
  (``{"id", "crash_at", "spec"}``), forks a fresh process per request and answers
  ``{"id", "rc"}`` on stdout when that process ends. The forked process is the
  one that runs the step and is SIGKILLed; the fork only saves the import.

Exit codes: -9 killed as planned, 0 the workflow finished, 3 it raised. The
environment carries ``PREFECT_API_URL`` (the test server) and ``PAYMENTS_URL``.
The kill uses the documented test seam ``coder_chat.crash_safe.add_crash_hook``:
no monkeypatching, a real ``SIGKILL`` — no ``finally`` block runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import sys
import threading
from typing import Any


def run_once(crash_at: str, spec: dict[str, Any]) -> int:
    from coder_chat.crash_safe import add_crash_hook
    from prefect_coder.flows.deployments.agent_workflow import agent_workflow
    from prefect_coder.flows.parts.params import Step, WorkflowSettings

    name, _, nth = crash_at.partition(":")
    # "<point>:<n>+<seconds>": SIGKILL that long AFTER the point (e.g. with a request
    # in flight), from a timer thread, whatever the event loop is doing then.
    nth, _, delay = nth.partition("+")
    wanted = int(nth or 1)
    seen: dict[str, int] = {}

    def kill() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def hook(point: str) -> None:
        seen[point] = seen.get(point, 0) + 1
        if point == name and seen[point] == wanted:
            if delay:
                threading.Timer(float(delay), kill).start()
            else:
                kill()

    if name:
        add_crash_hook(hook)
    steps = [Step.model_validate(s) for s in spec["steps"]]
    settings = WorkflowSettings.model_validate(spec["settings"])
    try:
        asyncio.run(agent_workflow(spec["workflow_id"], steps, settings))
    except Exception as exc:
        print(f"RAISED {type(exc).__name__}: {exc}", file=sys.stderr)
        return 3
    return 0


def serve() -> int:
    # Import everything a run needs BEFORE forking; start no thread or loop here.
    import payment_tools  # noqa: F401

    import coder_chat.crash_safe  # noqa: F401
    import prefect_coder.flows.deployments.agent_workflow  # noqa: F401

    print(json.dumps({"ready": True}), flush=True)
    running: dict[int, Any] = {}
    buf = b""
    stdin = sys.stdin.fileno()
    open_input = True
    while open_input or running:
        if open_input:
            readable, _, _ = select.select([stdin], [], [], 0.02)
            if readable:
                chunk = os.read(stdin, 65536)
                if not chunk:
                    open_input = False
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if not line.strip():
                        continue
                    req = json.loads(line)
                    pid = os.fork()
                    if pid == 0:  # the child: the process that runs (and crashes) the step
                        os.dup2(2, 1)  # stdout carries the protocol: only the server writes it
                        code = 1
                        try:
                            code = run_once(req["crash_at"], req["spec"])
                        finally:
                            os._exit(code)
                    running[pid] = req["id"]
        else:
            select.select([], [], [], 0.02)
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            print(json.dumps({"id": running.pop(pid), "rc": rc}), flush=True)
    return 0


if __name__ == "__main__":
    if "--serve" in sys.argv:
        sys.exit(serve())
    sys.exit(run_once(os.environ.get("CRASH_AT", ""), json.loads(os.environ["CRASH_SPEC"])))
