"""``sweep-stuck-turns`` never cuts short a checkpointed step's crashed attempt that is
still within its turn deadline (the chaos finding of seeds 14 and 71, docs/chaos.md).

A real SIGKILL (the crash matrix's children, ``tests/recovery``) leaves the step's
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
from warm_python import WarmPython

_TESTS = Path(__file__).resolve().parents[1]
for _p in (str(_TESTS / "recovery"), str(_TESTS / "chaos")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from chaos_runner import process_env  # noqa: E402
from crash_matrix import (  # noqa: E402
    STEPS,
    ForkServer,
    charge_calls,
    child_spec,
    crash_to_chat,
    env_for_children,
    run_workflow,
)
from crash_matrix import crash_settings as matrix_settings  # noqa: E402
from payments import Payments, running_payments  # noqa: E402
from recovery_env import PrefectEnv  # noqa: E402
from test_crash_followups import (  # noqa: E402
    _at_rest,
    _charge,
    _effects,
    _interrupts,
    _pay,
    _transcript,
    assert_finished_once,
)

from coder_chat.emulator import Emulator  # noqa: E402
from prefect_coder.blocks import ChatStateStore, StateStore  # noqa: E402
from prefect_coder.blocks.state import JournalEntry  # noqa: E402
from prefect_coder.flows.common.params import Step, WorkflowSettings, step_marker  # noqa: E402
from prefect_coder.flows.deployments.sweep_settings import SweepSettings  # noqa: E402
from prefect_coder.flows.deployments.sweep_stuck_turns import sweep_stuck_turns  # noqa: E402
from prefect_coder.flows.sweeps.options import SweepOptions  # noqa: E402
from prefect_coder.flows.sweeps.plan import (  # noqa: E402
    Action,
    SweepDecision,
    crashed_attempt_left,
    crashed_attempt_refinement,
)
from prefect_coder.flows.sweeps.report import SweepReport, SweepRow  # noqa: E402

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
    prefect_harness: Any,
    payments: Payments,
    warm_python: WarmPython,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[ForkServer]:
    """Crash runs forked from the session's warm process (no Prefect import each)."""
    env = env_for_children(
        PrefectEnv(prefect_harness.api_url, prefect_harness.results_dir).child_env(), payments.url
    )
    # (PREFECT_* changed since the warm process started: a warm process of its own)
    warm = warm_python if warm_python.would_fork(env) else None
    server = ForkServer(env, tmp_path_factory.mktemp("sweep-fork") / "stderr.log", warm)
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
    # the rerun follows the whole continuation within one request timeout
    return matrix_settings(coder_block, name, request_timeout_s=2.5 * CONTINUATION_S)


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


def _wf(tag: str) -> str:
    return f"sw-{tag}-{uuid.uuid4().hex[:8]}"


async def _crash(
    server: ForkServer,
    settings: WorkflowSettings,
    emu: Emulator,
    tag: str,
    *,
    fee_sleep: float = 0.0,
    status: str | None = None,
) -> tuple[str, str]:
    """A workflow SIGKILLed right after pay's first tool results landed: its
    continuation keeps running ``fee_sleep`` s of model work before the fee, or
    (``fee_sleep`` 0) pauses on the fee at once, a call nothing ran. Returns
    ``(workflow_id, chat_id)`` once the chat shows ``status`` (if given)."""
    workflow_id = _wf(tag)
    spec = child_spec(workflow_id, settings, steps=_pay_then_fee(fee_sleep=fee_sleep))
    chat = await crash_to_chat(
        server, "turn.after_tool_results:2", spec, emu, workflow_id, status=status
    )
    return workflow_id, chat


async def test_a_crashed_attempt_within_its_deadline_is_left_running_and_answered_paused(
    fork_server: ForkServer,
    crash_settings: WorkflowSettings,
    emu: Emulator,
    payments: Payments,
    store: StateStore,
) -> None:
    """Two workflows SIGKILLed side by side right after pay's first tool results
    landed, one sweep for both (one sweep flow run and one wait for the continuation
    instead of two; the sweep decides each chat on its own row):

    * the running continuation (seed 71's path) is **left** to the workflow's rerun,
      which follows it;
    * the pause on the fee, a call nothing ran (seed 14's path), is **answered**
      through the ledger (the call runs once, under its call id's key), not cut short.
    """
    (running_wf, running), (paused_wf, paused) = await asyncio.gather(
        _crash(fork_server, crash_settings, emu, "run", fee_sleep=CONTINUATION_S),
        _crash(fork_server, crash_settings, emu, "pause", status="requires_action"),
    )
    assert emu.chat(running)["status"] == "running"
    fee_call = charge_calls(emu, paused)[-1]
    assert await store.ledger.get(paused, fee_call) is None

    report = await _sweep(crash_settings)
    row = _row(report, running)
    assert row.status == "running", f"the sweep came after the continuation paused: {row}"
    assert (row.decision, row.ok) == ("leave", True), row
    assert "crashed attempt" in row.reason and "left of its turn deadline" in row.reason
    assert emu.chat(running)["status"] in ("running", "requires_action")
    entry = await store.journal.get(running)
    assert entry is not None and entry.state == "submitting"  # nothing journaled cut-short

    row = _row(report, paused)
    assert (row.decision, row.outcome, row.ok) == ("reconcile", "reconciled (resumed)", True), row
    assert "crashed attempt" in row.reason
    entry = await store.journal.get(paused)
    assert entry is not None and entry.state == "resumed"  # its recovery lets it finish
    ledgered = await store.ledger.get(paused, fee_call)
    assert ledgered is not None and ledgered.state == "done"  # run under its own call id

    ran, answered = await asyncio.gather(
        run_workflow(running_wf, _pay_then_fee(fee_sleep=CONTINUATION_S), crash_settings),
        run_workflow(paused_wf, _pay_then_fee(), crash_settings),
    )
    assert ran[1].text == "All paid."
    assert answered[1].text == "All paid."  # the finished attempt's answer
    assert [c.name for c in answered[1].tool_calls] == ["charge_card", "charge_card"]
    # plan's, pay's, the fee (no new id); neither crashed attempt was resubmitted or
    # cut short; each charge once, under its own call id
    await assert_finished_once(emu, payments, running, step_marker(running_wf, "pay"), calls=3)
    await assert_finished_once(emu, payments, paused, step_marker(paused_wf, "pay"), calls=3)


#: The turn timeout of the steps the sweep must leave or answer: past the sweep's own
#: (1 s) and a short step's (SHORT_S), with room for the kills, the first sweep's
#: decisions and the answered step's rerun on a machine at load 20 (10 s was not:
#: the kills alone took most of it there).
STEP_S = 20.0
#: The turn timeout of the step whose pause is past its deadline at the first sweep.
#: Its own child must still reach the kill within it (plan's turn and pay's send).
SHORT_S = 8.0
#: What must be left of the long steps' deadlines when the first sweep starts: its
#: decisions come within it.
MARGIN_S = 5.0


async def _sent(store: StateStore, chat: str, turn_s: float) -> Any:
    entry = await store.journal.get(chat)
    assert entry is not None and entry.state == "submitting", entry
    assert entry.deadline == pytest.approx(entry.at + turn_s), entry  # the step's own
    return entry


def _first_status_change(emu: Emulator, chat: str, since: float) -> float:
    return min(
        e["time"] for e in emu.event_log(["status"]) if e["chat_id"] == chat and e["time"] >= since
    )


async def test_the_steps_own_recorded_deadline_not_the_sweeps_turn_timeout_decides(
    fork_server: ForkServer,
    crash_settings: WorkflowSettings,
    emu: Emulator,
    payments: Payments,
    store: StateStore,
) -> None:
    """The steps record their own deadline at their send (``JournalEntry.deadline``:
    the send + the step's turn timeout), and the sweep honours it, not its own turn
    timeout (1 s here). Three workflows SIGKILLed side by side right after pay's first
    tool results landed: two whose steps run with a LONGER turn timeout (STEP_S), one
    running and one paused on the fee, and one paused whose step ran with a SHORT one
    (SHORT_S). One set of kills serves both sides of the rule:

    * the first sweep, past the short deadline and the sweep's own but within the
      long ones, leaves the running attempt, answers the long step's pause (the
      revival journaled with the step's timeout) and cuts the short step's pause short,
      journaling ``cut-short`` before any interrupt (its workflow is taken for gone: a
      later recovery never takes the truncated attempt for a finished one);
    * past the running attempt's recorded deadline the next sweep stops it the same
      way; the fee of the cut attempts never ran.
    """
    step = crash_settings.model_copy(update={"turn_timeout_s": STEP_S})
    short = crash_settings.model_copy(update={"turn_timeout_s": SHORT_S})
    sweep = crash_settings.model_copy(update={"turn_timeout_s": 1.0})
    # Side by side: their sends (and so their deadlines) come close together, however
    # long one child takes on a loaded machine.
    (running_wf, running), (paused_wf, paused), (late_wf, late) = await asyncio.gather(
        _crash(fork_server, step, emu, "run", fee_sleep=60),
        _crash(fork_server, step, emu, "pause", status="requires_action"),
        _crash(fork_server, short, emu, "late", status="requires_action"),
    )
    sent = {
        running: await _sent(store, running, STEP_S),
        paused: await _sent(store, paused, STEP_S),
    }
    late_sent = await _sent(store, late, SHORT_S)
    # Past the short step's deadline, and so past the sweep's own for every send.
    await _sleep_until(max(late_sent.deadline, *(e.at + 1.0 for e in sent.values())) + 0.1)
    assert time.time() < min(e.deadline for e in sent.values()) - MARGIN_S, (
        "the kills took most of the long steps' turn timeout: nothing left to test"
    )
    swept_at = time.time()
    report = await _sweep(sweep)
    run_row, pause_row, late_row = _row(report, running), _row(report, paused), _row(report, late)
    assert (run_row.decision, run_row.ok) == ("leave", True), run_row
    assert "left of its turn deadline" in run_row.reason, run_row
    assert (pause_row.decision, pause_row.outcome) == ("reconcile", "reconciled (resumed)")
    assert (late_row.decision, late_row.outcome) == ("reconcile", "reconciled (cut-short)")
    untouched = sent[running]  # its times read back on our clock: exact to latency
    assert (await store.journal.get(running)) == untouched.model_copy(
        update={
            "at": pytest.approx(untouched.at, abs=1.0),
            "deadline": pytest.approx(untouched.deadline, abs=1.0),
        }
    )
    revived = await store.journal.get(paused)
    assert revived is not None and revived.state == "resumed"
    # the revival is bounded by the STEP's turn timeout, carried from its send's entry
    assert revived.deadline == pytest.approx(revived.at + STEP_S), revived

    # The paused workflow's rerun lets the revived run finish: nothing resubmitted,
    # each charge once under its own call id.
    results = await run_workflow(paused_wf, _pay_then_fee(), step)
    assert results[1].text == "All paid."
    await assert_finished_once(emu, payments, paused, step_marker(paused_wf, "pay"), calls=3)

    # Past the running attempt's recorded deadline its workflow is taken for gone:
    # the sweep stops it, journaling cut-short first.
    await _sleep_until(sent[running].deadline + 0.1)
    run_swept_at = time.time()
    run_row = _row(await _sweep(sweep), running)
    assert (run_row.decision, run_row.ok) == ("interrupt", True), run_row
    assert run_row.outcome.startswith("interrupted"), run_row

    for chat, wf, at in ((late, late_wf, swept_at), (running, running_wf, run_swept_at)):
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
        first = _first_status_change(emu, chat, at)
        assert at <= entry.at <= first, (at, entry.at, first)
        # the fee never ran: plan's and pay's charges only, once each
        assert sorted(_effects(payments, chat).values()) == [1, 1], _transcript(emu, chat)


async def _sleep_until(wall: float) -> None:
    await asyncio.sleep(max(0.0, wall - time.time()))


# ------------------------------------------------------------------ the pure rule


def _decision(action: Action = Action.INTERRUPT, status: str = "running") -> SweepDecision:
    return SweepDecision("c1", action, "stuck", status, workflow_id="wf")


def _left(state: str, journal_attempt: int, attempts: int, now: float) -> float | None:
    """The rule for a journal entry written at t=100 s, a 20 s turn timeout."""
    entry = JournalEntry(
        state=state,  # type: ignore[arg-type]
        marker="[wf/pay]",
        attempt=journal_attempt,
        at=100.0,
    )
    return crashed_attempt_left(entry, attempts, now=now, turn_timeout_s=20.0)


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


def test_a_recorded_deadline_replaces_the_sweeps_turn_timeout_and_old_rows_fall_back() -> None:
    def left(state: str, journal_attempt: int, now: float, deadline: float | None) -> float | None:
        entry = JournalEntry(
            state=state,  # type: ignore[arg-type]
            marker="[wf/pay]",
            attempt=journal_attempt,
            at=100.0,
            deadline=deadline,
        )
        return crashed_attempt_left(entry, 1, now=now, turn_timeout_s=20.0)  # the sweep's own

    # the step ran with a 60 s turn timeout (deadline 160): left past the sweep's 20 s
    assert left("submitting", 0, now=130.0, deadline=160.0) == pytest.approx(30.0)
    assert left("submitting", 0, now=160.5, deadline=160.0) is None
    assert left("resumed", 1, now=150.0, deadline=160.0) == pytest.approx(10.0)
    # a shorter recorded timeout (10 s) is honoured as well
    assert left("submitting", 0, now=112.0, deadline=110.0) is None
    # an entry from before the field: the sweep's own turn timeout, as before
    assert left("submitting", 0, now=130.0, deadline=None) is None
    assert left("submitting", 0, now=115.0, deadline=None) == pytest.approx(5.0)
    # a nonsensical recorded deadline (not after the send) is ignored, not trusted
    assert left("submitting", 0, now=115.0, deadline=90.0) == pytest.approx(5.0)
    # the step's turn timeout a revival gets: recorded, else the sweep's own
    assert JournalEntry.submitting("[wf/pay]", 0, at=100.0, turn_timeout=60.0).turn_s(20.0) == 60.0
    assert JournalEntry.submitting("[wf/pay]", 0, at=100.0).turn_s(20.0) == 20.0


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
