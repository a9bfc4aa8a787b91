"""Child process: run a workflow and SIGKILL itself at a named crash point.

``CRASH_AT`` = ``<point>`` (first occurrence), ``CRASH_SPEC`` = JSON
``{"workflow_id", "steps", "settings"}``. Exit codes: -9 killed as planned (seen
by the parent as a signal), 0 the workflow finished, 3 it raised. The kill uses
the documented test seam ``coder_chat.crash_safe.add_crash_hook`` and a real
``SIGKILL``: no ``finally`` block, no Prefect state change runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys


def main() -> int:
    from coder_chat.crash_safe import add_crash_hook
    from prefect_coder.flows.common.params import Step, WorkflowSettings
    from prefect_coder.flows.deployments.agent_workflow import agent_workflow

    point = os.environ.get("CRASH_AT", "")

    def hook(name: str) -> None:
        if name == point:
            os.kill(os.getpid(), signal.SIGKILL)

    if point:
        add_crash_hook(hook)
    spec = json.loads(os.environ["CRASH_SPEC"])
    steps = [Step.model_validate(s) for s in spec["steps"]]
    settings = WorkflowSettings.model_validate(spec["settings"])
    try:
        asyncio.run(agent_workflow(spec["workflow_id"], steps, settings))
    except Exception as exc:
        print(f"RAISED {type(exc).__name__}: {exc}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
