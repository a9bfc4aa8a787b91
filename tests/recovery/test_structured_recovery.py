"""Structured-output steps: a crash after the answer was filed recovers the last
validating ``structured_output`` input from history — the same answer a
fault-free run returns — without resubmitting."""

from __future__ import annotations

import pytest
from crash_matrix import ForkServer, child_spec, directive, run_workflow, user_texts

from coder_chat.emulator import Emulator
from prefect_coder.flows.common.params import Step, WorkflowSettings, step_marker

PLAN = {"summary": "Pin the date parser.", "files": ["dates.py"], "risk": "low"}
STEPS = [
    Step(
        name="propose",
        prompt="Propose a fix."
        + directive(
            {
                "steps": [
                    {"structured_output": {"summary": 3}},  # invalid: must not shadow
                    {"structured_output": PLAN},
                    {"text": "Filed the plan."},
                ]
            }
        ),
        output_model="fix_plan",
    )
]


@pytest.mark.parametrize("point", ["turn.after_checkpoint:1", "turn.before_persist:1"])
async def test_structured_answer_is_recovered_not_resubmitted(
    point: str,
    fork_server: ForkServer,
    settings: WorkflowSettings,
    workflow_id: str,
    emu: Emulator,
) -> None:
    base = await run_workflow(f"{workflow_id}-base", STEPS, settings)
    assert base[0].structured == PLAN
    rc = await fork_server.run(point, child_spec(workflow_id, settings, steps=STEPS))
    assert rc == -9, fork_server.stderr_tail()
    results = await run_workflow(workflow_id, STEPS, settings)
    assert results[0].structured == base[0].structured
    assert results[0].text == base[0].text == "Filed the plan."
    marker = step_marker(workflow_id, "propose")
    assert sum(marker in t for t in user_texts(emu, results[0].chat_id)) == 1
    if point == "turn.before_persist:1":
        assert results[0].generate_ms == 0  # recovered from history, nothing sent
    # after_checkpoint: the checkpoint is written off the stream's dial, so the kill
    # lands either before the pauses were answered (the ack replayed, the revived run
    # followed) or after the turn finished (recovered) — both send nothing (above).
