"""Crash-matrix rows of issue 11, each crashed by a real SIGKILL of the process running
the workflow (forked from the warm server) and recovered at once by a plain rerun:

* a long model continuation after a tool result: the rerun follows the crashed
  attempt (no interrupt, no resubmission, the continuation's next client tool is
  answered once through the ledger);
* a crashed attempt paused on a call that never ran: recovery runs the call through
  the ledger and follows the revived run (nothing resubmitted, nothing interrupted);
  past the attempt's turn deadline it is stopped instead (double interrupt: the
  resumed model pauses again);
* an applied effect the server recorded as "timed out": the step fails with
  ``ToolOutcomeLostError`` instead of returning the model's answer;
* ``eager_checkpoint: false``: a finished first step is recovered, never resent;
* a structured step whose answers never validate: the re-ask, then a typed failure.

Counts come from the emulator's event log (user messages, status transitions) and
the payments service (effects per idempotency key); no wall-clock assertion.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from crash_matrix import (
    STEPS,
    ForkServer,
    charge_calls,
    child_spec,
    crash,
    crash_to_chat,
    directive,
    run_workflow,
    workflow_chat,
)
from payments import Payments

from coder_chat.emulator import Emulator
from coder_chat.recovery import ToolOutcomeLostError
from prefect_coder.errors import StructuredAnswerError
from prefect_coder.flows.common.params import Step, WorkflowSettings, step_marker

#: How long the scripted model keeps generating after the crash: long enough that the
#: rerun (lease lapse + flow start) finds it running on a loaded machine, short
#: enough to keep the file fast. The follow waits for it; nothing else sleeps.
CONTINUATION_S = 6.0
LIVE = {"running", "pending", "requires_action", "interrupting", "paused"}


def _charge(cents: int, text: str, **extra: Any) -> dict[str, Any]:
    return {
        "text": text,
        "deltas": 4,
        "delay": 0.01,
        "tool_calls": [{"name": "charge_card", "args": {"amount_cents": cents}}],
        **extra,
    }


def _pay(*steps: dict[str, Any]) -> Step:
    return Step(
        name="pay",
        prompt="Charge the rest." + directive({"steps": list(steps)}),
        tools=["charge_card"],
    )


def _user_turns(emu: Emulator, chat_id: str, marker: str) -> list[str]:
    """User messages of the chat carrying ``marker``: ids from the event log, texts
    from the stored rows."""
    ids = {
        e["details"]["id"]
        for e in emu.event_log(["message"])
        if e["chat_id"] == chat_id and e["details"]["role"] == "user"
    }
    out = []
    for m in emu.messages(chat_id, include_system=False):
        if m["id"] in ids:
            text = "".join(p.get("text", "") for p in m.get("content") or [])
            if marker in text:
                out.append(text)
    return out


def _interrupts(emu: Emulator, chat_id: str) -> int:
    """Interrupts the server accepted on the chat (status → interrupting, or a paused
    chat's pending calls closed as "interrupted by user")."""
    status = [
        e
        for e in emu.event_log(["status"])
        if e["chat_id"] == chat_id and e["details"]["new"] == "interrupting"
    ]
    synthetic = [
        p
        for m in emu.messages(chat_id, include_system=False)
        for p in m.get("content") or []
        if p.get("type") == "tool-result" and "interrupted by user" in str(p.get("result"))
    ]
    return len(status) + len(synthetic)


def _transcript(emu: Emulator, chat_id: str) -> list[str]:
    """A compact history, for assertion messages."""
    out = []
    for m in emu.messages(chat_id, include_system=False):
        for p in m.get("content") or []:
            kind = p.get("type")
            if kind == "text":
                out.append(f"{m['id']} {m['role']}: {p.get('text', '')[:40]}")
            elif kind in ("tool-call", "tool-result"):
                detail = p.get("args") if kind == "tool-call" else p.get("result")
                out.append(f"{m['id']} {kind} {p.get('tool_call_id')} {str(detail)[:40]}")
    return out


def _effects(payments: Payments, chat_id: str) -> dict[str, int]:
    return payments.effects_with_prefix(f"/{chat_id}/")


async def _at_rest(emu: Emulator, chat_id: str) -> None:
    for _ in range(200):
        if emu.chat(chat_id)["status"] not in LIVE:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(emu.chat(chat_id)["status"])


async def assert_finished_once(
    emu: Emulator, payments: Payments, chat_id: str, marker: str, *, calls: int
) -> None:
    """The step's crashed (or failed) attempt was finished, never resubmitted or cut
    short: one user turn carries ``marker``, the server accepted no interrupt, the
    chat holds ``calls`` charge calls (none repeated under a new id), each call's
    effect happened once under its own call id's key, and the chat came to rest."""
    transcript = "\n".join(_transcript(emu, chat_id))
    assert len(_user_turns(emu, chat_id, marker)) == 1, transcript  # nothing resubmitted
    assert _interrupts(emu, chat_id) == 0, transcript  # never cut short
    ids = charge_calls(emu, chat_id)
    assert len(ids) == calls, transcript
    effects = _effects(payments, chat_id)
    assert sorted(effects.values()) == [1] * calls, f"{effects}\n{transcript}"
    assert {k.rsplit("/", 1)[-1] for k in effects} == set(ids), effects
    await _at_rest(emu, chat_id)


async def test_a_long_continuation_after_a_tool_result_is_followed_not_resubmitted(
    fork_server: ForkServer,
    settings: WorkflowSettings,
    workflow_id: str,
    emu: Emulator,
    payments: Payments,
    baseline: list[str],
) -> None:
    # pay: a charge, then a long continuation that calls a second client tool.
    steps = [
        STEPS[0],
        _pay(
            _charge(250, "Charging the rest now."),
            _charge(30, "Now the fee.", sleep=CONTINUATION_S),
            {"text": "All paid.", "deltas": 3, "delay": 0.01},
        ),
    ]
    # The continuation is one segment longer than the suite's 5 s request timeout would
    # allow: give the step a segment budget that fits it, or a fast rerun (which follows
    # more of the sleep) would time out where the original attempt would have too.
    settings = settings.model_copy(update={"request_timeout_s": 2.5 * CONTINUATION_S})
    spec = child_spec(workflow_id, settings, steps=steps)
    # SIGKILL right after pay's first tool results landed: the model keeps going.
    chat = await crash_to_chat(fork_server, "turn.after_tool_results:2", spec, emu, workflow_id)
    assert emu.chat(chat)["status"] == "running"  # the crashed attempt lives on
    results = await run_workflow(workflow_id, steps, settings)
    assert [r.text for r in results] == [baseline[0], "All paid."]
    # the continuation's pause was answered by the follower, with the step's result
    assert [c.name for c in results[1].tool_calls] == ["charge_card", "charge_card"]
    # plan's, pay's, the continuation's: no repeated call, the continuation not cut
    await assert_finished_once(emu, payments, chat, step_marker(workflow_id, "pay"), calls=3)


def _two_rounds() -> list[Step]:
    """plan as in the matrix; pay: two client tool rounds, then the answer."""
    return [
        STEPS[0],
        _pay(
            _charge(250, "Charging the rest now."),
            _charge(30, "Now the fee."),
            {"text": "All paid.", "deltas": 3, "delay": 0.01},
        ),
    ]


async def test_a_crashed_attempts_pause_whose_call_never_ran_is_answered_and_followed(
    fork_server: ForkServer,
    settings: WorkflowSettings,
    workflow_id: str,
    emu: Emulator,
    payments: Payments,
    baseline: list[str],
) -> None:
    steps = _two_rounds()
    spec = child_spec(workflow_id, settings, steps=steps)
    # SIGKILL while pay streams: its first call then pauses with no ledger entry (it
    # never ran). The pause is pay's own crashed attempt, within its turn deadline:
    # recovery runs the call through the ledger (the call id's key), submits, and
    # follows the revived run, whose next pause (the fee) the follower answers.
    chat = await crash_to_chat(
        fork_server, "turn.mid_stream:2", spec, emu, workflow_id, status="requires_action"
    )
    results = await run_workflow(workflow_id, steps, settings)
    assert [r.text for r in results] == [baseline[0], "All paid."]
    # plan's, pay's two rounds (no new id); the paused attempt was not cut short
    await assert_finished_once(emu, payments, chat, step_marker(workflow_id, "pay"), calls=3)


async def test_a_pause_past_its_turn_deadline_is_stopped_even_when_it_pauses_again(
    fork_server: ForkServer,
    settings: WorkflowSettings,
    workflow_id: str,
    emu: Emulator,
    payments: Payments,
    baseline: list[str],
) -> None:
    steps = _two_rounds()
    # A short turn deadline that every turn of this emulator run fits easily.
    turn_s = 4.0
    short = settings.model_copy(update={"turn_timeout_s": turn_s})
    spec = child_spec(workflow_id, short, steps=steps)
    chat = await crash_to_chat(
        fork_server, "turn.mid_stream:2", spec, emu, workflow_id, status="requires_action"
    )
    # The crashed attempt's deadline (its send + the turn timeout) has passed once a
    # turn timeout has gone by since the kill: a crash never extends a turn, so the
    # call that never ran is cut short. Interrupting the pause resumes the model,
    # which calls the next tool: it must be stopped again (one stop primitive).
    await asyncio.sleep(turn_s)
    # What ran before the kill: plan's charge, and pay's first one too when the kill
    # came at a later part of pay's turn (on a loaded machine the B1 era can deliver
    # the first round before its parts stream live, so the first streamed part — the
    # crash point — is the fee round's).
    before = _effects(payments, chat)
    results = await run_workflow(workflow_id, steps, short)
    assert [r.text for r in results] == [baseline[0], "All paid."]
    pay = step_marker(workflow_id, "pay")
    assert len(_user_turns(emu, chat, pay)) == 2  # the cut-short attempt + the resubmission
    assert _interrupts(emu, chat) >= 1
    effects = _effects(payments, chat)
    transcript = "\n".join([str(before), str(effects), *_transcript(emu, chat)])
    # every effect once under its own key, and each charge once: plan's, pay's and
    # the fee. A pay charge that ran before the kill is not run again when the
    # resubmitted attempt repeats it (the ledger answers it from the applied call,
    # 41523e3), so the resubmission adds only what had not run.
    assert set(effects.values()) == {1}, transcript
    assert len(effects) == 3, transcript
    assert before.keys() <= effects.keys(), transcript
    # the stopped calls never ran: no effect under a call the interrupt closed
    stopped = {
        p["tool_call_id"]
        for m in emu.messages(chat, include_system=False)
        for p in m.get("content") or []
        if p.get("type") == "tool-result" and "interrupted by user" in str(p.get("result"))
    }
    assert stopped, transcript
    assert not {k.rsplit("/", 1)[-1] for k in effects} & stopped, transcript
    await _at_rest(emu, chat)


async def test_a_revived_runs_next_pause_is_answered_by_following(
    fork_server: ForkServer,
    settings: WorkflowSettings,
    workflow_id: str,
    emu: Emulator,
    payments: Payments,
    baseline: list[str],
) -> None:
    steps = _two_rounds()
    spec = child_spec(workflow_id, settings, steps=steps)
    # SIGKILL inside pay's first tool after its write-ahead: recovery re-drives it
    # (same key) and submits; the revived run then pauses on the fee, which the
    # follower answers instead of cutting the attempt short.
    chat = await crash_to_chat(fork_server, "tool.before_effect:2", spec, emu, workflow_id)
    results = await run_workflow(workflow_id, steps, settings)
    assert [r.text for r in results] == [baseline[0], "All paid."]
    await assert_finished_once(emu, payments, chat, step_marker(workflow_id, "pay"), calls=3)


async def test_an_applied_effect_recorded_as_timed_out_fails_the_step(
    fork_server: ForkServer,
    settings: WorkflowSettings,
    workflow_id: str,
    emu: Emulator,
    payments: Payments,
) -> None:
    spec = child_spec(workflow_id, settings)
    # SIGKILL after pay's effect committed and the ledger says done, before submission.
    chat = await crash_to_chat(fork_server, "tool.after_done:2", spec, emu, workflow_id)
    # Nobody answers the pause in time: chatd writes "Tool execution timed out" and
    # the model answers on that basis.
    assert emu.expire_requires_action(chat)
    await emu.await_status(chat, "waiting")
    with pytest.raises(ToolOutcomeLostError) as info:
        await run_workflow(workflow_id, STEPS, settings)
    err = info.value
    assert err.chat_id == chat
    assert [(name, state) for _, name, state, _ in err.calls] == [("charge_card", "done")]
    assert err.calls[0][3] == {"charged_cents": 250, "status": "charged"}
    pay = step_marker(workflow_id, "pay")
    assert len(_user_turns(emu, chat, pay)) == 1  # not resubmitted
    effects = _effects(payments, chat)
    assert sorted(effects.values()) == [1, 1], effects  # plan's and pay's, once each
    await _at_rest(emu, chat)


async def test_without_the_eager_checkpoint_a_finished_first_step_is_not_resent(
    fork_server: ForkServer,
    settings: WorkflowSettings,
    workflow_id: str,
    emu: Emulator,
    payments: Payments,
) -> None:
    # A first step that runs no crash-safe tool: nothing but the turn's own
    # checkpoint records its send.
    hello = Step(
        name="plan",
        prompt="Say hello." + directive({"text": "Hello there.", "deltas": 3, "delay": 0.01}),
    )
    steps = [hello, STEPS[1]]
    lazy = settings.model_copy(update={"eager_checkpoint": False})
    spec = child_spec(workflow_id, lazy, steps=steps)
    # SIGKILL between the finally checkpoint and Prefect persisting the result.
    await crash(fork_server, "turn.before_persist:1", spec)
    results = await run_workflow(workflow_id, steps, lazy)
    assert results[0].text == "Hello there."
    assert results[0].generate_ms == 0  # recovered from history
    chat = await workflow_chat(emu, workflow_id)
    assert len(_user_turns(emu, chat, step_marker(workflow_id, "plan"))) == 1
    assert len(_user_turns(emu, chat, step_marker(workflow_id, "pay"))) == 1
    assert sorted(_effects(payments, chat).values()) == [1]


async def test_a_structured_step_that_never_validates_fails_after_the_reask(
    settings: WorkflowSettings, workflow_id: str, emu: Emulator
) -> None:
    steps = [
        Step(
            name="propose",
            prompt="Propose a fix." + directive({"structured_output": {"summary": 3}}),
            output_model="fix_plan",
        )
    ]
    with pytest.raises(StructuredAnswerError) as info:
        await run_workflow(workflow_id, steps, settings)
    assert info.value.step == "propose"
    assert info.value.output_model == "fix_plan"
    chat = info.value.chat_id
    assert chat is not None
    turns = _user_turns(emu, chat, step_marker(workflow_id, "propose"))
    assert len(turns) == 2  # the prompt, then exactly one re-ask
    assert "#emu" not in turns[1]
