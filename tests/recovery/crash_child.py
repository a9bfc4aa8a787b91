"""Child process of the crash matrix: run a workflow and SIGKILL itself at a named point.

Environment: ``CRASH_AT`` = ``<crash point>:<occurrence>`` (e.g. ``tool.after_effect:2``;
empty = never), ``CRASH_SPEC`` = JSON ``{"workflow_id", "steps", "settings"}``, plus
``PREFECT_API_URL`` (the test server), ``PAYMENTS_URL``. Exit codes: -9 killed as
planned, 0 the workflow finished, 3 it raised (the exception type is printed).

The kill uses the documented test seam ``coder_chat.crash_safe.add_crash_hook``:
no monkeypatching, a real ``SIGKILL`` — no ``finally`` block runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys


def main() -> int:
    from coder_chat.crash_safe import add_crash_hook

    at = os.environ.get("CRASH_AT", "")
    name, _, nth = at.partition(":")
    wanted = int(nth or 1)
    seen: dict[str, int] = {}

    def hook(point: str) -> None:
        seen[point] = seen.get(point, 0) + 1
        if point == name and seen[point] == wanted:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    if name:
        add_crash_hook(hook)

    from flows.params import Step, WorkflowSettings
    from flows.workflow import agent_workflow

    spec = json.loads(os.environ["CRASH_SPEC"])
    steps = [Step.model_validate(s) for s in spec["steps"]]
    settings = WorkflowSettings.model_validate(spec["settings"])
    try:
        asyncio.run(agent_workflow(spec["workflow_id"], steps, settings))
    except Exception as exc:
        print(f"RAISED {type(exc).__name__}: {exc}")
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
