"""A step result rebuilt from history carries what the same step's result carries
when nothing crashed: ``message_ids`` (the turn's assistant and tool messages) and
``usage`` (their wire usage, summed), not empty fields.

Through the real path: the workflow runs in a forked process SIGKILLed after pay's
turn ended but before Prefect persisted its result; the rerun's ``TurnRecovery``
classifies pay "recovered" and rebuilds it from the chat's history. plan's result is
the crashed run's own, stored by Prefect: the reference for what ``generate()``
records. Both are checked against the emulator's stored rows. (The other rebuild,
from history when a later step was sent after the step, is checked in
test_lost_and_archived.py.)
"""

from __future__ import annotations

from crash_matrix import STEPS, ForkServer, child_spec, crash_to_chat, run_workflow, turn_record

from coder_chat.emulator import Emulator
from prefect_coder.flows.common.params import WorkflowSettings


async def test_a_recovered_result_has_the_turns_message_ids_and_usage(
    fork_server: ForkServer,
    settings: WorkflowSettings,
    workflow_id: str,
    emu: Emulator,
    baseline: list[str],
) -> None:
    spec = child_spec(workflow_id, settings)
    chat = await crash_to_chat(fork_server, "turn.before_persist:2", spec, emu, workflow_id)
    plan, pay = await run_workflow(workflow_id, STEPS, settings)
    assert [plan.text, pay.text] == baseline
    assert plan.generate_ms > 0  # the crashed run's stored result: what generate() gave
    assert pay.generate_ms == 0  # rebuilt from history, nothing sent
    for result in (plan, pay):
        assert result.chat_id == chat
        ids, usage = turn_record(emu, chat, result.user_message_id)
        # a charge_card round: the call's assistant message, our tool result, the answer
        assert len(ids) == 3, ids
        assert result.message_ids == ids, (result.step, result.message_ids, ids)
        got = {
            "input_tokens": result.usage.get("no_cache_input_tokens"),
            "output_tokens": result.usage.get("output_tokens"),
            "total_tokens": result.usage.get("total_tokens"),
        }
        assert got == usage and usage["output_tokens"] > 0, (result.step, result.usage, usage)
    # the same record fields, rebuilt or not
    assert set(pay.usage) == set(plan.usage)
