"""``sweep-stuck-turns`` never cuts short a checkpointed step's crashed attempt that is
still within its turn deadline (the chaos finding of seeds 14 and 71, docs/chaos.md).

A real SIGKILL (the crash matrix's fork server, ``tests/recovery``) leaves the step's
attempt live on the server; the sweep then runs with the chaos test's budgets
(0.01 s: everything running or paused is "stuck"):

* running (seed 71's path): the sweep **leaves** it; the workflow's rerun follows it;
* paused on a call that never ran (seed 14's path): the sweep **answers** it through
  the ledger (the call runs once, under its call id's key) instead of cutting it short;
* past the deadline (the workflow gone for good): the sweep interrupts / cuts short
  as before, journaling ``cut-short`` before its interrupt.

Before the fix both first cases ended with the rerun resubmitting the step, and the
model charged the attempt's committed first call again under a new call id: two
effects of one logical call. Counts come from the payments service (effects per
idempotency key) and the emulator's event log; no mock anywhere.
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

_TESTS = Path(__file__).resolve().parents[1]
for _p in (str(_TESTS / "recovery"), str(_TESTS / "chaos")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from chaos_runner import process_env  # noqa: E402
from crash_matrix import STEPS, ForkServer, child_spec, env_for_children, run_workflow  # noqa: E402
from payments import Payments, running_payments  # noqa: E402
from recovery_env import PrefectEnv  # noqa: E402
from test_crash_followups import (  # noqa: E402
    _at_rest,
    _charge,
    _charge_calls,
    _effects,
    _interrupts,
    _pay,
    _transcript,
    _user_turns,
)

from coder_chat.emulator import Emulator  # noqa: E402
from prefect_coder.blocks import ChatStateStore, StateStore  # noqa: E402
from prefect_coder.flows.deployments.sweep_settings import SweepSettings  # noqa: E402
from prefect_coder.flows.deployments.sweep_stuck_turns import sweep_stuck_turns  # noqa: E402
from prefect_coder.flows.parts.params import Step, WorkflowSettings, step_marker  # noqa: E402
from prefect_coder.flows.parts.sweep_options import SweepOptions  # noqa: E402
from prefect_coder.flows.parts.sweep_plan import (  # noqa: E402
    Action,
    SweepDecision,
    crashed_attempt_left,
    crashed_attempt_refinement,
)
from prefect_coder.flows.parts.sweep_report import SweepReport, SweepRow  # noqa: E402

#: The continuation the kill leaves running: long enough that the sweep (after the
#: dead run's 1 s lease lapses) and the rerun find it live on a loaded machine.
CONTINUATION_S = 12.0


@pytest.fixture(scope="module")
def payments() -> Iterator[Payments]:
    """The payments service; its URL and the fast recovery constants in this process
    (the in-process sweep and rerun run ``charge_card`` here)."""
    with running_payments() as p, process_env(p):
        yield p


@pytest.fixture(scope="module")
async def fork_server(
    prefect_harness: Any, payments: Payments, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ForkServer]:
    env = PrefectEnv(prefect_harness.api_url, prefect_harness.results_dir)
    server = ForkServer(
        env_for_children(env.child_env(), payments.url),
        tmp_path_factory.mktemp("sweep-fork") / "children-stderr.log",
    )
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def crash_settings(
    coder_block: str, state_db: str, tenant: str, payments: Payments
) -> WorkflowSettings:
    """The crash matrix's settings on this test's own store tenant (its sweep sees
    only its chats); the dead run's lease lapses after 1 s."""
    name = f"sweeps-crash-{tenant}"
    await ChatStateStore(url=state_db, tenant=tenant).save(name, overwrite=True)
    return WorkflowSettings(
        credentials_block=coder_block,
        store_block=name,
        retries=0,
        retry_delay_s=0,
        lease_wait_s=20,
        lease_ttl_s=1,
        settle_wait_s=5,
        redial_backoff_ms=20,
        request_timeout_s=2.5 * CONTINUATION_S,  # the rerun follows the whole continuation
        artifacts=False,
        tool_modules=["prefect_coder.flows.demo_tools", "payment_tools"],
    )


#: The chaos test's sweep: every running or paused chat is "stuck"; the lease wait
#: outlasts the dead run's lease (ttl 1 s).
OPTIONS = SweepOptions(
    concurrency=2,
    lease_wait_s=3,
    lease_ttl_s=10,
    interrupt_bound_s=5,
    archive_settle_s=5,
    archive_retry_s=0.05,
    request_timeout_s=10,
    emit_events=False,
)


async def _sweep(settings: WorkflowSettings) -> SweepReport:
    return await sweep_stuck_turns(
        SweepSettings.model_validate(settings),
        turn_budget_s=0.01,
        action_budget_s=0.01,
        options=OPTIONS,
    )


def _row(report: SweepReport, chat_id: str) -> SweepRow:
    rows = [r for r in report.rows if r.chat_id == chat_id]
    assert len(rows) == 1, report.rows
    return rows[0]


def _chat_of(emu: Emulator, workflow_id: str) -> str:
    """The workflow's chat (the one carrying its first step's marker)."""
    marker = step_marker(workflow_id, STEPS[0].name)
    found = [
        c["id"]
        for c in emu.chats()
        if any(
            marker in p.get("text", "")
            for m in emu.messages(c["id"], include_system=False)
            if m.get("role") == "user"
            for p in m.get("content") or []
        )
    ]
    assert len(found) == 1, found
    return str(found[0])


def _pay_then_fee(*, fee_sleep: float = 0.0) -> list[Step]:
    """plan (100); pay: a charge (250), then a continuation that charges the fee (30)."""
    fee = _charge(30, "Now the fee.", **({"sleep": fee_sleep} if fee_sleep else {}))
    return [
        STEPS[0],
        _pay(
            _charge(250, "Charging the rest now."),
            fee,
            {"text": "All paid.", "deltas": 3, "delay": 0.01},
        ),
    ]


async def _killed(server: ForkServer, point: str, spec: str) -> None:
    """The workflow runs in a forked process that SIGKILLs itself at ``point``."""
    assert await server.run(point, spec) == -9, server.stderr_tail()


def _wf(tag: str) -> str:
    return f"sw-{tag}-{uuid.uuid4().hex[:8]}"


async def test_a_running_crashed_attempt_is_left_to_its_workflows_recovery(
    fork_server: ForkServer,
    crash_settings: WorkflowSettings,
    emu: Emulator,
    payments: Payments,
    store: StateStore,
) -> None:
    workflow_id = _wf("run")
    steps = _pay_then_fee(fee_sleep=CONTINUATION_S)
    # SIGKILL right after pay's first tool results landed: the model keeps going.
    spec = child_spec(workflow_id, crash_settings, steps=steps)
    await _killed(fork_server, "turn.after_tool_results:2", spec)
    chat = _chat_of(emu, workflow_id)
    assert emu.chat(chat)["status"] == "running"

    report = await _sweep(crash_settings)
    row = _row(report, chat)
    assert row.status == "running", f"the sweep came after the continuation paused: {row}"
    assert (row.decision, row.ok) == ("leave", True), row
    assert "crashed attempt" in row.reason and "left of its turn deadline" in row.reason
    assert emu.chat(chat)["status"] in ("running", "requires_action")
    entry = await store.journal.get(chat)
    assert entry is not None and entry.state == "submitting"  # nothing journaled cut-short

    results = await run_workflow(workflow_id, steps, crash_settings)
    assert results[1].text == "All paid."
    pay = step_marker(workflow_id, "pay")
    assert len(_user_turns(emu, chat, pay)) == 1  # nothing resubmitted
    assert _interrupts(emu, chat) == 0  # the crashed attempt was never cut short
    calls = _charge_calls(emu, chat)
    assert len(calls) == 3, _transcript(emu, chat)  # plan's, pay's, the fee: no new id
    effects = _effects(payments, chat)
    assert sorted(effects.values()) == [1, 1, 1], "\n".join([str(effects), *_transcript(emu, chat)])
    await _at_rest(emu, chat)


async def test_a_crashed_attempts_pause_on_a_call_that_never_ran_is_answered_not_cut_short(
    fork_server: ForkServer,
    crash_settings: WorkflowSettings,
    emu: Emulator,
    payments: Payments,
    store: StateStore,
) -> None:
    workflow_id = _wf("pause")
    steps = _pay_then_fee()
    spec = child_spec(workflow_id, crash_settings, steps=steps)
    # SIGKILL right after pay's first tool results landed; the continuation pauses
    # on the fee at once, a call nothing ran (no ledger entry for it).
    await _killed(fork_server, "turn.after_tool_results:2", spec)
    chat = _chat_of(emu, workflow_id)
    await emu.await_status(chat, "requires_action")
    fee_call = _charge_calls(emu, chat)[-1]
    assert await store.ledger.get(chat, fee_call) is None

    report = await _sweep(crash_settings)
    row = _row(report, chat)
    assert (row.decision, row.outcome, row.ok) == ("reconcile", "reconciled (resumed)", True), row
    assert "crashed attempt" in row.reason
    entry = await store.journal.get(chat)
    assert entry is not None and entry.state == "resumed"  # its recovery lets it finish
    ledgered = await store.ledger.get(chat, fee_call)
    assert ledgered is not None and ledgered.state == "done"  # run under its own call id

    results = await run_workflow(workflow_id, steps, crash_settings)
    pay = step_marker(workflow_id, "pay")
    assert len(_user_turns(emu, chat, pay)) == 1  # nothing resubmitted
    assert results[1].text == "All paid."  # the finished attempt's answer
    assert [c.name for c in results[1].tool_calls] == ["charge_card", "charge_card"]
    assert _interrupts(emu, chat) == 0
    calls = _charge_calls(emu, chat)
    assert len(calls) == 3, _transcript(emu, chat)
    effects = _effects(payments, chat)
    assert sorted(effects.values()) == [1, 1, 1], "\n".join([str(effects), *_transcript(emu, chat)])
    assert {k.rsplit("/", 1)[-1] for k in effects} == set(calls), effects
    await _at_rest(emu, chat)


async def test_past_its_turn_deadline_a_crashed_attempt_is_swept_as_before(
    fork_server: ForkServer,
    crash_settings: WorkflowSettings,
    emu: Emulator,
    payments: Payments,
    store: StateStore,
) -> None:
    """Its workflow is gone for good: once the step's turn deadline (its send + the
    turn timeout) has passed, the sweep stops the run and cuts the pause short —
    journaling ``cut-short`` before any interrupt, so a later recovery never takes
    the truncated attempt for a finished one."""
    turn_s = 4.0
    short = crash_settings.model_copy(update={"turn_timeout_s": turn_s})
    running_wf, paused_wf = _wf("late-run"), _wf("late-pause")
    await _killed(
        fork_server,
        "turn.after_tool_results:2",
        child_spec(running_wf, short, steps=_pay_then_fee(fee_sleep=60)),
    )
    await _killed(
        fork_server,
        "turn.after_tool_results:2",
        child_spec(paused_wf, short, steps=_pay_then_fee()),
    )
    running, paused = _chat_of(emu, running_wf), _chat_of(emu, paused_wf)
    await emu.await_status(paused, "requires_action")
    sent = []
    for chat in (running, paused):
        entry = await store.journal.get(chat)
        assert entry is not None and entry.state == "submitting"
        sent.append(entry.at)
    # Sleep out both deadlines (clamped: each send is at most turn_s old already).
    await _sleep_until(max(sent) + turn_s + 0.1)

    swept_at = time.time()
    report = await _sweep(short)
    run_row, pause_row = _row(report, running), _row(report, paused)
    assert (run_row.decision, run_row.ok) == ("interrupt", True), run_row
    assert run_row.outcome.startswith("interrupted"), run_row
    assert (pause_row.decision, pause_row.outcome) == ("reconcile", "reconciled (cut-short)")
    for chat, wf in ((running, running_wf), (paused, paused_wf)):
        entry = await store.journal.get(chat)
        assert entry is not None, chat
        assert (entry.state, entry.marker, entry.attempt) == (
            "cut-short",
            step_marker(wf, "pay"),
            1,
        )
        await _at_rest(emu, chat)
        assert _interrupts(emu, chat) >= 1
        # the verdict was journaled before the sweep's first interrupt reached the
        # server (the chat's first status change since the sweep began)
        first = min(
            e["time"]
            for e in emu.event_log(["status"])
            if e["chat_id"] == chat and e["time"] >= swept_at
        )
        assert swept_at <= entry.at <= first, (swept_at, entry.at, first)
    # the fee never ran: plan's and pay's charges only, once each
    for chat in (running, paused):
        assert sorted(_effects(payments, chat).values()) == [1, 1], _transcript(emu, chat)


async def _sleep_until(wall: float) -> None:
    await asyncio.sleep(max(0.0, wall - time.time()))


# ------------------------------------------------------------------ the pure rule


def _decision(action: Action = Action.INTERRUPT, status: str = "running") -> SweepDecision:
    return SweepDecision("c1", action, "stuck", status, workflow_id="wf")


def _left(state: str, journal_attempt: int, attempts: int, now: float) -> float | None:
    """The rule for a journal entry written at t=100 s, a 20 s turn timeout."""
    return crashed_attempt_left(
        state=state,
        marker="[wf/pay]",
        journal_attempt=journal_attempt,
        journal_at=100.0,
        attempts=attempts,
        now=now,
        turn_timeout_s=20.0,
    )


def test_the_rule_is_recoverys_own_a_landed_send_or_a_revived_run_within_the_deadline() -> None:
    # submitting below the count: the send landed — the deadline runs from the send
    assert _left("submitting", 0, attempts=1, now=105.0) == pytest.approx(15.0)
    # not landed (the count is not past the write-ahead): not this attempt's run
    assert _left("submitting", 1, attempts=1, now=101.0) is None
    # past the deadline: swept as before
    assert _left("submitting", 0, attempts=1, now=120.5) is None
    # revived by a recovery pass: counted from the revival, never open-ended
    assert _left("resumed", 1, attempts=1, now=110.0) == pytest.approx(10.0)
    assert _left("resumed", 1, attempts=1, now=121.0) is None
    # cut short already, or a resumed verdict of an older attempt: nothing to protect
    assert _left("cut-short", 1, attempts=1, now=101.0) is None
    assert _left("resumed", 1, attempts=2, now=101.0) is None


def test_the_refinement_leaves_a_run_answers_a_pause_and_otherwise_acts_as_planned() -> None:
    left = crashed_attempt_refinement(_decision(), status="running", left_s=5.0)
    assert left.action is Action.LEAVE and "left to its workflow's recovery" in left.reason
    paused = crashed_attempt_refinement(
        _decision(status="requires_action"), status="requires_action", left_s=5.0
    )
    assert paused.action is Action.RECONCILE and "never cut it short" in paused.reason
    # past the deadline, already interrupting, or nothing to do: unchanged
    assert crashed_attempt_refinement(_decision(), status="running", left_s=None).action is (
        Action.INTERRUPT
    )
    assert crashed_attempt_refinement(
        _decision(status="interrupting"), status="interrupting", left_s=5.0
    ).action is (Action.INTERRUPT)
    assert crashed_attempt_refinement(
        _decision(Action.BUSY), status="running", left_s=5.0
    ).action is (Action.BUSY)
