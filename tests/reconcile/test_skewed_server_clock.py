"""The reconciler's ages are on the Prefect server's clock, not on its own host's.

A private Prefect API server (tests/faults/prefect_server_proc.py's process: uvicorn on
Prefect's ``create_app``, its own SQLite database) runs under Debian's ``faketime``
(libfaketime, preloaded into the server process only): its clock is really 10 minutes
off this host's, so every state timestamp and every event's ``received`` it stamps is
too. One reconciler tick (``reconcile_once``, a real store on SQLite, Prefect's own
client) runs against it:

* server 10 min **behind** (the reconciler's host ahead): a run Pending for a second is
  left alone. Before the fix the tick took it for "Pending for 600 s" and marked it
  Crashed — a healthy run killed.
* server 10 min **ahead** (the host behind): a run Pending past the grace is marked
  Crashed. Before the fix its age came out negative (0) and a lost run was never
  noticed.
* server 10 min ahead, a Running run that just beat (an event sent from this host,
  its ``occurred`` on the host's clock): left alone — its heartbeat's age is taken from
  the server's ``received``, not from ``occurred``, and the events query's window
  finds a beat stamped by a clock behind the server's.

Needs the ``faketime`` Debian package (``apt-get install -y faketime``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from prefect import flow
from prefect.client.orchestration import PrefectClient
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.events import Event
from prefect.events.clients import PrefectEventsClient
from prefect.events.filters import (
    EventFilter,
    EventNameFilter,
    EventOccurredFilter,
    EventResourceFilter,
)
from prefect.states import Running
from prefect_server_proc import PrivatePrefectServer

from prefect_coder.blocks.state.store import StateStore
from prefect_coder.flows.deployments.reconcile_workflows import ReconcileOptions, reconcile_once
from prefect_coder.flows.liveness.server_clock import read_server_clock

#: Debian's libfaketime, wherever its multiarch directory is.
LIBFAKETIME = next(
    iter(sorted(Path("/usr/lib").glob("*/faketime/libfaketime.so.1"))),
    Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"),
)
SKEW = timedelta(minutes=10)


class SkewedPrefectServer(PrivatePrefectServer):
    """The private server with its wall clock moved by ``skew`` (libfaketime, a constant
    offset; its monotonic clock untouched)."""

    def __init__(self, root: Path, skew: str) -> None:
        super().__init__(root)
        self.skew = skew

    def env(self) -> dict[str, str]:
        return {
            **super().env(),
            "LD_PRELOAD": str(LIBFAKETIME),
            "FAKETIME": self.skew,
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        }


@pytest.fixture(scope="module", params=["-10m", "+10m"])
def skewed(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SkewedPrefectServer]:
    if not LIBFAKETIME.is_file():
        pytest.fail(f"{LIBFAKETIME} missing: apt-get install -y faketime")
    server = SkewedPrefectServer(tmp_path_factory.mktemp("skewed"), request.param)
    try:
        server.start()
        yield server
    finally:
        server.close()


@pytest.fixture
async def client(skewed: SkewedPrefectServer) -> AsyncIterator[PrefectClient]:
    async with PrefectClient(skewed.api_url) as c:
        yield c


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[StateStore]:
    s = StateStore(f"sqlite+aiosqlite:///{tmp_path / 'state.db'}", tenant="skew")
    yield s
    await s.aclose()


@flow(name="skewed-clock-probe")
def probe() -> None:
    """Only its name is used: the flow the runs below belong to."""


async def _tracked_run(client: PrefectClient, store: StateStore) -> FlowRun:
    """A fresh Pending flow run on the skewed server, recorded as a workflow whose lease
    nobody holds (what a run lost before it took its lease looks like)."""
    run = await client.create_flow_run(probe)
    workflow = uuid.uuid4().hex[:8]
    await store.workflows.started(
        f"workflow:{workflow}",
        deployment=str(uuid.uuid4()),
        parameters={},
        flow_run_id=str(run.id),
        workflow_id=workflow,
        lease_keys=[f"workflow:{workflow}"],
    )
    return run


def _direction(server: SkewedPrefectServer) -> int:
    return -1 if server.skew.startswith("-") else 1


async def test_the_skewed_server_clock_is_read(
    skewed: SkewedPrefectServer, client: PrefectClient
) -> None:
    began = datetime.now(UTC)
    clock = await read_server_clock(client)
    took = datetime.now(UTC) - began
    assert clock.source == "server"
    # The Date's second and uvicorn's once-a-second refresh (2 s), plus the round
    # trip as it happened: a bound from causality, not from how fast the machine is.
    assert abs(clock.offset - _direction(skewed) * SKEW) <= timedelta(seconds=2) + took, clock


async def test_a_fresh_pending_run_is_left_and_a_lost_one_crashed(
    skewed: SkewedPrefectServer, client: PrefectClient, store: StateStore
) -> None:
    run = await _tracked_run(client, store)
    if _direction(skewed) < 0:
        # The reconciler's host is 10 min ahead: the shipped grace, the run 0 s old.
        rows = await reconcile_once(store, ReconcileOptions(adopt=False), client=client)
        [row] = rows
        assert row.action == "leave", row
        assert (await client.read_flow_run(run.id)).state_type == StateType.PENDING
    else:
        # The host is 10 min behind: past a 2 s grace, the run is lost.
        grace = 2.0
        await asyncio.sleep(grace + 2.0)
        rows = await reconcile_once(
            store, ReconcileOptions(adopt=False, pending_grace_s=grace), client=client
        )
        [row] = rows
        assert row.action == "mark-crashed", row
        assert row.acted
        assert (await client.read_flow_run(run.id)).state_type == StateType.CRASHED


async def _beat(skewed: SkewedPrefectServer, client: PrefectClient, run: FlowRun) -> None:
    """A heartbeat of ``run`` sent from this host (``occurred``: this host's clock), and
    wait until the server lists it."""
    resource = f"prefect.flow-run.{run.id}"
    async with PrefectEventsClient(skewed.api_url) as events:
        await events.emit(
            Event.model_validate(
                {
                    "occurred": datetime.now(UTC),
                    "event": "prefect.flow-run.heartbeat",
                    "resource": {"prefect.resource.id": resource},
                }
            )
        )
    deadline = time.monotonic() + 30
    wanted = EventFilter(
        occurred=EventOccurredFilter.model_validate(
            {"since": datetime.now(UTC) - timedelta(hours=1)}
        ),
        event=EventNameFilter(name=["prefect.flow-run.heartbeat"]),
        resource=EventResourceFilter(id=[resource]),
    )
    while not (await client.read_events(wanted, limit=50)).events:
        assert time.monotonic() < deadline, "the heartbeat was never listed"
        await asyncio.sleep(0.2)


async def test_a_running_run_that_just_beat_is_left(
    skewed: SkewedPrefectServer, client: PrefectClient, store: StateStore
) -> None:
    run = await _tracked_run(client, store)
    await client.set_flow_run_state(run.id, Running(), force=True)
    # Running longer than the heartbeat grace, no live lease: only the beat vetoes.
    grace = 2.0
    await asyncio.sleep(grace + 1.0)
    await _beat(skewed, client, run)
    # A beat counts as fresh for 120 s: far above the seconds the server may take to
    # list it on a loaded machine, far below the 10 min a host-clock age would be off.
    options = ReconcileOptions(
        adopt=False, heartbeat_grace_s=grace, heartbeat_fresh_s=120, lost_grace_s=0
    )
    [row] = await reconcile_once(store, options, client=client)
    assert row.action == "leave" and row.why.startswith("alive: heartbeat"), row
    assert (await client.read_flow_run(run.id)).state_type == StateType.RUNNING
