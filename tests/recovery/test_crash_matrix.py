"""The crash matrix: a real SIGKILL of the process running the step, at every named
point, then recovery by a plain rerun (automatic) or by the ``recover-turn`` flow.

After recovery: each payment effect applied exactly once per idempotency key and
one key per step; the final results equal the fault-free run's; at most one extra
user turn, only where the documented window allows it, with the same marker; no
chat of the workflow left in ``requires_action`` or running.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest
from crash_matrix import (
    CASES,
    STEPS,
    Case,
    ForkServer,
    arm_fault,
    chats_of,
    child_spec,
    effects_of,
    run_workflow,
    user_texts,
)
from payments import Payments
from recovery_env import PrefectEnv

from coder_chat.emulator import Emulator
from prefect_coder.flows.deployments.recover_turn import recover_turn
from prefect_coder.flows.parts.params import WorkflowSettings, step_marker

LIVE = {"running", "pending", "requires_action", "interrupting", "paused"}


async def crash(
    case: Case,
    workflow_id: str,
    settings: WorkflowSettings,
    server: ForkServer,
    emu: Emulator,
) -> None:
    spec = child_spec(workflow_id, settings)
    if case.fault:
        # the request commits but its response never arrives
        arm_fault(emu, case.fault)
        try:
            rc = await server.run("", spec)
        finally:
            emu.faults.clear()
        assert rc == 3, (rc, server.stderr_tail())
    for i, point in enumerate(case.crashes):
        if i:
            # A second crash point inside recovery is reached only on the path the
            # crashed attempt leaves once the model is done streaming (a pause, or
            # rest); a child started while it still streams would follow it instead.
            # With eight children on a loaded machine that can take a while: wait.
            await _not_streaming(emu, workflow_id)
        rc = await server.run(point, spec)
        assert rc == -9, (point, rc, server.stderr_tail())


async def _not_streaming(emu: Emulator, workflow_id: str, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if all(c["status"] not in {"running", "pending"} for c in chats_of(emu, workflow_id)):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{workflow_id}: a chat still streams after {within:g}s")


MODES = ["rerun", "recover-turn"]


@pytest.fixture(scope="module")
def matrix_settings(settings: WorkflowSettings) -> WorkflowSettings:
    """The suite's settings with a turn deadline no loaded machine reaches here.

    A second crash point inside recovery (``recovery.after_submit``) is reached only
    while the crashed attempt is within its turn deadline: past it, recovery cuts the
    attempt short instead of answering its pause, the child finishes, and the row
    fails for a reason that is not the one it checks. With eight children starting
    Prefect at once on a loaded 2-core machine the second child came later than the
    credentials' 20 s (twice at load 13-20). No row waits out this deadline.
    """
    return settings.model_copy(update={"turn_timeout_s": 120.0})


@pytest.fixture(scope="module")
async def crashed(
    matrix_settings: WorkflowSettings,
    prefect_env: PrefectEnv,
    payments: Payments,
    emu: Emulator,
    baseline: list[str],
    fork_server: ForkServer,
) -> dict[tuple[str, str], str]:
    """Crash every (case, mode) once, children running concurrently (a child costs
    ≈ 2-4 s of Prefect import and flow start). Fault cases run alone first: an
    armed emulator fault is global."""
    server = fork_server
    ids = {
        (c.name, m): f"r-mx-{i}-{j}-{uuid.uuid4().hex[:6]}"
        for i, c in enumerate(CASES)
        for j, m in enumerate(MODES)
    }
    for case in CASES:
        if case.fault:
            for m in MODES:
                await crash(case, ids[case.name, m], matrix_settings, server, emu)
    gate = asyncio.Semaphore(8)

    async def one(case: Case, mode: str) -> None:
        async with gate:
            await crash(case, ids[case.name, mode], matrix_settings, server, emu)

    await asyncio.gather(*(one(c, m) for c in CASES if not c.fault for m in MODES))
    return ids


async def check(
    case: Case,
    workflow_id: str,
    results: list[Any],
    baseline: list[str],
    payments: Payments,
    emu: Emulator,
) -> None:
    assert [r.text for r in results] == baseline
    chats = chats_of(emu, workflow_id)
    ids = [c["id"] for c in chats]
    effects = effects_of(payments, ids)
    # exactly once per key, and one key (one effect) per step
    assert sorted(effects.values()) == [1, 1], effects
    main = results[-1].chat_id
    for s in STEPS:
        marker = step_marker(workflow_id, s.name)
        on_main = sum(marker in t for t in user_texts(emu, main))
        allowed = 1 + case.extra_turns if s.name in case.may_resubmit else 1
        assert 1 <= on_main <= allowed, (s.name, user_texts(emu, main))
    for c in chats:
        if c["id"] != main:
            # an orphan of the empty-checkpoint window: only the first step's prompt
            texts = user_texts(emu, c["id"])
            assert len(texts) == 1 and step_marker(workflow_id, "plan") in texts[0]
    for _ in range(100):
        live = [c["id"] for c in chats_of(emu, workflow_id) if c["status"] in LIVE]
        if not live:
            break
        await asyncio.sleep(0.05)
    assert not live, [(c["id"], c["status"]) for c in chats_of(emu, workflow_id)]


async def recover(case: Case, mode: str, workflow_id: str, settings: WorkflowSettings) -> list[Any]:
    """Recover a crashed workflow: a plain rerun, or ``recover-turn`` then the rerun
    (which then returns every step from storage)."""
    if mode == "recover-turn":
        report = await recover_turn(
            workflow_id, steps=STEPS, settings=settings, finish_workflow=True
        )
        assert report.action in ("nothing", "recovered", "ran"), report
        assert report.finished_workflow
    return await run_workflow(workflow_id, STEPS, settings)


@pytest.fixture(scope="module")
async def recovered(
    crashed: dict[tuple[str, str], str], matrix_settings: WorkflowSettings
) -> dict[tuple[str, str], list[Any] | BaseException]:
    """Every crashed workflow recovered, concurrently (each in its own flow runs;
    they wait on nothing of each other's but the machine)."""
    gate = asyncio.Semaphore(6)

    async def one(key: tuple[str, str]) -> list[Any] | BaseException:
        case = next(c for c in CASES if c.name == key[0])
        async with gate:
            try:
                return await recover(case, key[1], crashed[key], matrix_settings)
            except Exception as exc:  # reported by the case's own test
                return exc

    keys = list(crashed)
    outcomes = await asyncio.gather(*(one(k) for k in keys))
    return dict(zip(keys, outcomes, strict=True))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@pytest.mark.parametrize("mode", MODES)
async def test_crash_matrix(
    case: Case,
    mode: str,
    crashed: dict[tuple[str, str], str],
    recovered: dict[tuple[str, str], list[Any] | BaseException],
    baseline: list[str],
    payments: Payments,
    emu: Emulator,
) -> None:
    results = recovered[case.name, mode]
    if isinstance(results, BaseException):
        raise results
    await check(case, crashed[case.name, mode], results, baseline, payments, emu)
