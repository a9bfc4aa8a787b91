"""The ``recover-turn`` flow's own modes (the crash matrix covers resubmission)."""

from __future__ import annotations

from crash_matrix import STEPS, ForkServer, child_spec

from coder_chat.emulator import Emulator
from flows.params import WorkflowSettings, step_marker
from flows.recovery import recover_turn


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


async def test_read_only_recovery_reports_a_cut_short_attempt(
    settings: WorkflowSettings, workflow_id: str, fork_server: ForkServer, emu: Emulator
) -> None:
    rc = await fork_server.run("turn.mid_stream:2", child_spec(workflow_id, settings))
    assert rc == -9, fork_server.stderr_tail()
    report = await recover_turn(workflow_id, resubmit=False, settings=settings)
    assert report.action == "would-resubmit", report
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
