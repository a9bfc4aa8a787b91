"""Child process: run one first turn and SIGKILL itself at a crash point —
``turn.after_create`` (the create response arrived, no checkpoint can exist yet)
by default, or ``$SWEEP_CRASH_AT`` (e.g. ``turn.mid_stream``: after the dial).

Environment: ``SWEEP_SPEC`` = JSON ``{"workflow_id", "step", "settings"}`` plus the
Prefect test server's ``PREFECT_API_URL``. The kill goes through the documented
test seam ``coder_chat.crash_safe.add_crash_hook``: a real SIGKILL, no ``finally``
block runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys


def main() -> int:
    from coder_chat.crash_safe import add_crash_hook

    at = os.environ.get("SWEEP_CRASH_AT") or "turn.after_create"

    def hook(point: str) -> None:
        if point == at:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    add_crash_hook(hook)

    from prefect_coder.flows.common.params import Step, WorkflowSettings
    from prefect_coder.flows.deployments.agent_turn import agent_turn

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
