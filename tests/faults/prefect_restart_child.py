"""The flow-run process of tests/faults/test_prefect_api_restart.py: one
``agent_workflow`` run against the test's private Prefect server (``PREFECT_API_URL``
in the environment), as a worker's flow-run process would run it.

Argument: a JSON object (emulator URL, token and organization, the state store's
SQLite path, tenant, workflow id, steps, Prefect task retries). Prints one JSON line:
the run's final state type and the steps' texts, or the exception that escaped.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from typing import Any

from pydantic import SecretStr

from prefect_coder.blocks import ChatStateStore, CoderCredentials
from prefect_coder.flows.common.params import Step, WorkflowSettings
from prefect_coder.flows.deployments.agent_workflow import agent_workflow


async def main(cfg: dict[str, Any]) -> dict[str, Any]:
    suffix = cfg["suffix"]
    await CoderCredentials(
        base_url=cfg["base_url"],
        organization_id=uuid.UUID(cfg["organization_id"]),
        token=SecretStr(cfg["token"]),
        # The test holds a step's model for as long as a restart takes (seconds, more
        # on a loaded machine): no segment budget may end it first.
        request_timeout=90.0,
        turn_timeout=120.0,
    ).save(f"pr-coder-{suffix}", overwrite=True)
    await ChatStateStore(url=cfg["store_url"], tenant=f"pr-{suffix}").save(
        f"pr-store-{suffix}", overwrite=True
    )
    settings = WorkflowSettings(
        credentials_block=f"pr-coder-{suffix}",
        store_block=f"pr-store-{suffix}",
        retries=cfg["retries"],
        retry_delay_s=cfg.get("retry_delay_s", 1),
        settle_wait_s=5,
        redial_backoff_ms=20,
        artifacts=cfg.get("artifacts", True),
    )
    steps = [Step(**s) for s in cfg["steps"]]
    try:
        state = await agent_workflow(cfg["workflow_id"], steps, settings, return_state=True)
    except BaseException as exc:  # what escaped the engine itself (the API gone)
        return {"escaped": f"{type(exc).__name__}: {exc}"[:500]}
    out: dict[str, Any] = {
        "state": state.type.value,
        "flow_run_id": str(state.state_details.flow_run_id),
    }
    try:
        results = await state.aresult()  # type: ignore[attr-defined]
        out["texts"] = [r.text for r in results]
    except BaseException as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"[:500]
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(json.loads(sys.argv[1])))), flush=True)
