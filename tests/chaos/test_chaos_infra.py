"""Chaos schedules with faults of our own dependencies (issue 30): the state store
(PostgreSQL restarted, its connections terminated; SQLite's write lock held by a
stopped process), the Prefect API (restarted) and result storage (unwritable for a
while), each beside a workflow run that is killed or not, then recovery to the end;
every invariant of ``chaos_invariants`` must hold. ``bench/chaos.py --store pg`` and
``--store sqlite`` draw these faults on hundreds of seeds (docs/chaos.md).

Fixed schedules, not seeds: each test names the fault it is about and asserts that
the fault really ran during the schedule (its line in the phase's report), so that
none of them passes without its fault.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from typing import Any

import pytest
from chaos_infra import Infra, results_dir
from chaos_runner import Rig, open_rig, process_env, run_schedule
from chaos_schedule import SHORT_STORE_WAIT, Phase, Schedule, Timed
from faults_pg import PrivateCluster, running_cluster
from payments import running_payments
from prefect_server_proc import PrivatePrefectServer, running_prefect_server
from recovery_env import PrefectEnv


def _schedule(seed: int, templates: tuple[str, ...], retries: int, *phases: Phase) -> Schedule:
    return Schedule(seed, templates, retries, phases)


async def _run(rig: Rig, schedule: Schedule, *ran: tuple[int, str]) -> Any:
    """Run ``schedule``; each ``(phase, what)`` of ``ran`` must be in that phase's line
    (the fault really ran), and every invariant must hold."""
    outcome = await run_schedule(rig, schedule)
    print(outcome.report())
    for phase, what in ran:
        assert what in outcome.phases[phase], f"the fault did not run:\n{outcome.report()}"
    assert outcome.ok, "\n" + outcome.report()
    return outcome


@pytest.fixture(scope="module")
def pg_cluster() -> Iterator[PrivateCluster]:
    with running_cluster() as cluster:
        yield cluster


@pytest.fixture(scope="module")
def private_prefect(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivatePrefectServer]:
    """A Prefect server of this module's own, which its schedules restart (the
    session's must never go down)."""
    with running_prefect_server(tmp_path_factory.mktemp("chaos-prefect")) as server:
        yield server


async def _rebind_prefect_workers() -> None:
    """Send what Prefect's process-wide event and log workers hold and stop them: the
    next ones start bound to the server current then. The events worker is one per
    process, bound to the API of the moment it started: left bound to the session's
    server, it looked this rig's runs up there (404: events dropped); left bound to this
    module's server, the later tests of this process would lose theirs."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    # (from a running event loop these return an awaitable)
    for drained in (
        EventsWorker.drain_all(timeout=10, at_exit=False),
        APILogWorker.drain_all(timeout=10),
    ):
        if inspect.isawaitable(drained):
            await drained


@pytest.fixture(scope="module")
async def pg_rig(
    pg_cluster: PrivateCluster,
    private_prefect: PrivatePrefectServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Rig]:
    """A rig on a PostgreSQL store and a Prefect server both of which may be faulted;
    its crash children fork from a warm process of its own (another API URL)."""
    workdir = tmp_path_factory.mktemp("chaos-infra-pg")
    infra = Infra("pg", pg=pg_cluster, prefect=private_prefect)
    env = PrefectEnv(private_prefect.api_url, results_dir(workdir))
    await _rebind_prefect_workers()
    try:
        with running_payments() as payments, process_env(payments):
            async with open_rig(env.child_env(), workdir, payments, infra=infra, name="pg") as r:
                yield r
    finally:
        await _rebind_prefect_workers()


#: A SQLite store's write lock taken by another process 0.3 s into a workflow run and
#: held 12 s (the process SIGSTOPped): past the store's own 10 s wait and its retries,
#: so a write of the run fails, transiently — the task retries, or the run fails and
#: the rerun goes on in the same chat once the lock is gone; the chat is never
#: archived for it.
LOCK_HELD = _schedule(
    9101,
    ("rounds", "deposit"),
    1,
    Phase("child", timed=(Timed(0.3, "store-lock", 12.0),)),
    Phase("recover"),
)

#: The result storage refuses new files for 4 s from 0.2 s into a run: a step whose
#: result cannot be written fails retryably (never a silent Completed); the rerun
#: stores it, from the chat, without a second charge.
RESULTS_UNWRITABLE = _schedule(
    9102,
    ("deposit", "rest"),
    0,
    Phase("child", timed=(Timed(0.2, "results-unwritable", 4.0),)),
    Phase("recover"),
)


#: The same lock with a store of little patience (2 s to connect, 3 s of retries):
#: its retries run out while the lock is held, so the step fails transiently — task
#: retries, then a failed run whose chat stays live — and the recovery goes on in
#: the same chat once the lock is gone.
LOCK_PAST_PATIENCE = replace(LOCK_HELD, seed=9103, store_wait=SHORT_STORE_WAIT)


@pytest.mark.parametrize("schedule", [LOCK_HELD, LOCK_PAST_PATIENCE], ids=["waits", "gives-up"])
async def test_sqlite_store_locked_by_a_stopped_process(rig: Rig, schedule: Schedule) -> None:
    await _run(rig, schedule, (0, "store write lock held 12 s"))


async def test_result_storage_unwritable_for_a_while(rig: Rig) -> None:
    await _run(rig, RESULTS_UNWRITABLE, (0, "result storage unwritable 4 s"))


#: Every connection to the store terminated 0.8 s into a run (the run's own and this
#: process's pooled ones), then PostgreSQL restarted (down 1 s) at the start of the
#: recovery: every pooled connection of both processes is dead once.
PG_RESTARTED = _schedule(
    9201,
    ("think", "deposit"),
    0,
    Phase("child", timed=(Timed(0.8, "store-drop-conns"),)),
    Phase("recover", timed=(Timed(0.05, "store-restart", 1.0),)),
)

#: PostgreSQL down 5 s, past a store of little patience: the step fails transiently
#: and the run fails with its chat live; the recovery continues in it.
PG_DOWN_PAST_PATIENCE = replace(
    _schedule(
        9203,
        ("deposit", "rest"),
        0,
        Phase("child", timed=(Timed(0.4, "store-restart", 5.0),)),
        Phase("recover"),
    ),
    store_wait=SHORT_STORE_WAIT,
)

#: The Prefect API SIGKILLed and restarted (down 1 s) while a run that will be killed
#: after its first charge starts, and again (down 0 s) during the recovery.
PREFECT_RESTARTED = _schedule(
    9202,
    ("rounds", "rest"),
    1,
    Phase("child", crash_at="tool.after_effect:1", timed=(Timed(0.1, "prefect-restart", 1.0),)),
    Phase("recover", timed=(Timed(0.05, "prefect-restart", 0.0),)),
)


async def test_postgresql_store_restarted_and_its_connections_terminated(pg_rig: Rig) -> None:
    outcome = await _run(
        pg_rig,
        PG_RESTARTED,
        (0, "store connections terminated"),
        (1, "store restarted (down 1 s)"),
    )
    assert "terminated (0)" not in outcome.phases[0], outcome.report()


async def test_postgresql_store_down_past_the_stores_patience(pg_rig: Rig) -> None:
    await _run(pg_rig, PG_DOWN_PAST_PATIENCE, (0, "store restarted (down 5 s)"))


async def test_prefect_api_restarted_during_a_run_and_its_recovery(pg_rig: Rig) -> None:
    await _run(
        pg_rig,
        PREFECT_RESTARTED,
        (0, "Prefect API restarted (down 1 s"),
        (1, "Prefect API restarted (down 0 s"),
    )
