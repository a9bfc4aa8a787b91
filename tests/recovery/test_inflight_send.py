"""The send window: the process dies with its ``POST /messages`` in flight, and the
server commits it only later. Recovery must sleep out the journaled send's commit
horizon, see the late turn, and return ITS result — not queue a duplicate."""

from __future__ import annotations

import pytest
from crash_matrix import ForkServer, child_spec, directive, run_workflow, user_texts

from coder_chat.emulator import Emulator
from prefect_coder.flows.common.params import Step, WorkflowSettings, step_marker

HORIZON_S = 6.0
LATE_COMMIT_S = 3.0


@pytest.fixture
def long_horizon(monkeypatch: pytest.MonkeyPatch) -> None:
    # The in-process rerun's horizon (the crashed child's is its own environment's).
    monkeypatch.setenv("PREFECT_CODER_COMMIT_HORIZON_S", str(HORIZON_S))


TEXT_STEPS = [
    Step(name="plan", prompt="Plan." + directive({"text": "A plan."})),
    Step(name="answer", prompt="Answer." + directive({"text": "The answer.", "deltas": 4})),
]


async def test_late_landing_send_is_waited_for_and_recovered(
    fork_server: ForkServer,
    settings: WorkflowSettings,
    workflow_id: str,
    emu: Emulator,
    long_horizon: None,
) -> None:
    # The second step's send is held LATE_COMMIT_S by the server before it commits;
    # the process is SIGKILLed 0.5 s after the request left, while it is in flight.
    emu.faults.delay_commit(LATE_COMMIT_S, method="POST", path="/messages")
    try:
        rc = await fork_server.run(
            "turn.sending:1+0.5", child_spec(workflow_id, settings, steps=TEXT_STEPS)
        )
    finally:
        emu.faults.clear()
    assert rc == -9, fork_server.stderr_tail()
    results = await run_workflow(workflow_id, TEXT_STEPS, settings)
    assert [r.text for r in results] == ["A plan.", "The answer."]
    # The late turn is the only attempt of "answer": recovered after the horizon
    # sleep, never resubmitted (a resubmission would have queued a duplicate).
    assert results[1].attempt == 1 and results[1].generate_ms == 0
    chat_id = results[1].chat_id
    marker = step_marker(workflow_id, "answer")
    assert sum(marker in t for t in user_texts(emu, chat_id)) == 1
    assert emu.chat(chat_id)["status"] not in ("running", "requires_action", "pending")
