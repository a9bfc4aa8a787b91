"""Child process of the crash tests: run a workflow and SIGKILL itself at a named point.

``python crash_child.py`` with ``CRASH_AT`` = ``<point>:<occurrence>`` (empty =
never; ``<point>:<n>+<seconds>`` kills that long after the point) and
``CRASH_SPEC`` = JSON ``{"workflow_id", "steps", "settings"}`` (and optionally
``CRASH_RESULTS_DIR``: where the run stores its Prefect results;
``RECOVERY_API_CA_FILE``: the API clients' CA bundle, ``recovery_env.api_ca_bundle``).
The tests start it through ``crash_matrix.ForkServer``: forked from a warm Python process
(``tests/warm_python.py``), so it does not import Prefect again; it is still a
process of its own, and the kill is a real ``SIGKILL``.

``CRASH_SPEC`` may also name the flow the child runs (``"flow"``): ``agent-workflow``
(the default: a direct call), ``recover-turn`` (``finish_workflow``), ``shard`` (the
workflow as the one workflow of an ``agent-fanout-shard`` run: exit 3 when its
outcome is a failure) or ``deployment`` (the flow run ``"flow_run_id"`` of an
``agent-workflow`` deployment, executed as a process worker executes it). Beside the
product's crash points, a ``deployment`` run can be killed at two points read from
its run log: ``approval.before_suspend`` (the approval step's "waits for a decision"
line, right before it suspends) and ``approval.suspended`` (the engine's "Finished
in state Suspended" line: the suspension recorded, the process not yet gone).

Exit codes: -9 killed as planned, 0 the workflow finished, 3 it raised, 4 the run
suspended (waiting for an approval). The
environment carries ``PREFECT_API_URL`` (the test server), ``PAYMENTS_URL`` and the
recovery tests' fast constants. The kill uses the documented test seam
``coder_chat.crash_safe.add_crash_hook``: no monkeypatching, a real ``SIGKILL`` — no
``finally`` block runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from typing import Any


class _LogPoints(logging.Handler):
    """Calls the crash hook at the approval points of a deployment run's log."""

    def __init__(self, hook: Any) -> None:
        super().__init__(logging.INFO)
        self.hook = hook

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith("approval ") and "now waits for a decision" in msg:
            self.hook("approval.before_suspend")
        elif msg.startswith(("Finished in state Suspended(", "Finished in state Paused(")):
            self.hook("approval.suspended")


def _run_flow(spec: dict[str, Any], steps: list[Any], settings: Any) -> int:
    """The flow ``spec["flow"]`` names; its exit code (0 finished, 3 failed, 4 suspended)."""
    flow = spec.get("flow") or "agent-workflow"
    workflow_id = spec["workflow_id"]
    if flow == "agent-workflow":
        from prefect_coder.flows.deployments.agent_workflow import agent_workflow

        asyncio.run(agent_workflow(workflow_id, steps, settings))
        return 0
    if flow == "recover-turn":
        from prefect_coder.flows.deployments.recover_turn import recover_turn

        asyncio.run(recover_turn(workflow_id, steps=steps, settings=settings, finish_workflow=True))
        return 0
    if flow == "shard":
        from prefect_coder.flows.deployments.fanout_shard import FanoutItem, agent_fanout_shard

        item = FanoutItem(workflow_id=workflow_id, steps=steps)
        outcomes = asyncio.run(agent_fanout_shard([item], settings, shard_name=workflow_id))
        failed = [o for o in outcomes if not o.ok]
        if failed:
            print(f"SHARD OUTCOME {failed[0].error}", file=sys.stderr)
            return 3
        return 0
    if flow == "deployment":
        import uuid

        from prefect.client.schemas.objects import StateType
        from prefect.exceptions import Pause
        from prefect.flow_engine import load_flow_run, run_flow

        from prefect_coder.flows.deployments.agent_workflow import agent_workflow

        run_id = uuid.UUID(spec["flow_run_id"])
        flow_run = load_flow_run(flow_run_id=run_id)
        try:
            outcome = run_flow(agent_workflow, flow_run=flow_run)
            if asyncio.iscoroutine(outcome):
                asyncio.run(outcome)
        except Pause:
            return 4
        state = load_flow_run(flow_run_id=run_id).state
        return 4 if state is not None and state.type == StateType.PAUSED else 0
    raise ValueError(f"unknown flow {flow!r}")


def run_once(crash_at: str, spec: dict[str, Any]) -> int:
    from pydantic import TypeAdapter

    from coder_chat.crash_safe import add_crash_hook
    from prefect_coder.flows.common import params
    from prefect_coder.flows.common.params import Step, WorkflowSettings

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
        if name.startswith("approval."):
            # the run logger's INFO lines (the process may run at a higher level)
            runs = logging.getLogger("prefect.flow_runs")
            runs.setLevel(logging.INFO)
            runs.addHandler(_LogPoints(hook))
    ca_file = os.environ.get("RECOVERY_API_CA_FILE")
    if ca_file:
        # The API clients' one-certificate CA bundle (recovery_env.api_ca_bundle: a
        # client made ≈ 40 ms cheaper). Set for the whole process, the events
        # worker's thread included; in the request's environment it would have been
        # an import-time setting, which a fork must share with its warm process.
        from prefect.context import refresh_global_settings_context

        os.environ["PREFECT_API_SSL_CERT_FILE"] = ca_file
        refresh_global_settings_context()
    # the union of step kinds where there is one (AnyStep), else Step is every kind
    step_type: Any = getattr(params, "AnyStep", Step)
    steps = TypeAdapter(list[step_type]).validate_python(spec["steps"])
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
            return _run_flow(spec, steps, settings)
    except Exception as exc:
        print(f"RAISED {type(exc).__name__}: {exc}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(run_once(os.environ.get("CRASH_AT", ""), json.loads(os.environ["CRASH_SPEC"])))
