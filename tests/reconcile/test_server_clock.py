"""The reconciler's one clock: the Prefect server's (flows/liveness/server_clock.py).

Pure: a world described on the server's clock (states, heartbeats' ``received``, a
pause's deadline) seen from a reconciler host whose clock is 10 minutes ahead, on time,
or 10 minutes behind decides the same, every time, through the facts builder
(``run_facts``) and ``decide`` — while ages on the host's clock (what the reconciler
did before) decide otherwise. Over sockets: the session's Prefect server's clock is
read (this host's: offset about 0), and an API that sends no ``Date`` header leaves the
host's clock with one WARNING naming the fix. The skewed real server:
tests/reconcile/test_skewed_server_clock.py.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import pytest
import uvicorn
from prefect.client.orchestration import PrefectClient, get_client
from prefect.client.schemas.objects import FlowRun, State, StateDetails, StateType
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from prefect_coder.flows.deployments.reconcile_workflows import run_facts
from prefect_coder.flows.liveness.decide import Action, LeaseFacts, Observation, Timing, decide
from prefect_coder.flows.liveness.server_clock import (
    ServerClock,
    clock_from_date,
    read_server_clock,
)

HOST_NOW = datetime(2026, 12, 6, 18, 0, 0, 250_000, tzinfo=UTC)
SKEWS = (timedelta(minutes=-10), timedelta(0), timedelta(minutes=10))


def _clock_seen_from(host_now: datetime, server_now: datetime) -> ServerClock:
    """What the host measures from the server's ``Date`` (truncated to the second) on a
    request sent 40 ms before and answered 40 ms after ``host_now``."""
    clock = clock_from_date(
        format_datetime(server_now, usegmt=True),
        host_now - timedelta(milliseconds=40),
        host_now + timedelta(milliseconds=40),
    )
    assert clock is not None and clock.source == "server"
    return clock


@pytest.mark.parametrize("skew", SKEWS, ids=lambda s: f"{s.total_seconds():+.0f}s")
def test_the_offset_is_the_skew_within_the_dates_resolution(skew: timedelta) -> None:
    clock = _clock_seen_from(HOST_NOW, HOST_NOW + skew)
    assert abs(clock.offset - skew) <= timedelta(milliseconds=550)


@pytest.mark.parametrize("date", [None, "", "not a date", "Sun, 06 Dec 2026 18:00:00 -0000"])
def test_no_usable_date_gives_no_clock(date: str | None) -> None:
    assert clock_from_date(date, HOST_NOW, HOST_NOW) is None


#: A world on the server's clock: (state type, its age, last beat's age or None, the
#: workflow's lease silence or None (released), seconds to a pause's deadline) -> action.
WORLD: list[tuple[str, float, float | None, float | None, float | None, Action]] = [
    ("PENDING", 5.0, None, None, None, Action.LEAVE),  # starting
    ("PENDING", 200.0, None, None, None, Action.MARK_CRASHED),  # lost before it started
    ("RUNNING", 100.0, 10.0, 100.0, None, Action.LEAVE),  # a recent beat vetoes
    ("RUNNING", 100.0, 100.0, 100.0, None, Action.MARK_CRASHED),  # lease and beats silent
    ("CRASHED", 5.0, None, None, None, Action.LEAVE),  # the fast path's turn
    ("CRASHED", 60.0, None, None, None, Action.RECOVER),
    ("FAILED", 5.0, None, None, None, Action.LEAVE),  # its failure handler's turn
    ("FAILED", 60.0, None, None, None, Action.DONE),
    ("PAUSED", 30.0, None, None, 300.0, Action.LEAVE),  # waiting on a person
]


def _run(server_now: datetime, kind: str, age: float, pause_left: float | None) -> FlowRun:
    details = StateDetails.model_validate(
        {
            "pause_timeout": None
            if pause_left is None
            else server_now + timedelta(seconds=pause_left)
        }
    )
    state: State[Any] = State(
        type=StateType(kind),
        name=kind.title(),
        timestamp=server_now - timedelta(seconds=age),
        state_details=details,
    )
    return FlowRun(flow_id=uuid.uuid4(), state=state)


def _decisions(host_now: datetime, skew: timedelta, *, on_host_clock: bool) -> list[Action]:
    server_now = host_now + skew
    clock = _clock_seen_from(host_now, server_now)
    now = host_now if on_host_clock else host_now + clock.offset
    actions = []
    for kind, age, beat_age, silent, pause_left, _ in WORLD:
        run = _run(server_now, kind, age, pause_left)
        received = None if beat_age is None else server_now - timedelta(seconds=beat_age)
        lease = None if silent is None else LeaseFacts(live=False, silent_s=silent, ttl_s=60.0)
        observation = Observation(key="workflow:w", run=run_facts(run, received, now), lease=lease)
        actions.append(decide(observation, Timing()).action)
    return actions


@pytest.mark.parametrize("skew", SKEWS, ids=lambda s: f"{s.total_seconds():+.0f}s")
def test_a_skewed_reconciler_host_decides_as_an_unskewed_one(skew: timedelta) -> None:
    expected = [w[-1] for w in WORLD]
    assert _decisions(HOST_NOW, skew, on_host_clock=False) == expected
    if skew:
        # Ages on the host's own clock (before): a host ahead crashes a run that is
        # starting and one that beat 10 s ago; a host behind misses the lost ones.
        assert _decisions(HOST_NOW, skew, on_host_clock=True) != expected


async def test_the_session_servers_clock_is_this_hosts(prefect_server: Any) -> None:
    async with get_client() as client:
        began = datetime.now(UTC)
        clock = await read_server_clock(client)
        took = datetime.now(UTC) - began
    assert clock.source == "server"
    # Same host, same clock: the Date's second and uvicorn's once-a-second refresh
    # (2 s), plus the round trip as it happened (not a bound on the machine's speed).
    assert abs(clock.offset) <= timedelta(seconds=2) + took, clock


async def _hello(request: Request) -> JSONResponse:
    return JSONResponse("👋")


@pytest.fixture
async def dateless_api() -> AsyncIterator[str]:
    """A real HTTP server answering Prefect's ``/api/hello`` with no ``Date`` header
    (what an API behind a proxy that strips it looks like)."""
    config = uvicorn.Config(
        Starlette(routes=[Route("/api/hello", _hello)]),
        date_header=False,
        log_level="error",
        lifespan="off",
    )
    server = uvicorn.Server(config)
    # Listening before the server starts: a request waits in the backlog meanwhile.
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield f"http://127.0.0.1:{port}/api"
    finally:
        server.should_exit = True
        await task
        sock.close()


async def test_without_a_date_the_host_clock_is_used_and_said_once(
    dateless_api: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="prefect_coder.flows.reconcile")
    async with PrefectClient(dateless_api) as client:
        first = await read_server_clock(client)
        second = await read_server_clock(client)
    assert first == second == ServerClock(timedelta(0), "host")
    warned = [r for r in caplog.records if "no usable Date header" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "NTP" in warned[0].getMessage() and "strip" in warned[0].getMessage()
