"""``recover-turn`` takes the workflow lease of the crashed run it recovers at once.

It used to take the lease with a bare holder id and no ``holder_gone``: the dead
holder's row was waited out to its ttl (``lease_ttl_s`` after the killed process's
last renewal), which put up to a minute between a recovery run's start and its first
settle decision (docs/deploy.md "Recovery time"). Here the holder is a real process
killed with SIGKILL whose run Prefect shows Crashed; its lease ttl (600 s) is far
longer than recover-turn may wait (20 s), so only a takeover lets it through.
"""

from __future__ import annotations

import uuid

from prefect.client.orchestration import get_client
from prefect.states import Crashed, Running
from test_takeover import _holder_flow, _kill, _start_holder
from warm_python import WarmPython

from prefect_coder.blocks import ChatStateStore, CoderCredentials, StateStore
from prefect_coder.blocks.state import workflow_key
from prefect_coder.flows.common.holders import holder_run_id
from prefect_coder.flows.common.params import WorkflowSettings
from prefect_coder.flows.deployments.recover_turn import recover_turn


async def test_recover_turn_takes_over_a_crashed_runs_lease(
    warm_python: WarmPython, store_url: str, tenant: str, creds: CoderCredentials
) -> None:
    workflow_id = f"hl-rt-{uuid.uuid4().hex[:8]}"
    async with get_client() as client:
        run = await client.create_flow_run(_holder_flow)
        await client.set_flow_run_state(run.id, Running(), force=True)
    proc = await _start_holder(warm_python, store_url, tenant, workflow_id, str(run.id))
    store = StateStore(store_url, tenant=tenant)
    try:
        await _kill(proc)
        held = await store.leases.get(workflow_key(workflow_id))
        assert held is not None and holder_run_id(held[0].holder) == run.id
        async with get_client() as client:  # what the worker reports after the kill
            await client.set_flow_run_state(run.id, Crashed(), force=True)
        suffix = uuid.uuid4().hex[:8]
        await creds.save(f"hl-rt-coder-{suffix}", overwrite=True)
        await ChatStateStore(url=store_url, tenant=tenant).save(
            f"hl-rt-store-{suffix}", overwrite=True
        )
        settings = WorkflowSettings(
            credentials_block=f"hl-rt-coder-{suffix}",
            store_block=f"hl-rt-store-{suffix}",
            lease_ttl_s=5,
            lease_wait_s=20,
            artifacts=False,
        )
        report = await recover_turn(workflow_id, settings=settings)
        # Through the lease (else WorkflowBusyError after 20 s): the workflow never
        # got a chat, so there is nothing to recover.
        assert report.action == "nothing", report
        assert "no checkpoint" in report.reason
    finally:
        if proc.returncode is None:
            await _kill(proc, check=False)
        await store.aclose()
