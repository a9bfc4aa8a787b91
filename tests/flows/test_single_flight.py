"""Single-flight across worker processes on a shared PostgreSQL store: two runs of
the same workflow never run turns at the same time; a waiting run either gets the
finished steps from storage (sending nothing) or gives up with a clear message."""

from __future__ import annotations

import asyncio
from typing import Any

from flow_helpers import ROOT, emu_directive, user_messages
from warm_python import Child, WarmPython

from coder_chat.emulator import Emulator
from prefect_coder.blocks import ChatStateStore
from prefect_coder.blocks.state import workflow_key
from prefect_coder.flows.common.params import Step, WorkflowSettings, step_marker
from prefect_coder.flows.common.results import TurnResult

CHILD = """
import asyncio, sys
from prefect_coder.flows.common.params import Step, WorkflowSettings
from prefect_coder.flows.deployments.agent_workflow import agent_workflow
settings = WorkflowSettings.model_validate_json(sys.argv[1])
steps = [Step.model_validate_json(s) for s in sys.argv[3:]]
results = asyncio.run(agent_workflow(sys.argv[2], steps, settings))
for r in results:
    print("RESULT " + r.model_dump_json())
"""


def _start(
    warm: WarmPython, prefect_env: Any, settings: WorkflowSettings, wf: str, steps: list[Step]
) -> Child:
    # A process of its own per run (forked from the session's warm process: no
    # second import of Prefect), each with its own connection to the store.
    return warm.start(
        ["-c", CHILD, settings.model_dump_json(), wf, *[s.model_dump_json() for s in steps]],
        env=prefect_env.subprocess_env(),
        cwd=ROOT,
    )


def _results(stdout: str) -> list[TurnResult]:
    return [
        TurnResult.model_validate_json(line.removeprefix("RESULT "))
        for line in stdout.splitlines()
        if line.startswith("RESULT ")
    ]


async def test_two_worker_processes_never_run_a_workflow_concurrently(
    emu: Emulator,
    settings: WorkflowSettings,
    pg_block: str,
    workflow_id: str,
    prefect_env: object,
    warm_python: WarmPython,
) -> None:
    steps = [
        Step(name="one", prompt="1" + emu_directive({"text": "one", "deltas": 5, "delay": 0.1})),
        Step(name="two", prompt="2" + emu_directive({"text": "two", "deltas": 5, "delay": 0.1})),
    ]
    base = settings.model_copy(update={"store_block": pg_block, "keep_chat": True})
    store = (await ChatStateStore.aload(pg_block)).get_store()
    try:
        # Someone else (this test) drives the workflow while three runs start: C may
        # wait only briefly and must give up; A and B wait, then race each other.
        async with store.lease(workflow_key(workflow_id), ttl=5, wait=5):
            patient = base.model_copy(update={"lease_wait_s": 60})
            a = _start(warm_python, prefect_env, patient, workflow_id, steps)
            b = _start(warm_python, prefect_env, patient, workflow_id, steps)
            c = _start(
                warm_python,
                prefect_env,
                base.model_copy(update={"lease_wait_s": 0.3}),
                workflow_id,
                steps,
            )
            c_done = await c.communicate(limit_s=120)
        a_done, b_done = await asyncio.gather(
            a.communicate(limit_s=120), b.communicate(limit_s=120)
        )
    finally:
        await store.aclose()

    assert c_done.returncode != 0
    assert f"workflow {workflow_id!r} is busy" in c_done.stderr
    assert a_done.returncode == 0, a_done.stderr[-3000:]
    assert b_done.returncode == 0, b_done.stderr[-3000:]
    ra, rb = _results(a_done.stdout), _results(b_done.stdout)
    assert [r.text for r in ra] == ["one", "two"]
    assert ra == rb  # the loser of each race got the winner's stored result

    # One chat, exactly one send per step: no turn ran twice or alongside another.
    chat_id = ra[0].chat_id
    owners = {
        ch["id"]
        for ch in emu.chats()
        if any(workflow_id in m for m in user_messages(emu, ch["id"]))
    }
    assert owners == {chat_id}
    sent = [m.split(" ", 1)[0] for m in user_messages(emu, chat_id)]
    assert sent == [step_marker(workflow_id, "one"), step_marker(workflow_id, "two")]
