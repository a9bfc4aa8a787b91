"""A real SIGKILL between create and checkpoint leaves an orphan the sweep retires;
sweeps running beside live workflows lose nothing and break no turn."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

from flow_helpers import ROOT, user_messages
from pydantic import BaseModel
from sweep_helpers import directive, wait_status
from warm_python import WarmPython

from coder_chat.emulator import Emulator
from coder_chat.rest import ChatClient
from coder_chat.tools import ToolContext, client_tool
from prefect_coder.blocks import StateStore
from prefect_coder.flows.common.labels import LABEL_FLOW_RUN, LABEL_WORKFLOW
from prefect_coder.flows.common.params import Step, WorkflowSettings, step_marker
from prefect_coder.flows.deployments.agent_workflow import agent_workflow
from prefect_coder.flows.deployments.sweep_orphans import sweep_orphans
from prefect_coder.flows.deployments.sweep_stuck_turns import sweep_stuck_turns
from prefect_coder.flows.sweeps.options import SweepOptions
from prefect_coder.flows.sweeps.report import SweepReport
from prefect_coder.tools import register_tool

HERE = Path(__file__).resolve().parent


async def test_a_crash_after_create_before_checkpoint_leaves_an_orphan_the_sweep_retires(
    emu: Emulator,
    client: ChatClient,
    settings: WorkflowSettings,
    store: StateStore,
    workflow_id: str,
    options: SweepOptions,
    prefect_env: object,
    warm_python: WarmPython,
) -> None:
    step = Step(name="first", prompt="start" + directive({"text": "done", "deltas": 3}))
    spec = {
        "workflow_id": workflow_id,
        "step": step.model_dump(),
        # the killed process's workflow lease lapses after this ttl
        "settings": settings.model_copy(update={"lease_ttl_s": 1.0}).model_dump(),
    }
    # A process of its own (forked from the warm one: no Prefect import), SIGKILLed.
    proc = await asyncio.to_thread(
        warm_python.run,
        [str(HERE / "sweep_crash_child.py")],
        env=prefect_env.subprocess_env(SWEEP_SPEC=json.dumps(spec)),  # type: ignore[attr-defined]
        cwd=ROOT,
        timeout=90,
    )
    assert proc.returncode == -9, proc.stdout + proc.stderr
    marker = step_marker(workflow_id, "first")
    [orphan] = [
        c["id"] for c in emu.chats() if any(marker in m for m in user_messages(emu, c["id"]))
    ]
    assert await store.checkpoints.get(workflow_id) is None  # no finally ran
    chat = await client.get_chat(orphan)
    assert chat.labels[LABEL_WORKFLOW] == workflow_id and chat.labels[LABEL_FLOW_RUN]
    # its first turn runs on server-side and settles with nobody listening
    await wait_status(client, orphan, "waiting")

    protected = await sweep_orphans(settings, grace_s=3600, options=options)
    assert [r.decision for r in protected.rows] == ["wait"]
    assert not (await client.get_chat(orphan)).archived

    # the dead run's lease lapses within its ttl; until then the chat is left alone
    patient = options.model_copy(update={"lease_wait_s": 3.0})
    report = await sweep_orphans(settings, grace_s=0, options=patient)
    [row] = report.rows
    assert (row.chat_id, row.decision, row.ok) == (orphan, "retire", True)
    assert (await client.get_chat(orphan)).archived


async def test_the_eager_checkpoint_option_decides_who_owns_a_chat_after_a_mid_stream_crash(
    emu: Emulator,
    client: ChatClient,
    settings: WorkflowSettings,
    store: StateStore,
    workflow_id: str,
    options: SweepOptions,
    prefect_env: object,
    warm_python: WarmPython,
) -> None:
    async def crash(wid: str, eager: bool) -> str:
        slow = directive({"text": "long", "deltas": 30, "delay": 0.1})
        spec = {
            "workflow_id": wid,
            "step": Step(name="s", prompt="go" + slow).model_dump(),
            "settings": settings.model_copy(
                update={"lease_ttl_s": 1.0, "eager_checkpoint": eager}
            ).model_dump(),
        }
        child = await asyncio.to_thread(
            warm_python.start,
            [str(HERE / "sweep_crash_child.py")],
            env=prefect_env.subprocess_env(  # type: ignore[attr-defined]
                SWEEP_SPEC=json.dumps(spec), SWEEP_CRASH_AT="none"
            ),
            cwd=ROOT,
        )
        try:
            marker = step_marker(wid, "s")
            chat = None
            for _ in range(3000):  # until its stream is connected
                found = [
                    c["id"]
                    for c in emu.chats()
                    if any(marker in m for m in user_messages(emu, c["id"]))
                ]
                if found and any(e["chat_id"] == found[0] for e in emu.event_log(["ws_connect"])):
                    chat = found[0]
                    break
                await asyncio.sleep(0.01)
            assert chat is not None
            if eager:
                for _ in range(300):
                    if await store.checkpoints.get(wid) is not None:
                        break
                    await asyncio.sleep(0.01)
            else:
                await asyncio.sleep(0.3)  # the dial is long past: nothing was written
            assert child.poll() is None  # still mid-stream
        finally:
            child.kill()  # a real SIGKILL: no finally block runs
            await child.communicate(30)
        return chat

    # Both children are killed mid-stream, after the dial, before their `finally`.
    eager_chat, lazy_chat = await asyncio.gather(
        crash(f"{workflow_id}-e", True), crash(f"{workflow_id}-l", False)
    )
    cp = await store.checkpoints.get(f"{workflow_id}-e")
    assert cp is not None and cp.chat_id == eager_chat  # the dial made it durable
    assert await store.checkpoints.get(f"{workflow_id}-l") is None
    for chat in (eager_chat, lazy_chat):
        await wait_status(client, chat, "waiting")
    patient = options.model_copy(update={"lease_wait_s": 3.0})
    report = await sweep_orphans(settings, grace_s=0, options=patient)
    [row] = report.rows
    assert (row.chat_id, row.decision) == (lazy_chat, "retire")  # an orphan without it
    assert (await client.get_chat(lazy_chat)).archived
    assert not (await client.get_chat(eager_chat)).archived  # resumable by its workflow


class _Nothing(BaseModel):
    pass


#: The gate tool holds its turn (paused in requires_action, its process answering)
#: until the test opens it: sweeps then surely meet a live turn, however slow
#: the machine is.
_gate = threading.Event()


@client_tool(name="sweep_gate", description="Wait for the test to open the gate.")
async def _sweep_gate(args: _Nothing, ctx: ToolContext) -> str:
    # a threading.Event: Prefect may run the task on another thread's loop
    await asyncio.to_thread(_gate.wait, 60)
    return "gate opened"


register_tool(_sweep_gate, replace=True)


async def test_sweeps_beside_live_workflows_lose_nothing_and_break_no_turn(
    emu: Emulator,
    client: ChatClient,
    settings: WorkflowSettings,
    store: StateStore,
    workflow_id: str,
    options: SweepOptions,
) -> None:
    gated = [{"tool_calls": [{"name": "sweep_gate", "args": {}}]}, {"text": "answer 1"}]
    steps = [
        Step(name="s0", prompt="step 0" + directive({"text": "answer 0"})),
        Step(name="s1", prompt="step 1" + directive(gated), tools=["sweep_gate"]),
        Step(name="s2", prompt="step 2" + directive({"text": "answer 2", "deltas": 4})),
    ]
    ids = [f"{workflow_id}-{n}" for n in range(2)]
    # The gated turn stays paused while the sweep pairs run; at load ~22 they took
    # long enough that the credentials' 30 s turn timeout ended it (TimedOut). This
    # test is about what the sweeps do to live turns, not about the turn timeout.
    settings = settings.model_copy(update={"turn_timeout_s": 120.0})
    keep = settings.model_copy(update={"keep_chat": True})
    _gate.clear()
    workflows = asyncio.gather(
        agent_workflow(ids[0], steps, keep),
        agent_workflow(ids[1], steps, settings),  # archives its own chat at the end
    )

    # The harshest bounds: no grace, every running or paused chat "stuck".
    async def sweep() -> None:
        reports.append(await sweep_orphans(settings, grace_s=0, options=options))
        reports.append(
            await sweep_stuck_turns(
                settings, turn_budget_s=0.01, action_budget_s=0.01, options=options
            )
        )

    reports: list[SweepReport] = []
    try:
        for _ in range(2000):  # both turns paused in their (live) client tool
            paused = [
                c
                for c in emu.chats()
                if c["status"] == "requires_action" and any(i in str(c.get("labels")) for i in ids)
            ]
            if len(paused) == 2 or workflows.done():
                break
            await asyncio.sleep(0.01)
        assert len(paused) == 2
        await sweep()
        await sweep()
    finally:
        _gate.set()
    while not workflows.done():  # and on, while the workflows finish
        await sweep()
    results = await workflows

    for wid, turns in zip(ids, results, strict=True):
        assert [t.text for t in turns] == [f"answer {i}" for i in range(3)]
        chat_id = turns[0].chat_id
        assert {t.chat_id for t in turns} == {chat_id}
        # every step sent exactly once: nothing resubmitted, nothing interrupted
        sent = user_messages(emu, chat_id)
        assert len(sent) == 3 and all(step_marker(wid, f"s{i}") in sent[i] for i in range(3))
        [tool] = turns[1].tool_calls
        assert (tool.name, tool.output, tool.is_error) == ("sweep_gate", "gate opened", False)
    cp = await store.checkpoints.get(ids[0])
    assert cp is not None and not (await client.get_chat(cp.chat_id)).archived  # kept live
    assert not any(r.failed for r in reports)
    busy = [row for r in reports[:4] for row in r.rows]
    # the stuck sweeps met both paused turns and left them to their live runs
    assert [row.decision for row in busy] == ["busy"] * 4, busy
    touched = {row.decision for r in reports for row in r.rows}
    assert touched <= {"busy", "wait", "keep"}, touched
    # afterwards the chats are still accounted for; nothing left to retire
    final = await sweep_orphans(settings, grace_s=0, options=options)
    assert final.count("retire") == 0 and final.count("keep") == 2
