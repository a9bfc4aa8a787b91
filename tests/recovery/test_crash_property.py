"""Hypothesis: random kill points (one or two successive crashes, the second often
inside recovery) and fault schedules, then recovery; the same invariants as the
crash matrix must hold."""

from __future__ import annotations

import uuid

from crash_matrix import STEPS, Case, ForkServer, check, child_spec, run_workflow
from hypothesis import HealthCheck, given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st
from payments import Payments

from coder_chat.emulator import Emulator
from prefect_coder.flows.common.params import WorkflowSettings
from prefect_coder.flows.deployments.recover_turn import recover_turn

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


@hyp_settings(
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
    fork_server: ForkServer,
    baseline: list[str],
    settings: WorkflowSettings,
    payments: Payments,
    emu: Emulator,
) -> None:
    workflow_id = f"r-prop-{uuid.uuid4().hex[:10]}"
    spec = child_spec(workflow_id, settings)
    if fault == "drop_response_messages":
        emu.faults.drop_response(1, method="POST", path="/messages")
    elif fault == "fail_tool_results_once":
        emu.faults.fail_rest(1, status=503, method="POST", path="/tool-results")
    try:
        rc = await fork_server.run(first, spec)
    finally:
        emu.faults.clear()
    assert rc in (-9, 0, 3), fork_server.stderr_tail()
    if second is not None:
        rc = await fork_server.run(second, spec)
        assert rc in (-9, 0, 3), fork_server.stderr_tail()
    if mode == "recover-turn":
        report = await recover_turn(
            workflow_id, steps=STEPS, settings=settings, finish_workflow=True
        )
        assert report.finished_workflow
    results = await run_workflow(workflow_id, STEPS, settings)
    # each crash or failure may cut one live attempt short: one extra turn each
    failures = 1 + (second is not None) + (fault is not None)
    await check(
        Case("random", may_resubmit=frozenset({"plan", "pay"}), extra_turns=failures),
        workflow_id,
        results,
        baseline,
        payments,
        emu,
    )
