"""The run page tells the story: one log line per client tool call — its name, call
id, time and outcome; for a failure its exception type and error id — and never its
arguments or output (issue 31 §3: the logs showed nothing during a 55 s turn).

Three links, each tested where it lives: the agent emits one ``ToolRun`` transport
event per executed call; the turn's observer turns it into a line; and a workflow's
failing tool call reaches the flow run's logs on the Prefect server (the test
harness ships WARNING and above, so the failure line is the one read back)."""

from __future__ import annotations

import asyncio
import logging

from flow_helpers import TOKEN, emu_directive
from prefect import get_client
from prefect.client.schemas.sorting import LogSort
from pydantic import BaseModel

from coder_chat import CoderAgent
from coder_chat.emulator import Emulator
from coder_chat.events import ToolRun, TransportEvent
from coder_chat.tools import ToolContext, client_tool
from prefect_coder.flows.common.params import Step, WorkflowSettings
from prefect_coder.flows.observe.observer import describe
from prefect_coder.tools import registered_tool

SECRET_ARG = "arg-value-never-logged"


class Note(BaseModel):
    body: str


@registered_tool(name="run_page_broken_tool", description="Always fails (tests).")
async def run_page_broken_tool(args: Note, ctx: ToolContext) -> str:
    raise RuntimeError(f"postgresql://app:{SECRET_ARG}@db.internal/app")


def test_the_observer_writes_one_line_per_call_without_arguments() -> None:
    ok = describe(
        ToolRun(
            chat_id="c", tool_call_id="call-1", tool_name="lookup", duration_ms=12.0, outcome="ok"
        )
    )
    assert ok is not None and ok.level == logging.INFO
    assert ok.message == "tool lookup (call call-1) answered in 0.01 s"
    failed = describe(
        ToolRun(
            chat_id="c",
            tool_call_id="call-2",
            tool_name="charge",
            duration_ms=2500.0,
            outcome="error",
            error="RuntimeError [tool-err-1a2b3c4d]",
        )
    )
    assert failed is not None and failed.level == logging.WARNING
    assert "RuntimeError [tool-err-1a2b3c4d]" in failed.message and "2.50 s" in failed.message


async def test_the_agent_emits_one_tool_run_per_executed_call(emu: Emulator) -> None:
    @client_tool(description="Echo the body back.")
    async def echo(args: Note, ctx: ToolContext) -> str:
        return args.body

    seen: list[TransportEvent] = []
    script = [
        {
            "tool_calls": [
                {"name": "echo", "args": {"body": SECRET_ARG}},
                {"name": "echo", "args": {"body": "two"}},
            ]
        },
        {"text": "done"},
    ]
    agent = CoderAgent(
        base_url=emu.base_url,
        token=TOKEN,
        organization_id=emu.organization_id,
        tools=[echo],
        on_transport_event=seen.append,
    )
    try:
        result = await agent.generate("go" + emu_directive(script), timeout=30)
    finally:
        await agent.aclose()
    assert result.text == "done"
    runs = [e for e in seen if isinstance(e, ToolRun)]
    assert sorted(r.tool_call_id for r in runs) == sorted(
        c.tool_call_id for c in result.client_tool_calls
    )
    assert {(r.tool_name, r.outcome) for r in runs} == {("echo", "ok")}
    assert all(SECRET_ARG not in repr(r) for r in runs)


async def test_a_failing_tool_call_is_a_line_in_the_flow_runs_log(
    emu: Emulator, settings: WorkflowSettings, workflow_id: str
) -> None:
    from prefect_coder.flows.deployments.agent_workflow import agent_workflow

    script = [
        {"tool_calls": [{"name": "run_page_broken_tool", "args": {"body": SECRET_ARG}}]},
        {"text": "the tool failed"},
    ]
    steps = [
        Step(name="broken", prompt="go" + emu_directive(script), tools=["run_page_broken_tool"])
    ]
    (result,) = await agent_workflow(workflow_id, steps, settings)
    assert result.text == "the tool failed"
    prefix = "[broken] tool run_page_broken_tool (call "
    async with get_client() as client:
        # Logs are shipped in batches by a background worker: a look every 0.25 s.
        for _ in range(40):
            logs = await client.read_logs(limit=200, sort=LogSort.TIMESTAMP_DESC)
            lines = [log.message for log in logs if log.message.startswith(prefix)]
            if lines:
                break
            await asyncio.sleep(0.25)
    assert len(lines) == 1, lines
    assert "failed: RuntimeError [tool-err-" in lines[0] and "(the model was told)" in lines[0]
    assert all(SECRET_ARG not in log.message for log in logs)


async def test_each_step_is_a_start_and_an_end_line_in_the_runs_log(
    emu: Emulator, settings: WorkflowSettings, workflow_id: str
) -> None:
    from prefect_coder.flows.deployments.agent_workflow import agent_workflow

    # The test harness ships WARNING and up; a deployment logs INFO (Prefect's
    # default), which is what this test turns back on for the task runs' logger.
    task_log = logging.getLogger("prefect.task_runs")
    level = task_log.level
    task_log.setLevel(logging.INFO)
    try:
        steps = [
            Step(name="first", prompt="one" + emu_directive({"text": "1"})),
            Step(name="second", prompt="two" + emu_directive({"text": "2"})),
        ]
        results = await agent_workflow(workflow_id, steps, settings)
    finally:
        task_log.setLevel(level)
    assert [r.text for r in results] == ["1", "2"]
    chat_id = results[0].chat_id
    wanted = {
        f"step {name}: {what}" for name in ("first", "second") for what in ("started", "completed")
    }
    async with get_client() as client:
        for _ in range(40):
            logs = await client.read_logs(limit=200, sort=LogSort.TIMESTAMP_DESC)
            mine = [log.message for log in logs if log.message.startswith("step ")]
            found = {m.split(" in ")[0].rstrip() for m in mine} & wanted
            if found == wanted:
                break
            await asyncio.sleep(0.25)
    assert found == wanted, mine
    done = [m for m in mine if m.startswith("step second: completed in ")]
    assert f"(attempt 1, chat {chat_id}, 0 tool call(s))" in done[0]
