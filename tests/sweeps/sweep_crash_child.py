"""Child process: run one first turn and SIGKILL itself right after the create
response arrived — before any checkpoint of the chat exists.

Environment: ``SWEEP_SPEC`` = JSON ``{"workflow_id", "step", "settings"}`` plus the
Prefect test server's ``PREFECT_API_URL``. The kill goes through the documented
test seam ``coder_chat.crash_safe.add_crash_hook`` (crash point
``turn.after_create``): a real SIGKILL, no ``finally`` block runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys


def main() -> int:
    from coder_chat.crash_safe import add_crash_hook

    def hook(point: str) -> None:
        if point == "turn.after_create":
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    add_crash_hook(hook)

    from flows.params import Step, WorkflowSettings
    from flows.workflow import agent_turn

    spec = json.loads(os.environ["SWEEP_SPEC"])
    asyncio.run(
        agent_turn(
            spec["workflow_id"],
            Step.model_validate(spec["step"]),
            WorkflowSettings.model_validate(spec["settings"]),
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
