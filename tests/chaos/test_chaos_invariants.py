"""The chaos invariants can fail: each one, fed the evidence of a known bug, names it
(pure, no I/O; the evidence has the shape ``chaos_runner`` gathers from the
emulator and the payments service)."""

from __future__ import annotations

from typing import Any

from chaos_invariants import Evidence, check

from prefect_coder.flows.common.results import TurnResult

CHAT = "c-main"
MARK = "[wf/s0-deposit]"


def _event(kind: str, chat: str = CHAT, **details: Any) -> dict[str, Any]:
    return {"kind": kind, "chat_id": chat, "details": details}


def _evidence(**change: Any) -> Evidence:
    """A clean one-step workflow: prompt 1, assistant 2, tool row 3, answer 4."""
    result = TurnResult(
        workflow_id="wf",
        step="s0-deposit",
        marker=MARK,
        chat_id=CHAT,
        text="Results: ok",
        user_message_id=1,
        message_ids=[2, 4],
        generate_ms=1.0,
    )
    base: dict[str, Any] = {
        "workflow_id": "wf",
        "steps": {"s0-deposit": (MARK, "deposit")},
        "amounts": [101],
        "expected_text": {"deposit": "Results: ok"},
        "chats": [{"id": CHAT, "status": "waiting", "archived": True}],
        "messages": {
            CHAT: [
                {"id": 1, "role": "user", "content": [{"type": "text", "text": f"go {MARK}"}]},
                {"id": 2, "role": "assistant", "content": []},
                {
                    "id": 3,
                    "role": "tool",
                    "content": [{"type": "tool-result", "result": {"charged_cents": 101}}],
                },
                {"id": 4, "role": "assistant", "content": [{"type": "text", "text": "ok"}]},
            ]
        },
        "events": [
            _event("message", id=1, role="user"),
            _event("status", new="running"),
            _event("message", id=2, role="assistant"),
            _event("turn_end", outcome="requires_action"),
            _event("message", id=3, role="tool"),
            _event("message", id=4, role="assistant"),
            _event("turn_end", outcome="completed"),
            _event("status", new="waiting"),
        ],
        "effects": {f"/{CHAT}/call-1": (1, 101)},
        "results": [result],
        "stored": [result],
        "cuts": 0,
    }
    base.update(change)
    return Evidence(**base)


def _names(ev: Evidence) -> list[str]:
    return sorted({v.invariant for v in check(ev)})


def test_clean_evidence_passes() -> None:
    assert check(_evidence()) == []


def test_an_effect_repeated_under_a_new_key_is_caught() -> None:
    ev = _evidence(effects={f"/{CHAT}/call-1": (1, 101), f"/{CHAT}/call-2": (1, 101)})
    assert _names(ev) == ["exactly-once"]
    assert _names(_evidence(effects={})) == ["exactly-once"]  # never applied


def test_an_answer_of_a_cut_short_attempt_is_caught() -> None:
    cut = _evidence()
    cut.events[3:3] = [_event("status", new="interrupting")]
    assert _names(cut) == ["finished-attempt"]
    synthetic = _evidence()
    synthetic.messages[CHAT][2]["content"][0]["result"] = "Tool execution interrupted by user"
    assert _names(synthetic) == ["finished-attempt"]
    wrong_text = _evidence(expected_text={"deposit": "Results: other"})
    assert _names(wrong_text) == ["finished-attempt"]


def test_a_chat_left_live_or_unarchived_is_caught() -> None:
    assert _names(_evidence(chats=[{"id": CHAT, "status": "requires_action"}])) == ["chats-at-rest"]
    assert _names(_evidence(chats=[{"id": CHAT, "status": "waiting"}])) == ["chats-at-rest"]


def test_extra_user_turns_beyond_the_crashes_are_caught() -> None:
    again = {"id": 5, "role": "user", "content": [{"type": "text", "text": f"again {MARK}"}]}
    ev = _evidence()
    ev.messages[CHAT].append(again)
    assert _names(ev) == ["extra-turns"]
    ev.cuts = 1  # one kill left a live attempt: one resubmission is the documented window
    assert _names(ev) == []


def test_a_second_chat_with_the_first_prompt_counts_as_an_extra_turn() -> None:
    """A chat created before a crash is adopted, not left beside a fresh one: another
    chat carrying the first step's prompt is that step sent again."""
    other = "chat-2"
    ev = _evidence()
    first_prompt = next(m for m in ev.messages[CHAT] if m["role"] == "user")
    ev.messages[other] = [first_prompt]
    assert _names(ev) == ["extra-turns"]
    ev.fired = 1  # a stream refused on create: the SDK discarded that chat
    assert _names(ev) == []


def test_a_second_idempotency_key_for_one_call_is_caught() -> None:
    """One logical call, one ledger key at the payments service — also when the
    service was asked again under it (a replay), never under a key of its own."""
    ok = _evidence(keys={f"/{CHAT}/call-1": 101})
    assert _names(ok) == []
    second = _evidence(keys={f"/{CHAT}/call-1": 101, f"/{CHAT}/call-2": 101})
    assert _names(second) == ["one-key"]


def test_a_chat_archived_before_its_last_step_finished_is_caught() -> None:
    archived = _event("archived", archived=True)
    at_end = _evidence()
    at_end.events.append(archived)
    assert _names(at_end) == []
    before = _evidence()
    before.events.insert(0, archived)  # e.g. while the workflow waited on a person
    assert _names(before) == ["archived-early"]
    during = _evidence()
    during.events.insert(4, archived)  # between the tool round and the answer
    assert _names(during) == ["archived-early"]


def test_an_orphan_retired_by_a_short_grace_sweep_allows_one_extra_turn() -> None:
    """A crashed first turn's chat, retired by sweep-orphans (grace below the turn
    timeout) before the rerun could adopt it: the rerun sends that step again in a
    new chat — the sweep's documented window, one extra turn per retired chat."""
    ev = _evidence()
    first_prompt = next(m for m in ev.messages[CHAT] if m["role"] == "user")
    ev.messages["chat-retired"] = [first_prompt]
    assert _names(ev) == ["extra-turns"]
    ev.retired = 1
    assert _names(ev) == []


def test_an_attempt_a_stuck_sweep_interrupted_allows_its_resubmission() -> None:
    """A stuck sweep's interrupt is journaled cut-short: the step's resubmission on
    the workflow's chat is a journaled cut's extra turn, not a violation."""
    again = {"id": 5, "role": "user", "content": [{"type": "text", "text": f"again {MARK}"}]}
    ev = _evidence()
    ev.messages[CHAT].append(again)
    assert _names(ev) == ["extra-turns"]
    ev.interrupted = 1
    assert _names(ev) == []
