"""The pure status machine against the spec's transition table, every state x trigger."""

from __future__ import annotations

import pytest

from coder_chat.emulator import statemachine as sm
from coder_chat.emulator.statemachine import EffectKind as K
from coder_chat.emulator.statemachine import ExecView, Refused

STATE_VIEWS = {
    "W": ExecView("waiting", 0, False),
    "E0": ExecView("error", 0, False),
    "E1": ExecView("error", 1, False),
    "R0": ExecView("running", 0, False),
    "R1": ExecView("running", 1, False),
    "I0": ExecView("interrupting", 0, False),
    "I1": ExecView("interrupting", 1, False),
    "A0": ExecView("requires_action", 0, False),
    "A1": ExecView("requires_action", 1, False),
    "XW": ExecView("waiting", 0, True),
    "XE0": ExecView("error", 0, True),
    "XE1": ExecView("error", 1, True),
}
INVALID = [
    ExecView("waiting", 1, False),
    ExecView("running", 0, True),
    ExecView("interrupting", 1, True),
    ExecView("requires_action", 0, True),
    ExecView("waiting", 1, True),
    ExecView("pending", 0, False),
]


def test_classify_every_view() -> None:
    for name, view in STATE_VIEWS.items():
        assert sm.classify(view) == name
    for view in INVALID:
        assert sm.classify(view) == "INVALID"
    named = {sm.classify(v) for v in sm.ALL_VIEWS} - {"INVALID"}
    assert named == set(STATE_VIEWS)


def refused(fn, *args) -> tuple[int, str]:  # type: ignore[no-untyped-def]
    with pytest.raises(Refused) as ei:
        fn(*args)
    return ei.value.status, ei.value.message


def outcome_state(o: sm.Outcome, view: ExecView) -> str:
    """Classify the result assuming queue effects were applied."""
    q = view.queue_len
    for e in o.effects:
        if e.kind is K.ENQUEUE:
            q += 1
        elif e.kind in (K.PROMOTE_HEAD, K.DELETE_QUEUED):
            q -= 1
    archived = view.archived if o.archived is None else o.archived
    return sm.classify(ExecView(o.status, q, archived))


SEND_QUEUE = {
    "W": "R0",
    "E0": "R0",
    "E1": "R1",
    "R0": "R1",
    "R1": "R1",
    "I0": "I1",
    "I1": "I1",
    "A0": "A1",
    "A1": "A1",
}
SEND_INTERRUPT = {
    "W": "R0",
    "E0": "R0",
    "E1": "R1",
    "R0": "I1",
    "R1": "I1",
    "I0": "I1",
    "I1": "I1",
    "A0": "R1",
    "A1": "R1",
}


@pytest.mark.parametrize("busy,table", [("queue", SEND_QUEUE), ("interrupt", SEND_INTERRUPT)])
def test_send_table(busy: str, table: dict[str, str]) -> None:
    for name, view in STATE_VIEWS.items():
        if name.startswith("X"):
            assert refused(sm.send_message, view, busy)[0] == 409
            continue
        o = sm.send_message(view, busy)
        assert outcome_state(o, view) == table[name], (name, busy)
        assert o.queued == (name not in ("W", "E0"))
    for view in INVALID:
        assert refused(sm.send_message, view, busy) == (409, "Chat is in an invalid state.")


def test_send_effects_detail() -> None:
    o = sm.send_message(STATE_VIEWS["W"])
    assert o.kinds() == [K.CLOSE_OPEN_TOOL_CALLS, K.INSERT_MESSAGE, K.START_TURN]
    assert o.effects[0].reason == "Tool execution interrupted by new user message"
    o = sm.send_message(STATE_VIEWS["E1"])
    assert o.kinds().index(K.ENQUEUE) < o.kinds().index(K.PROMOTE_HEAD)
    assert K.CLEAR_ERROR in o.kinds()
    o = sm.send_message(STATE_VIEWS["A0"], "interrupt")
    cancel = next(e for e in o.effects if e.kind is K.CANCEL_PENDING_DYNAMIC)
    assert cancel.reason == "Tool execution interrupted by user message"
    assert K.SIGNAL_INTERRUPT in sm.send_message(STATE_VIEWS["R0"], "interrupt").kinds()


def test_queue_cap() -> None:
    full = ExecView("running", 20, False, queue_cap=20)
    st, msg = refused(sm.send_message, full, "queue")
    assert (st, msg) == (429, "Message queue is full.")
    ok = sm.send_message(ExecView("running", 19, False), "queue")
    assert ok.queued
    # W inserts directly regardless of the cap
    assert not sm.send_message(ExecView("waiting", 0, False, queue_cap=0)).queued


def test_worker_transitions() -> None:
    assert sm.finish_turn(STATE_VIEWS["R0"]).status == "waiting"
    o = sm.finish_turn(STATE_VIEWS["R1"])
    assert o.status == "running" and o.kinds()[0] is K.PROMOTE_HEAD  # no terminal between runs
    assert outcome_state(sm.enter_requires_action(STATE_VIEWS["R0"]), STATE_VIEWS["R0"]) == "A0"
    assert outcome_state(sm.enter_requires_action(STATE_VIEWS["R1"]), STATE_VIEWS["R1"]) == "A1"
    for n in ("W", "E0", "A0", "I0", "XW"):
        assert refused(sm.enter_requires_action, STATE_VIEWS[n])[0] == 409
    assert sm.finish_interruption(STATE_VIEWS["I0"]).status == "waiting"
    o = sm.finish_interruption(STATE_VIEWS["I1"])
    assert o.status == "running" and K.PROMOTE_HEAD in o.kinds()
    assert outcome_state(sm.finish_error(STATE_VIEWS["R0"]), STATE_VIEWS["R0"]) == "E0"
    assert outcome_state(sm.finish_error(STATE_VIEWS["R1"]), STATE_VIEWS["R1"]) == "E1"
    for n in ("W", "E0", "A0"):
        assert refused(sm.finish_error, STATE_VIEWS[n])[0] == 409


def test_tool_results_and_deadline() -> None:
    for n, view in STATE_VIEWS.items():
        if n in ("A0", "A1"):
            o = sm.complete_requires_action(view)
            assert outcome_state(o, view) == "R" + n[1]
            o = sm.cancel_requires_action(view)
            assert outcome_state(o, view) == "R" + n[1]
            assert o.effects[0].reason == "Tool execution timed out"
        else:
            st, msg = refused(sm.complete_requires_action, view)
            if n.startswith("X"):
                assert st == 409
            else:
                assert (st, msg) == (409, "Chat is not waiting for tool results.")


def test_tool_result_validation_order() -> None:
    v = sm.validate_tool_results
    assert (
        refused(v, ["a"], [{"tool_call_id": "a", "output": 1}, {"tool_call_id": "a", "output": 1}])[
            1
        ]
        == "Duplicate tool_call_id in results."
    )
    assert refused(v, ["a"], [{"tool_call_id": "a"}])[1] == "Tool result output must be valid JSON."
    # missing is checked before unexpected
    assert (
        refused(
            v, ["a", "b"], [{"tool_call_id": "a", "output": 1}, {"tool_call_id": "z", "output": 1}]
        )[1]
        == "Missing tool result."
    )
    assert (
        refused(v, ["a"], [{"tool_call_id": "a", "output": 1}, {"tool_call_id": "z", "output": 1}])[
            1
        ]
        == "Unexpected tool result."
    )
    v(["a", "b"], [{"tool_call_id": "b", "output": None}, {"tool_call_id": "a", "output": 2}])


INTERRUPT = {"R0": "I0", "R1": "I1", "A0": "R0", "A1": "R1"}


def test_interrupt_table() -> None:
    for n, view in STATE_VIEWS.items():
        if n in INTERRUPT:
            o = sm.interrupt(view)
            assert outcome_state(o, view) == INTERRUPT[n]
            if n.startswith("A"):
                assert o.effects[1].reason == "Tool execution interrupted by user"
        else:
            assert refused(sm.interrupt, view) == (409, "Chat is not in an interruptible state.")
    for view in INVALID:
        assert refused(sm.interrupt, view)[0] == 409


def test_archive_table() -> None:
    busy = "Cannot archive an active chat. Interrupt or wait for the chat to finish first."
    for n, view in STATE_VIEWS.items():
        if n.startswith("X"):
            o = sm.set_archived(view, False)
            assert outcome_state(o, view) == n[1:]
            assert refused(sm.set_archived, view, True) == (400, "Chat is already archived.")
        elif n in ("W", "E0", "E1"):
            o = sm.set_archived(view, True)
            assert outcome_state(o, view) == "X" + n
            assert refused(sm.set_archived, view, False) == (400, "Chat is already not archived.")
        else:
            assert refused(sm.set_archived, view, True) == (409, busy)
    assert refused(sm.set_archived, ExecView("waiting", 1, False), True)[0] == 409


def test_queue_delete_and_promote() -> None:
    for n, view in STATE_VIEWS.items():
        if view.queue_len == 0:
            assert refused(sm.delete_queued, view, False) == (
                409,
                "Chat has no queued messages to delete.",
            )
        else:
            assert refused(sm.delete_queued, view, False) == (404, "Queued message not found.")
            o = sm.delete_queued(view, True)
            assert outcome_state(o, view) in (n, n[:-1] + "0")
    promote = {"E1": "R0", "A1": "R0", "R1": "I1", "I1": "I1"}
    for n, view in STATE_VIEWS.items():
        if n.startswith("X"):
            assert refused(sm.promote_queued, view, True) == (
                400,
                "Cannot promote queued messages in an archived chat.",
            )
        elif n in promote:
            o = sm.promote_queued(view, True)
            assert outcome_state(o, view) == promote[n]
        else:
            assert refused(sm.promote_queued, view, True) == (
                409,
                "Chat has no queued messages to promote.",
            )


def test_create() -> None:
    assert sm.create_chat().status == "running"
    assert sm.create_chat(empty_content=True).status == "waiting"


def test_every_transition_lands_in_a_valid_state() -> None:
    triggers = [
        lambda v: sm.send_message(v, "queue"),
        lambda v: sm.send_message(v, "interrupt"),
        sm.finish_turn,
        sm.enter_requires_action,
        sm.complete_requires_action,
        sm.cancel_requires_action,
        sm.interrupt,
        sm.finish_interruption,
        sm.finish_error,
        lambda v: sm.delete_queued(v, True),
        lambda v: sm.promote_queued(v, True),
        lambda v: sm.set_archived(v, True),
        lambda v: sm.set_archived(v, False),
    ]
    for view in list(STATE_VIEWS.values()) + INVALID:
        for t in triggers:
            try:
                o = t(view)
            except Refused:
                continue
            assert sm.classify(view) != "INVALID"
            assert outcome_state(o, view) != "INVALID", (view, o)


def test_unowned_interrupt_finishes_at_once() -> None:
    # B3: no worker holds the chat, so the interruption finishes in the same transaction.
    assert sm.interrupt(ExecView("running"), owned=False).status == "waiting"
    assert sm.interrupt(ExecView("interrupting"), owned=False).status == "waiting"
    promoted = sm.interrupt(ExecView("running", 1), owned=False)
    assert promoted.status == "running"
    assert promoted.kinds() == [K.PROMOTE_HEAD, K.START_TURN]
    # requires_action is the same owned or not; an owned interrupting chat still 409s.
    assert sm.interrupt(ExecView("requires_action"), owned=False) == sm.interrupt(
        ExecView("requires_action")
    )
    with pytest.raises(Refused) as e:
        sm.interrupt(ExecView("interrupting"))
    assert e.value.status == 409
    for status in ("waiting", "error"):
        with pytest.raises(Refused):
            sm.interrupt(ExecView(status), owned=False)


@pytest.mark.parametrize(("status", "queue"), [("running", 0), ("interrupting", 0)])
def test_unowned_interrupting_send_promotes_the_new_message(status: str, queue: int) -> None:
    out = sm.send_message(ExecView(status, queue), "interrupt", owned=False)
    assert out.status == "running" and out.queued is False
    assert out.kinds() == [K.ENQUEUE, K.PROMOTE_HEAD, K.START_TURN]
    older = sm.send_message(ExecView(status, 1), "interrupt", owned=False)
    assert older.queued is True  # an older queued message is the head that runs
    # busy_behavior=queue is unaffected by ownership
    assert sm.send_message(ExecView("running"), "queue", owned=False) == sm.send_message(
        ExecView("running"), "queue"
    )
