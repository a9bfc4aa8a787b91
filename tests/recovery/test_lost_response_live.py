"""A tool-results POST that lands but whose response is lost, while the model's
continuation is still live server-side (chaos seeds 44 and 61, issue 11 items 1
and 6).

The step fails transiently; the agent must NOT interrupt the live continuation
(leave it for recovery), and the rerun follows it: one user turn, no interrupt,
each charge applied once under its own call id's key, and the step's answer is
the continuation's (never the cut-short attempt's empty text).

No kill: the fault comes from the emulator's fault API (``drop_response``). Counts
come from the emulator's event log and the payments service.
"""

from __future__ import annotations

import pytest
from crash_matrix import STEPS, run_workflow, workflow_chat
from payments import Payments
from test_crash_followups import _charge, _interrupts, _pay, _transcript, assert_finished_once

from coder_chat.emulator import Emulator
from prefect_coder.flows.common.params import WorkflowSettings, step_marker

#: The continuation's model work after the lost response: longer than the failed
#: run's exit and the rerun's start, so the rerun finds it live; shorter than the
#: step's request timeout below.
CONTINUATION_S = 2.5


@pytest.mark.parametrize(
    "lost_again",
    [None, "following", "reconciling"],
    ids=["once", "again-while-following", "again-while-reconciling"],
)
async def test_a_lost_tool_results_response_leaves_the_continuation_live_and_it_is_followed(
    lost_again: str | None,
    settings: WorkflowSettings,
    workflow_id: str,
    emu: Emulator,
    payments: Payments,
) -> None:
    steps = [
        _pay(
            _charge(250, "Charging the rest now."),
            _charge(30, "Now the fee.", sleep=CONTINUATION_S),
            {"text": "All paid.", "deltas": 3, "delay": 0.01},
        ),
    ]
    settings = settings.model_copy(update={"request_timeout_s": 4 * CONTINUATION_S})
    # pay's first tool results land, their response is lost.
    emu.faults.drop_response(1, method="POST", path="/tool-results")
    try:
        with pytest.raises(Exception):  # noqa: B017 - the transient failure, whatever its type
            await run_workflow(workflow_id, steps, settings)
    finally:
        emu.faults.clear()
    # The rerun of "again-while-reconciling" starts only once the continuation paused
    # on its call (which never ran): recovery answers that pause itself (reconcile)
    # and the answer's response is lost — history then shows the answer landed.
    chat = await workflow_chat(
        emu, workflow_id, status="requires_action" if lost_again == "reconciling" else None
    )
    # The failed run left the live continuation alone (checked before the rerun too).
    assert _interrupts(emu, chat) == 0, _transcript(emu, chat)
    if lost_again:
        # The follower's (or the reconcile's) answer to the continuation's pause
        # lands, its response is lost too: recovery goes on following the run
        # instead of failing or cutting it short.
        emu.faults.drop_response(1, method="POST", path="/tool-results")
    try:
        results = await run_workflow(workflow_id, steps, settings)
    finally:
        emu.faults.clear()
    assert [r.text for r in results] == ["All paid."], _transcript(emu, chat)
    assert [c.name for c in results[0].tool_calls] == ["charge_card", "charge_card"]
    # pay's and the continuation's calls, each once; never resubmitted, never cut short
    await assert_finished_once(emu, payments, chat, step_marker(workflow_id, "pay"), calls=2)


async def test_a_landed_send_whose_response_was_lost_is_followed_not_resubmitted(
    settings: WorkflowSettings,
    workflow_id: str,
    emu: Emulator,
    payments: Payments,
    baseline: list[str],
) -> None:
    # plan creates the chat (POST /chats); pay's POST /messages lands, its response is
    # lost. The rerun finds pay's turn by its marker (landed: the count is past the
    # journal's) and follows or recovers it: the step is never sent a second time.
    emu.faults.drop_response(1, method="POST", path="/messages")
    try:
        with pytest.raises(Exception):  # noqa: B017 - the transient failure, whatever its type
            await run_workflow(workflow_id, STEPS, settings)
    finally:
        emu.faults.clear()
    chat = await workflow_chat(emu, workflow_id)
    assert _interrupts(emu, chat) == 0, _transcript(emu, chat)
    results = await run_workflow(workflow_id, STEPS, settings)
    assert [r.text for r in results] == baseline, _transcript(emu, chat)
    # plan's and pay's calls, each once; pay never resubmitted, never cut short
    await assert_finished_once(emu, payments, chat, step_marker(workflow_id, "pay"), calls=2)
