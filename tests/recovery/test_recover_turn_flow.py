"""The ``recover-turn`` flow's own modes (the crash matrix covers resubmission)."""

from __future__ import annotations

import json
from typing import Any

from crash_matrix import STEPS, ForkServer, child_spec, turn_record
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

from coder_chat.emulator import Emulator
from prefect_coder.flows.common.params import WorkflowSettings, step_marker
from prefect_coder.flows.deployments.recover_turn import recover_turn


async def test_nothing_to_recover(settings: WorkflowSettings, workflow_id: str) -> None:
    report = await recover_turn(workflow_id, settings=settings)
    assert report.action == "nothing" and "no checkpoint" in report.reason


async def test_read_only_recovery_returns_a_finished_attempt_without_sending(
    settings: WorkflowSettings, workflow_id: str, fork_server: ForkServer, emu: Emulator
) -> None:
    # the second step finished server-side, then its process died before the result
    rc = await fork_server.run("turn.before_persist:2", child_spec(workflow_id, settings))
    assert rc == -9, fork_server.stderr_tail()
    report = await recover_turn(workflow_id, resubmit=False, settings=settings)
    assert report.action == "recovered", report
    assert report.step == "pay" and report.result is not None
    assert "charged" in report.result.text
    assert report.chat_id is not None
    users = [m for m in emu.messages(report.chat_id, include_system=False) if m["role"] == "user"]
    assert len(users) == 2  # nothing was resubmitted
    # the rebuilt result's record fields, as generate() would have filled them
    ids, _ = turn_record(emu, report.chat_id, report.result.user_message_id)
    assert ids and report.result.message_ids == ids, (report.result.message_ids, ids)
    assert report.result.usage.get("output_tokens", 0) > 0, report.result.usage


async def test_read_only_recovery_answers_the_crashed_attempts_pause_and_follows_it(
    settings: WorkflowSettings,
    workflow_id: str,
    fork_server: ForkServer,
    emu: Emulator,
    baseline: list[str],
) -> None:
    # pay is killed mid-stream: its call pauses, never run. Read-only recovery sends
    # nothing, but the pause is the crashed attempt's own: its call is run through
    # the ledger and the revived run followed to its answer (not cut short).
    rc = await fork_server.run("turn.mid_stream:2", child_spec(workflow_id, settings))
    assert rc == -9, fork_server.stderr_tail()
    report = await recover_turn(workflow_id, resubmit=False, settings=settings)
    assert report.action == "recovered", report
    assert report.result is not None and report.result.text == baseline[1]
    assert report.chat_id is not None
    # nothing left paused or running, and no second turn sent
    assert emu.chat(report.chat_id)["status"] in ("waiting", "error")
    marker = step_marker(workflow_id, "pay")
    texts = [
        "".join(p.get("text", "") for p in m["content"])
        for m in emu.messages(report.chat_id, include_system=False)
        if m["role"] == "user"
    ]
    assert sum(marker in t for t in texts) == 1
    assert STEPS[1].name == "pay"


async def test_recovery_decisions_are_published_as_a_table_artifact(
    settings: WorkflowSettings, workflow_id: str, fork_server: ForkServer
) -> None:
    rc = await fork_server.run("tool.after_done:2", child_spec(workflow_id, settings))
    assert rc == -9, fork_server.stderr_tail()
    loud = settings.model_copy(update={"artifacts": True})
    report = await recover_turn(workflow_id, resubmit=False, settings=loud)
    assert report.action == "recovered", report
    async with get_client() as client:
        arts = await client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(like_="coder-recovery-%")),
        )
    mine = [a for a in arts if a.description and workflow_id in a.description]
    assert mine, [a.key for a in arts]
    data: Any = mine[0].data
    rows: list[dict[str, str]] = json.loads(data) if isinstance(data, str) else data
    stages = [r["stage"] for r in rows]
    # the pause answered from the ledger, then the revived run followed to its settle
    assert stages[0] == "settle" and "reconcile" in stages and stages[-1] == "follow"
    assert all(r["seen"] and r["decided"] and r["why"] for r in rows)
    assert any("submit-recorded" in r["decided"] for r in rows)
