"""A dead holder whose Prefect run is already over gives up its workflow lease at once,
and its turn slot at once when its workflow has no chat running server-side (here: it
died before creating one). A real process holding both is killed with SIGKILL, its run
is marked Crashed (what the zombie automation does for a lost host), and the next holder
gets both before the dead holder's ttl (read from the rows, not timed). A dead holder
whose chat still runs: ``test_slot_takeover.py``."""

from __future__ import annotations

import asyncio
import signal
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import State
from prefect.states import Cancelled, Crashed, Failed, Running
from warm_python import Child, WarmPython

from coder_chat.emulator import Emulator
from prefect_coder.blocks import CoderCredentials, StateStore
from prefect_coder.blocks.state import LeaseUnavailableError, workflow_key
from prefect_coder.flows.common.errors import TurnSlotUnavailableError, WorkflowBusyError
from prefect_coder.flows.common.holders import (
    RUN_MARK,
    WORKFLOW_MARK,
    holder_run_id,
    holder_run_over,
    holder_workflow_id,
    run_holder,
)
from prefect_coder.flows.common.params import WorkflowSettings
from prefect_coder.flows.common.resources import hold_workflow_lease
from prefect_coder.flows.fleet.slots import slot_key, turn_slot

ROOT = Path(__file__).resolve().parents[2]
TTL = 600.0  # far longer than the test: only a takeover can free the rows in time

_HOLDER = """
import asyncio, sys
from prefect_coder.blocks import StateStore
from prefect_coder.flows.common.params import WorkflowSettings
from prefect_coder.flows.common.resources import hold_workflow_lease
from prefect_coder.flows.fleet.slots import turn_slot

async def main():
    url, tenant, wf, ttl = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    store = StateStore(url, tenant=tenant)
    settings = WorkflowSettings(lease_ttl_s=ttl, lease_wait_s=5)
    async with (
        hold_workflow_lease(wf, store, settings),
        turn_slot(store, 1, wait=5, ttl=ttl, workflow_id=wf),
    ):
        with open(sys.argv[5], "w") as mark:
            mark.write("HELD")
        await asyncio.sleep(3600)

asyncio.run(main())
"""


@flow(name="hostloss-holder")
def _holder_flow() -> None:
    """Only its runs are used: a flow run for the killed holder to belong to."""


def _ended(pid: int) -> bool:
    """The process is gone or a zombie (its parent, the warm process, reaps it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except OSError:
        return True


async def _start_holder(
    warm: WarmPython, store_url: str, tenant: str, workflow_id: str, run_id: str
) -> Child:
    """The holder: a separate process (own pid, killed for real with SIGKILL) forked
    from the session's warm process, so it does not import Prefect again (~4-5 CPU-s
    a fresh interpreter); it belongs to flow run ``run_id`` as a worker's flow-run
    process does (``PREFECT__FLOW_RUN_ID``). Returns once it holds lease and slot."""
    mark = Path(tempfile.gettempdir()) / f"hostloss-held-{uuid.uuid4().hex}"
    argv = ["-c", _HOLDER, store_url, tenant, workflow_id, str(TTL), str(mark)]
    env = dict(warm.env, PREFECT__FLOW_RUN_ID=run_id)
    child = await asyncio.to_thread(warm.start, argv, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not mark.exists():
            if _ended(child.pid) or time.monotonic() > deadline:
                child.kill()
                done = await child.communicate(30)
                raise AssertionError(
                    f"the holder did not take lease and slot (rc {done.returncode}):\n"
                    + done.stderr[-3000:]
                )
            await asyncio.sleep(0.02)
    finally:
        mark.unlink(missing_ok=True)
    return child


async def _kill(child: Child, *, check: bool = True) -> None:
    """SIGKILL (no release, no renewals) and wait until the process is gone; with
    ``check``, it was still alive (holding) when the signal came."""
    child.kill()
    done = await child.communicate(30)
    assert not check or done.returncode == -signal.SIGKILL, done.stderr[-3000:]


@pytest.mark.parametrize("over", [Crashed, Failed, Cancelled], ids=lambda s: s.__name__)
async def test_killed_holder_with_crashed_run_is_taken_over_at_once(
    warm_python: WarmPython,
    store_url: str,
    tenant: str,
    emu: Emulator,
    creds: CoderCredentials,
    over: Callable[[], State],
) -> None:
    # Crashed is what the zombie automation sets for a lost host; Failed and Cancelled
    # (an operator's cancel, a failed run) are over just the same (issue 15).
    workflow_id = f"hl-{uuid.uuid4().hex[:8]}"
    async with get_client() as client:
        run = await client.create_flow_run(_holder_flow)
        await client.set_flow_run_state(run.id, Running(), force=True)
    proc = await _start_holder(warm_python, store_url, tenant, workflow_id, str(run.id))
    store = StateStore(store_url, tenant=tenant)
    settings = WorkflowSettings(lease_ttl_s=5, lease_wait_s=0.3)
    try:
        await _kill(proc)  # a real crash: no release, no renewals
        lease = await store.leases.get(workflow_key(workflow_id))
        slot = await store.leases.get(slot_key(0))
        assert lease is not None and slot is not None
        old_lease, old_slot = lease[0], slot[0]
        # The holders name the dead process's flow run; the slot's, its workflow too.
        assert holder_run_id(old_lease.holder) == run.id
        assert holder_run_id(old_slot.holder) == run.id
        assert holder_workflow_id(old_slot.holder) == workflow_id

        # While Prefect still shows the run Running, its rows are respected.
        with pytest.raises(WorkflowBusyError):
            async with hold_workflow_lease(workflow_id, store, settings):
                pytest.fail("took the lease of a run Prefect shows Running")
        with pytest.raises(TurnSlotUnavailableError):
            async with turn_slot(store, 1, wait=0.3, ttl=5, credentials=creds):
                pytest.fail("took the slot of a run Prefect shows Running")

        async with get_client() as client:  # e.g. what the zombie automation does
            await client.set_flow_run_state(run.id, over(), force=True)
        settings = WorkflowSettings(lease_ttl_s=5, lease_wait_s=30)
        # ``holder_run_over`` reuses a "still running" answer for up to 1 s.
        async with hold_workflow_lease(workflow_id, store, settings) as held:
            assert held.holder != old_lease.holder
            assert held.fence == old_lease.fence + 1
            assert held.lease.acquired_at < old_lease.expires_at
            # A waiter that cannot ask the Coder server whether the dead holder's turn
            # still runs there does not take its slot: its ttl decides.
            with pytest.raises(TurnSlotUnavailableError):
                async with turn_slot(store, 1, wait=0.5, ttl=5):
                    pytest.fail("took a slot without knowing whether its turn still runs")
            now = await store.leases.get(slot_key(0))
            assert now is not None and now[0].holder == old_slot.holder
            # One that can: the dead holder's workflow has no chat on the server (it
            # died before creating one), so nothing of it runs, and the slot is taken.
            assert emu.chats() == []
            async with turn_slot(store, 1, wait=30, ttl=5, credentials=creds) as index:
                assert index == 0
                now = await store.leases.get(slot_key(0))
                assert now is not None
                assert now[0].holder != old_slot.holder
                assert now[0].fence == old_slot.fence + 1
                assert now[0].acquired_at < old_slot.expires_at
    finally:
        if proc.returncode is None:
            await _kill(proc, check=False)
        await store.aclose()


async def test_a_holder_without_a_run_waits_out_its_ttl(store_url: str, tenant: str) -> None:
    # Old holder ids (no run) are never taken over early: the ttl decides, as before.
    store = StateStore(store_url, tenant=tenant)
    try:
        assert await store.leases.acquire(workflow_key("w"), "host:1:abcd", ttl=TTL)
        with pytest.raises(LeaseUnavailableError):
            async with store.lease(workflow_key("w"), wait=0.2, holder_gone=holder_run_over):
                pytest.fail("took a live lease")
    finally:
        await store.aclose()


def test_slot_holder_ids_name_run_and_workflow() -> None:
    # The workflow id is the user's: marks inside it must not confuse the parsing.
    run_id = uuid.uuid4()
    workflow_id = "team@run=x/wf=1 ✓"
    holder = f"host:1:abcd{RUN_MARK}{run_id}{WORKFLOW_MARK}{quote(workflow_id, safe='')}"
    assert holder_run_id(holder) == run_id
    assert holder_workflow_id(holder) == workflow_id
    # Outside a run: no run, still the workflow (then only the ttl frees the slot).
    bare = run_holder(workflow_id)
    assert holder_run_id(bare) is None and holder_workflow_id(bare) == workflow_id
    # Workflow lease holders name no workflow; older slot holders neither.
    assert holder_workflow_id(f"host:1:abcd{RUN_MARK}{run_id}") is None
