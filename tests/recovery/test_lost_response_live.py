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
from crash_matrix import STEPS, run_workflow
from payments import Payments
from test_crash_followups import (
    _at_rest,
    _charge,
    _charge_calls,
    _effects,
    _interrupts,
    _main_chat,
    _pay,
    _transcript,
    _user_turns,
)

from coder_chat.emulator import Emulator
from prefect_coder.flows.parts.params import WorkflowSettings, step_marker

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
    chat = _main_chat(emu, workflow_id)
    pay = step_marker(workflow_id, "pay")
    # The failed run left the live continuation alone.
    assert _interrupts(emu, chat) == 0, _transcript(emu, chat)
    if lost_again == "reconciling":
        # The rerun starts only once the continuation paused on its call (which
        # never ran): recovery answers that pause itself (reconcile) and the
        # answer's response is lost — history then shows the answer landed.
        await emu.await_status(chat, "requires_action")
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
    assert len(_user_turns(emu, chat, pay)) == 1, _transcript(emu, chat)  # never resubmitted
    assert _interrupts(emu, chat) == 0, _transcript(emu, chat)  # never cut short
    calls = _charge_calls(emu, chat)
    assert len(calls) == 2, _transcript(emu, chat)  # pay's and the continuation's
    effects = _effects(payments, chat)
    assert sorted(effects.values()) == [1, 1], "\n".join([str(effects), *_transcript(emu, chat)])
    assert {k.rsplit("/", 1)[-1] for k in effects} == set(calls), effects
    await _at_rest(emu, chat)


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
    chat = _main_chat(emu, workflow_id)
    assert _interrupts(emu, chat) == 0, _transcript(emu, chat)
    results = await run_workflow(workflow_id, STEPS, settings)
    assert [r.text for r in results] == baseline, _transcript(emu, chat)
    pay = step_marker(workflow_id, "pay")
    assert len(_user_turns(emu, chat, pay)) == 1, _transcript(emu, chat)  # never resubmitted
    assert _interrupts(emu, chat) == 0, _transcript(emu, chat)
    effects = _effects(payments, chat)
    assert sorted(effects.values()) == [1, 1], "\n".join([str(effects), *_transcript(emu, chat)])
    await _at_rest(emu, chat)
