"""Child process of the crash tests: run a workflow and SIGKILL itself at a named point.

``python crash_child.py`` with ``CRASH_AT`` = ``<point>:<occurrence>`` (empty =
never; ``<point>:<n>+<seconds>`` kills that long after the point) and
``CRASH_SPEC`` = JSON ``{"workflow_id", "steps", "settings"}`` (and optionally
``CRASH_RESULTS_DIR``: where the run stores its Prefect results;
``RECOVERY_API_CA_FILE``: the API clients' CA bundle, ``recovery_env.api_ca_bundle``).
The tests start it through ``crash_matrix.ForkServer``: forked from a warm Python process
(``tests/warm_python.py``), so it does not import Prefect again; it is still a
process of its own, and the kill is a real ``SIGKILL``.

Exit codes: -9 killed as planned, 0 the workflow finished, 3 it raised. The
environment carries ``PREFECT_API_URL`` (the test server), ``PAYMENTS_URL`` and the
recovery tests' fast constants. The kill uses the documented test seam
``coder_chat.crash_safe.add_crash_hook``: no monkeypatching, a real ``SIGKILL`` — no
``finally`` block runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import threading
from typing import Any


def run_once(crash_at: str, spec: dict[str, Any]) -> int:
    from coder_chat.crash_safe import add_crash_hook
    from prefect_coder.flows.common.params import Step, WorkflowSettings
    from prefect_coder.flows.deployments.agent_workflow import agent_workflow

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
    ca_file = os.environ.get("RECOVERY_API_CA_FILE")
    if ca_file:
        # The API clients' one-certificate CA bundle (recovery_env.api_ca_bundle: a
        # client made ≈ 40 ms cheaper). Set for the whole process, the events
        # worker's thread included; in the request's environment it would have been
        # an import-time setting, which a fork must share with its warm process.
        from prefect.context import refresh_global_settings_context

        os.environ["PREFECT_API_SSL_CERT_FILE"] = ca_file
        refresh_global_settings_context()
    steps = [Step.model_validate(s) for s in spec["steps"]]
    settings = WorkflowSettings.model_validate(spec["settings"])
    results: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if os.environ.get("CRASH_RESULTS_DIR"):
        # Results stored elsewhere (another worker's local storage). A setting of this
        # run, not of the process's environment: Prefect reads that at import, and
        # this process was forked after it (ForkServer's results_dir).
        from prefect.settings import PREFECT_RESULTS_LOCAL_STORAGE_PATH, temporary_settings

        results = temporary_settings(
            updates={PREFECT_RESULTS_LOCAL_STORAGE_PATH: os.environ["CRASH_RESULTS_DIR"]}
        )
    try:
        with results:
            asyncio.run(agent_workflow(spec["workflow_id"], steps, settings))
    except Exception as exc:
        print(f"RAISED {type(exc).__name__}: {exc}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(run_once(os.environ.get("CRASH_AT", ""), json.loads(os.environ["CRASH_SPEC"])))
