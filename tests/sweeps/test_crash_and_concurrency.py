"""A real SIGKILL between create and checkpoint leaves an orphan the sweep retires;
sweeps running beside live workflows lose nothing and break no turn."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

from flow_helpers import user_messages
from sweep_helpers import directive, wait_status

from blocks import StateStore
from coder_chat.emulator import Emulator
from coder_chat.rest import ChatClient
from flows.labels import LABEL_FLOW_RUN, LABEL_WORKFLOW
from flows.params import Step, WorkflowSettings, step_marker
from flows.sweeps import SweepOptions, sweep_orphans, sweep_stuck_turns
from flows.workflow import agent_workflow

HERE = Path(__file__).resolve().parent


async def test_a_crash_after_create_before_checkpoint_leaves_an_orphan_the_sweep_retires(
    emu: Emulator,
    client: ChatClient,
    settings: WorkflowSettings,
    store: StateStore,
    workflow_id: str,
    options: SweepOptions,
    prefect_env: object,
) -> None:
    step = Step(name="first", prompt="start" + directive({"text": "done", "deltas": 3}))
    spec = {
        "workflow_id": workflow_id,
        "step": step.model_dump(),
        # the killed process's workflow lease lapses after this ttl
        "settings": settings.model_copy(update={"lease_ttl_s": 1.0}).model_dump(),
    }
    proc = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, str(HERE / "sweep_crash_child.py")],
        env=prefect_env.subprocess_env(SWEEP_SPEC=json.dumps(spec)),  # type: ignore[attr-defined]
        capture_output=True,
        text=True,
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
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            str(HERE / "sweep_crash_child.py"),
            env=prefect_env.subprocess_env(  # type: ignore[attr-defined]
                SWEEP_SPEC=json.dumps(spec), SWEEP_CRASH_AT="none"
            ),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
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
            assert child.returncode is None  # still mid-stream
        finally:
            child.kill()  # a real SIGKILL: no finally block runs
            await child.wait()
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


async def test_sweeps_beside_live_workflows_lose_nothing_and_break_no_turn(
    emu: Emulator,
    client: ChatClient,
    settings: WorkflowSettings,
    store: StateStore,
    workflow_id: str,
    options: SweepOptions,
) -> None:
    def step(i: int) -> Step:
        # the middle step is long, so that sweeps surely meet a live turn
        deltas, delay = (12, 0.1) if i == 1 else (3, 0.02)
        script = {"text": f"answer {i}", "deltas": deltas, "delay": delay}
        return Step(name=f"s{i}", prompt=f"step {i}" + directive(script))

    steps = [step(i) for i in range(3)]
    ids = [f"{workflow_id}-{n}" for n in range(2)]
    keep = settings.model_copy(update={"keep_chat": True})
    workflows = asyncio.gather(
        agent_workflow(ids[0], steps, keep),
        agent_workflow(ids[1], steps, settings),  # archives its own chat at the end
    )
    reports = []

    def live_turn() -> bool:
        return any(
            c["status"] == "running" and any(i in str(c.get("labels")) for i in ids)
            for c in emu.chats()
        )

    async def sweep_until_done() -> None:
        while not workflows.done():
            if not live_turn():
                await asyncio.sleep(0.02)
                continue
            # The harshest bounds: no grace, every running or paused chat "stuck".
            reports.append(await sweep_orphans(settings, grace_s=0, options=options))
            reports.append(
                await sweep_stuck_turns(
                    settings, turn_budget_s=0.01, action_budget_s=0.01, options=options
                )
            )

    sweeping = asyncio.create_task(sweep_until_done())
    results = await workflows
    await sweeping
    assert len(reports) >= 2

    for wid, turns in zip(ids, results, strict=True):
        assert [t.text for t in turns] == [f"answer {i}" for i in range(3)]
        chat_id = turns[0].chat_id
        assert {t.chat_id for t in turns} == {chat_id}
        # every step sent exactly once: nothing resubmitted, nothing interrupted
        sent = user_messages(emu, chat_id)
        assert len(sent) == 3 and all(step_marker(wid, f"s{i}") in sent[i] for i in range(3))
        assert all(t.finish_reason == "stop" for t in turns)
    for wid in ids[:1]:
        cp = await store.checkpoints.get(wid)
        assert cp is not None
        assert not (await client.get_chat(cp.chat_id)).archived  # kept chats stay live
    assert not any(r.failed for r in reports)
    touched = {row.decision for r in reports for row in r.rows}
    # the sweeps did meet live turns (and left them alone): not a vacuous pass
    assert "busy" in touched and touched <= {"busy", "wait", "keep"}, touched
    # afterwards the kept chats are still accounted for; nothing left to retire
    final = await sweep_orphans(settings, grace_s=0, options=options)
    assert final.count("retire") == 0 and final.count("keep") == 2
