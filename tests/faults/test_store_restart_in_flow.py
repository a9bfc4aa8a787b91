"""Issue 30, item 1, through a durable workflow: the step's PostgreSQL store restarts
(``pg_ctl stop -m fast`` + start) exactly between a ledgered tool's effect and its
``done`` write, inside a real ``agent_workflow`` run on the session's Prefect test
server, against the emulator.

The ``done`` write finds PostgreSQL down for longer than the store's own retry bound
(``transient_retry_s``; it is started again for the failed turn's checkpoint). Before
the fix the model was told ``Tool failed: … [SQL: INSERT INTO coder_state_tool_ledger …]`` and the step completed
on that. Now the turn fails retryably with the pause unanswered, the task retry's
recovery re-drives the call from the ``committing`` row under the same key, and the
step completes with the charge's real answer: one charge in the tool's own log, one
user message, nothing of the store in anything the Coder server received.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from faults_effects import EffectLog
from faults_pg import PrivateCluster
from pydantic import SecretStr

from coder_chat.crash_safe import add_crash_hook
from coder_chat.emulator.server import Emulator
from prefect_coder.blocks import ChatStateStore, CoderCredentials
from prefect_coder.flows.common.params import Step, WorkflowSettings, step_marker
from prefect_coder.flows.deployments.agent_workflow import agent_workflow


@pytest.fixture
def effect_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[EffectLog]:
    path = tmp_path / "effects.jsonl"
    monkeypatch.setenv("FAULTS_EFFECT_LOG", str(path))
    yield EffectLog(path)


async def test_store_restart_between_effect_and_done_in_a_workflow(
    prefect_harness: Any,
    chatd_emulator: Emulator,
    private_pg: PrivateCluster,
    effect_log: EffectLog,
) -> None:
    emu = chatd_emulator
    suffix = uuid.uuid4().hex[:8]
    await CoderCredentials(
        base_url=emu.base_url,
        organization_id=uuid.UUID(emu.organization_id),
        token=SecretStr(emu.token),
        request_timeout=15.0,
        turn_timeout=30.0,
    ).save(f"faults-coder-{suffix}", overwrite=True)
    # A short retry bound: the store rides out a restart by itself (issue 30, items 2-3),
    # so PostgreSQL stays down across the done write until the bound is spent.
    await ChatStateStore(
        url=private_pg.url, tenant=f"faults-{suffix}", connect_timeout=1.0, transient_retry_s=0.3
    ).save(f"faults-pg-{suffix}", overwrite=True)
    settings = WorkflowSettings(
        credentials_block=f"faults-coder-{suffix}",
        store_block=f"faults-pg-{suffix}",
        retries=2,
        retry_delay_s=0,
        lease_wait_s=20,
        lease_ttl_s=10,
        settle_wait_s=5,
        redial_backoff_ms=20,
        tool_modules=["fault_tools"],
    )
    workflow_id = f"faults-{suffix}"
    script = [
        {"tool_calls": [{"name": "fault_charge", "args": {"amount_cents": 700}}]},
        {"text": "charged 700"},
    ]
    steps = [
        Step(name="pay", prompt="Charge it. #emu " + json.dumps(script), tools=["fault_charge"]),
    ]

    def restart_store(point: str) -> None:
        if point == "tool.after_effect" and not restarted:
            restarted.append(point)
            private_pg.stop()  # down across the done write, longer than the retry bound
        elif point == "turn.before_checkpoint" and restarted and not private_pg.running:
            private_pg.start()  # back for the failed turn's checkpoint and the retry

    restarted: list[str] = []
    remove = add_crash_hook(restart_store)
    try:
        results = await agent_workflow(workflow_id, steps, settings)
    finally:
        remove()
    assert restarted  # the restart happened between the effect and the done write
    assert [r.text for r in results] == ["charged 700"]  # type: ignore[union-attr]
    [key] = effect_log.keys()
    # One charge. The done write failed and the retry re-drove the same key (2 requests).
    assert (effect_log.effects(), effect_log.requests(key)) == (1, 2)
    chat_id = key.split("/")[1]
    received = json.dumps([emu.event_log(), emu.messages(chat_id)], default=str)
    for leak in ("InterfaceError", "SQL", "INSERT", "Tool failed", str(private_pg.port)):
        assert leak not in received
    users = [m for m in emu.messages(chat_id, include_system=False) if m["role"] == "user"]
    marker = step_marker(workflow_id, "pay")
    assert sum(marker in json.dumps(m["content"]) for m in users) == 1
