"""A workflow's FIRST turn whose stream is lost for good after a tool's effect
committed (chaos seed 540).

The chat is created by the turn; its first charge runs and is recorded; then the
emulator drops every stream and refuses the redials, so the turn fails with
``CoderStreamError`` (redials exhausted). The SDK discards a session it created when
its stream cannot be re-established; the turn used to record that chat *stranded*,
so the rerun's orphan check left it for the sweep, sent the step again in a new chat
and the model charged again under a new key (a new chat: the ledger knows no earlier
attempt) — one charge applied twice. Now the turn checkpoints that chat with the
step's write-ahead and the rerun recovers the step on it: each charge once.

Faults come from the emulator's fault API, armed at the crash point after the first
charge's ``done`` write; counts come from the payments service and the event log.
"""

from __future__ import annotations

from typing import Any

import pytest
from crash_matrix import chats_of, run_workflow
from payments import Payments
from test_crash_followups import _charge, _pay, _transcript

from coder_chat.crash_safe import add_crash_hook
from coder_chat.emulator import Emulator
from coder_chat.errors import CoderStreamError
from prefect_coder.flows.common.params import WorkflowSettings, step_marker


def _charged(payments: Payments, chat_ids: list[str]) -> list[int]:
    """The amounts applied (once per key) on the workflow's chats."""
    with payments.lock:
        return sorted(
            int(payments.answers[k]["charged_cents"])
            for k, n in payments.effects.items()
            for _ in range(n)
            if any(f"/{c}/" in k for c in chat_ids)
        )


async def test_a_first_turn_whose_stream_is_lost_after_a_charge_is_recovered_on_its_chat(
    settings: WorkflowSettings, workflow_id: str, emu: Emulator, payments: Payments
) -> None:
    steps = [
        _pay(
            _charge(101, "Charging the deposit."),
            _charge(30, "Now the fee.", sleep=0.5),
            {"text": "All paid.", "deltas": 3, "delay": 0.01},
        )
    ]
    armed: list[str] = []

    def lose_the_stream(point: str) -> None:
        if point == "tool.after_done" and not armed:
            armed.append(point)
            # Every redial refused, the open stream dropped: redials run out.
            emu.faults.refuse_upgrades(503, count=1000)
            emu.faults.drop_stream()

    remove = add_crash_hook(lose_the_stream)
    try:
        with pytest.raises(CoderStreamError):
            await run_workflow(workflow_id, steps, settings)
    finally:
        remove()
        emu.faults.clear()
    assert armed, "the first charge never completed"
    first = [str(c["id"]) for c in chats_of(emu, workflow_id)]
    assert len(first) == 1, first
    results = await run_workflow(workflow_id, steps, settings)
    chats = [str(c["id"]) for c in chats_of(emu, workflow_id)]
    transcript: list[Any] = [_transcript(emu, c) for c in chats]
    assert [r.text for r in results] == ["All paid."], transcript
    # Each charge applied once, on the workflow's one chat.
    assert _charged(payments, chats) == [30, 101], transcript
    assert chats == first, transcript
    marker = step_marker(workflow_id, "pay")
    users = [
        m
        for m in emu.messages(first[0], include_system=False)
        if m["role"] == "user" and marker in str(m["content"])
    ]
    assert 1 <= len(users) <= 2, transcript  # the step, maybe resubmitted once (cut short)
