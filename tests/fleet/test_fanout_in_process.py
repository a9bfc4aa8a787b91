"""What a fan-out's workflows get inside one flow run (``run_many_in_process``: the body of
every ``agent-fanout-shard`` run, and of ``agent_fanout`` called without a deployment).

* ``max_parallel`` bounds the workflows driven at once (no turn cap here, so only it can
  keep the emulator's count of running turns down).
* A step's result is in result storage the moment the step ends, while its workflow
  goes on (issue 15: a step that was a task nested in a per-workflow task was written
  only when the whole workflow ended, so a crash lost every finished step in flight).
  The next step is held running on the emulator while the test looks: an order fact,
  not a timing.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from fleet_env import TOKEN
from support.prefect_blocks import emulator_credentials, save_settings

from coder_chat.emulator import Emulator
from prefect_coder.flows.common.labels import LABEL_WORKFLOW
from prefect_coder.flows.common.params import Step, step_marker
from prefect_coder.flows.common.results import result_key
from prefect_coder.flows.deployments.agent_fanout import FanoutItem, agent_fanout


def _step(workflow_id: str, name: str, seconds: float) -> Step:
    # The marker makes each step's prompt (and so its turn) distinct.
    prompt = f'{step_marker(workflow_id, name)} #emu {{"sleep": {seconds}, "text": "done {name}"}}'
    return Step(name=name, prompt=prompt)


async def test_max_parallel_bounds_the_workflows_run_at_once(
    prefect_server: Path, emu: Emulator, store_url: str
) -> None:
    settings = await save_settings("par", emulator_credentials(emu, TOKEN), store_url)
    run = uuid.uuid4().hex[:6]
    ids = [f"par-{run}-{i}" for i in range(6)]
    items = [FanoutItem(workflow_id=w, steps=[_step(w, "s", 1.0)]) for w in ids]
    outcomes = await agent_fanout(items, settings, max_parallel=2)
    assert [o.ok for o in outcomes] == [True] * len(ids)
    assert len(emu.event_log(["turn_start"])) == len(ids)
    # Six one-second turns started together would overlap six deep; the bound is 2.
    assert 1 <= emu.max_concurrent_turns() <= 2


async def test_a_steps_result_is_stored_while_its_workflow_goes_on(
    prefect_server: Path, emu: Emulator, store_url: str
) -> None:
    results_dir = prefect_server
    settings = await save_settings("stored", emulator_credentials(emu, TOKEN), store_url)
    run = uuid.uuid4().hex[:6]
    slow, quick = f"slow-{run}", f"quick-{run}"
    items = [
        # Its second step runs (server-side) until the test interrupts it.
        FanoutItem(workflow_id=slow, steps=[_step(slow, "a", 0.0), _step(slow, "b", 600.0)]),
        FanoutItem(workflow_id=quick, steps=[_step(quick, "x", 0.0)]),
    ]
    fanout = asyncio.create_task(agent_fanout(items, settings, fail_on_error=False))
    try:

        def slow_chat_turns() -> tuple[str, int] | None:
            chats = [c["id"] for c in emu.chats() if c["labels"].get(LABEL_WORKFLOW) == slow]
            if not chats:
                return None
            starts = [e for e in emu.event_log(["turn_start"]) if e["chat_id"] == chats[0]]
            return chats[0], len(starts)

        chat_id = ""
        for _ in range(2400):  # bounded: 2 min on a loaded machine
            seen = slow_chat_turns()
            if (seen and seen[1] == 2) or fanout.done():
                chat_id = seen[0] if seen else ""
                break
            await asyncio.sleep(0.05)
        assert not fanout.done(), fanout.result()
        assert chat_id, "step b of the slow workflow never started"
        # Step b runs (and will until interrupted) — step a's result is stored already,
        # under its stable key, in the flow run's result storage.
        assert emu.chat(chat_id)["status"] == "running"
        stored = results_dir / result_key(slow, "a")
        assert stored.exists(), sorted(p.name for p in results_dir.iterdir())
        assert "done a" in stored.read_text()
        # The neighbour finished meanwhile, its result stored too. Polled for its
        # content, not the file's existence: Prefect creates the file before writing it,
        # and a read in between saw it empty (a loaded CI run).
        quick_file = results_dir / result_key(quick, "x")
        for _ in range(2400):
            if quick_file.exists() and "done x" in quick_file.read_text():
                break
            await asyncio.sleep(0.05)
        assert "done x" in quick_file.read_text()
        assert not (results_dir / result_key(slow, "b")).exists()
        assert emu.chat(chat_id)["status"] == "running"  # still: the look was mid-workflow
        async with emulator_credentials(emu, TOKEN).get_client() as coder:
            await coder.interrupt_chat(chat_id)
        outcomes = await asyncio.wait_for(fanout, 120)
    finally:
        if not fanout.done():
            fanout.cancel()
    assert [o.workflow_id for o in outcomes] == [slow, quick]
    assert outcomes[1].ok
