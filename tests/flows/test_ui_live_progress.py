"""A running turn shows its progress in the Prefect UI: one live markdown artifact,
updated at a bounded rate while the turn runs, finished with the turn's outcome;
the turn artifact and the live one link the chat's page in the Coder web UI."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import pytest
from flow_helpers import TOKEN, emu_directive, say
from prefect.client.orchestration import get_client
from prefect.client.schemas.sorting import ArtifactSort
from pydantic import BaseModel

from coder_chat.emulator import Emulator
from coder_chat.tools import ToolContext
from prefect_coder.flows.common.params import Step, WorkflowSettings
from prefect_coder.flows.common.results import TurnResult
from prefect_coder.flows.observe.artifacts import artifact_key
from prefect_coder.flows.observe.live_progress import INTERVAL_ENV
from prefect_coder.tools import registered_tool

INTERVAL_S = 0.3
FIRST = "The first half of a long answer streams in many small deltas, " * 3
SECOND = "and the second half arrives after the tool answered."
_gate: asyncio.Event | None = None


class Nothing(BaseModel):
    pass


@registered_tool(name="ui_test_gate", description="Wait until the test lets the turn go on.")
async def ui_test_gate(args: Nothing, ctx: ToolContext) -> str:
    """The turn's scripted pause: it lasts until the test has seen the live view."""
    assert _gate is not None
    await _gate.wait()
    return "go on"


async def _live_artifacts(workflow_id: str) -> list[Any]:
    async with get_client() as client:
        recent = await client.read_artifacts(sort=ArtifactSort.CREATED_DESC, limit=100)
    return [
        a
        for a in recent
        if (a.description or "").startswith(f"Live progress of Coder turn {workflow_id}/")
    ]


async def test_a_running_turn_shows_live_progress_at_a_bounded_rate(
    emu: Emulator,
    settings: WorkflowSettings,
    workflow_id: str,
    prefect_env: object,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from prefect_coder.flows.deployments.agent_workflow import agent_workflow

    global _gate
    _gate = asyncio.Event()
    monkeypatch.setenv(INTERVAL_ENV, str(INTERVAL_S))
    script = [
        {
            "text": FIRST,
            "deltas": 100,
            "delay": 0.001,
            "tool_calls": [{"name": "ui_test_gate", "args": {}}],
        },
        {"text": SECOND, "deltas": 100, "delay": 0.001},
    ]
    steps = [Step(name="slow", prompt="go" + emu_directive(script), tools=["ui_test_gate"])]
    t0 = time.monotonic()
    run = asyncio.create_task(agent_workflow(workflow_id, steps, settings))
    try:
        seen_running = None
        # The gate holds the turn until the live artifact is seen: a look every 0.1 s
        # (each reads 100 artifacts from the shared test server), bounded at 20 s.
        for _ in range(200):
            live = await _live_artifacts(workflow_id)
            if live and "client | awaiting result" in str(live[0].data):
                seen_running = live[0]
                break
            assert not run.done(), run
            await asyncio.sleep(0.1)
        assert seen_running is not None, "no live artifact while the turn ran"
    finally:
        _gate.set()  # the turn goes on only now: everything above saw it running
    md = str(seen_running.data)
    assert "**running**" in md and FIRST in md and SECOND not in md, md
    assert "| `ui_test_gate` | client | awaiting result |" in md, md

    results = await run
    elapsed = time.monotonic() - t0
    (turn,) = results
    assert isinstance(turn, TurnResult)
    chat_id = turn.chat_id
    assert turn.text.endswith(SECOND)

    (final,) = await _live_artifacts(workflow_id)
    assert final.id == seen_running.id  # one artifact, updated in place
    md = str(final.data)
    assert "finished — settled" in md and SECOND in md, md
    assert "| `ui_test_gate` | client | answered |" in md, md
    # A plain link (a code span inside link text showed literal backticks in the UI).
    assert f"[{chat_id}]({emu.base_url}/agents/{chat_id})" in md
    # Keyed, so the UI gives the card a title (untitled before).
    assert final.key == artifact_key(workflow_id, "slow", kind="live")
    updates = int(re.search(r"_update (\d+),", md).group(1))  # type: ignore[union-attr]
    # 200 text deltas, statuses, a tool call: unthrottled that is > 200 updates.
    assert 2 <= updates <= elapsed / INTERVAL_S + 3, (updates, elapsed)

    async with get_client() as client:
        recent = await client.read_artifacts(sort=ArtifactSort.CREATED_DESC, limit=100)
    turn_md = [a for a in recent if a.key == artifact_key(workflow_id, "slow")]
    assert turn_md and f"({emu.base_url}/agents/{chat_id})" in str(turn_md[0].data)
    assert not [a for a in recent if TOKEN in str(a.data)]


async def test_no_live_artifact_when_artifacts_are_off(
    emu: Emulator, settings: WorkflowSettings, workflow_id: str, prefect_env: object
) -> None:
    from prefect_coder.flows.deployments.agent_workflow import agent_workflow

    off = settings.model_copy(update={"artifacts": False})
    results = await agent_workflow(workflow_id, [Step(name="quiet", prompt="hi" + say("ok"))], off)
    assert isinstance(results[0], TurnResult) and results[0].text == "ok"
    assert await _live_artifacts(workflow_id) == []


async def test_a_turn_shorter_than_the_interval_gets_no_live_artifact(
    emu: Emulator,
    settings: WorkflowSettings,
    workflow_id: str,
    prefect_env: object,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from prefect_coder.flows.deployments.agent_workflow import agent_workflow

    # The first live publish waits one interval from the turn's start: a turn that
    # settles before then is shown by its finished-turn artifact alone (two API
    # calls fewer per short turn). 600 s: no loaded machine runs a one-line turn that long.
    monkeypatch.setenv(INTERVAL_ENV, "600")
    results = await agent_workflow(
        workflow_id, [Step(name="quick", prompt="hi" + say("ok"))], settings
    )
    assert isinstance(results[0], TurnResult) and results[0].text == "ok"
    assert await _live_artifacts(workflow_id) == []
    async with get_client() as client:
        recent = await client.read_artifacts(sort=ArtifactSort.CREATED_DESC, limit=100)
    assert [a for a in recent if a.key == artifact_key(workflow_id, "quick")]
