"""Hypothesis: random kill points (one or two successive crashes, the second often
inside recovery) and fault schedules, then recovery; the same invariants as the
crash matrix must hold."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
from conftest import PrefectEnv
from crash_matrix import STEPS, Case, ForkServer, child_spec, env_for_children
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from payments import Payments
from test_crash_matrix import check

from coder_chat.emulator import Emulator
from flows.params import WorkflowSettings
from flows.recovery import recover_turn
from flows.workflow import agent_workflow

FIRST = [
    "turn.before_create:1",
    "turn.after_create:1",
    "turn.after_checkpoint:1",
    "turn.mid_stream:1",
    "turn.mid_stream:2",
    "tool.before_effect:1",
    "tool.before_effect:2",
    "tool.after_effect:1",
    "tool.after_effect:2",
    "tool.after_done:1",
    "tool.after_done:2",
    "turn.before_persist:1",
    "turn.before_persist:2",
]
SECOND = [
    "recovery.before_interrupt:1",
    "recovery.after_verdict:1",
    "recovery.after_submit:1",
    "recovery.before_resubmit:1",
    "tool.redrive.before_effect:1",
    "tool.after_done:1",
    "turn.mid_stream:1",
    "turn.before_persist:1",
]
FAULTS = [None, "drop_response_messages", "fail_tool_results_once"]


@pytest.fixture(scope="module")
async def server(
    prefect_env: PrefectEnv, payments: Payments, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ForkServer]:
    srv = ForkServer(
        env_for_children(prefect_env.child_env(), payments.url),
        tmp_path_factory.mktemp("fork-prop") / "stderr.log",
    )
    await srv.start()
    yield srv
    await srv.stop()


@pytest.fixture(scope="module")
async def baseline_prop(settings_prop: WorkflowSettings) -> list[str]:
    results = await agent_workflow(f"r-prop-base-{uuid.uuid4().hex[:6]}", STEPS, settings_prop)
    return [r.text for r in results]


@pytest.fixture(scope="module")
def settings_prop(coder_block: str, sqlite_block: str, payments: Payments) -> WorkflowSettings:
    return WorkflowSettings(
        credentials_block=coder_block,
        store_block=sqlite_block,
        retries=0,
        retry_delay_s=0,
        lease_wait_s=20,
        lease_ttl_s=1,
        settle_wait_s=5,
        redial_backoff_ms=20,
        artifacts=False,
        tool_modules=["flows.demo_tools", "payment_tools"],
    )


@settings(
    max_examples=4,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    first=st.sampled_from(FIRST),
    second=st.one_of(st.none(), st.sampled_from(SECOND)),
    fault=st.sampled_from(FAULTS),
    mode=st.sampled_from(["rerun", "recover-turn"]),
)
async def test_random_crash_schedules_recover(
    first: str,
    second: str | None,
    fault: str | None,
    mode: str,
    server: ForkServer,
    baseline_prop: list[str],
    settings_prop: WorkflowSettings,
    payments: Payments,
    emu: Emulator,
) -> None:
    workflow_id = f"r-prop-{uuid.uuid4().hex[:10]}"
    spec = child_spec(workflow_id, settings_prop)
    if fault == "drop_response_messages":
        emu.faults.drop_response(1, method="POST", path="/messages")
    elif fault == "fail_tool_results_once":
        emu.faults.fail_rest(1, status=503, method="POST", path="/tool-results")
    try:
        rc = await server.run(first, spec)
    finally:
        emu.faults.clear()
    assert rc in (-9, 0, 3), server.stderr_tail()
    if second is not None:
        rc = await server.run(second, spec)
        assert rc in (-9, 0, 3), server.stderr_tail()
    if mode == "recover-turn":
        report = await recover_turn(
            workflow_id, steps=STEPS, settings=settings_prop, finish_workflow=True
        )
        assert report.finished_workflow
    results = await agent_workflow(workflow_id, STEPS, settings_prop)
    # any schedule may resubmit a step once (a cut-short or unlanded attempt)
    await check(
        Case("random", may_resubmit=frozenset({"plan", "pay"})),
        workflow_id,
        results,
        baseline_prop,
        payments,
        emu,
    )
