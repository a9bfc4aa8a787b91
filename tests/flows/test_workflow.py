"""agent_workflow end to end on the emulator: one chat, results by key, re-runs that
send nothing, a flow retry that resends only what never completed, archive only
at the end (and in the failure handler)."""

from __future__ import annotations

from flow_helpers import emu_directive, say, user_messages

from coder_chat.emulator import Emulator
from prefect_coder.blocks import StateStore
from prefect_coder.flows.common.params import Step, WorkflowSettings, step_marker
from prefect_coder.flows.deployments.agent_turn import agent_turn
from prefect_coder.flows.deployments.agent_workflow import agent_workflow
from prefect_coder.flows.deployments.archive_workflow_chat import archive_workflow_chat


def _archive_events(emu: Emulator, chat_id: str) -> list[dict]:
    return [e for e in emu.event_log(["archived"]) if e["chat_id"] == chat_id]


async def test_three_steps_on_one_chat_with_tool_and_structured_answer(
    emu: Emulator, settings: WorkflowSettings, workflow_id: str, store: StateStore
) -> None:
    steps = [
        Step(
            name="look",
            prompt="Look the build up."
            + emu_directive(
                [
                    {"tool_calls": [{"name": "lookup_build", "args": {"build_id": "nightly-7"}}]},
                    {"text": "It fails in test_parse_iso_week."},
                ]
            ),
            tools=["lookup_build"],
        ),
        Step(
            name="plan",
            prompt="Plan a fix."
            + emu_directive(
                [
                    {"structured_output": {"summary": "count from 1", "files": ["d.py"]}},
                    {"text": "Filed."},
                ]
            ),
            output_model="fix_plan",
        ),
        Step(name="wrap", prompt="Wrap up." + say("All done.")),
    ]
    results = await agent_workflow(workflow_id, steps, settings)

    assert [r.step for r in results] == ["look", "plan", "wrap"]
    chat_id = results[0].chat_id
    assert {r.chat_id for r in results} == {chat_id}
    (call,) = results[0].tool_calls
    assert (call.name, call.kind, call.args) == (
        "lookup_build",
        "client",
        {"build_id": "nightly-7"},
    )
    assert call.output["failing_test"].endswith("test_parse_iso_week")
    assert results[0].text == "It fails in test_parse_iso_week."
    assert results[1].structured == {"summary": "count from 1", "files": ["d.py"], "risk": "low"}
    assert results[2].text == "All done."
    assert all(r.finish_reason == "stop" for r in results)

    # One user message per step, each carrying its step marker, in order.
    sent = user_messages(emu, chat_id)
    assert [m.split(" ", 1)[0] for m in sent] == [step_marker(workflow_id, s.name) for s in steps]
    # Archived exactly once, after the last turn.
    assert emu.chat(chat_id)["archived"] is True
    log = [e for e in emu.event_log(["turn_end", "archived"]) if e["chat_id"] == chat_id]
    assert [e["kind"] for e in log][-1] == "archived"
    assert len(_archive_events(emu, chat_id)) == 1
    cp = await store.checkpoints.get(workflow_id)
    assert cp is not None and cp.chat_id == chat_id

    # Re-running the finished, archived workflow returns the stored results and
    # sends nothing (its final archive finds the chat already archived).
    messages = len(emu.messages(chat_id))
    assert await agent_workflow(workflow_id, steps, settings) == results
    assert len(emu.messages(chat_id)) == messages
    assert len(_archive_events(emu, chat_id)) == 1


async def test_rerun_of_a_finished_workflow_sends_nothing(
    emu: Emulator, settings: WorkflowSettings, workflow_id: str
) -> None:
    steps = [Step(name="a", prompt="A" + say("one")), Step(name="b", prompt="B" + say("two"))]
    keep = settings.model_copy(update={"keep_chat": True})
    first = await agent_workflow(workflow_id, steps, keep)
    chat_id = first[0].chat_id
    messages, chats = len(emu.messages(chat_id)), len(emu.chats())

    again = await agent_workflow(workflow_id, steps, keep)

    assert again == first
    assert len(emu.messages(chat_id)) == messages
    assert len(emu.chats()) == chats
    assert emu.chat(chat_id)["archived"] is False  # keep_chat


async def test_flow_retry_resends_only_the_step_that_never_completed(
    emu: Emulator, settings: WorkflowSettings, workflow_id: str
) -> None:
    steps = [
        Step(name="a", prompt="A" + say("one")),
        Step(name="b", prompt="B" + say("two")),
        Step(name="c", prompt="C" + say("three")),
    ]
    # Step b's send is refused (nothing committed); its task fails for good
    # (400 is not retryable), the flow fails, Prefect retries the flow run.
    emu.faults.fail_rest(1, status=400, method="POST", path="/messages")
    flow = agent_workflow.with_options(retries=1, retry_delay_seconds=0)
    try:
        results = await flow(workflow_id, steps, settings)
    finally:
        emu.faults.clear()

    chat_id = results[0].chat_id
    sent = [m.split(" ", 1)[0] for m in user_messages(emu, chat_id)]
    assert sent == [step_marker(workflow_id, s.name) for s in steps]
    assert [r.text for r in results] == ["one", "two", "three"]
    # b went through the resubmission seam as its second journaled attempt
    assert [r.attempt for r in results] == [1, 2, 1]
    assert len(_archive_events(emu, chat_id)) == 1


async def test_steps_as_separate_flow_runs_archive_only_when_asked(
    emu: Emulator, settings: WorkflowSettings, workflow_id: str
) -> None:
    one = await agent_turn(workflow_id, Step(name="one", prompt="1" + say("a")), settings)
    two = await agent_turn(workflow_id, Step(name="two", prompt="2" + say("b")), settings)
    assert one.chat_id == two.chat_id
    assert emu.chat(one.chat_id)["archived"] is False

    outcome = await archive_workflow_chat(workflow_id, settings)
    assert outcome.archived and outcome.archived_chat_ids == [one.chat_id]
    assert emu.chat(one.chat_id)["archived"] is True


async def test_failure_handler_archives_a_finally_failed_workflow(
    emu: Emulator, settings: WorkflowSettings, workflow_id: str
) -> None:
    steps = [
        Step(name="ok", prompt="fine" + say("fine")),
        Step(name="boom", prompt="fail" + emu_directive({"fatal": "provider says no"})),
        Step(name="never", prompt="unreached" + say("x")),
    ]
    try:
        await agent_workflow(workflow_id, steps, settings)
    except Exception as exc:
        assert "provider says no" in str(exc)
    else:
        raise AssertionError("the workflow should have failed")
    chat_id = next(
        c["id"] for c in emu.chats() if workflow_id in "".join(user_messages(emu, c["id"]))
    )
    assert len(user_messages(emu, chat_id)) == 2  # "never" was never sent
    assert emu.chat(chat_id)["archived"] is True
